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
from dataclasses import dataclass
from typing import Callable, Iterable

import torch
import torch.distributed as dist
from torch import nn

from gcfamily.core import onednn
from gcfamily.core.batch import Batch
from gcfamily.errors import GcfError
from gcfamily.core.packing import Packing, backbone_hidden, pack_rows, position_ids_from_mask, shared_prefix  # noqa: F401  (the engine's API)

NORM_MODES = ("token", "sequence", "sum", "constant")


# ----------------------------------------------------------------------------------
# log-probs of the taken tokens, chunked, with an exact hand-written backward


class _ChunkedTokenLogprob(torch.autograd.Function):
    """log softmax(h @ W.T / tau)[target] for N rows, in chunks of rows.

    Forward and backward each hold one [chunk, V] float32 block at a time, never [N, V]:
    the backward recomputes the chunk's logits and uses d logp / d logits = onehot - softmax.
    With a `compute` dtype (mixed precision) both products take operands cast to it, as autocast
    casts a linear layer's, while logits, softmax statistics and gradients accumulate in float32.
    With `softcap` c (Gemma 2's final_logit_softcapping) the logits are c * tanh(z / c), as the model's
    own forward makes them, and the backward carries its derivative 1 - tanh^2(z / c).
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, temperature, chunk_size, with_entropy, compute=None, softcap=None):  # type: ignore[override]
        N = hidden.shape[0]
        h_c, w_c, b_c = _cast(compute, hidden, weight, bias)
        logps = hidden.new_empty(N, dtype=torch.float32)  # [N]
        entropy = hidden.new_zeros(N, dtype=torch.float32)  # [N]
        lse_all = hidden.new_empty(N, dtype=torch.float32)  # [N]
        for s in range(0, N, chunk_size):
            logits, _ = _chunk_logits(h_c[s : s + chunk_size], w_c, b_c, temperature, softcap)  # [c, V]
            lse = torch.logsumexp(logits, dim=-1)
            tgt = logits.gather(1, targets[s : s + chunk_size, None]).squeeze(1)
            logps[s : s + chunk_size] = tgt - lse
            if with_entropy:  # a metric: one more pass over [c, V], skipped by forward-only passes
                entropy[s : s + chunk_size] = lse - (torch.exp(logits - lse[:, None]) * logits).sum(-1)
            lse_all[s : s + chunk_size] = lse
        ctx.save_for_backward(hidden, weight, bias if bias is not None else torch.empty(0), targets, lse_all)
        ctx.temperature, ctx.chunk_size, ctx.has_bias, ctx.compute, ctx.softcap = (
            temperature,
            chunk_size,
            bias is not None,
            compute,
            softcap,
        )
        ctx.mark_non_differentiable(entropy)
        return logps, entropy

    @staticmethod
    def backward(ctx, grad_logps, _grad_entropy):  # type: ignore[override]
        hidden, weight, bias, targets, lse_all = ctx.saved_tensors
        bias = bias if ctx.has_bias else None
        tau, c = ctx.temperature, ctx.chunk_size
        h_c, w_c, b_c = _cast(
            ctx.compute, hidden, weight, bias
        )  # recast, rather than hold a [V, H] copy from forward to backward
        grad_h = torch.zeros_like(hidden) if ctx.needs_input_grad[0] else None
        grad_w = None  # the first chunk's product starts it: no [V, H] zero fill
        grad_b = (
            torch.zeros(weight.shape[0], dtype=torch.float32, device=weight.device)
            if bias is not None and ctx.needs_input_grad[2]
            else None
        )
        for s in range(0, hidden.shape[0], c):
            h = h_c[s : s + c]
            logits, dcap = _chunk_logits(h, w_c, b_c, tau, ctx.softcap)  # [c, V]
            # d logp / d logits = onehot(target) - softmax; scaled by the incoming grad and 1/tau
            g = -torch.exp(logits - lse_all[s : s + c, None])
            g.scatter_add_(1, targets[s : s + c, None], torch.ones_like(g[:, :1]))
            g.mul_(grad_logps[s : s + c, None].float() / tau)
            if dcap is not None:  # through the soft-cap to the linear map's output
                g.mul_(dcap)
            if grad_h is not None:
                grad_h[s : s + c] = (g.to(w_c.dtype) @ w_c).to(hidden.dtype)
            if ctx.needs_input_grad[1]:
                grad_w = g.t() @ h.float() if grad_w is None else grad_w.addmm_(g.t(), h.float())  # [V, H] in float32
            if grad_b is not None:
                grad_b += g.sum(0)
        grad_w = grad_w.to(weight.dtype) if grad_w is not None else None
        grad_b = grad_b.to(bias.dtype) if grad_b is not None else None
        return grad_h, grad_w, grad_b, None, None, None, None, None, None


def _cast(compute: torch.dtype | None, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> tuple:
    """The output layer's operands in the compute dtype (unchanged without one)."""
    if compute is None:
        return hidden, weight, bias
    return hidden.to(compute), weight.to(compute), bias.to(compute) if bias is not None else None


def _chunk_logits(
    h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, tau: float, softcap: float | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The chunk's float32 logits / tau, and with a soft-cap the derivative of the cap (else None)."""
    if h.dtype == weight.dtype == torch.float32:
        logits = onednn.linear(h, weight, bias)  # [c, V]; oneDNN on CPU
    else:
        logits = (h @ weight.t()).float()  # [c, V]
        if bias is not None:
            logits = logits + bias.float()
    dcap = None
    if softcap:
        t = torch.tanh(logits / softcap)  # [c, V]
        logits, dcap = t * softcap, 1 - t * t
    return (logits / tau if tau != 1.0 else logits), dcap


def model_parts(model: nn.Module) -> tuple[nn.Module, nn.Module]:
    """Split a causal LM into its backbone (returns hidden states) and its output layer."""
    try:
        return model.get_decoder(), model.get_output_embeddings()
    except (AttributeError, NotImplementedError) as e:  # a model without the HF split
        raise GcfError(
            f"The model {type(model).__name__} has no get_decoder()/get_output_embeddings(); gcfamily needs a causal LM with both."
        ) from e


@dataclass
class TokenLogprobs:
    """Per-token log-probs aligned with input_ids: logps[b, t] = log pi(input_ids[b, t] | input_ids[b, <t])."""

    logps: torch.Tensor  # [B, L] with grad where the mask is on, 0 elsewhere
    entropy: torch.Tensor  # [B, L] no grad, 0 where the mask is off and on passes without gradients


def token_logprobs(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    loss_mask: torch.Tensor,
    temperature: float = 1.0,
    chunk_size: int = 256,
    share_prefix: bool = True,
    host: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> TokenLogprobs:
    """Log-probs of the taken tokens, computed only where loss_mask is on and in chunks.

    The backbone runs once over the (trimmed) sequences; the output layer is applied chunk
    by chunk to the hidden states of the masked positions only, so memory for the logits is
    bounded by chunk_size x V rather than B x T x V. `model` is a causal LM or a (DDP- or
    FSDP2-wrapped) LogprobModel, whose forward is this same computation. `host`, CPU copies of
    (input_ids, attention_mask, loss_mask), lets the packing layout and the loss-token indices be
    worked out without reading the device's tensors back (no host sync on a GPU); without it they
    are copied to the CPU here.
    """
    if isinstance(getattr(model, "module", model), LogprobModel):
        return TokenLogprobs(*model(input_ids, attention_mask, loss_mask, temperature, chunk_size, share_prefix, host))
    return TokenLogprobs(
        *_token_logprobs(model, input_ids, attention_mask, loss_mask, temperature, chunk_size, share_prefix, host)
    )


def host_copies(
    input_ids: torch.Tensor, attention_mask: torch.Tensor, loss_mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The three tensors on the CPU (the same objects there already)."""
    return input_ids.cpu(), attention_mask.cpu(), loss_mask.cpu()


class LogprobModel(nn.Module):
    """A causal LM whose forward is `token_logprobs`: the one module DDP wraps and FSDP2 shards.

    DDP's gradient reducer and FSDP2's gather/free hooks run only when the wrapped module's
    forward is called, and the log-prob path reaches past the LM's forward (backbone, head
    weight), so the whole path must be one forward.
    """

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        loss_mask: torch.Tensor,
        temperature: float = 1.0,
        chunk_size: int = 256,
        share_prefix: bool = True,
        host: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        host = host if host is not None else host_copies(input_ids, attention_mask, loss_mask)
        logps, entropy = _token_logprobs(
            self.model, input_ids, attention_mask, loss_mask, temperature, chunk_size, share_prefix, host
        )
        if not bool(
            host[2][:, 1:].any()
        ):  # no token: the head still needs a (zero) gradient on this rank, or the reducers wait for it
            logps = logps + 0.0 * sum(p.sum() for p in self.model.get_output_embeddings().parameters())
        return logps, entropy


def _token_logprobs(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    loss_mask: torch.Tensor,
    temperature: float,
    chunk_size: int,
    share_prefix: bool = True,
    host: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    B, L = input_ids.shape
    device = input_ids.device
    host = host if host is not None else host_copies(input_ids, attention_mask, loss_mask)
    backbone, head = model_parts(model)
    hidden, S = backbone_hidden(backbone, input_ids, attention_mask, loss_mask, share_prefix, host)  # [B, L - S, H]
    # the hidden state at t-1 predicts the token at t; columns before S predict no loss token. The loss tokens'
    # flat indices come from the host copy of the mask, so no shape here depends on reading the device back.
    pred_host = host[2][:, 1:].bool()  # [B, L-1]
    at = pred_host.reshape(-1).nonzero()[:, 0].to(device, non_blocking=True)  # [N] into [B * (L-1)]
    bt = pred_host[:, S:].nonzero()  # [N, 2], the same tokens in the same (row-major) order: none lies before S
    at_h = (bt[:, 0] * (L - S) + bt[:, 1]).to(device, non_blocking=True)  # [N] into hidden's [B * (L-S)] rows
    h = hidden.reshape(-1, hidden.shape[-1]).index_select(0, at_h)  # [N, H]
    targets = input_ids[:, 1:].reshape(-1).index_select(0, at)  # [N]
    logps = torch.zeros(B, L, dtype=torch.float32, device=device)  # [B, L]
    entropy = torch.zeros(B, L, dtype=torch.float32, device=device)  # [B, L]
    if len(at) == 0:
        return logps + 0.0 * hidden.sum(), entropy
    # entropy is a training metric: passes without gradients (pi_old, the reference) skip it and get zeros
    dev = h.device.type  # under autocast the output layer's products take its dtype too
    compute = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else None
    softcap = getattr(getattr(model, "config", None), "final_logit_softcapping", None)  # Gemma 2
    lp, ent = _ChunkedTokenLogprob.apply(
        h,
        head.weight,
        head.bias,
        targets,
        float(temperature),
        int(chunk_size),
        torch.is_grad_enabled(),
        compute,
        softcap,
    )
    full = torch.zeros(B * (L - 1), dtype=torch.float32, device=device).index_copy(0, at, lp).view(B, L - 1)
    logps = torch.cat([torch.zeros_like(full[:, :1]), full], dim=1)
    entropy[:, 1:] = (
        torch.zeros(B * (L - 1), dtype=torch.float32, device=device).index_copy(0, at, ent.float()).view(B, L - 1)
    )
    return logps, entropy


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


@torch.no_grad()
def batch_logprobs(
    model: nn.Module,
    batch: Batch,
    temperature: float,
    micro_batch_size: int,
    chunk_size: int,
    share_prefix: bool,
    device: torch.device,
) -> torch.Tensor:
    """Log-probs [B, L] (float32, on the CPU) of a whole batch without grad, micro-batched (pi_old, pi_ref)."""
    out = torch.zeros(batch.input_ids.shape, dtype=torch.float32)
    for s in range(0, out.shape[0], micro_batch_size):
        ids, am, lm = (
            t[s : s + micro_batch_size].to(device) for t in (batch.input_ids, batch.attention_mask, batch.loss_mask)
        )
        with torch.inference_mode():
            lp = token_logprobs(model, ids, am, lm, temperature, chunk_size, share_prefix)
        out[s : s + micro_batch_size] = lp.logps.float().cpu()
    return out
