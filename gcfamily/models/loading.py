"""Loading a model and its tokenizer by name (load_model), adopting one passed from Python (adopt_model), and the
frozen reference copy of a policy (load_reference)."""

from __future__ import annotations

import copy
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from gcfamily.errors import GcfError
from gcfamily.models.safety import _non_finite, check_source, refuse_remote_code
from gcfamily.models.sources import resolve_source
from gcfamily.models.tiny import tiny_model, tiny_tokenizer


def _reason(err: BaseException, limit: int = 240) -> str:
    """A library's error as one short clause: its first line, cut at a sentence end when long."""
    text = (str(err).splitlines() or [""])[0].strip() or type(err).__name__
    if len(text) <= limit:
        return text.rstrip(".")
    cut = text[:limit].rfind(". ")
    return text[:cut] if cut > 0 else text[: limit - 3] + "..."


def load_model(
    name: str,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    trust_remote_code: bool = False,
    seed: int = 0,
    say: Callable[[str], None] | None = None,
) -> tuple[Any, Any]:
    """(model, tokenizer) for an alias, hub id or local folder; clear errors, no tracebacks. `say`, when given, hears
    a line once the model is loaded (none before: a folder that fails to load is one sentence alone) and a first
    use's conversion (gcfamily/models/gguf.py)."""
    if name == "tiny":
        tok = tiny_tokenizer()
        model = tiny_model(len(tok), seed=seed)
        return model.to(device=device, dtype=dtype), tok
    check_source(name)
    source = resolve_source(name, say)
    t0 = time.perf_counter()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    local = Path(source).exists()
    refuse_remote_code(source, trust_remote_code)
    try:
        tok = AutoTokenizer.from_pretrained(source, trust_remote_code=trust_remote_code)
        # use_safetensors: never fall back to unpickling a .bin (from a folder or the hub)
        model = AutoModelForCausalLM.from_pretrained(
            source, dtype=dtype, trust_remote_code=trust_remote_code, use_safetensors=True
        )
    # a local folder's files are the user's input: whatever they make the loader raise is one sentence
    except Exception as e:
        if not local and not isinstance(e, (OSError, ValueError, ImportError)):
            raise
        if local:
            raise GcfError(f"Model folder {source} could not be loaded ({_reason(e)}).") from e
        raise GcfError(
            f"Model {name} ({source}) could not be loaded from the hub, which this machine may not reach; "
            f"offline, use --model smollm2-135m or --model tiny."
        ) from e
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    from gcfamily.core.families import prepare

    prepare(model)  # refuses a model whose log-probs cannot be exact; eager attention where it soft-caps
    model = model.to(device)
    if say is not None:
        say(f"loaded model {name} in {time.perf_counter() - t0:.1f} s")
    return model, tok


def adopt_model(
    model: Any, dtype: torch.dtype, device: str | torch.device, trust_remote_code: bool = False
) -> tuple[Any, Any]:
    """A (model, tokenizer) pair passed from Python, or a model whose tokenizer loads from its name_or_path.

    The model is trained in place, its parameters cast to the run's master dtype (float32 by default).
    """
    model, tok = model if isinstance(model, tuple) else (model, None)
    if not isinstance(model, torch.nn.Module) or not hasattr(model, "config"):
        raise GcfError(
            f"model must be a name, a folder, a transformers causal LM or a (model, tokenizer) pair; got {type(model).__name__}."
        )
    if tok is None:
        from transformers import AutoTokenizer

        source = getattr(model, "name_or_path", "") or getattr(model.config, "_name_or_path", "")
        try:
            refuse_remote_code(source, trust_remote_code, "Tokenizer folder")
            tok = AutoTokenizer.from_pretrained(source, trust_remote_code=trust_remote_code)
        except (OSError, ValueError, TypeError) as e:
            raise GcfError(
                f"The tokenizer of the model passed in could not be loaded from {source!r}; pass model=(model, tokenizer)."
            ) from e
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    bad = _non_finite(model.config.to_dict())
    if bad is not None:  # a NaN norm epsilon: every step would be skipped as non-finite
        raise GcfError(
            f"The model passed in has {bad}={getattr(model.config, bad, 'nan')} in its config; set it to a finite number."
        )
    from gcfamily.core.families import prepare

    prepare(model)
    return model.to(device=device, dtype=dtype), tok


def load_reference(policy: Any) -> Any:
    """A frozen copy of the policy, in eval mode, with no grads."""
    ref = copy.deepcopy(policy)
    ref.eval()
    ref.requires_grad_(False)
    return ref
