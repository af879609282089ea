"""`gcf bench`: its options, and the suite they choose (the default suite, several tasks, a dataset, or --suite unified)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import click

from gcfamily.bench.plan import DEFAULT_METHODS, default_methods
from gcfamily.bench.suite import run_bench
from gcfamily.errors import GcfError


def _out_folder(out: str) -> Path:
    """The bench's output folder, refused in one sentence where it, or a folder above it, is a file."""
    folder = Path(out).expanduser()
    blocked = next((p for p in (folder, *folder.parents) if p.exists() and not p.is_dir()), None)
    if blocked is not None:
        raise GcfError(f"--out {out} cannot be a folder: {blocked} is a file; pass a folder's path.")
    return folder


def _names(methods: Optional[str]) -> Optional[list[str]]:
    """--methods as a list of names (None when not given)."""
    return [m.strip() for m in methods.split(",") if m.strip()] if methods else None


@click.command("bench")
@click.option(
    "--methods",
    default=None,
    help=f"Comma-separated methods (names, module:Class or path/to/file.py:Class), or all (the whole zoo); default {','.join(DEFAULT_METHODS)}. With --suite unified: a subset of its seven (default all).",
)
@click.option("--model", default=None, help="Model for every method; default smollm2-135m (tiny with --quick).")
@click.option(
    "--task",
    default=None,
    help="Built-in task, a preset (sorting-short: sorting of 2-3 numbers), or several comma-separated (one suite each, "
    "OUT/TASK/); default arithmetic (chained with --suite unified).",
)
@click.option(
    "--suite",
    type=click.Choice(["default", "unified"]),
    default="default",
    show_default=True,
    help="default: the methods from the base model on one budget; unified: DeepSeekMath 5.2.2's comparison, every method "
    "from one SFT model on the same prompts, with the paper's four findings (gcfamily/bench/unified.py).",
)
@click.option(
    "--budget",
    default=None,
    help="steps:N | tokens:N | time:SECONDS | flops:N (estimated training FLOPs), the same for each method; default time:210 (steps:60 with --quick). With --suite unified: steps:N, every method's stage-2 steps.",
)
@click.option("--quick", is_flag=True, help="The suite on the tiny random model: minutes on a laptop CPU.")
@click.option(
    "--output-dir",
    "--out",
    "out",
    default=None,
    help="Output folder (--out is the older spelling); default runs/bench (runs/bench-quick with --quick).",
)
@click.option(
    "--set", "sets", multiple=True, help="Override a setting for every method (key=value) or one (grpo.lr=1e-6)."
)
@click.option(
    "--threads", type=int, default=None, help="CPU threads per run; default 1 with --quick, else torch's default."
)
@click.option(
    "--fresh",
    is_flag=True,
    help="Run every method again, even one that already finished in --out with the same settings.",
)
@click.option(
    "--replace-runs",
    is_flag=True,
    help="Replace what a method's folder OUT/<method> holds that this bench did not start: "
    "a run of your own, a model, or a bench run of other settings (refused without it).",
)
@click.option(
    "--seeds",
    type=click.IntRange(1, 100),
    default=1,
    show_default=True,
    help="Runs per method (seeds 0..N-1): means, intervals and bands.",
)
@click.option(
    "--baseline",
    default=None,
    help="Method every other is compared with, paired over prompts and seeds; default the first.",
)
@click.option(
    "--sweep",
    default=None,
    help="KEY=V1,V2,...: each method's value chosen on a validation split (never the held-out prompts), "
    "then its held-out accuracy reported.",
)
@click.option(
    "--dataset",
    default=None,
    help="Your training rows instead of a task (file, save_to_disk folder or hub id; any TRL format): "
    "the methods that can train on its format run, the rest are left out and said.",
)
@click.option(
    "--eval-dataset",
    default=None,
    help="With --dataset: held-out rows scored by --reward before and after training (split: --set eval_split=NAME).",
)
@click.option(
    "--plan",
    "plan_from",
    default=None,
    metavar="BENCH_JSON",
    help="Plan instead of run: from an earlier bench.json, its variance components, the minimum detectable difference (MDD) "
    "of its design and of each finding, and the seeds and prompts that reach --target-mdd, with their time (bench/power.py).",
)
@click.option(
    "--target-mdd",
    type=float,
    default=None,
    help="With --plan: the difference in accuracy a design must detect (80% power, two-sided 0.05; default 0.05). With "
    "--suite unified: refuse, before any run, a --seeds that an earlier bench.json in OUT predicts cannot detect it.",
)
@click.option(
    "--prompts",
    "prompts_available",
    type=click.IntRange(min=1),
    default=None,
    help="With --plan: how many held-out prompts the task has (default: the bench's own).",
)
@click.option(
    "--gate/--no-gate",
    default=None,
    help="With --suite unified: stop after seed 0's reference RL method (grpo) when it did not move sampled pass@1 from "
    "pi_sft by more than that difference's MDD (--no-gate runs every method anyway); default on, off with --quick.",
)
@click.option(
    "--reward",
    multiple=True,
    help="With --dataset: reward(s) for the on-policy methods and the evaluation: built-in name, module:function or file.py:function.",
)
def bench(
    methods: Optional[str],
    model: Optional[str],
    task: Optional[str],
    suite: str,
    budget: Optional[str],
    quick: bool,
    out: Optional[str],
    sets: tuple[str, ...],
    threads: Optional[int],
    fresh: bool,
    replace_runs: bool,
    seeds: int,
    baseline: Optional[str],
    sweep: Optional[str],
    dataset: Optional[str],
    eval_dataset: Optional[str],
    reward: tuple[str, ...],
    plan_from: Optional[str],
    target_mdd: Optional[float],
    prompts_available: Optional[int],
    gate: Optional[bool],
) -> None:
    """Run several methods on one model, task and budget; write a table, plots and a JSON of every figure. With --plan,
    say instead what an earlier bench could detect and what design detects --target-mdd."""
    from gcfamily.config import parse_sets

    if plan_from is not None:
        from gcfamily.bench.power import plan, recorded_findings

        target = 0.05 if target_mdd is None else target_mdd
        click.echo(plan(Path(plan_from), target, max_prompts=prompts_available) + recorded_findings(Path(plan_from)))
        return

    if suite == "unified":
        given = [
            n
            for n, v in (
                ("--baseline", baseline),
                ("--sweep", sweep),
                ("--dataset", dataset),
            )
            if v
        ]
        if given:
            raise GcfError(f"{given[0]} does not go with --suite unified: its control and data are the paper's.")
        from gcfamily.bench.unified import run_unified, unified_steps

        folder = _out_folder(out or ("runs/bench-unified-quick" if quick else "runs/bench-unified"))
        if target_mdd is not None:
            from gcfamily.bench.power import reachable

            click.echo(reachable(folder / "bench.json", target_mdd, seeds, parse_sets(sets).get("eval_samples")))
        res = run_unified(
            folder,
            quick,
            seeds,
            parse_sets(sets),
            threads,
            click.echo,
            fresh,
            replace_runs,
            model,
            task,
            _names(methods),
            unified_steps(budget),
            (not quick) if gate is None else gate,
        )
        failed = [n for n, r in res["results"].items() if r.get("returncode") != 0]
        if failed:
            raise GcfError(f"{', '.join(failed)} failed; the table marks them and each folder's bench.log says why.")
        return
    task = task or "arithmetic"
    if dataset is None and (eval_dataset or reward):
        raise GcfError(
            "--eval-dataset and --reward go with --dataset (a built-in task brings its own held-out prompts and reward)."
        )

    if methods == "all":  # every method of the zoo: built in, and registered by installed packages
        from gcfamily.methods import all_methods

        chosen = list(all_methods())
    else:
        chosen = _names(methods) or default_methods()
    folder = _out_folder(out or ("runs/bench-quick" if quick else "runs/bench"))
    tasks = (
        [t.strip() for t in task.split(",") if t.strip()]
        if dataset is None
        else [Path(dataset.rstrip("/")).stem or dataset]
    )
    data = None if dataset is None else {"dataset": dataset, "eval_dataset": eval_dataset, "reward": list(reward)}
    failed = []
    for t in tasks:  # several tasks: one suite each, in OUT/<task>/
        res = run_bench(
            chosen,
            model,
            t,
            budget,
            quick,
            folder / t if len(tasks) > 1 else folder,
            parse_sets(sets),
            threads,
            echo=click.echo,
            fresh=fresh,
            seeds=seeds,
            baseline=baseline,
            sweep=sweep,
            data=data,
            replace_runs=replace_runs,
        )
        failed += [f"{n} ({t})" if len(tasks) > 1 else n for n, r in res["results"].items() if r.get("returncode") != 0]
    if failed:
        raise GcfError(f"{', '.join(failed)} failed; the table marks them and each folder's bench.log says why.")
