"""Memory: what a model and its optimizer hold, the run's peak, and handing freed heap pages back to the system."""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import resource
import sys

import torch
from torch import nn


def module_mb(module: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> tuple[float, float]:
    """(parameters, optimizer state) of a model in MB, this process's shards where it is sharded."""

    def nbytes(t: torch.Tensor) -> int:  # this process's share of a sharded tensor
        local = t.to_local() if hasattr(t, "to_local") else t
        return local.numel() * local.element_size()

    params = sum(nbytes(p) for p in module.parameters())
    state = 0
    if optimizer is not None:
        for s in optimizer.state.values():
            state += sum(nbytes(v) for v in s.values() if isinstance(v, torch.Tensor))
    return params / 2**20, state / 2**20


def peak_memory_mb(device: torch.device) -> float:
    """Peak GPU memory allocated, or the process's peak resident memory on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def release_free_heap() -> None:
    """glibc's malloc_trim(0): return the heap's free pages to the system (Linux; elsewhere a no-op).

    The packed weights and KV-cache buffers a rollout frees are small blocks in malloc's heap, which
    glibc keeps for reuse; the training forwards that follow allocate blocks of other sizes, so
    without this the process would hold both. Only free memory is released: no value changes.
    """
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim(0)
