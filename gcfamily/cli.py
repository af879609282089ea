"""`gcf`: run a method, list methods and settings, evaluate a model.

Every user mistake ends in one sentence on stderr and exit code 2; no traceback.
"""

from __future__ import annotations

import os
import sys
from typing import Any, Optional

import click

from gcfamily import __version__
from gcfamily.bench import bench
from gcfamily.errors import GcfError
from gcfamily.theory.cli import theory

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Read when the libraries are imported: their notices and warnings would otherwise come before a one-line error.
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
os.environ.setdefault("DATASETS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_VERBOSITY", "error")


def _fail(message: str, code: int = 2) -> None:
    click.echo(f"error: {message}", err=True)
    sys.exit(code)


class GcfGroup(click.Group):
    """Turns GcfError into one clear line and a non-zero exit."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except GcfError as e:
            _fail(str(e), getattr(e, "exit_code", 2))
        except click.UsageError as e:  # a bad option or value: click's own message, on one line like the rest
            hint = _usage_hint(e)
            if hint is not None:
                _fail(hint, e.exit_code)
            where = f"; see `{e.ctx.command_path} --help`." if e.ctx is not None else "."
            _fail(" ".join(e.format_message().split()).rstrip(".") + where, e.exit_code)
        except KeyboardInterrupt:
            _fail("interrupted.", 130)


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
    if (
        trl is None or trl.target == unknown[0]
    ):  # a name gcfamily shares (beta for sft): the error names the method's own
        return None
    return sentence(unknown[0], f"'{unknown[0]}'")


def _quiet_libraries() -> None:
    """Keep the libraries' progress bars, notices and warnings out of the run's output (an error stays one line).

    Warnings raised in gcfamily or in the user's own code (a reward, a method) still show.
    """
    import logging
    import warnings

    for name in (
        "transformers",
        "datasets",
        "huggingface_hub",
        "torch",
        "accelerate",
        "peft",
        "safetensors",
        "filelock",
        "urllib3",
    ):
        logging.getLogger(name).setLevel(logging.ERROR)
    # datasets' file readers log a parse error, then raise it: the raise becomes the one error line
    logging.getLogger("datasets.packaged_modules").setLevel(logging.CRITICAL)
    warnings.filterwarnings(
        "ignore", module=r"(transformers|datasets|huggingface_hub|torch|accelerate|peft|safetensors)(\.|$)"
    )
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        hf_logging.set_verbosity_error()
    except ImportError:  # pragma: no cover
        pass


@click.group(cls=GcfGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, "--version", prog_name="gcf", message="%(prog)s (gcfamily) %(version)s")
def main() -> None:
    """gcfamily: one engine for SFT, rejection sampling, PPO, GRPO, DPO and their variants."""
    _quiet_libraries()


def _overrides(**opts: Any) -> dict[str, Any]:
    return {k: v for k, v in opts.items() if v is not None}


@main.command()
@click.option("--method", help="Method: a name from `gcf methods`, module:Class or path/to/file.py:Class.")
@click.option("--model", help="Alias (tiny, smollm2-135m, qwen-0.5b), hub id or local folder.")
@click.option("--task", help="Built-in task (arithmetic, countdown, sorting, ...).")
@click.option(
    "--dataset",
    help="JSONL/JSON/parquet/CSV file, save_to_disk folder, or hub id (org/name); any TRL format the method takes.",
)
@click.option("--dataset-config", help="The hub dataset's configuration (subset), e.g. main.")
@click.option("--config", "config_path", type=str, help="YAML recipe (configs/...).")
@click.option("--set", "sets", multiple=True, help="Override any setting: --set key=value (repeatable).")
@click.option("--max-steps", type=int)
@click.option("--output-dir", type=str)
@click.option(
    "--reward",
    multiple=True,
    callback=lambda _ctx, _p, v: (v[0] if len(v) == 1 else list(v)) if v else None,
    help="Reward: built-in name, module:function or file.py:function; repeat for several (weights: --set reward_weights=[1,0.5]).",
)
@click.option("--reward-model", help="Folder of a trained reward model.")
@click.option("--seed", type=int)
@click.option(
    "--resume",
    is_flag=False,
    flag_value="latest",
    default=None,
    help="Continue from the newest checkpoint (or from PATH).",
)
@click.option("--overwrite", is_flag=True, default=None, help="Replace a previous run in the output folder.")
@click.option("--trust-remote-code", is_flag=True, default=None, help="Allow model code from the hub.")
@click.option("--eval", "eval_at_ends", is_flag=True, default=None, help="Held-out accuracy before and after training.")
@click.option("--nproc", type=int, default=1, show_default=True, help="Processes (torch.distributed) on this machine.")
@click.option("--strategy", type=str, help="ddp or fsdp2 when --nproc > 1.")
def run(config_path: Optional[str], sets: tuple[str, ...], resume: Optional[str], nproc: int, **opts: Any) -> None:
    """Train a model with a method."""
    from gcfamily.config import parse_sets
    from gcfamily.config import validate
    from gcfamily.models import check_source, context_of

    overrides = _overrides(**opts)
    overrides.update(parse_sets(sets))
    cfg = _resolve(config_path, overrides)
    validate(cfg)  # before any folder is named, taken or cleared, and before --nproc starts processes
    check_source(cfg.model)  # a damaged model folder is refused before --overwrite clears the output folder
    context = context_of(cfg.model)
    if context is not None and cfg.max_length > context:  # longer rows would run past the model's positions
        raise GcfError(
            f"max_length={cfg.max_length} is longer than the context of model {cfg.model} ({context} positions, "
            f"max_position_embeddings); set max_length <= {context}."
        )
    if "output_dir" not in cfg.explicit:
        from gcfamily.api import default_output_dir

        cfg = default_output_dir(cfg, resume)
        if nproc > 1 and "run" in sys.argv:  # every process must write to the same folder
            sys.argv += ["--output-dir", cfg.output_dir]
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:  # one process of torchrun (or of --nproc)
        from gcfamily.run.launch import run_process

        run_process(cfg, resume)
        return
    if nproc > 1:
        from gcfamily.run.distributed import check_batch_size
        from gcfamily.run.launch import launch

        check_batch_size(cfg.batch_size, nproc)
        if "run" not in sys.argv:
            raise GcfError(
                "--nproc re-runs the `gcf run` command line; call it as `gcf run ... --nproc N`, or use torchrun."
            )
        sys.exit(launch(nproc, sys.argv[sys.argv.index("run") :]))
    from gcfamily.run.trainer import Trainer

    trainer = Trainer(cfg, resume=resume)
    trainer.run()
    if trainer.is_main:
        click.echo(trainer.summary())


@main.command()
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


@main.command()
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


@main.command("check")
@click.argument("spec")
@click.option("--set", "sets", multiple=True, help="Also check at these settings: --set key=value (repeatable).")
@click.option(
    "--seeds", default=2, show_default=True, type=click.IntRange(1, 10), help="Random batches per settings case."
)
def check_cmd(spec: str, sets: tuple[str, ...], seeds: int) -> None:
    """Check a method's gradient (a name, module:Class or path/to/file.py:Class) against an independent textbook.

    At the method's defaults and at settings that reach every branch: (a) the engine's gradient equals autograd
    of the textbook objective (gcfamily/check/__init__.py) and of the method's own objective; (b) d loss / d logits through
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


@main.command()
def tasks() -> None:
    """List the built-in tasks."""
    from gcfamily.tasks import TASKS

    for name, cls in TASKS.items():
        click.echo(f"{name}: {getattr(cls, 'description', '')}")


@main.command("data")
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
    from gcfamily.config import parse_sets
    from gcfamily.config import validate
    from gcfamily.inspect_data import describe

    overrides = _overrides(**opts)
    overrides.update(parse_sets(sets))
    cfg = _resolve(config_path, overrides)
    validate(cfg)
    click.echo(describe(cfg, rows))


@main.command("eval")
@click.option(
    "--model", default="smollm2-135m", show_default=True, help="Alias, hub id or local folder (e.g. a run folder)."
)
@click.option("--task", default="arithmetic", show_default=True)
@click.option(
    "--dataset",
    default=None,
    help="Your held-out rows instead of a task (file, save_to_disk folder or hub id); needs --reward.",
)
@click.option("--dataset-config", default=None, help="The hub dataset's configuration (subset).")
@click.option("--split", default="test", show_default=True, help="Split of --dataset.")
@click.option(
    "--reward",
    multiple=True,
    help="Reward(s) scoring --dataset completions: built-in name, module:function or file.py:function.",
)
@click.option("--samples", default=200, show_default=True, type=click.IntRange(min=1), help="Held-out prompts.")
@click.option("--max-new-tokens", default=32, show_default=True, type=click.IntRange(min=1))
@click.option(
    "--seed",
    default=0,
    show_default=True,
    type=int,
    help="Seed of the task's train/test split and of --maj-k's sampling.",
)
@click.option(
    "--maj-k",
    "maj_k",
    default=None,
    type=click.IntRange(min=1),
    help="Also sample K completions per held-out prompt: Maj@K (majority vote of their answers) and pass@K.",
)
@click.option(
    "--temperature",
    default=None,
    type=click.FloatRange(min=0, min_open=True),
    help="Temperature of the --maj-k samples.  [default: 1.0]",
)
@click.option(
    "--set",
    "sets",
    multiple=True,
    help="Task options (--set level=1d-add); with --dataset, data settings (chat_format, columns, ...).",
)
@click.option("--device", default="auto", show_default=True)
def eval_cmd(
    model: str,
    task: str,
    dataset: Optional[str],
    dataset_config: Optional[str],
    split: str,
    reward: tuple[str, ...],
    samples: int,
    max_new_tokens: int,
    seed: int,
    maj_k: Optional[int],
    temperature: Optional[float],
    sets: tuple[str, ...],
    device: str,
) -> None:
    """Held-out accuracy of a model on a task, or mean reward (and accuracy where rows carry an answer) on your data; greedy decoding.

    With --maj-k K, also Maj@K and pass@K from K completions sampled per held-out prompt (task only: the vote needs the
    task's answer extraction)."""
    import time

    from gcfamily.config import parse_sets
    from gcfamily.models import load_model
    from gcfamily.run.build import resolve_device, resolve_dtype

    dev = resolve_device(device)
    if temperature is not None and maj_k is None:
        raise GcfError("--temperature sets the temperature of the --maj-k samples; add --maj-k K or drop it.")
    temperature = 1.0 if temperature is None else temperature
    if dataset is None and reward:
        raise GcfError(
            "--reward scores --dataset rows; a task is scored by its own reward (drop --reward or pass --dataset)."
        )
    if dataset is not None:
        from gcfamily.config import Config, apply
        from gcfamily.config import validate
        from gcfamily.data.sources import load_rows
        from gcfamily.run.heldout import evaluate_rows
        from gcfamily.data.formats import Formatter
        from gcfamily.rewards import Rewards

        if not reward:
            raise GcfError("gcf eval --dataset needs --reward to score the completions (e.g. --reward numeric).")
        if maj_k is not None:
            from gcfamily.run.heldout import answer_extractor

            answer_extractor(None)  # rows scored by reward functions read no answers: the one-sentence error
        cfg = apply(Config(), parse_sets(sets), "--set")
        validate(cfg)
        rows = load_rows(dataset, split, dataset_config, cfg.columns)
        m, tok = load_model(model, resolve_dtype("auto", dev), dev)
        fmt = Formatter(tok, cfg.chat_format, cfg.system_prompt, cfg.assistant_only_loss, cfg.chat_template)
        t0 = time.time()
        from gcfamily.core import onednn

        with onednn.packing(cfg.rollout_pack_weights):
            out = evaluate_rows(
                m,
                fmt,
                rows,
                Rewards.from_specs(list(reward), cfg.reward_weights, cfg.reward_timeout),
                max_new_tokens,
                n=samples,
            )
        acc = f", accuracy {out['eval/accuracy']:.3f}" if "eval/accuracy" in out else ""
        click.echo(
            f"{model} on {dataset} ({split}): mean reward {out['eval/reward_mean']:.4f}{acc} over {int(out['eval/prompts'])} prompts "
            f"({int(out['eval/reward_failed'])} failed) in {time.time() - t0:.1f} s"
        )
        return
    from gcfamily.run.heldout import answer_extractor, heldout_accuracy, sampled_eval
    from gcfamily.tasks import get_task

    import yaml

    try:  # --set min_len=2: a number, as in a recipe's task_options
        options = {k: yaml.safe_load(v) for k, v in parse_sets(sets).items()}
    except yaml.YAMLError as e:
        raise GcfError(f"a --set task option is not a valid value ({str(e).splitlines()[0]}).") from e
    t = get_task(task, seed=seed, **options)
    answer = answer_extractor(t) if maj_k is not None else None  # before the model loads: a task without one fails fast
    m, tok = load_model(model, resolve_dtype("auto", dev), dev)
    t0 = time.time()
    acc = heldout_accuracy(m, tok, t, samples, max_new_tokens)
    n = len(t.heldout_rows(samples))
    click.echo(f"{model} on {task}: held-out accuracy {acc:.3f} ({round(acc * n)}/{n}) in {time.time() - t0:.1f} s")
    if maj_k is not None:
        from gcfamily.data.formats import Formatter

        t0 = time.time()
        got = sampled_eval(
            m,
            Formatter(tok),
            t.heldout_rows(samples),
            t.reward,
            maj_k,
            temperature,
            max_new_tokens,
            seed,
            answer=answer,
        )
        click.echo(
            f"{model} on {task}: maj@{maj_k} {got.maj_at_k:.3f}, pass@{maj_k} {got.pass_at_k[maj_k]:.3f}, "
            f"pass@1 {got.pass_at_k[1]:.3f} from {maj_k} samples per prompt at temperature {temperature:g} over "
            f"{got.prompts} prompts ({got.unanswered} with no answer in any sample) in {time.time() - t0:.1f} s"
        )


main.add_command(theory)
main.add_command(bench)


if __name__ == "__main__":
    main()
