"""Settings: typed defaults, then a YAML recipe, then command-line overrides (in that order).

Two kinds, set the same way (`key: value` in YAML, `--set key=value`):

- shared settings, the fields of `Config`: what to run, the step, the optimizer, sampling, logging;
- a method's own settings, a small dataclass on the method class (`GRPO.Settings`: the clip range,
  the KL weight and estimator, ...), which a subclass extends without touching this file.

A key is looked up in the shared settings, then in the method's; an unknown key is one sentence
naming both. Each field's docstring is what `gcf settings --method M` prints.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Optional

import yaml

from gcfamily.config.data import DataSettings
from gcfamily.errors import GcfError


@dataclass(init=False)
class Config(DataSettings):
    """The shared settings, plus the run's method settings (`settings`, once the method is known); the data settings are in config_data.py."""

    # --- what to run
    method: str = "sft"
    """Method: a name (see `gcf methods`), module:Class, path/to/file.py:Class, or a name an installed package registers."""
    model: str = "smollm2-135m"
    """Model alias (tiny, smollm2-135m, qwen-0.5b, ...), hub id or local folder."""
    task: Optional[str] = "arithmetic"
    """Built-in offline task: prompts, references and the reward (see `gcf tasks`)."""
    task_options: dict = field(default_factory=dict)
    """Options for the task, e.g. {level: 1d-add}."""
    output_dir: str = "runs/default"
    """Run folder: settings, metrics.jsonl, TensorBoard events, checkpoints and the final model. `gcf run` without it makes runs/METHOD-MODEL-TIME."""
    overwrite: bool = False
    """Allow writing into an output folder that holds another run."""
    seed: int = 0
    """Seed for data order, sampling and initialisation."""
    device: str = "auto"
    """cpu, cuda, cuda:N, or auto (cuda when available)."""
    dtype: str = "auto"
    """Compute dtype of forwards and backwards: float32, bfloat16, or auto (bfloat16 on a GPU that supports it, float32 on CPU).
    Weights and AdamW state stay in master_dtype; see gcfamily/core/precision.py."""
    master_dtype: str = "float32"
    """dtype of the trained parameters, their gradients and AdamW's state: float32, or bfloat16 to train in pure bfloat16 on purpose
    (small updates then round away: at lr 1e-6 most weights never move)."""
    save_dtype: str = "master"
    """dtype of the final model folder: master (the master weights as trained), float32, bfloat16 or float16 (a smaller copy).
    Checkpoints always hold the master weights, so a resume is exact."""
    trust_remote_code: bool = False
    """Run model code shipped with a hub model; off unless asked for."""

    # --- the step
    max_steps: int = 100
    """Number of training steps (each step draws one batch)."""
    max_time: float = 0.0
    """Also stop once the training steps have taken this many seconds (evaluation not counted; 0 = no limit).
    Checked after each step, so the last step may overrun; the lr schedule still spans max_steps."""
    max_tokens: int = 0
    """Also stop once this many tokens were generated plus trained on (loss tokens; 0 = no limit). Checked after each step."""
    max_flops: float = 0.0
    """Also stop once the estimated training FLOPs reach this (6 x parameters x loss tokens + 2 x parameters x generated tokens;
    0 = no limit). Checked after each step."""
    batch_size: int = 8
    """Examples per step: rows for SFT, prompts for on-policy methods, pairs for DPO."""
    micro_batch_size: int = 8
    """Rows per forward/backward; gradient accumulation never changes the gradient."""
    loss_norm: Optional[str] = None
    """token, sequence, sum or constant; None takes the method's default (see engine.py)."""
    norm_constant: float = 1.0
    """Per-sequence constant of the "constant" normalisation (Dr. GRPO uses the max length)."""
    chunk_size: int = 256
    """Rows of the output projection computed at a time in the log-prob path."""
    share_prefix: bool = True
    """Run a prompt that several rows of a micro-batch share (GRPO's group, a DPO pair) through the model once; same log-probs and gradient."""
    max_length: int = 512
    """Longest prompt + completion in tokens for offline data."""
    long_prompts: str = "skip"
    """A prompt longer than max_length: skip (counted and logged) or error."""

    # --- optimizer
    lr: float = 1e-5
    """Peak learning rate of AdamW."""
    weight_decay: float = 0.0
    """AdamW weight decay on matrices."""
    adam_betas: tuple = (0.9, 0.999)
    """AdamW betas."""
    warmup_steps: int = 0
    """Linear warm-up steps."""
    lr_schedule: str = "constant"
    """constant, linear or cosine after warm-up."""
    min_lr_ratio: float = 0.0
    """Final learning rate as a fraction of the peak for linear/cosine."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this (0 turns clipping off)."""
    max_bad_steps: int = 5
    """Stop after this many consecutive steps with a non-finite loss or gradient."""

    # --- on-policy sampling and rewards
    group_size: int = 8
    """G: completions sampled per prompt."""
    max_new_tokens: int = 64
    """Longest completion sampled."""
    temperature: float = 1.0
    """Sampling temperature; the policy's log-probs use the same temperature."""
    top_p: float = 1.0
    """Nucleus sampling mass."""
    top_k: int = 0
    """Top-k sampling (0 = off)."""
    stop_strings: list = field(default_factory=list)
    """Strings that end a completion."""
    rollout_compile: str = "auto"
    """auto | on | off: decode through a fixed-shape step compiled with torch.compile (CUDA graphs on a GPU; gcfamily/rollout/decode.py);
    auto compiles on CUDA only, where the rollout is launch-bound (on the CPU the compiled step measured slower than eager).
    Models whose layers are not all full attention through SDPA decode eagerly either way."""
    rollout_pack_weights: bool = True
    """CPU float32 sampling and evaluation run the linear layers through oneDNN on a packed copy of their weights, made when a
    rollout starts and freed when it ends (gcfamily/core/onednn.py): 1.2-2.2x faster, but a second copy of the weights while
    sampling (540 MB for SmolLM2-135M). false samples on the plain weights, for the lowest peak memory (LoRA with
    activation checkpointing, where the rollout sets the peak). The same tokens up to float32 rounding either way."""
    reward: Optional[str | list] = None
    """Reward(s): a built-in name (numeric, exact, boxed), module:function or path/file.py:function, or a list of them
    (--reward repeated, reward=[a,b]) summed with reward_weights; None takes the task's reward. Built-ins, the task's reward
    and a reward model run in the trainer's process; module:function and file.py:function run in a worker process, where
    an exception, sys.exit, os._exit or a hang fails the call's samples (counted in reward/failed) instead of ending the process
    (a step in which every sample of every process fails still stops the run, in one sentence naming the function)."""
    reward_weights: list = field(default_factory=list)
    """Weight of each reward in `reward`, in order: the reward is sum_k w_k r_k (with several, each r_k is logged as reward/<name>/mean and /std); empty = 1 each."""
    reward_timeout: float = 300.0
    """Seconds one call of a module:function or file.py:function reward may take; past it, all the call's samples fail (0 = no limit)."""
    reward_model: Optional[str] = None
    """Folder of a trained reward model to score completions with."""

    # --- logging, evaluation and checkpoints
    log_every: int = 1
    """Write metrics every this many steps."""
    eval_every: int = 0
    """Held-out accuracy every this many steps (0 = only before and after)."""
    eval_every_s: float = 0.0
    """Held-out accuracy each time this many more seconds of training steps have run (0 = off; evaluation time is not counted)."""
    eval_samples: int = 64
    """Held-out prompts used for accuracy."""
    eval_at_ends: bool = False
    """Evaluate held-out accuracy before the first and after the last step."""
    save_every: int = 0
    """Write a resumable checkpoint every this many steps (0 = only at the end)."""
    keep_last: int = 2
    """Checkpoints to keep."""
    progress: bool = True
    """Show a progress bar."""
    report_to: str | list = "tensorboard"
    """Where metrics go besides metrics.jsonl (always written): tensorboard, wandb (needs the wandb extra), none, or a list."""
    log_completions_every: int = 10
    """On-policy runs: every this many steps, write a sample of prompts, completions and rewards to completions.jsonl and the trackers (0 = off)."""

    # --- LoRA (gcfamily/models/lora.py; needs peft)
    lora_r: int = 0
    """Rank of LoRA adapters on the attention and MLP projections (0 = full fine-tuning). The reference policy is then the
    base with the adapters off (no copy), PPO's critic a second set of adapters on the same base."""
    lora_alpha: float = 32.0
    """LoRA scale numerator: the update is (lora_alpha / lora_r) * B A."""
    lora_dropout: float = 0.0
    """Dropout on the adapters' input (0 keeps pi_old, pi_ref and the training forward the same function)."""
    lora_target_modules: list = field(default_factory=list)
    """Module names to adapt, e.g. [q_proj, v_proj]; empty = every linear layer but the output layer."""
    merge_lora: bool = False
    """Save the final model with the adapters merged into its weights (loadable by from_pretrained); the adapter goes to adapter/."""

    # --- the run folder
    allow_changed_settings: bool = False
    """Let --resume continue with settings that change the trajectory (lr, batch, method, data, ...); the change is recorded
    in run_config.json ("changes") and in the metrics. Off: a resume with such a change is refused, naming the differences."""

    # --- distribution
    dist_timeout: float = 600.0
    """Seconds a collective waits for the other processes before the run stops with one sentence (a process that died)."""
    strategy: str = "ddp"
    """ddp or fsdp2 when several processes run."""
    activation_checkpointing: bool = False
    """Recompute decoder layers in the backward to save memory."""


    explicit: list = field(default_factory=list)
    """Settings given by a recipe or on the command line (filled in by gcf); a method's own defaults never override them."""
    method_options: dict = field(default_factory=dict)
    """Method settings as given, before the method's Settings class types and checks them (internal)."""
    settings: Any = None
    """The method's own settings (an instance of its Settings dataclass; internal)."""

    def __init__(self, **values: Any) -> None:
        """Shared settings by name; any other key is kept for the method's own settings (checked by `settings_for`)."""
        for f in fields(Config):
            object.__setattr__(self, f.name, f.default_factory() if f.default is dataclasses.MISSING else f.default)  # type: ignore[misc]
        for k, v in values.items():
            if k == "method_options":
                self.method_options.update(v)
            elif k in FIELD_NAMES:
                object.__setattr__(self, k, v)
            else:
                self.method_options[k] = v

    def __getattr__(self, name: str) -> Any:
        # only reached for names that are not shared settings: a method setting, once resolved
        settings = self.__dict__.get("settings")
        if settings is not None and name in {f.name for f in fields(settings)}:
            return getattr(settings, name)
        if name in self.__dict__.get("method_options", {}):
            return self.__dict__["method_options"][name]
        raise AttributeError(f"Config has no setting {name!r} (method settings are known once the method resolved them)")

    def __setattr__(self, name: str, value: Any) -> None:
        settings = self.__dict__.get("settings")
        if name not in FIELD_NAMES and settings is not None and name in {f.name for f in fields(settings)}:
            setattr(settings, name, value)
        elif name not in FIELD_NAMES and not name.startswith("_"):
            raise AttributeError(f"Config has no setting {name!r}")
        else:
            object.__setattr__(self, name, value)


@dataclass
class MethodSettings:
    """Base of a method's own settings: subclass it as `Settings` on the method class, a docstring per field."""


FIELDS = {f.name: f for f in fields(Config)}
FIELD_NAMES = frozenset(FIELDS)
INTERNAL = ("explicit", "method_options", "settings")


def field_docs(cls: type = Config) -> dict[str, str]:
    """Field name -> its docstring, read from the source of `cls` and of its dataclass bases."""
    import ast
    import inspect
    import textwrap

    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass) or klass is object:
            continue
        try:
            src = textwrap.dedent(inspect.getsource(klass))
        except (OSError, TypeError):
            continue
        tree = ast.parse(src).body[0]
        last = None
        for node in tree.body:  # type: ignore[attr-defined]
            if isinstance(node, ast.AnnAssign):
                last = node.target.id  # type: ignore[union-attr]
            elif isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and last:
                docs[last] = " ".join(str(node.value.value).split())
                last = None
    return {k: v for k, v in docs.items() if k not in INTERNAL}


def _coerce(f: dataclasses.Field, value: Any, owner: str = "Setting") -> Any:
    """Turn a YAML or command-line value into the field's type; a clear error otherwise."""
    name = f.name
    default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
    typ = (f.type if isinstance(f.type, str) else getattr(f.type, "__name__", None) or str(f.type)).replace("typing.", "")
    optional = default is None or typ.startswith("Optional")
    base = typ.removeprefix("Optional[").removesuffix("]") if optional else typ
    if isinstance(value, str) and base != "str":
        if value.lower() in ("none", "null") and optional:
            return None
        try:
            value = yaml.safe_load(value)  # numbers, booleans, lists, dicts; never code
        except yaml.YAMLError as e:
            raise GcfError(f"{owner} {name}={value!r} is not a valid value.") from e
    if value is None and optional:
        return None
    try:
        if base == "bool":
            if isinstance(value, bool):
                return value
        elif base == "int":
            if isinstance(value, float) and value.is_integer():
                value = int(value)
            if isinstance(value, int) and not isinstance(value, bool):
                return value
        elif base == "float":
            if isinstance(value, str):  # YAML reads 1e-3 (no dot) as a string
                value = float(value)
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                return float(value)
        elif base == "tuple":
            if isinstance(value, (list, tuple)):
                return tuple(value)
        elif base in ("list", "dict"):
            if isinstance(value, list if base == "list" else dict):
                return value
        elif base == "str":
            if isinstance(value, (str, int, float)) and not isinstance(value, bool):
                return str(value)
        else:
            return value
    except (TypeError, ValueError):
        pass
    raise GcfError(f"{owner} {name}={value!r} has the wrong type; expected {base}{' or none' if optional else ''}.")


def settings_for(method_cls: Any, cfg: Config) -> Any:
    """The method's Settings instance from cfg.method_options; an unknown key names both kinds of setting."""
    cls = getattr(method_cls, "Settings", MethodSettings)
    own = {f.name: f for f in fields(cls)}
    values = {}
    for k, v in cfg.method_options.items():
        if k not in own:
            known = ", ".join(sorted(own)) or "none"
            raise GcfError(f"Unknown setting '{k}' for method {cfg.method}; its own settings are: {known}; "
                           f"the shared ones are listed by `gcf settings`.")
        values[k] = _coerce(own[k], v)
        if isinstance(values[k], float) and not math.isfinite(values[k]):  # no method setting means anything at nan or inf
            raise GcfError(f"Setting {k}={values[k]} of method {cfg.method} must be a finite number.")
    return cls(**values)


def own_setting_names(method_cls: Any) -> set[str]:
    """Every key `--set` takes for a method class: the shared settings and its own (by name: gcfamily.methods.setting_names)."""
    own = {f.name for f in fields(getattr(method_cls, "Settings", MethodSettings))}
    return (set(FIELD_NAMES) - set(INTERNAL)) | own


def resolve_settings(cfg: Config, method_cls: Any) -> Config:
    """Attach the method's settings to cfg (a class; by name: gcfamily.methods.resolve); returns cfg."""
    if not isinstance(cfg.settings, getattr(method_cls, "Settings", MethodSettings)):
        object.__setattr__(cfg, "settings", settings_for(method_cls, cfg))
    return cfg


def apply(cfg: Config, values: dict[str, Any], source: str) -> Config:
    """Return a copy of cfg with values applied: shared keys typed now, the rest kept for the method."""
    out = Config(**{f.name: getattr(cfg, f.name) for f in fields(Config) if f.name not in ("settings", "method_options")},
                 method_options=dict(cfg.method_options))
    for k, v in values.items():
        key = k.replace("-", "_")
        if key in INTERNAL:
            raise GcfError(f"Unknown setting '{k}' in {source}; see `gcf settings` for the list.")
        if key in FIELD_NAMES:
            object.__setattr__(out, key, _coerce(FIELDS[key], v))
        else:
            out.method_options[key] = v
    return out


def load_yaml(path: str) -> dict[str, Any]:
    """Read a recipe; a missing or malformed file is a clear error."""
    p = Path(path)
    if not p.is_file():
        raise GcfError(f"Config file {path} does not exist; pass a YAML recipe such as configs/sft-arithmetic.yaml.")
    try:
        data = yaml.safe_load(p.read_text(encoding="utf-8")) or {}
    except UnicodeDecodeError as e:
        raise GcfError(f"Config file {path} is not text (byte {e.start} is not UTF-8); pass a YAML recipe such as configs/sft-arithmetic.yaml.") from e
    except OSError as e:
        raise GcfError(f"Config file {path} could not be read ({e.strerror or e}).") from e
    except yaml.YAMLError as e:
        raise GcfError(f"Config file {path} is not valid YAML ({(str(e).splitlines() or [type(e).__name__])[0]}).") from e
    if not isinstance(data, dict):
        raise GcfError(f"Config file {path} must be a mapping of setting: value.")
    bad = [k for k in data if not isinstance(k, str)]
    if bad:
        raise GcfError(f"Config file {path} has the key {bad[0]!r}, which is not a setting name; keys are names such as lr or method.")
    return data


def parse_sets(items: tuple[str, ...]) -> dict[str, str]:
    """`--set key=value` pairs to a dict."""
    out = {}
    for item in items:
        if "=" not in item:
            raise GcfError(f"--set {item!r} must look like key=value.")
        k, v = item.split("=", 1)
        out[k.strip()] = v
    return out


def read(config_path: Optional[str], overrides: dict[str, Any]) -> Config:
    """Defaults, then the YAML recipe, then command-line values; the method's own settings stay untyped until its class
    types them (gcfamily.methods.resolve does both)."""
    cfg = Config()
    given: dict[str, Any] = {}
    if config_path:
        given = load_yaml(config_path)
        cfg = apply(cfg, given, config_path)
    cfg = apply(cfg, overrides, "the command line")
    if cfg.trust_remote_code and not any(k.replace("-", "_") == "trust_remote_code" for k in overrides):
        # a recipe is often someone else's file: running a model's own code is asked for where the command is typed
        raise GcfError(f"Config file {config_path} sets trust_remote_code: true, which a recipe alone may not do; "
                       f"pass --trust-remote-code on the command line if you trust the model's code.")
    object.__setattr__(cfg, "explicit", sorted({k.replace("-", "_") for k in [*given, *overrides]}))
    return cfg


def to_dict(cfg: Config) -> dict[str, Any]:
    """JSON-ready dict of the resolved settings, shared and the method's, flat (saved with every run)."""
    out = {f.name: getattr(cfg, f.name) for f in fields(Config) if f.name not in INTERNAL}
    out.update(dataclasses.asdict(cfg.settings) if cfg.settings is not None else cfg.method_options)
    out["explicit"] = list(cfg.explicit)
    return json.loads(json.dumps(out, default=list))


def env_flag(name: str) -> bool:
    """True when an environment variable is set to a truthy value."""
    return os.environ.get(name, "").lower() in ("1", "true", "yes")


__all__ = ["Config", "MethodSettings", "apply", "own_setting_names", "parse_sets", "read", "resolve_settings", "to_dict"]
