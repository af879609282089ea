"""Log-probs of the taken tokens: the backbone once, the output layer in chunks with an exact hand-written backward.

`token_logprobs` is what the engine weighs (core/engine.py): log pi(o_t | q, o_<t) at every loss token, [B, L], with
grad; `batch_logprobs` the same without grad for a whole batch (pi_old, pi_ref). Never a [B, L, V] float32 block: the
output layer runs over the loss tokens' hidden states only, a chunk of rows at a time, forward and backward.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from gcfamily.core import float32_parts, onednn
from gcfamily.core.batch import Batch
from gcfamily.core.packing import backbone_hidden
from gcfamily.errors import GcfError

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
        # recast, rather than hold a [V, H] copy from forward to backward
        h_c, w_c, b_c = _cast(ctx.compute, hidden, weight, bias)
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
        # no token: the head still needs a (zero) gradient on this rank, or the reducers wait for it
        if not bool(host[2][:, 1:].any()):
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
    if float32_parts.kept(head):  # float32_components=head: float32 operands under autocast too
        compute, h = None, h.float()
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
