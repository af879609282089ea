"""`gcf methods`, `gcf settings`, `gcf tasks`, `gcf data` and `gcf check`: the commands that show or check, never train."""

from __future__ import annotations

import sys
from typing import Any, Optional

import click

from gcfamily.cli.options import _overrides, _resolve
from gcfamily.errors import GcfError


@click.command()
@click.option("--method", "spec", default=None, help="Show one method: a name, module:Class or path/to/file.py:Class.")
def methods(spec: Optional[str]) -> None:
    """List every method (built in, then installed by packages) with its data source and gradient coefficient."""
    from gcfamily.methods import METHODS, get_method, installed_methods

    installed = installed_methods()
    names = [spec] if spec else [*METHODS, *(n for n in installed if n not in METHODS)]
    w = max(len(n) for n in names)
    broken: Optional[GcfError] = None
    for name in names:
        try:
            cls = get_method(name)
        except GcfError as e:  # a broken package: list the rest, then fail with its one line
            broken = broken or e
            continue
        source = f"  (from {installed[name][1]})" if name in installed and name not in METHODS else ""
        click.echo(f"{name:<{w}}  data: {cls.data_source}{source}\n{'':<{w}}  GC:   {cls.gc_formula}")
    if broken is not None:
        raise broken


@click.command()
@click.option(
    "--method", "spec", default=None, help="Add a method's own settings: a name, module:Class or path/to/file.py:Class."
)
def settings(spec: Optional[str]) -> None:
    """List the shared settings (and a method's own) with their defaults and meaning."""
    import dataclasses

    from gcfamily.config import INTERNAL, Config, field_docs

    def show(cls: type, overrides: dict[str, Any]) -> None:
        docs = field_docs(cls)
        for f in dataclasses.fields(cls):
            if f.name in INTERNAL:
                continue
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
            if f.name in overrides:  # the method's own default of a shared setting
                value = overrides[f.name]
                default = "set from the other settings" if callable(value) else value
            click.echo(f"{f.name} = {default!r}\n    {docs.get(f.name, '')}")

    if spec is None:
        show(Config, {})
        return
    from gcfamily.methods import get_method

    cls = get_method(spec)
    show(Config, getattr(cls, "setting_defaults", {}))
    own = getattr(cls, "Settings", None)
    if own is not None and dataclasses.fields(own):
        click.echo(f"\n# {spec}'s own settings (--set KEY=VALUE as well)")
        show(own, getattr(cls, "setting_defaults", {}))


@click.command("check")
@click.argument("spec")
@click.option("--set", "sets", multiple=True, help="Also check at these settings: --set key=value (repeatable).")
@click.option(
    "--seeds", default=2, show_default=True, type=click.IntRange(1, 10), help="Random batches per settings case."
)
def check_cmd(spec: str, sets: tuple[str, ...], seeds: int) -> None:
    """Check a method's gradient (a name, module:Class or path/to/file.py:Class) against an independent textbook.

    At the method's defaults and at settings that reach every branch: (a) the engine's gradient equals autograd
    of the textbook objective (gcfamily/check/textbook.py) and of the method's own objective; (b) d loss / d logits through
    the engine's log-prob backward equals GC * w / Z * (onehot - softmax). Exit 0: passed; 1: a check failed.
    """
    from gcfamily import check
    from gcfamily.config import FIELDS, Config, apply, parse_sets
    from gcfamily.methods import get_method

    cls = get_method(spec)
    cases = check.cases(cls)  # a family it cannot build a batch for is one sentence
    if sets:
        values = parse_sets(sets)
        typed = apply(Config(), values, "--set")  # shared settings typed here, the method's own by its Settings
        given = {k.replace("-", "_"): v for k, v in values.items()}
        given = {k: getattr(typed, k) if k in FIELDS else v for k, v in given.items()}
        if "group_size" in given:
            raise GcfError(
                f"--set group_size: the check's batches have {check.G} samples per prompt; leave group_size out."
            )
        m = check.make(cls, {"group_size": check.G, **given})  # a bad key or value: one error line
        cases.append(("given", {k: getattr(m.cfg if k in FIELDS else m.settings, k) for k in given}))  # typed
    outcomes = [check.run_case(cls, label, s, tuple(range(seeds))) for label, s in cases]
    text, ok = check.report(spec, cls, outcomes)
    click.echo(text)
    sys.exit(0 if ok else 1)


@click.command()
def tasks() -> None:
    """List the built-in tasks."""
    from gcfamily.tasks import TASKS

    for name, cls in TASKS.items():
        click.echo(f"{name}: {getattr(cls, 'description', '')}")


@click.command("data")
@click.option("--method", default="sft", show_default=True, help="The method whose view of the data to show.")
@click.option("--model", default="smollm2-135m", show_default=True, help="Whose tokenizer (and chat template) to use.")
@click.option(
    "--dataset", help="File, save_to_disk folder or hub id; without it, the task's rows as the method makes them."
)
@click.option("--dataset-config", help="The hub dataset's configuration (subset).")
@click.option("--task", default=None, help="Built-in task, when there is no --dataset.")
@click.option("--config", "config_path", type=str, help="YAML recipe (configs/...).")
@click.option(
    "--set", "sets", multiple=True, help="Settings: chat_format, system_prompt, columns, max_length, ... (key=value)."
)
@click.option("--rows", default=3, show_default=True, type=click.IntRange(0, 1000), help="Rows to print.")
def data_cmd(config_path: Optional[str], sets: tuple[str, ...], rows: int, **opts: Any) -> None:
    """Show what a method trains on: format, chat format, rows kept and skipped, lengths, and the first rows as tokenised."""
    from gcfamily.config import parse_sets, validate
    from gcfamily.inspect_data import describe

    overrides = _overrides(**opts)
    overrides.update(parse_sets(sets))
    cfg = _resolve(config_path, overrides)
    validate(cfg)
    click.echo(describe(cfg, rows))
