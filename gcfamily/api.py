"""The Python door: `gcfamily.train(...)`, the same run as `gcf run`, with objects where the CLI takes names.

    import gcfamily as gcf
    out = gcf.train(method="grpo", model="tiny", dataset=ds, reward=my_reward, max_steps=10)

- `method`: a name, `module:Class`, `path/file.py:Class`, or a Method subclass itself;
- `model`: a name or folder, a transformers causal LM (trained in place; its tokenizer loads from its
  name_or_path), or a `(model, tokenizer)` pair;
- `dataset`, `eval_dataset`: a path or hub id, a `datasets.Dataset` / `DatasetDict`, or a list of dicts;
- `reward`: a name or spec, a function (called in this process, TRL's keyword convention), or a list of them;
- `env`: a name or spec as `--env` takes it, or an Environment subclass itself (run in this process);
- every other keyword is a setting (`gcf settings --method M` lists them), typed and checked as `--set` is.

Returns the run folder. Errors are `gcfamily.errors.GcfError` with one sentence.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any, Optional

from gcfamily.errors import GcfError


def default_output_dir(cfg: Any, resume: Optional[str] = None) -> Any:
    """A run given no output folder gets one of its own: runs/METHOD-MODEL-TIME.

    `resume=PATH` continues in PATH's run folder; a bare resume ("latest") needs the folder. Under
    torchrun every process takes the name from the shared run id.
    """
    if resume not in (None, "latest"):
        p = Path(resume)  # type: ignore[arg-type]
        run_dir = p.parent.parent if p.parent.name == "checkpoints" else p
        return cfg.replace(output_dir=str(run_dir))
    if resume == "latest":
        raise GcfError("--resume without a path needs --output-dir (the folder of the run to continue).")
    stamp = os.environ.get("TORCHELASTIC_RUN_ID") if int(os.environ.get("WORLD_SIZE", "1")) > 1 else None
    stamp = stamp or time.strftime("%Y%m%d-%H%M%S")
    from gcfamily.methods import method_label

    model = Path(cfg.model).name or "model"
    return cfg.replace(output_dir=f"runs/{method_label(cfg.method)}-{model}-{stamp}")


def _what(value: Any) -> str:
    """A wrong argument named by its type and a short repr."""
    text = repr(value) if isinstance(value, (bool, int, float)) else ""
    return f"the {type(value).__name__} {text}".rstrip() if text else f"a {type(value).__name__}"


def _is_data(obj: Any) -> bool:
    """Whether obj is one of the data sources train() takes (None: the task's)."""
    if obj is None or isinstance(obj, (str, Path)):
        return True
    if isinstance(obj, list):
        return all(isinstance(r, dict) for r in obj)
    return hasattr(obj, "column_names") or (
        hasattr(obj, "keys") and all(hasattr(v, "column_names") for v in obj.values())
    )


def _reward_label(r: Any) -> str:
    return r if isinstance(r, str) else getattr(r, "__name__", None) or type(r).__name__


def train(
    method: Any = "sft",
    model: Any = "smollm2-135m",
    dataset: Any = None,
    reward: Any = None,
    *,
    eval_dataset: Any = None,
    output_dir: Optional[str] = None,
    resume: Optional[str] = None,
    **settings: Any,
) -> Path:
    """Train and return the run folder (module docstring); the final model loads with from_pretrained(folder)."""
    from gcfamily.config import Config, apply, resolve_settings
    from gcfamily.data.sources import describe
    from gcfamily.methods import get_method
    from gcfamily.methods.base import Method
    from gcfamily.run.hooks import RunHooks
    from gcfamily.run.trainer import Trainer

    for key, given in (("resume", resume), ("output_dir", output_dir)):
        if given is not None and not isinstance(given, (str, Path)):
            raise GcfError(f"{key} must be a path (a str or pathlib.Path) or None; got {_what(given)}.")
    for key, obj in (("dataset", dataset), ("eval_dataset", eval_dataset)):
        if not _is_data(obj):
            raise GcfError(
                f"{key} must be a path or hub id, a datasets.Dataset or DatasetDict, or a list of dicts; got {_what(obj)}."
            )
    pair = isinstance(model, tuple) and len(model) == 2
    if not (isinstance(model, (str, Path)) or pair or hasattr(model, "config")):
        raise GcfError(
            f"model must be a name, a folder, a transformers causal LM or a (model, tokenizer) pair; got {_what(model)}."
        )
    rewards_given = list(reward) if isinstance(reward, (list, tuple)) else [] if reward is None else [reward]
    if reward is not None and (not rewards_given or not all(isinstance(r, str) or callable(r) for r in rewards_given)):
        raise GcfError(f"reward must be a name or spec, a function, or a non-empty list of them; got {_what(reward)}.")
    values: dict[str, Any] = dict(settings)
    method_cls = None
    if isinstance(method, type):
        if not issubclass(method, Method):
            raise GcfError(f"method={method.__name__} is not a gcfamily Method subclass.")
        method_cls, values["method"] = method, f"{method.__module__}:{method.__qualname__}"
    else:
        values["method"] = method
    model_obj = None
    if isinstance(model, (str, Path)):
        values["model"] = str(model)
    else:
        model_obj = model
        m = model[0] if isinstance(model, tuple) else model
        values["model"] = str(getattr(m, "name_or_path", "") or type(m).__name__)
    data_obj = eval_obj = None
    for key, obj in (("dataset", dataset), ("eval_dataset", eval_dataset)):
        if isinstance(obj, (str, Path)):
            values[key] = str(obj)
        elif obj is not None:
            values[key] = describe(obj)
            data_obj, eval_obj = (obj, eval_obj) if key == "dataset" else (data_obj, obj)
    env_cls = settings.get("env") if isinstance(settings.get("env"), type) else None
    if env_cls is not None:  # an Environment class runs in this process (the worker cannot import a script's class)
        values["env"] = f"{env_cls.__module__}:{env_cls.__qualname__}"
    rewards = None
    if reward is not None:
        items = list(reward) if isinstance(reward, (list, tuple)) else [reward]
        if any(callable(r) for r in items):
            rewards = items
        values["reward"] = [_reward_label(r) for r in items] if len(items) > 1 else _reward_label(items[0])
    if output_dir is not None:
        values["output_dir"] = str(output_dir)
    cfg = apply(Config(), values, "train()")
    object.__setattr__(cfg, "explicit", sorted(values))
    resolve_settings(cfg, method_cls if method_cls is not None else get_method(cfg.method))
    if output_dir is None:
        cfg = default_output_dir(cfg, resume)
    hooks = RunHooks(environment=env_cls)
    trainer = Trainer(
        cfg,
        resume=resume,
        method=method_cls,
        model=model_obj,
        dataset=data_obj,
        eval_dataset=eval_obj,
        rewards=rewards,
        hooks=hooks,
    )
    return trainer.run().resolve()
