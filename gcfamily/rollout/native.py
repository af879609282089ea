"""Sampling G completions per prompt from the policy: batched, KV-cached, one forward per new token.

The loop is written here rather than calling `model.generate` because a trainer needs three things
generate does not give cheaply: the log-prob each token had when it was sampled, rows that stop
costing compute as soon as they end, and masks laid out for the engine. Rows that end (EOS or a stop
string) are dropped from the active batch and their KV-cache rows compacted away, so the last long
completion does not drag 63 finished ones through every layer.
"""

from __future__ import annotations

import bisect
import contextlib
import inspect
import math
from dataclasses import dataclass, field

import torch

from gcfamily.core import families
from gcfamily.core.cpu_attention import rollout_attention
from gcfamily.core.memory import release_free_heap
from gcfamily.core.onednn import packed_linears
from gcfamily.errors import GcfError
from gcfamily.rollout import decode, recompute
from gcfamily.rollout.kv_cache import _GrowingLayer, _make_cache
from gcfamily.rollout.sampling import SamplingSettings, sample_tokens

_STOP_CHECK_EVERY = 4  # decode for stop strings every few tokens; a final exact pass fixes the lengths
# Copying a row's KV cache costs about a tenth of a decode step for that row (SmolLM2-135M, CPU), so ended
# rows are dropped once (ended rows x steps left) reaches this share of the batch.
_COMPACT_AFTER = 0.25


@dataclass
class Rollout:
    """Completions laid out for the engine; prompt i's G samples are rows i*G .. i*G+G-1."""

    input_ids: torch.Tensor  # [N, P + C] left-padded prompts then completions (right-padded with pad_id)
    attention_mask: torch.Tensor  # [N, P + C] 1 on real prompt and completion tokens
    completion_mask: torch.Tensor  # [N, P + C] 1 on completion tokens, the EOS included, padding excluded
    sample_logps: torch.Tensor  # [N, P + C] log-prob of each completion token when sampled (0 elsewhere)
    truncated: torch.Tensor  # [N] bool: hit max_new_tokens without EOS / stop string
    completion_lengths: torch.Tensor  # [N] long
    completions: list[str]  # decoded completion text (special tokens skipped, cut after a stop string)
    prompt_index: torch.Tensor  # [N] which prompt each row came from
    ended_by: list[str] = field(default_factory=list)  # [N] "eos", "stop" (a stop string) or "length" (max_new_tokens)
    stats: dict[str, float] = field(default_factory=dict)  # the backend's figures for the step's metrics (rollout/...)


_SHARE_MIN = 8  # a common prompt prefix shorter than this is prefilled with the rest of each prompt


def _shared_prefix(prompt_ids: list[list[int]]) -> int:
    """How many leading tokens every prompt has in common, leaving each at least one of its own; 0 if under _SHARE_MIN or one prompt."""
    if len(prompt_ids) < 2:
        return 0
    first, c = prompt_ids[0], min(len(p) for p in prompt_ids) - 1
    for p in prompt_ids[1:]:
        c = next((k for k in range(c) if p[k] != first[k]), c)
    return c if c >= _SHARE_MIN else 0


def _forward_kwargs(model) -> tuple[str, bool]:
    """The cache keyword the model takes (`cache` in recent transformers) and whether it takes logits_to_keep."""
    params = inspect.signature(model.forward).parameters
    return ("cache" if "cache" in params else "past_key_values"), "logits_to_keep" in params


def _left_pad(prompt_ids: list[list[int]], pad_id: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-pad prompts so every row's next token sits in the last column."""
    P = max(len(p) for p in prompt_ids)
    ids = torch.full((len(prompt_ids), P), pad_id, dtype=torch.long)  # [n, P]
    mask = torch.zeros((len(prompt_ids), P), dtype=torch.long)  # [n, P]
    for i, p in enumerate(prompt_ids):
        ids[i, P - len(p) :] = torch.tensor(p, dtype=torch.long)
        mask[i, P - len(p) :] = 1
    return ids.to(device), mask.to(device)


def _eos_ids(model, tokenizer, eos_token_ids: list[int] | None) -> list[int]:
    """The given ids, else the union of the tokenizer's and the generation config's EOS ids."""
    if eos_token_ids is not None:
        return list(eos_token_ids)
    ids: list[int] = []
    for src in (
        getattr(tokenizer, "eos_token_id", None),
        getattr(getattr(model, "generation_config", None), "eos_token_id", None),
    ):
        ids += [] if src is None else [src] if isinstance(src, int) else list(src)
    return sorted(set(ids))


def _first_stop(text: str, stops: tuple[str, ...]) -> int:
    """Index just past the earliest-ending stop string in text, or -1."""
    ends = [text.find(s) + len(s) for s in stops if s in text]
    return min(ends) if ends else -1


def _has_stop(tokenizer, tokens: torch.Tensor, rows: torch.Tensor, t: int, stops: tuple[str, ...]) -> torch.Tensor:
    """Which of `rows` have a stop string in the text of their first t + 1 tokens: [len(rows)] bool."""
    texts = tokenizer.batch_decode(tokens[rows, : t + 1].tolist(), skip_special_tokens=True)
    return torch.tensor([_first_stop(x, stops) >= 0 for x in texts], dtype=torch.bool, device=rows.device)


def _cut_at_stops(tokenizer, tokens: torch.Tensor, lengths: torch.Tensor, ended: torch.Tensor, stops) -> None:
    """Shorten each row whose text holds a stop string to the token that completed it, marking it ended.

    The loop only checks every few tokens (and not after an EOS), so this exact pass makes the
    lengths independent of when the checks ran.
    """
    for row, (seq, L) in enumerate(zip(tokens.tolist(), lengths.tolist())):

        def stopped(m: int) -> bool:
            return _first_stop(tokenizer.decode(seq[:m], skip_special_tokens=True), stops) >= 0

        if stopped(L):
            lengths[row], ended[row] = bisect.bisect_left(range(L + 1), True, key=stopped), True


@torch.no_grad()
def generate(
    model,
    tokenizer,
    prompt_ids: list[list[int]],
    num_samples: int,
    settings: SamplingSettings,
    generator: torch.Generator | None = None,
    eos_token_ids: list[int] | None = None,
) -> Rollout:
    """Sample `num_samples` completions for each prompt (token ids, unpadded) with a KV cache.

    `sample_logps[n, t]` is log_softmax(logits / temperature)[input_ids[n, t]] of the full
    distribution (before top-k / top-p), at temperature 1 when greedy: what a later forward pass of
    the same model over `input_ids` gives at that temperature, so it can serve as pi_old. EOS ids
    default to the union of the tokenizer's and the generation config's. Same `generator` seed, same
    rollout (it may live on another device than the model). Tensors come back on the model's device,
    trimmed to the longest completion; masks are long, `sample_logps` float32.
    """
    _check(settings)
    if hasattr(model, "get_base_model") and hasattr(model, "peft_config"):
        model = model.get_base_model()  # LoRA: the same function (adapters in place) without peft's wrapper forward
    if not prompt_ids or not all(prompt_ids):
        raise GcfError("every prompt needs at least one token; drop empty prompts before sampling.")
    device, G, C = model.device, num_samples, settings.max_new_tokens
    eos = torch.tensor(_eos_ids(model, tokenizer, eos_token_ids), dtype=torch.long, device=device)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else int(eos[0]) if len(eos) else 0
    P = max(len(p) for p in prompt_ids)
    limit = context_length(model)
    # past it a position table is indexed out of range, or RoPE extrapolates unchecked
    if limit is not None and P + C > limit:
        raise GcfError(
            f"A prompt of {P} tokens plus max_new_tokens={C} needs {P + C} positions, past the model's context of {limit} "
            f"(max_position_embeddings); lower max_new_tokens or shorten the prompt (training skips prompts of max_length tokens or more)."
        )
    prompt, prompt_mask = _left_pad(prompt_ids, pad_id, device)  # [n, P]
    if families.no_kv_cache(model.config):  # a state the KV cache cannot hold: a full forward per token, exact
        stops = settings.stop_strings
        hit = (lambda tok, rows, t: _has_stop(tokenizer, tok, rows, t, stops)) if stops else None
        out = recompute.decode(model, prompt_ids, num_samples, settings, generator, eos, pad_id, hit)
        if stops:
            _cut_at_stops(tokenizer, out[0], out[2], out[3], stops)
        return _assemble(tokenizer, prompt, prompt_mask, num_samples, *out, pad_id, stops)
    static = decode.wanted(model, settings.compile)
    if static:
        try:
            return _decode(model, tokenizer, settings, generator, eos, pad_id, prompt_ids, prompt, prompt_mask, G, True)
        except Exception as e:  # noqa: BLE001 - only torch.compile's own failures are caught; the rest re-raise
            if not decode.compile_failed(e, model, settings.compile):
                raise
    return _decode(model, tokenizer, settings, generator, eos, pad_id, prompt_ids, prompt, prompt_mask, G, False)


def _decode(
    model,
    tokenizer,
    settings: SamplingSettings,
    generator,
    eos: torch.Tensor,
    pad_id: int,
    prompt_ids: list[list[int]],
    prompt: torch.Tensor,
    prompt_mask: torch.Tensor,
    G: int,
    static: bool,
) -> Rollout:
    """The rollout loop: prefill, then one token a step, eagerly or through the compiled fixed-shape step.

    The KV cache's prompt columns are the prompts left-padded, or, where they share a prefix of at
    least _SHARE_MIN tokens, that prefix (computed once) followed by the rest of each prompt
    left-padded. Padding columns are masked and positions count real tokens only, so each token
    attends to the same tokens at the same positions either way; the Rollout is laid out the same.
    """
    device, C = model.device, settings.max_new_tokens
    n, P = prompt.shape
    N = n * G
    cache = _make_cache(model, P if static else P + C)
    cache_kw, takes_keep = _forward_kwargs(model)
    keep = {"logits_to_keep": 1} if takes_keep else {}

    def step(ids: torch.Tensor, mask: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        out = model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True, **{cache_kw: cache}, **keep)
        return out.logits[:, -1]  # [B, V]

    # CPU float32 eager decoding: oneDNN with weights packed once for the whole rollout (compiled code takes plain weights),
    # and attention as two matmuls on the KV heads (gcfamily.core.cpu_attention)
    with contextlib.ExitStack() as eager:
        if not static:
            eager.enter_context(packed_linears(model, N))
            eager.enter_context(rollout_attention(model))
        # Prefill each distinct prompt once, then copy its cache rows G times.
        c = (
            _shared_prefix(prompt_ids)
            if all(isinstance(layer, _GrowingLayer) for layer in getattr(cache, "layers", [None]))
            else 0
        )
        if c:  # the tokens every prompt starts with (a chat template's system turn) once, then each prompt's own after them
            step(
                torch.tensor([prompt_ids[0][:c]], device=device),
                prompt_mask.new_ones(1, c),
                torch.arange(c, device=device)[None],
            )
            cache.batch_repeat_interleave(n)
            rest, rest_mask = _left_pad([p[c:] for p in prompt_ids], pad_id, device)  # [n, P - c]
            # [n, P]: the KV columns, prefix then left-padded rests
            kv_mask = torch.cat([rest_mask.new_ones(n, c), rest_mask], 1)
            pos = c + (rest_mask.cumsum(-1) - 1).clamp(min=0)  # [n, P - c]: the same positions as in the whole prompt
            logits = step(rest, kv_mask, pos)
        else:
            kv_mask = prompt_mask
            pos = (prompt_mask.cumsum(-1) - 1).clamp(min=0)  # [n, P]; left padding shifts positions
            logits = step(prompt, prompt_mask, pos)
        logits = logits.repeat_interleave(G, 0)  # [N, V]
        next_pos = pos[:, -1].repeat_interleave(G) + 1  # [N]
        if static:  # fixed slots and batch buckets, one compiled step (gcfamily.rollout.decode)
            dec = decode.decoder(model, N, P + C)
            dec.load(cache, G, kv_mask)
            del cache
        else:
            cache.batch_repeat_interleave(G)
            mask = torch.cat([kv_mask, kv_mask.new_ones(n, C)], 1).repeat_interleave(G, 0)  # [N, P + C]

        tokens = torch.full((N, C), pad_id, dtype=torch.long, device=device)  # [N, C]
        logps = torch.zeros(N, C, dtype=torch.float32, device=device)  # [N, C]
        lengths = torch.full((N,), C, dtype=torch.long, device=device)  # [N]
        ended = torch.zeros(N, dtype=torch.bool, device=device)  # [N]
        # The batch in flight: `active` maps its rows to rows of the result; rows that ended since the
        # last compaction ride along until the next one. Per-row state lives in [A] tensors updated
        # without host syncs; it is written back to the [N] ones when the batch shrinks and at the end.
        active = torch.arange(N, device=device)  # [A]
        len_a, ended_a = lengths.clone(), ended.clone()  # [A]
        draw = generator.device if generator is not None else device
        for t in range(C):
            # One uniform per row of the result at every step, whichever rows are still in flight: the
            # tokens drawn depend on the seed alone, not on when the batch was compacted.
            u = (
                None
                if settings.greedy
                else torch.rand(N, 1, generator=generator, device=draw)[active.to(draw)].to(device)
            )
            tok, lp = sample_tokens(logits, settings, generator, u)  # [A]
            tokens[active, t], logps[active, t] = tok, lp
            hit = torch.isin(tok, eos)  # [A]
            if settings.stop_strings and (t + 1) % _STOP_CHECK_EVERY == 0:
                hit |= _has_stop(tokenizer, tokens, active, t, settings.stop_strings)
            len_a = torch.where(hit & ~ended_a, t + 1, len_a)
            ended_a = ended_a | hit
            n_done = int(ended_a.sum())  # the one host sync per token
            if n_done == len(active) or t == C - 1:
                break
            # Drop ended rows so later steps spend nothing on them: eagerly once the row-steps saved outweigh
            # the copy; in the static decoder when the rows left fit a smaller bucket.
            if n_done and (
                dec.bucket(len(active) - n_done) < dec.size
                if static
                else n_done * (C - 1 - t) >= _COMPACT_AFTER * len(active)
            ):
                lengths[active], ended[active] = len_a, ended_a
                live = (~ended_a).nonzero()[:, 0]  # [A']
                if static:
                    dec.keep(live)
                else:
                    cache.batch_select_indices(live)
                    mask = mask[live]
                active, tok, next_pos = active[live], tok[live], next_pos[live]
                len_a, ended_a = len_a[live], ended_a[live]
            if static:
                logits = dec.step(model, tok, next_pos, P + t)
            else:
                logits = step(tok[:, None], mask[:, : P + t + 1], next_pos[:, None])
            next_pos = next_pos + 1
    lengths[active], ended[active] = len_a, ended_a
    cache = logits = None  # the eager KV cache and the oneDNN packed weights (freed with the block) are done with:
    release_free_heap()  # hand their memory back to the system before the training passes allocate theirs
    if settings.stop_strings:
        _cut_at_stops(tokenizer, tokens, lengths, ended, settings.stop_strings)
    return _assemble(tokenizer, prompt, prompt_mask, G, tokens, logps, lengths, ended, pad_id, settings.stop_strings)


def context_length(model) -> int | None:
    """The most positions the model was built for (max_position_embeddings, n_positions, ...), or None where it names none."""
    config = getattr(model, "config", None)
    if config is None:
        return None
    if hasattr(config, "get_text_config"):
        config = config.get_text_config(decoder=True)
    for key in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        value = getattr(config, key, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def _check(settings: SamplingSettings) -> None:
    """Settings a user can get wrong end in one clear sentence."""
    if not settings.greedy and not 0 < settings.temperature < math.inf:  # written so that NaN fails
        raise GcfError(
            f"temperature must be > 0 and finite (got {settings.temperature}); set greedy: true for argmax decoding."
        )
    if not 0 < settings.top_p <= 1:
        raise GcfError(f"top_p must be in (0, 1] (got {settings.top_p}); use 1 to switch nucleus sampling off.")
    decode.mode_ok(settings.compile)
    if settings.max_new_tokens < 1 or settings.top_k < 0:
        raise GcfError("max_new_tokens must be >= 1 and top_k >= 0 (0 switches top-k off).")


def _assemble(tokenizer, prompt, prompt_mask, G, tokens, logps, lengths, ended, pad_id, stops) -> Rollout:
    """Lay prompts and completions side by side, trimmed to the longest completion."""
    N = tokens.shape[0]
    C = int(lengths.max())
    valid = torch.arange(C, device=tokens.device)[None, :] < lengths[:, None]  # [N, C]
    comp = tokens[:, :C].masked_fill(~valid, pad_id)  # [N, C]
    prompt, prompt_mask = prompt.repeat_interleave(G, 0), prompt_mask.repeat_interleave(G, 0)  # [N, P]
    texts = tokenizer.batch_decode(
        [row[:l] for row, l in zip(comp.tolist(), lengths.tolist())], skip_special_tokens=True
    )
    # [N, P + C]
    return Rollout(
        input_ids=torch.cat([prompt, comp], 1),  # [N, P + C]
        attention_mask=torch.cat([prompt_mask, valid.long()], 1),  # [N, P + C]
        completion_mask=torch.cat([torch.zeros_like(prompt_mask), valid.long()], 1),  # [N, P + C]
        sample_logps=torch.cat(
            [torch.zeros_like(prompt, dtype=torch.float32), logps[:, :C].masked_fill(~valid, 0.0)], 1
        ),
        truncated=~ended,
        completion_lengths=lengths,
        completions=[x[:e] if (e := _first_stop(x, stops)) >= 0 else x for x in texts],
        prompt_index=torch.arange(N, device=tokens.device) // G,
        ended_by=[
            "length" if not end else "stop" if _first_stop(x, stops) >= 0 else "eos"
            for x, end in zip(texts, ended.tolist())
        ],
    )
