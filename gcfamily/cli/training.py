"""`gcf run` (train a model with a method) and `gcf eval` (a model's held-out accuracy, or mean reward on your rows): the
commands that load a model."""

from __future__ import annotations

import os
import sys
from typing import Any, Optional

import click

from gcfamily.cli.options import _overrides, _resolve
from gcfamily.errors import GcfError


@click.command()
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
@click.option(
    "--env",
    help="Environment for multi-turn episodes: calculator, guess, reasoning-gym, module:Class or file.py:Class.",
)
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
    from gcfamily.config import parse_sets, validate
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


@click.command("eval")
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
@click.option(
    "--env",
    default=None,
    help="Evaluate episodes with this environment (as gcf run --env); --maj-k votes on last turns.",
)
@click.option("--max-turns", default=4, show_default=True, type=click.IntRange(min=1), help="Policy turns per episode.")
@click.option(
    "--save",
    default=None,
    metavar="FILE",
    help="Write every scored prompt as a JSON line: prompt, completion, reward and verdict (correct).",
)
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
    env: Optional[str],
    max_turns: int,
    save: Optional[str],
) -> None:
    """Held-out accuracy of a model on a task, or mean reward (and accuracy where rows carry an answer) on your data; greedy decoding.

    With --maj-k K, also Maj@K and pass@K from K completions sampled per held-out prompt (task only: the vote needs the
    task's answer extraction)."""
    import time

    from gcfamily.config import parse_sets
    from gcfamily.models import load_model
    from gcfamily.run import console
    from gcfamily.run.build import resolve_device, resolve_dtype
    from gcfamily.run.heldout import save_details

    dev = resolve_device(device)
    if save is not None and not os.path.isdir(os.path.dirname(os.path.abspath(save))):  # before minutes of decoding
        raise GcfError(f"--save {save}: its folder does not exist; create it or give another file.")
    details: list = []
    if temperature is not None and maj_k is None:
        raise GcfError("--temperature sets the temperature of the --maj-k samples; add --maj-k K or drop it.")
    temperature = 1.0 if temperature is None else temperature
    if env is not None and dataset is not None:
        raise GcfError("--env evaluates a task's held-out prompts as episodes; drop --dataset with it.")
    if dataset is None and reward:
        raise GcfError(
            "--reward scores --dataset rows; a task is scored by its own reward (drop --reward or pass --dataset)."
        )
    if dataset is not None:
        from gcfamily.config import Config, apply, validate
        from gcfamily.data.encoding import Formatter
        from gcfamily.data.sources import load_rows
        from gcfamily.rewards import Rewards
        from gcfamily.run.heldout import accuracy_rule, evaluate_rows

        if not reward:
            raise GcfError("gcf eval --dataset needs --reward to score the completions (e.g. --reward numeric).")
        if maj_k is not None:
            from gcfamily.run.heldout import answer_extractor

            answer_extractor(None)  # rows scored by reward functions read no answers: the one-sentence error
        cfg = apply(Config(), parse_sets(sets), "--set")
        validate(cfg)
        rows = load_rows(dataset, split, dataset_config, cfg.columns)
        scorer = Rewards.from_specs(list(reward), cfg.reward_weights, cfg.reward_timeout)
        counted, measured = accuracy_rule(scorer, rows[:samples])  # what accuracy means here, or why there is none
        m, tok = load_model(model, resolve_dtype("auto", dev), dev, say=console.teller(cfg.progress))
        from gcfamily.run.heldout import check_fits

        check_fits(m, min(128, samples, len(rows)), max_new_tokens, f"--max-new-tokens {max_new_tokens}")
        fmt = Formatter(tok, cfg.chat_format, cfg.system_prompt, cfg.assistant_only_loss, cfg.chat_template)
        t0 = time.time()
        from gcfamily.core import onednn

        with onednn.packing(cfg.rollout_pack_weights), console.eval_bar(cfg.progress, samples, "evaluating") as bar:
            out = evaluate_rows(
                m, fmt, rows, scorer, max_new_tokens, n=samples, accuracy=counted, details=details, bar=bar
            )
        n, right = int(out["eval/prompts"]), sum(bool(d.get("correct")) for d in details)
        acc = f", accuracy {out['eval/accuracy']:.3f} ({right}/{n} {measured})" if "eval/accuracy" in out else ""
        click.echo(
            f"{model} on {dataset} ({split}): mean reward {out['eval/reward_mean']:.4f}{acc} over {n} prompts "
            f"({int(out['eval/reward_failed'])} failed) in {time.time() - t0:.1f} s"
        )
        if "eval/accuracy" not in out:
            click.echo(measured)
        if save is not None:
            save_details(save, details)
            click.echo(f"saved {len(details)} prompts, completions, rewards and verdicts to {save}")
        return
    import yaml

    from gcfamily.run.heldout import answer_extractor, check_fits, heldout_accuracy, sampled_eval
    from gcfamily.tasks import get_task

    try:  # --set min_len=2: a number, as in a recipe's task_options
        options = {k: yaml.safe_load(v) for k, v in parse_sets(sets).items()}
    except yaml.YAMLError as e:
        raise GcfError(f"a --set task option is not a valid value ({str(e).splitlines()[0]}).") from e
    t = get_task(task, seed=seed, **options)
    answer = answer_extractor(t) if maj_k is not None else None  # before the model loads: a task without one fails fast
    m, tok = load_model(model, resolve_dtype("auto", dev), dev, say=console.teller(True))
    n = len(t.heldout_rows(samples))
    check_fits(m, min(128, n), max_new_tokens, f"--max-new-tokens {max_new_tokens}")
    if maj_k is not None:  # before the greedy pass, which may take minutes
        check_fits(m, min(16, n) * maj_k, max_new_tokens, f"--maj-k {maj_k}")
    fmt, episodes = None, None
    if env is not None:  # greedy episodes: the environment's instructions and tools in the prompt, as in training
        from gcfamily.data.encoding import Formatter
        from gcfamily.envs.worker import open_envs
        from gcfamily.methods.episodes import EpisodeLimits
        from gcfamily.rollout import context_length

        envs = open_envs(env)
        fmt = Formatter(tok, system_prompt=envs.description["system"], tools=envs.description["tools"])
        episodes = (envs, EpisodeLimits(max_turns, max_new_tokens * max_turns, context_length(m)))
    t0 = time.time()
    with console.eval_bar(True, samples, "evaluating") as bar:
        acc = heldout_accuracy(m, tok, t, samples, max_new_tokens, 128, fmt, details, bar, episodes)
    click.echo(f"{model} on {task}: held-out accuracy {acc:.3f} ({round(acc * n)}/{n}) in {time.time() - t0:.1f} s")
    if save is not None:
        save_details(save, details)
        click.echo(f"saved {len(details)} prompts, completions, rewards and verdicts to {save}")
    if maj_k is not None:
        from gcfamily.data.encoding import Formatter

        t0 = time.time()
        got = sampled_eval(
            m,
            fmt or Formatter(tok),
            t.heldout_rows(samples),
            t.reward,
            maj_k,
            temperature,
            max_new_tokens,
            seed,
            answer=answer,
            episodes=episodes,
        )
        click.echo(
            f"{model} on {task}: maj@{maj_k} {got.maj_at_k:.3f}, pass@{maj_k} {got.pass_at_k[maj_k]:.3f}, "
            f"pass@1 {got.pass_at_k[1]:.3f} from {maj_k} samples per prompt at temperature {temperature:g} over "
            f"{got.prompts} prompts ({got.unanswered} with no answer in any sample) in {time.time() - t0:.1f} s"
        )
