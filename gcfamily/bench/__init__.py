"""`gcf bench`: several methods on one model, task and budget; a table, plots and every figure in JSON.

    gcf bench                                   # SFT, RFT, GRPO, PPO, DPO on smollm2-135m / arithmetic
    gcf bench --quick                           # the same suite on the tiny random model, in minutes
    gcf bench --methods sft,grpo --budget time:300 --set eval_samples=100 --set grpo.lr=1e-6

Each method is a normal Trainer run in its own folder OUT/<method>/ and its own subprocess, so the
peak memory is that method's alone (the child's ru_maxrss, read with wait4). All runs share the
seed, model, task and budget, and evaluate held-out accuracy before and after (eval_at_ends); runs that start
from the same policy and evaluate the same prompts the same way evaluate before training once (start_key).
The budget is the same number of optimizer steps (`steps:N`), of generated plus trained tokens
(`tokens:N`, the trainer's max_tokens), of seconds spent in training steps (`time:S`, the
trainer's max_time; evaluation is not counted) or of estimated training FLOPs (`flops:N`, the
trainer's max_flops: 6 x parameters per loss token + 2 x parameters per generated token). With a
token, time or FLOPs budget max_steps is only a cap (10000 unless --set max_steps=N).

Besides what the trainer logs, each child (gcfamily/bench/child.py) records what the trainer does not:
- the GC distribution: it wraps the method's `coefficient` and keeps the GC of every loss token
  (those of the effective mask; a random subsample past 200,000), from which OUT/bench.json gets
  per-step quantiles and a histogram, and gc.png one histogram per method;
- KL to the reference, the same way for every method: one completion per held-out prompt sampled
  from the final policy at temperature 1, and the mean k3 estimator (rho - log rho - 1,
  rho = pi_ref / pi) over its tokens against the untouched initial model.

A method that already finished in the output folder with exactly the same settings is kept, not
run again (so after a failure, the same command runs only what is missing); --fresh runs all.
The bench replaces only runs it started with the same settings: a folder OUT/<method> that holds a run
of the user's, a model, or a bench run of other settings is refused before any method runs, unless
--replace-runs says to replace it.
A finished child deletes its resumable checkpoints and keeps its final model.

Outputs (written by gcfamily/bench/report.py): bench.md (the table), bench.json (every figure,
per-step rows included), reward.png and accuracy.png (against step and against training wall
time, one line per method), gc.png.
"""

from __future__ import annotations

import json
import os
import platform
import time
from pathlib import Path
from typing import Any, Optional

import click

# the plans (suites, recipes, settings, budgets, shared start evaluations) live in bench_plan; their names are bench's too
from gcfamily.bench.plan import (
    DEFAULT_METHODS,
    SUITES,
    TASK_PRESETS,
    check_sets,
    data_label,
    dataset_suite,  # noqa: F401
    default_methods,
    method_name,
    parse_budget,
    recipe,
    run_settings,
    seeded,
    share_start_evaluations,
    start_key,
)
from gcfamily.bench.report import fmt, plots, summarise, table
from gcfamily.bench.runs import _bench_spec, _load, _setting_part, check_run_folder, finished_run, launch  # noqa: F401
from gcfamily.errors import GcfError


# ----------------------------------------------------------------------------------
# the parent: launch, collect, write (launching a child and telling the bench's own runs apart: bench/runs.py)


def run_bench(
    methods: list[str],
    model: Optional[str],
    task: str,
    budget: Optional[str],
    quick: bool,
    out: Path,
    sets: dict[str, str],
    threads: Optional[int] = None,
    echo: Any = print,
    fresh: bool = False,
    seeds: int = 1,
    baseline: Optional[str] = None,
    sweep: Optional[str] = None,
    data: Optional[dict[str, Any]] = None,
    replace_runs: bool = False,
) -> dict[str, Any]:
    """Run every method (seeds times: OUT/METHOD/seed-K) in its own subprocess, then write bench.md, bench.json and the plots into out.
    With `data` ({dataset, eval_dataset, reward}) the runs train on the user's rows instead of `task`, which only labels them.
    A run folder holding what the bench did not write is refused before any method runs, unless replace_runs (check_run_folder)."""
    suite = SUITES["quick" if quick else "default"]
    model = model or suite["model"]
    budget = budget or suite["budget"]
    stop = parse_budget(budget)
    label, task = task, (task if data is None else None)
    if data is not None and sweep is not None:
        raise GcfError(
            "--sweep chooses on validation rows kept from a built-in task's train split; with --dataset, run each value as its own suite."
        )
    if data is not None:
        methods = dataset_suite(
            methods,
            data,
            lambda spec: run_settings(suite, spec, method_name(spec), model, None, stop, sets, out, data),
            echo,
        )
    names = {spec: method_name(spec) for spec in methods}
    if len(set(names.values())) != len(names):
        raise GcfError(f"--methods names a method twice ({', '.join(methods)}).")
    check_sets(sets, methods)
    if baseline is not None and baseline not in names.values():
        raise GcfError(f"--baseline {baseline} is not one of the suite's methods ({', '.join(names.values())}).")
    if seeds < 1:
        raise GcfError("--seeds must be at least 1.")
    plans: dict[str, dict[str, Any]] = {}
    swept = None
    if sweep is not None:
        from gcfamily.bench.sweep import parse_sweep, plan_sweep

        swept = parse_sweep(sweep)
        plans = plan_sweep(
            swept,
            methods,
            names,
            seeds,
            lambda spec, extra: run_settings(suite, spec, names[spec], model, task, stop, extra, out, data),
            sets,
            out,
        )
    for spec in methods if sweep is None else []:
        for k in range(seeds):
            key = names[spec] if seeds == 1 else f"{names[spec]}/seed-{k}"
            settings = seeded(run_settings(suite, spec, names[spec], model, task, stop, sets, out, data), k, out / key)
            plans[key] = {"method_spec": spec, "settings": settings}
    share_start_evaluations(plans)
    for name, plan in plans.items():  # every folder before the first run: a refusal leaves the whole suite as it was
        check_run_folder(out / name, plan, replace_runs)
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    threads = threads or (
        1 if quick else None
    )  # a tiny model gains nothing from a second thread, and loses much on a busy machine
    if threads:
        env["OMP_NUM_THREADS"] = env["MKL_NUM_THREADS"] = str(threads)
    header = {
        "model": model,
        "task": label,
        "budget": budget,
        "load_start": _load(),
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "machine": f"{platform.machine()} {os.cpu_count()} CPUs ({threads or 'all'} torch threads), {platform.system()}, python {platform.python_version()}",
    }
    results, kept = {}, []
    for name, plan in plans.items():
        proc = None if fresh else finished_run(out / name, plan)
        if proc is not None:
            kept.append(name)
            echo(
                f"[bench] {name}: kept the finished run with the same settings in {out / name} (--fresh runs it again)"
            )
        else:
            echo(f"[bench] {name}: running ({out / name}/bench.log)")
            proc = launch(plan, out / name, env)
            (out / name / "bench_proc.json").write_text(json.dumps(proc))
        results[name] = summarise(out / name, proc)
        results[name]["data"] = data_label(plan["method_spec"])
        r = results[name]
        if proc["returncode"] != 0:
            echo(f"[bench] {name}: FAILED with exit {proc['returncode']}; see {out / name}/bench.log")
        else:
            echo(
                f"[bench] {name}: {r.get('steps')} steps, {proc['wall_s']:.0f} s, accuracy {fmt(r.get('accuracy_before'), '.3f')} -> "
                f"{fmt(r.get('accuracy_after'), '.3f')}, {fmt(r.get('step_s_median'), '.3g')} s/step, peak {proc['max_rss_mb']:.0f} MB"
            )
    header.update(load_end=_load(), total_s=sum(r.get("wall_s", 0.0) for r in results.values()), kept=kept)
    per_method: dict[str, list[dict[str, Any]]] = {}
    for key, r in results.items():
        per_method.setdefault(key.split("/")[0], []).append(r)
    if swept is not None:
        from gcfamily.bench.sweep import write_sweep

        write_sweep(swept, per_method, plans, seeds, header, out)
        pngs = []
    elif seeds > 1 or baseline is not None:
        from gcfamily.bench.seeds import band_plots, seeds_table

        (out / "bench.md").write_text(seeds_table(per_method, header, baseline or next(iter(per_method))))
        pngs = band_plots(per_method, out) + plots(
            {k: r for k, r in results.items() if k.endswith("seed-0") or "/" not in k}, out
        )
    else:
        (out / "bench.md").write_text(table(results, header))
        pngs = plots(results, out)
    if swept is None:
        from gcfamily.bench.seeds import frontier_plot

        pngs += [p for p in [frontier_plot(per_method, out)] if p is not None]
    (out / "bench.json").write_text(
        json.dumps(
            {"header": header, "settings": {n: p["settings"] for n, p in plans.items()}, "results": results},
            indent=1,
            default=str,
        )
    )
    echo(f"[bench] wrote {out / 'bench.md'}, {out / 'bench.json'}, " + ", ".join(str(p) for p in pngs))
    return {"header": header, "results": results}


@click.command("bench")
@click.option(
    "--methods",
    default=None,
    help=f"Comma-separated methods (names, module:Class or path/to/file.py:Class), or all (the whole zoo); default {','.join(DEFAULT_METHODS)}.",
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
    help="steps:N | tokens:N | time:SECONDS | flops:N (estimated training FLOPs), the same for each method; default time:210 (steps:60 with --quick).",
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
) -> None:
    """Run several methods on one model, task and budget; write a table, plots and a JSON of every figure."""
    from gcfamily.config import parse_sets

    if suite == "unified":
        given = [
            n
            for n, v in (
                ("--methods", methods),
                ("--budget", budget),
                ("--baseline", baseline),
                ("--sweep", sweep),
                ("--dataset", dataset),
            )
            if v
        ]
        if given:
            raise GcfError(
                f"{given[0]} does not go with --suite unified: its methods, budget and control are the paper's."
            )
        from gcfamily.bench.unified import run_unified

        folder = Path(out or ("runs/bench-unified-quick" if quick else "runs/bench-unified"))
        res = run_unified(folder, quick, seeds, parse_sets(sets), threads, click.echo, fresh, replace_runs, model, task)
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
        chosen = [m.strip() for m in methods.split(",") if m.strip()] if methods else default_methods()
    folder = Path(out or ("runs/bench-quick" if quick else "runs/bench"))
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
