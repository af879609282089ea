"""Model families: the attention each layer of a transformers model uses, so the packed path can match it.

The packed log-prob path (`packing.backbone_hidden`) hands the backbone a custom 4-D mask, which a
transformers model uses as-is for every layer: it no longer builds the sliding-window mask of a layer
itself (Mistral, Gemma 2/3, Qwen2 with `use_sliding_window`). So the mask of each layer type is built
here, the window measured on the ORIGINAL position ids: a shared prefix and packed segments see exactly
the keys their unpadded row sees. Families and layer types the packed path has not been checked on
take the plain padded pass; what no pass of the engine can reproduce is refused in one sentence
(`attention`, `prepare`), never silently approximated.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

import torch

from gcfamily.errors import GcfError

FULL, SLIDING = "full_attention", "sliding_attention"

PACKED_FAMILIES = frozenset(
    {
        "llama",
        "qwen2",
        "qwen3",
        "qwen2_moe",
        "qwen3_moe",
        "mistral",
        "gemma2",
        "gemma3_text",
        "phi3",
        "olmo2",
        "smollm3",
        "gpt2",
    }
)
"""Model types whose packed log-probs and greedy rollouts tests/test_families.py checks against the model's own forward
and `generate` at lengths past their windows (the rollout's CPU attention, `cpu_attention`, is switched on for these only);
any other family, or a layer type other than these two (Llama 4's chunked attention, linear
attention, state-space layers), runs the plain padded pass, which lets the model build its own masks."""

EAGER_FAMILIES = frozenset({"gemma3n", "gemma3n_text"})
"""Model types whose SDPA attention is wrong where eager is exact, run with eager attention: Gemma 3n's SDPA backward
gives NaN gradients in most parameter tensors on left-padded (rollout-shaped) batches, its log-probs exact
(tests/test_families.py)."""

RECURRENT_FAMILIES = frozenset(
    {
        "mamba",
        "mamba2",
        "falcon_mamba",
        "jamba",
        "bamba",
        "lfm2",
        "lfm2_moe",
        "granitemoehybrid",
        "qwen3_next",
        "falcon_h1",
        "minimax",
        "zamba",
        "zamba2",
        "nemotron_h",
        "rwkv",
        "xlstm",
        "recurrent_gemma",
    }
)
"""Model types whose state is not (only) a key-value cache (state-space, recurrent and linear-attention layers): the
rollout's KV-cache loop cannot hold it, so they sample by recomputing the whole forward each token (`no_kv_cache`)."""

OWN_CACHE_FAMILIES = frozenset({"openai-gpt", "xlm", "dory"})
"""Attention families whose cache the rollout's loop cannot drive (none, or one of their own; benchmarks/families_table.py
measured its KV-cache loop failing on them): they sample by the full forward per token too."""

INEXACT_FAMILIES = frozenset(
    {
        "bart",
        "mbart",
        "marian",
        "pegasus",
        "blenderbot",
        "blenderbot-small",
        "plbart",
        "mvp",
        "trocr",
        "bigbird_pegasus",
        "cpmant",
        "inkling_text",
        "recurrent_gemma",
        "rwkv",
        "xlstm",
    }
)
"""Model types whose log-probs on padded rows differ from their own forward on each unpadded row (benchmarks/families_table.py:
by 8e-3 to 14 nats; the decoders of encoder-decoder families place positions without the padding in mind): refused."""

_HEAD_TRANSFORMS = {"logits_scaling": 1.0, "logit_scale": 1.0, "lm_head_multiplier": 1.0}
"""Config fields (and their no-op value) of output layers that change the logits after the linear map:
the engine's chunked log-softmax applies the linear map and Gemma 2's final_logit_softcapping (and its
derivative) only, so any other value cannot be exact."""


@dataclass(frozen=True)
class Attention:
    """Which keys each layer of a model attends to, read from its (text) config."""

    family: str  # config.model_type
    layer_types: tuple[str, ...]  # one per layer: FULL, SLIDING or a type the packed path does not build
    sliding_window: int | None  # a sliding layer's query at position p sees keys at positions > p - window

    @property
    def packable(self) -> bool:
        """True when the packed path reproduces this model's attention exactly (a family the tests check)."""
        return self.family in PACKED_FAMILIES and set(self.layer_types) <= {FULL, SLIDING}


def attention(config: Any) -> Attention:
    """The attention layout of a decoder config; GcfError for a model whose log-probs cannot be exact."""
    family = getattr(config, "model_type", "") or type(config).__name__
    for field, neutral in _HEAD_TRANSFORMS.items():
        value = getattr(config, field, neutral)
        if value != neutral and value is not None:
            raise GcfError(
                f"The {family} model sets {field}={value}, which changes its logits after the output layer "
                f"and which gcfamily's log-probs do not apply, so they cannot be exact; use a model without it."
            )
    if (
        getattr(config, "use_bidirectional_attention", False)
        or not getattr(config, "is_causal", True)
        or getattr(config, "causal", True) is False  # XLM's language models are bidirectional unless causal=True
    ):
        raise GcfError(
            f"The {family} model attends bidirectionally, so it is not a causal LM and its token log-probs "
            f"are not defined; use a causal model."
        )
    if family in INEXACT_FAMILIES:
        raise GcfError(
            f"The {family} model's log-probs on padded rows differ from its own forward on each row (measured by "
            f"benchmarks/families_table.py), so they cannot be exact; use another model family."
        )
    if getattr(config, "is_decoder", None) is False:  # only configs of models that can be either carry the field
        raise GcfError(
            f"The {family} model is set up as an encoder (is_decoder=False) and attends bidirectionally, so its token "
            f"log-probs are not a causal LM's; use a causal model."
        )
    n = getattr(config, "num_hidden_layers", None) or getattr(config, "n_layer", 0)
    window = getattr(config, "sliding_window", None)
    types = getattr(config, "layer_types", None)
    if types is None:  # one kind for every layer, chosen as these models' forwards choose their mask (Mistral, Phi-3)
        types = [SLIDING if window is not None else FULL] * n
    return Attention(family, tuple(types), window)


def prepare(model: Any) -> None:
    """Check a loaded causal LM can give exact log-probs (GcfError if not) and set what it needs.

    A model that soft-caps its attention logits (Gemma 2, a Gemma 3 with `attn_logit_softcapping`) runs
    with eager attention, which applies the soft-cap, in the log-prob path and in the rollout alike; so does a family
    of EAGER_FAMILIES (Gemma 3n), whose SDPA gradients are NaN on padded rows.
    """
    config = model.config.get_text_config(decoder=True)
    attention(config)
    decoder = model.get_decoder()
    takes = inspect.signature(decoder.forward).parameters if hasattr(decoder, "forward") else {}
    if decoder is not model and not {"input_ids", "inputs_embeds"} & set(takes):
        raise GcfError(
            f"The {type(model).__name__} model's get_decoder() returns a {type(decoder).__name__}, not a backbone that "
            f"reads tokens, which gcfamily's log-prob path needs; use a causal LM whose get_decoder() returns its backbone."
        )
    if decoder is model:
        raise GcfError(
            f"The {type(model).__name__} model has no separate decoder (its get_decoder() returns the whole "
            f"model), which gcfamily's log-prob path needs; use a causal LM whose get_decoder() returns its backbone."
        )
    eager = getattr(config, "attn_logit_softcapping", None) is not None or config.model_type in EAGER_FAMILIES
    if eager and config._attn_implementation != "eager":
        model.set_attn_implementation("eager")


def no_kv_cache(config: Any) -> bool:
    """Whether the rollout's KV-cache loop cannot sample the model: a state it cannot hold (RECURRENT_FAMILIES, or a
    layer type other than attention: linear attention, state-space or convolution layers), or a cache of the model's
    own (OWN_CACHE_FAMILIES). Such a model samples by the full forward per token (gcfamily/rollout/recompute.py)."""
    config = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    kinds = set(getattr(config, "layer_types", None) or [])
    family = getattr(config, "model_type", "")
    return family in RECURRENT_FAMILIES | OWN_CACHE_FAMILIES or not kinds <= {FULL, SLIDING}


def layer_masks(
    att: Attention, allowed: torch.Tensor, position_ids: torch.Tensor
) -> torch.Tensor | dict[str, torch.Tensor]:
    """The packed mask of each layer type, from the block-causal `allowed` [R, 1, T, T] and original positions [R, T].

    A sliding layer also drops keys `window` or more positions back, as the model's own mask does
    for its unpadded row. One mask when every layer is of one type (a model that takes a single
    mask uses it for every layer), else {layer type: mask}, as models with mixed layers take.
    """
    pos_q, pos_k = position_ids[:, None, :, None], position_ids[:, None, None, :]  # [R, 1, T, 1], [R, 1, 1, T]
    masks = {}
    for kind in set(att.layer_types):
        masks[kind] = allowed & (pos_q - pos_k < att.sliding_window) if kind == SLIDING else allowed  # [R, 1, T, T]
    return next(iter(masks.values())) if len(masks) == 1 else masks
