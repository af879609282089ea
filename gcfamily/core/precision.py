"""Mixed precision: the dtype the model computes in, and the dtype its weights and AdamW state live in.

Two settings, kept apart because rounding hurts them differently:

- `dtype` (compute): what matmuls run in. bfloat16 on a GPU halves activation memory and runs on the
  tensor cores; its 8-bit mantissa is fine for a forward pass.
- `master_dtype` (parameters, gradients, AdamW's moments): float32 unless the user opts in to pure
  bfloat16. A bfloat16 weight of size ~0.02 moves in steps of ~1e-4, so an update of lr 1e-6 (GRPO's
  usual rates) rounds away to nothing: pure-bf16 training silently stops learning.

With compute != master, forwards run under `torch.autocast` (single process, DDP) or FSDP2's
MixedPrecisionPolicy, so weights are cast to the compute dtype per op while the optimizer updates the
float32 masters. The engine's log-prob path casts its output-layer operands itself and accumulates
softmax statistics in float32 either way.

| strategy | parameters, gradients, AdamW | forward and backward | gradient reduction |
|---|---|---|---|
| one process, DDP | master_dtype (float32) | dtype, by autocast | float32 (DDP) |
| FSDP2 | master_dtype (float32), sharded | dtype, by MixedPrecisionPolicy | float32 |
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

import torch

from gcfamily.errors import GcfError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
MASTER_DTYPES = ("float32", "bfloat16")
SAVE_DTYPES = ("master", "float32", "bfloat16", "float16")


@dataclass(frozen=True)
class Precision:
    """The compute and master dtypes of a run, and where it runs."""

    compute: torch.dtype
    master: torch.dtype
    device_type: str

    @property
    def mixed(self) -> bool:
        """True when weights are cast per op (compute dtype narrower than the masters)."""
        return self.compute != self.master

    def autocast(self) -> contextlib.AbstractContextManager:
        """Forwards inside run in the compute dtype; a no-op when compute == master."""
        if not self.mixed:
            return contextlib.nullcontext()
        return torch.autocast(self.device_type, dtype=self.compute)


def compute_dtype(name: str, device: torch.device) -> torch.dtype:
    """auto -> bfloat16 on a GPU that supports it, float32 otherwise."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" and torch.cuda.is_bf16_supported() else torch.float32
    if name not in DTYPES:
        raise GcfError(f"dtype={name!r} is not one of auto, {', '.join(DTYPES)}.")
    return DTYPES[name]


def auto_choice(compute: torch.dtype, device_type: str) -> str:
    """What dtype=auto chose and why, in one line (the evidence: docs/precision.md, benchmarks/bf16_components.py)."""
    if compute == torch.bfloat16:
        return (
            f"dtype=auto: bfloat16 compute on {device_type} (weights, gradients and AdamW in float32); it moves a trained "
            "model's per-token log-probs by about 0.05 nats (docs/precision.md): dtype=float32 keeps them exactly."
        )
    if device_type == "cpu":
        return (
            "dtype=auto: float32 on the CPU, log-probs exact; bf16 compute ran SFT and GRPO steps 1.4x faster on a CPU "
            "with bf16 units and learned the same, but moves a trained model's per-token log-probs by about 0.05 nats "
            "(docs/precision.md): dtype=bfloat16 takes it."
        )
    return f"dtype=auto: float32 on {device_type} (no bfloat16 support there)."


def resolve(dtype: str, master_dtype: str, device: torch.device, training: bool = True) -> Precision:
    """The run's Precision; settings that cannot train exactly are one sentence.

    Pure bfloat16 (weights and AdamW in bfloat16) happens only when master_dtype=bfloat16 is asked
    for; dtype=auto then computes in bfloat16 too.
    """
    if master_dtype not in MASTER_DTYPES:
        raise GcfError(f"master_dtype={master_dtype!r} is not one of {', '.join(MASTER_DTYPES)}.")
    master = DTYPES[master_dtype]
    compute = master if dtype == "auto" and master_dtype == "bfloat16" else compute_dtype(dtype, device)
    if master == torch.bfloat16 and compute != torch.bfloat16:
        raise GcfError(
            f"master_dtype=bfloat16 trains in pure bfloat16, so it computes in bfloat16 too: set dtype=bfloat16 (or auto), not {dtype}."
        )
    if training and compute == torch.float16:
        raise GcfError(
            "dtype=float16 needs loss scaling, which gcfamily does not do: train with dtype=bfloat16 (GPUs since Ampere) or float32."
        )
    return Precision(compute, master, device.type)


def check_master(params: Iterable[torch.nn.Parameter], precision: Precision, what: str) -> None:
    """Refuse trainable parameters that are not in the master dtype: pure-bf16 training nobody asked for."""
    found = {p.dtype for p in params if p.requires_grad}
    if found - {precision.master}:
        names = ", ".join(sorted(str(d).removeprefix("torch.") for d in found))
        raise GcfError(
            f"{what} holds trainable parameters in {names} but master_dtype is {str(precision.master).removeprefix('torch.')}; "
            "load it in float32 (or pass master_dtype=bfloat16 to train in pure bfloat16 on purpose)."
        )


def saved_state(state: dict[str, torch.Tensor], save_dtype: str) -> dict[str, torch.Tensor]:
    """The weights the final folder holds: the masters, or a copy cast to save_dtype (floating tensors only)."""
    if save_dtype == "master":
        return state
    target = DTYPES[save_dtype]
    return {k: (v.to(target) if v.is_floating_point() else v) for k, v in state.items()}


def save_pretrained(model: Any, out_dir: Any, state: dict[str, torch.Tensor], save_dtype: str) -> None:
    """`save_pretrained` with the weights in save_dtype and a config.json that says so; the model is not changed."""
    model.save_pretrained(out_dir, state_dict=saved_state(state, save_dtype), safe_serialization=True)
    if save_dtype != "master":  # transformers writes the model's own dtype into config.json
        path = Path(out_dir) / "config.json"
        config = json.loads(path.read_text())
        config["dtype"] = save_dtype
        path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
