"""The parent of a bench: launch each method's run, collect what it measured, write the table, the plots and bench.json.

Launching a child and telling the bench's own runs apart: bench/runs.py; the plans: bench/plan.py.
"""

from __future__ import annotations

import json
import os
import platform
import time
from pathlib import Path
from typing import Any, Optional

from gcfamily.bench.plan import (
    SUITES,
    check_sets,
    data_label,
    dataset_suite,
    method_name,
    parse_budget,
    run_settings,
    seeded,
    share_start_evaluations,
)
from gcfamily.bench.report import fmt, plots, summarise, table
from gcfamily.bench.runs import _load, check_run_folder, finished_run, launch
from gcfamily.errors import GcfError


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
    # a tiny model gains nothing from a second thread, and loses much on a busy machine
    threads = threads or (1 if quick else None)
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
