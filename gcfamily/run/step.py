"""One optimizer step of the policy, in three parts a reader can name and a test can call:

    backward   every micro-batch forward and backward: the method's coefficient, the engine's one weighted loss
    metrics    the step's figures, token-weighted over its micro-batches (a ..._max or ..._min by max or min), read
               after every backward is queued
    apply      the optimizer step proper: gradients checked finite on every rank, clipped, stepped, zeroed

and beside them a step of a method that trains only its own model, and the run's two refusals of bad steps. The Trainer
composes them (Trainer.optimizer_step) and keeps the counts of trained and skipped steps.
"""

from __future__ import annotations

import contextlib
import math
import signal
from pathlib import Path
from typing import Any, NamedTuple

import torch

from gcfamily.config import Config
from gcfamily.core import engine
from gcfamily.core.batch import to_device
from gcfamily.core.engine import gc_stats
from gcfamily.core.memory import release_free_heap
from gcfamily.core.precision import Precision
from gcfamily.data.batches import split_batch
from gcfamily.errors import GcfError, Interrupted
from gcfamily.methods.base import Batch, Method, extreme
from gcfamily.run import checkpoint_format
from gcfamily.run.distributed import DistEnv


def host_copy(batch: Batch) -> Batch:
    """CPU copies of the fields that lay out a micro-batch (ids and masks), the same objects where already there."""
    return Batch(
        input_ids=batch.input_ids.cpu(), attention_mask=batch.attention_mask.cpu(), loss_mask=batch.loss_mask.cpu()
    )


class MicroBatchResult(NamedTuple):
    """What one micro-batch's backward leaves for the step's figures (detached; read after every backward is queued)."""

    mb: Batch
    logps: torch.Tensor  # [B, L]
    entropy: torch.Tensor  # [B, L]
    coef: torch.Tensor  # [B, L]
    loss: torch.Tensor  # []
    aux: dict[str, float]  # the method's second model's figures (Method.auxiliary_step)


def backward(
    policy: torch.nn.Module,
    method: Method,
    batch: Batch,
    cfg: Config,
    device: torch.device,
    prec: Precision,
    dist: DistEnv | None,
) -> list[MicroBatchResult]:
    """Micro-batched weighted backward over `batch`: the gradients accumulate in `policy` (under DDP they are averaged
    at the last micro-batch only); per micro-batch what its figures need."""
    m = method
    # CPU copies of the ids and masks, read back once a step and split with the batch: each micro-batch's packing layout
    # and loss-token indices are worked out from them, so nothing in the loop below waits on the device
    mbs = split_batch(batch, cfg.micro_batch_size, m.rows_per_example)
    # the same cuts: trim reads the same mask
    hosts = split_batch(host_copy(batch), cfg.micro_batch_size, m.rows_per_example)
    Z = engine.normaliser(mbs, m.norm, cfg.norm_constant)
    scale = dist.world_size if dist is not None else 1  # DDP averages; Z is already global
    done = []  # per micro-batch, what its metrics need; read after every backward is queued (no host sync in between)
    for i, mb in enumerate(mbs):
        host = (hosts[i].input_ids, hosts[i].attention_mask, hosts[i].loss_mask)
        mb = to_device(mb, device)
        sync = dist.no_sync(policy) if dist is not None and i < len(mbs) - 1 else contextlib.nullcontext()
        with sync:
            with prec.autocast():
                out = engine.token_logprobs(
                    policy,
                    mb.input_ids,
                    mb.attention_mask,
                    mb.loss_mask,
                    m.logprob_temperature(),
                    cfg.chunk_size,
                    cfg.share_prefix,
                    host,
                )
                coef = m.coefficient(mb, out.logps.detach())  # [B, L]
                loss = engine.weighted_loss(coef, out.logps, mb, m.norm, Z)
            (loss * scale).backward()
        with prec.autocast():
            m_aux = m.auxiliary_step(mb)
        done.append(MicroBatchResult(mb, out.logps.detach(), out.entropy.detach(), coef.detach(), loss.detach(), m_aux))
        if device.type == "cpu":  # this micro-batch's activations are freed: hand their pages back before the
            del out, coef, loss  # next one, of another length, allocates its own (SmolLM2-135M LoRA GRPO peak RSS
            release_free_heap()  # 2,477 -> 2,255 MB, benchmarks/results-memory-cpu.txt); only free memory goes
    return done


def total_loss(done: list[MicroBatchResult]) -> float:
    """The step's loss, summed over its micro-batches (the step's first host sync)."""
    return float(torch.stack([d[4].double() for d in done]).sum()) if done else 0.0


def combine(parts: list[tuple[dict[str, float], float]]) -> dict[str, float]:
    """One row from the figures of several parts, each with its weight: a figure named ..._max or ..._min is the max
    or min over the parts that report it (methods/base.py's EXTREMES; NaN if one is), any other the weighted sum over
    the parts divided by the weight of them all (a part without the figure counts as 0)."""
    weighted: dict[str, float] = {}
    extremes: dict[str, float] = {}
    for figures, w in parts:
        for key, v in figures.items():
            how = extreme(key)
            if how is None:
                weighted[key] = weighted.get(key, 0.0) + v * w
            else:
                # a NaN stays (max([nan, 1.0]) is nan, max([1.0, nan]) is not): it says a part's figure broke
                extremes[key] = v if key not in extremes or math.isnan(v) else how([extremes[key], v])
    total = sum(w for _, w in parts)
    return {**{k: v / total for k, v in weighted.items()}, **extremes}


def metrics(done: list[MicroBatchResult], method: Method) -> tuple[dict[str, float], int]:
    """The step's figures (GC statistics, entropy, the method's own and its second model's), each micro-batch's
    weighted by its loss tokens, maxima and minima by max and min (`combine`); and the loss tokens in all."""
    m = method
    parts: list[tuple[dict[str, float], float]] = []
    n_tok = 0
    for mb, logps, entropy, coef, _, m_aux in done:
        mask = engine.effective_mask(mb)
        k = int(mask.sum())
        n_tok += k
        figures = {
            **gc_stats(coef, mask),
            "entropy": float((entropy * mask).sum()) / max(k, 1),
            **m.metrics(mb, logps, coef),
            **m_aux,  # the second model's figures weigh with its micro-batch's tokens too
        }
        parts.append((figures, max(k, 1)))
    return combine(parts), n_tok


def grads_finite(loss_total: float, params: list[torch.Tensor], dist: DistEnv | None) -> bool:
    """The loss and every gradient are finite, on every rank."""
    return (
        math.isfinite(loss_total) and engine.grads_finite(params)
        if dist is None
        else dist.all_finite(loss_total, params)
    )


def apply(
    params: list[torch.Tensor],
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    grad_clip: float,
    dist: DistEnv | None,
) -> float:
    """Clip the gradients (grad_clip <= 0: measured, not clipped), step the optimizer and the schedule, zero the
    gradients; the gradient norm before clipping."""
    clip = torch.nn.utils.clip_grad_norm_ if dist is None else dist.clip_grad_norm_  # FSDP2: the norm over every shard
    gn = clip(params, grad_clip if grad_clip > 0 else float("inf"))
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return float(gn)


def auxiliary_only(method: Method, mbs: list[Batch], device: torch.device, prec: Precision) -> dict[str, float]:
    """One step of a method that trains only its own model (trains_policy=False): no policy pass at all; its figures,
    row-weighted, and the loss tokens."""
    parts: list[tuple[dict[str, float], float]] = []
    for mb in mbs:
        with prec.autocast():
            parts.append((method.auxiliary_step(to_device(mb, device)), int(mb.input_ids.shape[0])))
    metrics = combine(parts) if parts else {}
    metrics.update(method.auxiliary_step_end())
    return {"tokens": float(sum(int(engine.effective_mask(mb).sum()) for mb in mbs)), **metrics}


def refuse_bad_steps(
    bad_steps: int, skipped_steps: int, first_bad_step: int | None, max_bad_steps: int, step: int, out_dir: Path
) -> None:
    """A run stops, its last checkpoint intact, at max_bad_steps skipped steps in a row or at more than
    max_bad_steps in all (the Trainer also refuses a run that took steps and skipped every one: `refuse_untrained`). A
    step here is an optimizer step: a method with several minibatches or inner epochs takes several per logged step."""
    first = first_bad_step
    if bad_steps >= max_bad_steps:
        what = f"{bad_steps} consecutive steps had a non-finite loss or gradient, the run's first at step {first}"
    elif skipped_steps > max_bad_steps:
        what = (
            f"{skipped_steps} steps in all had a non-finite loss or gradient, more than "
            f"max_bad_steps={max_bad_steps}, the first at step {first}"
        )
    else:
        return
    last = checkpoint_format.complete_checkpoints(out_dir / "checkpoints")
    kept = f"the checkpoint of step {last[-1].name[5:]} intact" if last else "no checkpoint saved"
    raise GcfError(f"{what}; stopping at step {step + 1} with {kept} (lower lr or check the data).")


def refuse_untrained(step: int, trained_steps: int, first_bad_step: int | None) -> None:
    """A run that took steps and skipped every one trained nothing: it ends in one sentence, writing no model.
    (max_steps=0 takes no step: the model is written as loaded.)"""
    if step == 0 or trained_steps > 0:
        return
    why = (
        f"had a non-finite loss or gradient and was skipped, the first at step {first_bad_step}"
        if first_bad_step is not None
        else "ended without an optimizer step"
    )
    raise GcfError(
        f"Every step of this run ({step}) {why}, so nothing was trained and no model was written (lower lr, "
        "or check the data and the method's coefficient)."
    )


def interrupted(signal_name: str, at: int) -> Interrupted:
    """The stop a signal asked for, after the checkpoint of step `at`: one sentence, exit 128 + the signal's number."""
    code = 128 + int(getattr(signal, signal_name, signal.SIGTERM))
    return Interrupted(
        f"Stopped by {signal_name} at step {at}; a checkpoint was saved: continue with the same command plus --resume.",
        code,
    )
