"""The engine: token log-probs, the one weighted backward, and the optimizer step.

Every method in the family has the gradient

    grad J = E[ sum_t w_t * GC(q, o, t) * grad log pi(o_t | q, o_<t) ]

so one loss does all of them (spinningup's idea, generalised):

    loss = -sum(coef * w * logps * mask) / Z

with GC evaluated on detached log-probs, which makes grad(loss) == -grad J exactly.

Normalisation contract (one for every method). Z is counted over the WHOLE optimizer
step, every micro-batch and every rank, before any backward runs, so splitting a step
into micro-batches or across ranks never changes the gradient:

    "token"     w_t = 1,        Z = number of loss tokens in the step
    "sequence"  w_t = 1/|o_i|,  Z = sum of example weights (sequence-mean of token-means)
    "sum"       w_t = 1,        Z = sum of example weights (sequence-sum, e.g. DPO)
    "constant"  w_t = 1,        Z = norm_constant * sum of example weights (Dr. GRPO)

Rows whose `valid` flag is off (a failed reward, an excluded zero-std group) contribute
nothing to the loss and nothing to Z. The example weight of a row is 1 unless the method
says otherwise (a DPO pair is one example split over two rows of weight 1/2).
"""

from __future__ import annotations

import math
from typing import Callable, Iterable

import torch
import torch.distributed as dist
from torch import nn

from gcfamily.core.batch import Batch

# the engine's API: the log-probs it weighs (core/logprobs.py) and the packed layout they run in (core/packing.py)
from gcfamily.core.logprobs import (  # noqa: F401
    LogprobModel,
    TokenLogprobs,
    batch_logprobs,
    host_copies,
    model_parts,
    token_logprobs,
)
from gcfamily.core.packing import Packing, backbone_hidden, pack_rows, position_ids_from_mask, shared_prefix  # noqa: F401
from gcfamily.errors import GcfError

NORM_MODES = ("token", "sequence", "sum", "constant")


# ----------------------------------------------------------------------------------
# the normaliser and the one weighted backward


def example_weights(batch: Batch) -> torch.Tensor:
    """Per-row weight in the sequence counts: `example_weight` times the `valid` flag."""
    w = batch.example_weight
    w = torch.ones(batch.rows, device=batch.input_ids.device) if w is None else w.float()
    if batch.valid is not None:
        w = w * batch.valid.float()
    return w  # [B]


def effective_mask(batch: Batch) -> torch.Tensor:
    """Loss mask with invalid rows switched off."""
    m = batch.loss_mask.float()
    if batch.valid is not None:
        m = m * batch.valid.float()[:, None]
    return m  # [B, L]


def token_weights(batch: Batch, mode: str) -> torch.Tensor:
    """w_t of the contract: 1/|o_i| in "sequence" mode, else 1."""
    m = effective_mask(batch)
    if mode == "sequence":
        return m / batch.loss_mask.float().sum(-1, keepdim=True).clamp(min=1)
    return m  # [B, L]


def normaliser(batches: Iterable[Batch], mode: str, norm_constant: float = 1.0, group: object = None) -> float:
    """Z over all micro-batches of a step, summed over ranks when torch.distributed is up."""
    if mode not in NORM_MODES:
        raise GcfError(f"Unknown normalisation '{mode}'; choose one of {', '.join(NORM_MODES)}.")
    z = torch.zeros((), dtype=torch.float64)
    for b in batches:
        if mode == "token":
            z += effective_mask(b).sum().double().cpu()
        else:
            z += example_weights(b).sum().double().cpu()
    if dist.is_available() and dist.is_initialized():
        z = z.to(_dist_device())
        dist.all_reduce(z, group=group)
        z = z.cpu()
    z = float(z) * (norm_constant if mode == "constant" else 1.0)
    return max(z, 1e-12)  # an all-masked step has zero loss; Z only needs to be non-zero


def gc_stats(coef: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """Mean, mean |GC| and the fraction of loss tokens whose GC is exactly 0."""
    m = mask.bool()
    n = max(int(m.sum()), 1)
    c = coef[m]
    return {
        "gc/mean": float(c.sum()) / n,
        "gc/abs_mean": float(c.abs().sum()) / n,
        "gc/zero_frac": float((c == 0).sum()) / n,
        "gc/std": float(c.std()) if c.numel() > 1 else 0.0,
    }


def _dist_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")


def weighted_loss(coef: torch.Tensor, logps: torch.Tensor, batch: Batch, mode: str, Z: float) -> torch.Tensor:
    """The one loss of the family: -sum(coef * w * logps * mask) / Z."""
    w = token_weights(batch, mode)
    return -(coef.detach() * w * logps).sum() / Z


# ----------------------------------------------------------------------------------
# optimizer and schedule


def build_optimizer(
    params: Iterable[nn.Parameter], lr: float, weight_decay: float, betas: tuple[float, float] = (0.9, 0.999)
) -> torch.optim.Optimizer:
    """AdamW; no decay on biases and norms (1-d tensors), as is standard for transformers."""
    params = [p for p in params if p.requires_grad]
    decay = [p for p in params if p.ndim >= 2]
    no_decay = [p for p in params if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    # The fused kernel makes one pass over each tensor (about 7x faster than foreach on a CPU);
    # sharded (DTensor) parameters, and devices without the kernel, take the foreach path.
    fused = all(
        p.device.type in ("cpu", "cuda") and p.is_floating_point() and not hasattr(p, "placements") for p in params
    )
    return torch.optim.AdamW(groups, lr=lr, betas=betas, **({"fused": True} if fused else {"foreach": True}))


def lr_lambda(schedule: str, warmup_steps: int, total_steps: int, min_ratio: float = 0.0) -> Callable[[int], float]:
    """Linear warm-up, then constant, linear or cosine decay to min_ratio of the peak."""

    def f(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / (warmup_steps + 1)
        if schedule == "constant":
            return 1.0
        frac = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
        if schedule == "linear":
            return min_ratio + (1 - min_ratio) * (1 - frac)
        if schedule == "cosine":
            return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * frac))
        raise GcfError(f"Unknown lr schedule '{schedule}'; choose constant, linear or cosine.")

    return f


def grads_finite(params: Iterable[nn.Parameter]) -> bool:
    """True when every gradient is finite (one fused check, not one sync per tensor)."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return True
    norms = torch._foreach_norm(grads)
    return bool(torch.isfinite(torch.stack(norms)).all())


def second_model_step(
    optimizer: torch.optim.Optimizer,
    params: list[nn.Parameter],
    divisor: float,
    grad_clip: float,
    all_finite: Callable[[list], bool] = grads_finite,
    clip_norm: Callable[[list, float], torch.Tensor] = torch.nn.utils.clip_grad_norm_,
) -> tuple[str, float]:
    """The optimizer step of a model a method trains beside the policy (PPO's critic, the reward model), written once.

    Its loss was summed over the step's micro-batches; the gradients are divided by `divisor` (the step's tokens or
    pairs), checked finite, clipped to `grad_clip` (0 = no clip) and stepped, then zeroed. `all_finite` and
    `clip_norm` span the processes where the model is sharded (Services.all_finite, Services.clip_grad_norm).
    Returns ("stepped", the norm before clipping), ("skipped", nan) for a non-finite gradient, or ("idle", nan)
    when there was nothing to step (no gradient, a zero divisor).
    """
    params = [p for p in params if p.grad is not None]
    status, norm = "idle", math.nan
    if params and divisor > 0:
        torch._foreach_div_([p.grad for p in params], float(divisor))
        if all_finite(params):
            norm = float(clip_norm(params, grad_clip if grad_clip > 0 else math.inf))
            optimizer.step()
            status = "stepped"
        else:
            status = "skipped"
    optimizer.zero_grad(set_to_none=True)
    return status, norm
