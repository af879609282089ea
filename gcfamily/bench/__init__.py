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

    command.py   the `gcf bench` command and its options
    suite.py     run_bench: launch every method's run, collect, write
    plan.py      the suites, recipes, settings and budgets; which runs share the evaluation before training
    runs.py      launching a child, and telling the bench's own runs apart from others
    child.py     one method's run in its own process, with what the trainer does not record
    report.py    the table, the plots and the summaries, read from the run folders
    seeds.py, sweep.py, unified.py   several seeds, a swept setting, DeepSeekMath's unified comparison
"""

from __future__ import annotations

# the plans (suites, recipes, settings, budgets, shared start evaluations), the report and the runs live in modules of
# their own; their names are bench's too
from gcfamily.bench.command import bench
from gcfamily.bench.plan import (
    DEFAULT_METHODS,
    SUITES,
    TASK_PRESETS,
    check_sets,
    data_label,
    dataset_suite,
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
from gcfamily.bench.suite import run_bench

__all__ = [
    "DEFAULT_METHODS",
    "SUITES",
    "TASK_PRESETS",
    "bench",
    "check_run_folder",
    "check_sets",
    "data_label",
    "dataset_suite",
    "default_methods",
    "finished_run",
    "fmt",
    "launch",
    "method_name",
    "parse_budget",
    "plots",
    "recipe",
    "run_bench",
    "run_settings",
    "seeded",
    "share_start_evaluations",
    "start_key",
    "summarise",
    "table",
]
