"""What the command line's settings mean: --set overrides, the run's settings resolved from them, and one sentence for a
flag or setting spelled as TRL spells it (or for `--set a=1 b=2`)."""

from __future__ import annotations

from typing import Any

import click

from gcfamily.errors import GcfError

_TAKE_SETTINGS = ("run", "data")
"""The commands whose --set takes the run's settings (eval's takes task options)."""


def _usage_hint(e: click.UsageError) -> str | None:
    """One sentence for a flag spelled as TRL spells it (--learning_rate -> --set lr=..., --output_dir -> --output-dir),
    or for `--set a=1 b=2` (one pair per --set); None: click's own message."""
    import re

    from gcfamily.config import FIELD_NAMES
    from gcfamily.config.trl_names import TRL_NAMES, sentence

    ctx = e.ctx
    if ctx is None or ctx.command is None:
        return None
    flags = {o for p in ctx.command.params for o in getattr(p, "opts", [])}
    settings = ctx.command.name in _TAKE_SETTINGS
    if isinstance(e, click.NoSuchOption):
        typed = e.option_name
        name = typed.lstrip("-").replace("-", "_")
        trl = TRL_NAMES.get(name)
        if trl is not None and (trl.target in flags if (trl.target or "").startswith("--") else settings):
            return sentence(name, typed)
        dashed = "--" + name.replace("_", "-")
        if dashed in flags:
            return f"gcf {ctx.command.name} has no {typed}; it spells it {dashed}."
        if settings and name in FIELD_NAMES | _method_setting_names():
            return f"{typed} is a setting, not a flag: gcfamily spells it --set {name}=..."
        return None
    extra = re.search(r"unexpected extra arguments? \((.+)\)", e.format_message())
    if extra and "--set" in flags and all("=" in a for a in extra.group(1).split()):
        left = extra.group(1).split()
        pairs = " ".join(f"--set {a}" for a in left)
        return f"--set takes one key=value, so {' '.join(left)} was left over: give each its own --set ({pairs})."
    return None


def _method_setting_names() -> set[str]:
    """The own settings of every built-in method (grpo's beta, ppo's gamma, ...)."""
    import dataclasses

    from gcfamily.methods import METHODS, get_method

    return {f.name for m in METHODS for f in dataclasses.fields(get_method(m).Settings)}


def _resolve(config_path: str | None, overrides: dict[str, Any]) -> Any:
    """The run's settings (gcfamily.methods.resolve); an unknown setting that TRL spells so (learning_rate,
    num_train_epochs) is one sentence with gcfamily's spelling."""
    from gcfamily.methods import resolve

    try:
        return resolve(config_path, overrides)
    except GcfError as e:
        hint = _trl_setting_hint(config_path, overrides, str(e))
        if hint is None:
            raise
        raise GcfError(hint) from e


def _trl_setting_hint(config_path: str | None, overrides: dict[str, Any], error: str) -> str | None:
    """The sentence for the first setting the method does not know, when the error is about it and TRL spells it so."""
    from gcfamily.config import own_setting_names, read
    from gcfamily.config.trl_names import TRL_NAMES, sentence
    from gcfamily.methods import get_method

    try:
        cfg = read(config_path, overrides)
        known = own_setting_names(get_method(cfg.method))
    except GcfError:
        return None
    unknown = [k for k in cfg.method_options if k not in known]
    if not unknown or f"'{unknown[0]}'" not in error:
        return None
    trl = TRL_NAMES.get(unknown[0])
    # a name gcfamily shares (beta for sft): the error names the method's own
    if trl is None or trl.target == unknown[0]:
        return None
    return sentence(unknown[0], f"'{unknown[0]}'")


def _overrides(**opts: Any) -> dict[str, Any]:
    return {k: v for k, v in opts.items() if v is not None}
