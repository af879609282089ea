"""oneDNN linear layers for forwards without gradients on CPU (sampling, evaluation).

torch sends float32 CPU matmuls to MKL. On the AMD EPYC (AVX2, no AVX-512) this project runs on, oneDNN with
the weight reordered once into its blocked layout computes the same products 1.2-2.2x faster:
`benchmarks/generation.py` measures the rollout with and without (`--no-onednn`). Weights change at
every optimizer step, so they are packed when a forward-only section starts and dropped when it ends;
packing SmolLM2-135M takes about 0.3 s, a rollout of batch 64 about 10 s. The packed copies
are a second copy of the linear weights (540 MB for SmolLM2-135M in float32) while they live.

Only exact `nn.Linear` modules with plain float32 CPU weights are switched (not DTensor shards, not
subclasses such as adapters), and only while gradients are off; everything else runs as before.
Results equal `F.linear` to float32 rounding (a different summation order), as tested.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

import torch
from torch import nn

ENABLED = True
"""Switch for tests and benchmarks; the packed path is taken only where `available()` too."""

_PACK = contextvars.ContextVar("gcfamily_onednn_pack", default=True)


@contextlib.contextmanager
def packing(on: bool) -> Iterator[None]:
    """Inside the block, `packed_linears` packs weights only if `on` (a run's `rollout_pack_weights`): off, sampling runs on
    the plain weights, slower on the CPU but without the second copy of them."""
    token = _PACK.set(bool(on))
    try:
        yield
    finally:
        _PACK.reset(token)


def available() -> bool:
    """This torch build has oneDNN and the packed-linear ops."""
    ops = torch.ops.mkldnn
    return (
        torch.backends.mkldnn.is_available()
        and hasattr(ops, "_reorder_linear_weight")
        and hasattr(ops, "_linear_pointwise")
    )


def _onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """oneDNN's x @ weight.T + bias; `weight` is plain (any strides) or packed by `_reorder_linear_weight`."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


def _eligible(m: nn.Module) -> bool:
    w = m.weight if type(m) is nn.Linear else None
    return (
        w is not None
        and type(w.data) is torch.Tensor
        and w.device.type == "cpu"
        and w.dtype == torch.float32
        and "forward" not in m.__dict__
    )


def _packed_forward(m: nn.Linear, packed: torch.Tensor):
    weight, bias = m.weight, m.bias

    def forward(x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.float32 or torch.is_grad_enabled():
            return nn.functional.linear(x, weight, bias)
        return _onednn_linear(x, packed, bias)

    return forward


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight.T (+ bias) without autograd: oneDNN for float32 CPU tensors, else `F.linear`.

    For hand-written backward passes (the engine's chunked output layer), where a product with a
    [V, H] weight is a large share of the step.
    """
    if ENABLED and x.device.type == "cpu" and x.dtype == weight.dtype == torch.float32 and available():
        return _onednn_linear(x, weight, bias)
    return nn.functional.linear(x, weight, bias)


def _pack(weight: torch.Tensor, rows: int) -> torch.Tensor:
    """`weight` [N, K] reordered into oneDNN's blocked layout for about `rows` input rows (0.4 s for all of SmolLM2-135M)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), max(int(rows), 1))


@contextlib.contextmanager
def packed_linears(model: nn.Module, rows: int) -> Iterator[int]:
    """Run `model`'s float32 CPU `nn.Linear` layers through oneDNN with packed weights inside the block.

    `rows` is the usual number of input rows (a hint for the layout; any count works). Yields how
    many layers were switched (0 where oneDNN is off, unavailable or the model is not on CPU). The
    weights must not change inside the block: the packed copies would go stale.
    """
    # under autocast the layers compute in its dtype: packed float32 kernels would compute another function
    on = (
        ENABLED and _PACK.get() and not torch.is_grad_enabled() and not torch.is_autocast_enabled("cpu") and available()
    )
    mods = [m for m in model.modules() if _eligible(m)] if on else []
    packed: dict[tuple, torch.Tensor] = {}  # by weight memory and shape: a tied head and embedding pack once
    try:
        for m in mods:
            key = (m.weight.data_ptr(), tuple(m.weight.shape), m.weight.stride())
            if key not in packed:
                packed[key] = _pack(m.weight, rows)
            m.forward = _packed_forward(m, packed[key])
        yield len(mods)
    finally:
        for m in mods:
            m.__dict__.pop("forward", None)
