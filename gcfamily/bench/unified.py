"""`gcf bench --suite unified`: the comparison of DeepSeekMath section 5.2.2, every method from one SFT model.

    gcf bench --suite unified                 # SmolLM2-135M-Instruct on the chained task, one seed
    gcf bench --suite unified --seeds 3       # three seeds, one command
    gcf bench --suite unified --quick         # the tiny random model, in a minute or two (the test suite runs it)

Stage 1 trains SFT on the task's demonstrations into one model, pi_sft (OUT/sft-stage), trained once and reused by
every method and seed; its own accuracy, Maj@K and Pass@K are in the table. Stage 2 runs, each from pi_sft on the same
training prompts and the same number of prompts a step (batch_size), for the same number of steps: SFT continued (the
control), RFT (offline: pi_sft's samples, drawn once), Online RFT, DPO on pi_sft's own pairs, PPO, GRPO with outcome
supervision and GRPO with process supervision (the task's step reward). So every method sees the same prompts (the
paper's axis); wall time and FLOPs are reported beside it. Run K of a method is OUT/METHOD/seed-K, so --seeds 3 after
--seeds 1 into the same folder keeps stage 1 and seed 0 and runs seeds 1 and 2 (and --seeds 1 after --seeds 3 renders
seed 0 alone). Each stage-2 run takes pi_sft's final evaluation as its own before the first step (the same greedy
decoding of the same weights on the same prompts), so its "before" is pi_sft's "after" and costs nothing.

The table (bench.md) gives greedy held-out accuracy, Maj@K and Pass@K with the intervals of the seeds suite, and a
findings table: each of the paper's four findings with its paired bootstrap difference (over prompts, and seeds when
there are several), its minimum detectable difference and a verdict (gcfamily/bench/findings.py).

    (1) Online RFT beats RFT                          accuracy(rft) - accuracy(rft-offline)
    (2) GRPO (outcome) beats Online RFT               accuracy(grpo) - accuracy(rft)
    (3) process supervision beats outcome supervision accuracy(grpo-ps) - accuracy(grpo)
    (4) RL raises Maj@K but not Pass@K                Maj@K(grpo) - Maj@K(pi_sft) above 0, Pass@K(grpo) - Pass@K(pi_sft) not

Every figure is measured and reported as measured, also where it disagrees with the paper.
"""

from __future__ import annotations

import json
import os
import platform
import time
from pathlib import Path
from typing import Any, Optional

from gcfamily.bench.findings import CONTROL, STAGE, _per_prompt, control_gains, findings, findings_table
from gcfamily.errors import GcfError

_ONPOLICY = {"micro_batch_size": 32}
QUICK_REWARD = "gcfamily.bench.unified:length_parity"


def length_parity(completions: list, **kw: Any) -> list[float]:
    """The quick suite's reward: 1 for a completion of odd length (about half of a random model's), else 0."""
    return [float(len(c) % 2) for c in completions]


UNIFIED: dict[str, dict[str, Any]] = {
    # Sized so that the methods can move (issue 48: the earlier 12 steps of 4 prompts at G = 4 left every method within
    # 0.02 nats/token of pi_sft). Stage 2 trains every method for the same 24 steps of 8 prompts (192 prompts seen), G = 8
    # samples a prompt for the methods that sample, no KL term (beta 0: a reference forward would cost a third of each
    # step); the RL methods at lr 5e-6 (GRPO from pi_sft on chained at 1e-5 and 2e-5 lost 10-14 points of greedy accuracy
    # in 8 steps). Each run is evaluated at its start (pi_sft's final evaluation, copied) and its end: greedily on
    # eval_samples held-out prompts and, on the same prompts, with k = 4 samples at temperature 1, whose share right
    # (sampled pass@1) is the compared figure, Maj@4 and Pass@4 beside it; the KL to pi_sft on 32. `tasks` adjusts the
    # design to a task: on arithmetic (answers of a few tokens) stage 1 is 20 SFT steps, which leaves pi_sft at 0.50, every
    # held-out prompt is evaluated (eval_samples 500 >= its 205), and a run takes 1-4 minutes, so six methods fit four
    # seeds in an hour (docs/bench/unified/README.md has the measured times); a chained run costs about four times as much.
    "default": {
        "model": "smollm2-135m",
        "task": "chained",
        "steps": 24,  # stage 2: steps per method, batch_size prompts each
        "sft_stage": {"max_steps": 100, "batch_size": 8, "micro_batch_size": 8, "lr": 2e-5, "eval_every": 50},
        "common": {
            "batch_size": 8,
            "group_size": 8,
            "eval_samples": 300,
            "max_new_tokens": 48,
            "max_length": 256,
            "temperature": 1.0,
            "eval_every": 0,
        },
        "measure": {"sample_k": 4, "sample_prompts": 500, "kl_prompts": 32},  # Maj@K and Pass@K: K samples a prompt
        "tasks": {
            "arithmetic": {"sft_stage": {"max_steps": 20}, "common": {"max_new_tokens": 16, "eval_samples": 500}},
        },
        "methods": {
            "sft": {"micro_batch_size": 8, "lr": 1e-5},
            "rft-offline": {**_ONPOLICY, "lr": 1e-5},
            "rft": {**_ONPOLICY, "lr": 1e-5},
            "dpo": {"pairs": "own-samples", "micro_batch_size": 16, "lr": 1e-6, "beta": 0.1},
            "ppo": {**_ONPOLICY, "lr": 5e-6, "beta": 0.0, "critic_lr": 1e-5},
            "grpo": {**_ONPOLICY, "lr": 5e-6, "beta": 0.0},
            "grpo-ps": {**_ONPOLICY, "lr": 5e-6, "beta": 0.0},
        },
    },
    "quick": {
        "model": "tiny",
        "task": "chained",
        "steps": 3,
        "sft_stage": {"max_steps": 4, "batch_size": 4, "micro_batch_size": 4, "lr": 3e-3},
        "common": {
            "batch_size": 2,
            "group_size": 4,
            "eval_samples": 8,
            "max_new_tokens": 12,
            "max_length": 640,
            "temperature": 1.0,
            "eval_every": 0,
        },
        "measure": {"sample_k": 4, "sample_prompts": 8, "kl_prompts": 8},
        # the random tiny model never answers a chained problem, so its rewards would all be 0 (no DPO pair, no advantage):
        # the quick suite, a test of the pipeline, scores the samples of stage 2 by the parity of their length instead
        "methods": {
            "sft": {"micro_batch_size": 4, "lr": 1e-3},
            "rft-offline": {"micro_batch_size": 8, "lr": 1e-3, "reward": QUICK_REWARD},
            "rft": {"micro_batch_size": 8, "lr": 1e-3, "reward": QUICK_REWARD},
            "dpo": {"pairs": "own-samples", "lr": 1e-3, "reward": QUICK_REWARD},
            "ppo": {"micro_batch_size": 8, "lr": 1e-3, "beta": 0.04, "critic_lr": 1e-3, "reward": QUICK_REWARD},
            "grpo": {"micro_batch_size": 8, "lr": 1e-3, "beta": 0.04, "reward": QUICK_REWARD},
            "grpo-ps": {"micro_batch_size": 8, "lr": 1e-3, "beta": 0.04, "reward": QUICK_REWARD},
        },
    },
}
# rft-offline and dpo (pairs=own-samples) draw their pool on steps x batch_size prompts: the first positions of the seed's
# epoch-0 order, which are the prompts the online methods of the same seed see in their steps (data/batches.epoch_indices)
# what pi_sft's final greedy evaluation depends on besides the model: a stage-2 run with the same values takes it as its own
# evaluation before the first step (the same greedy decoding of the same weights on the same prompts)
EVAL_KEYS = tuple("task task_seed eval_samples max_new_tokens max_length dtype system_prompt chat_template".split())


def _base(settings: dict[str, Any], out: Path, name: str) -> dict[str, Any]:
    return {
        "seed": 0,
        "task_seed": 0,
        "eval_at_ends": True,
        "progress": False,
        "save_every": 0,
        "keep_last": 1,
        "output_dir": str(out / name),
        "overwrite": True,
        **settings,
    }


def _with_sets(s: dict[str, Any], name: str, sets: dict[str, str]) -> dict[str, Any]:
    """--set KEY (every run that has it) or METHOD.KEY (one method; sft-stage.KEY for stage 1)."""
    from gcfamily.methods import setting_names

    own = setting_names(s["method"])
    for key, value in sets.items():
        target, _, field = key.rpartition(".")
        if not target and key.replace("-", "_") in own:
            s[key] = value
        elif target == name:
            s[field] = value
    return s


def plans_of(
    out: Path,
    quick: bool,
    seeds: int,
    sets: dict[str, str],
    model: Optional[str],
    task: Optional[str],
    methods: Optional[list[str]] = None,
    steps: Optional[int] = None,
) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    """(stage 1's plan, stage 2's plans by OUT-relative folder, in the order they run): settings checked before any run
    starts. Seed by seed, the SFT control and the reference RL method first (the gate reads them), then the rest."""
    from gcfamily.bench.moved import REFERENCE
    from gcfamily.bench.plan import share_start_evaluations
    from gcfamily.config import validate
    from gcfamily.methods import resolve, setting_names

    suite = UNIFIED["quick" if quick else "default"]
    model, task = model or suite["model"], task or suite["task"]
    adjust = suite.get("tasks", {}).get(task, {})
    suite = {**suite, **{k: {**suite[k], **v} for k, v in adjust.items()}}
    steps = steps or suite["steps"]
    known = {STAGE, *suite["methods"]}
    chosen = methods or list(suite["methods"])
    unknown = [m for m in chosen if m not in suite["methods"]]
    if unknown:
        raise GcfError(
            f"--methods {unknown[0]} is not a method of the unified suite (choose among {', '.join(suite['methods'])})."
        )
    bad = [k for k in sets if "." in k and k.rpartition(".")[0] not in known]
    if bad:
        raise GcfError(f"--set {bad[0]} names no run of the unified suite ({', '.join(sorted(known))}).")
    stage = _base({"method": "sft", "model": model, "task": task, **suite["common"], **suite["sft_stage"]}, out, STAGE)
    stage = _with_sets(stage, STAGE, sets)
    validate(resolve(None, stage))
    pi_sft = str((out / STAGE).resolve())
    measure = dict(suite["measure"])
    first = [m for m in (CONTROL, REFERENCE) if m in chosen]
    order = first + [m for m in suite["methods"] if m in chosen and m not in first]
    plans: dict[str, dict[str, Any]] = {}
    for k in range(seeds):
        for name in order:
            key = f"{name}/seed-{k}"  # so --seeds N+1 into the same folder keeps the runs of --seeds N
            s = _base(
                {"method": name, "model": pi_sft, "task": task, **suite["common"], **suite["methods"][name]},
                out,
                key,
            )
            s["max_steps"] = steps
            # offline data: G samples of each prompt the run will see, no more
            if "pool_prompts" in setting_names(name):
                s["pool_prompts"] = steps * s["batch_size"]
            s = _with_sets(s, name, sets)
            s["seed"] = int(s.get("seed", 0)) + k
            validate(resolve(None, s))
            plans[key] = {"method_spec": name, "settings": s, **measure}
            if all(s.get(k) == stage.get(k) for k in EVAL_KEYS):  # pi_sft's final evaluation is this run's first
                plans[key].update(start_eval_from=str(out / STAGE), start_eval_last=True)
    rest = {k: p for k, p in plans.items() if "start_eval_from" not in p}
    share_start_evaluations(rest)
    return {"method_spec": "sft", "settings": stage, **measure}, plans


def unified_steps(budget: Optional[str]) -> Optional[int]:
    """--budget for the unified suite: steps:N, the stage-2 steps of every method (stage 1 keeps its own)."""
    if budget is None:
        return None
    kind, _, n = budget.partition(":")
    if kind.strip() != "steps" or not n.strip().isdigit() or int(n) < 1:
        raise GcfError(
            f"--budget with --suite unified is steps:N (N at least 1): every method the same steps, not {budget!r}."
        )
    return int(n)


def _times(header: dict[str, Any]) -> str:
    """Wall time of stage 1 and of each seed's stage 2, as the runs measured them (kept runs: their first launch)."""
    per = header.get("seed_s") or []
    if header.get("stage1_s") is None or not per:
        return ""
    mins = lambda s: f"{s / 60:.1f} min"  # noqa: E731
    return (
        f"Wall time: stage 1 (pi_sft) {mins(header['stage1_s'])}; stage 2 "
        + ", ".join(f"seed {k} {mins(s)}" for k, s in enumerate(per))
        + f"; one seed from scratch (stage 1 and seed 0) {mins(header['stage1_s'] + per[0])}"
        + f"; this command {mins(header['total_s'])}"
        + (f" ({len(header['kept'])} runs kept from an earlier command)" if header.get("kept") else "")
        + ".\n"
    )


def run_unified(
    out: Path,
    quick: bool,
    seeds: int,
    sets: dict[str, str],
    threads: Optional[int] = None,
    echo: Any = print,
    fresh: bool = False,
    replace_runs: bool = False,
    model: Optional[str] = None,
    task: Optional[str] = None,
    methods: Optional[list[str]] = None,
    steps: Optional[int] = None,
    use_gate: bool = True,
) -> dict[str, Any]:
    """Stage 1 (pi_sft), then stage 2 (every method from pi_sft, `seeds` times), then bench.md, bench.json and the plots.
    With `use_gate`, the suite stops after seed 0's reference RL run when it did not move (bench/moved.py: `gate`)."""
    from gcfamily.bench.moved import REFERENCE, gate
    from gcfamily.bench.report import fmt, summarise
    from gcfamily.bench.runs import _load, check_run_folder, finished_run, launch

    if seeds < 1:
        raise GcfError("--seeds must be at least 1.")
    stage, plans = plans_of(out, quick, seeds, sets, model, task, methods, steps)
    for name, plan in [(STAGE, stage), *plans.items()]:  # every folder before the first run
        check_run_folder(out / name, plan, replace_runs)
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    threads = threads or (1 if quick else None)
    if threads:
        env["OMP_NUM_THREADS"] = env["MKL_NUM_THREADS"] = str(threads)
    t0 = time.perf_counter()
    header = {
        "suite": "unified",
        "model": stage["settings"]["model"],
        "task": stage["settings"]["task"],
        "budget": f"steps:{next(iter(plans.values()))['settings']['max_steps']} from pi_sft",
        "load_start": _load(),
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "machine": f"{platform.machine()} {os.cpu_count()} CPUs ({threads or 'all'} torch threads), {platform.system()}, python {platform.python_version()}",
    }
    results: dict[str, dict[str, Any]] = {}
    kept = []
    stopped = None
    for name, plan in [(STAGE, stage), *plans.items()]:
        proc = None if fresh else finished_run(out / name, plan)
        if proc is not None:
            kept.append(name)
            echo(f"[bench] {name}: kept the finished run with the same settings in {out / name}")
        else:
            echo(f"[bench] {name}: running ({out / name}/bench.log)")
            proc = launch(plan, out / name, env)
            (out / name / "bench_proc.json").write_text(json.dumps(proc))
            if name == STAGE and proc["returncode"] != 0:
                raise GcfError(
                    f"Stage 1 (SFT into pi_sft) failed with exit {proc['returncode']}; see {out / STAGE}/bench.log."
                )
        r = results[name] = summarise(out / name, proc)
        r["data"] = plan["method_spec"]
        echo(
            f"[bench] {name}: {r.get('steps')} steps, {proc['wall_s']:.0f} s, accuracy {fmt(r.get('accuracy_before'), '.3f')} -> "
            f"{fmt(r.get('accuracy_after'), '.3f')}, maj@k {fmt(r.get('maj_at_k'), '.3f')}, pass@k {fmt(r.get('pass_at_k'), '.3f')}"
            if proc["returncode"] == 0
            else f"[bench] {name}: FAILED with exit {proc['returncode']}; see {out / name}/bench.log"
        )
        if use_gate and name == f"{REFERENCE}/seed-0":
            stopped = gate(results)
            if stopped:
                break
    header.update(load_end=_load(), total_s=time.perf_counter() - t0, kept=kept, stopped=stopped)
    found = write_report(out, header, stage, plans, results, seeds, echo)
    if stopped:
        raise GcfError(stopped)
    return {"header": header, "results": results, "findings": found}


def write_report(
    out: Path,
    header: dict[str, Any],
    stage: dict[str, Any],
    plans: dict[str, dict[str, Any]],
    results: dict[str, dict[str, Any]],
    seeds: int,
    echo: Any = print,
) -> list[dict[str, Any]]:
    """bench.md, bench.json and the band plots of the runs in `results` (all of the suite's, or those before the gate)."""
    from gcfamily.bench.moved import moved, moved_table
    from gcfamily.bench.report import fmt
    from gcfamily.bench.seeds import band_plots, seeds_table

    walls = {key: r.get("wall_s") for key, r in results.items()}
    header["stage1_s"] = walls.get(STAGE)
    # each seed's stage 2: what one more seed costs; one seed from scratch is stage1_s + seed_s[0]
    header["seed_s"] = [sum(w or 0.0 for key, w in walls.items() if key.endswith(f"/seed-{k}")) for k in range(seeds)]
    per_method: dict[str, list[dict[str, Any]]] = {}
    for key, r in results.items():
        per_method.setdefault(key.split("/")[0], []).append(r)
    for r in results.values():  # the scores the findings pair, prompt by prompt, so bench.json alone recomputes them
        r["per_prompt"] = {
            f: {str(i): v for (i, _), v in sorted((_per_prompt(r, f) or {}).items())}
            for f in ("accuracy", "pass1", "maj", "pass")
        }
    found = findings(per_method)
    gains = control_gains(per_method)
    movement = moved(results)
    stage_row = results[STAGE]
    text = (
        (f"**Stopped by the gate:** {header['stopped']}\n\n" if header.get("stopped") else "")
        + seeds_table(
            {k: v for k, v in per_method.items() if k != STAGE}, header, CONTROL if CONTROL in per_method else None
        )
        + f"\npi_sft (stage 1, {stage_row.get('steps')} SFT steps): held-out accuracy {fmt(stage_row.get('accuracy_before'), '.3f')} -> "
        f"{fmt(stage_row.get('accuracy_after'), '.3f')}, sampled pass@1 {fmt(stage_row.get('pass_at_1'), '.3f')}, "
        f"Maj@K {fmt(stage_row.get('maj_at_k'), '.3f')}, Pass@K {fmt(stage_row.get('pass_at_k'), '.3f')} (k={stage_row.get('k')}).\n\n"
        + _times(header)
        + "\n## Findings (DeepSeekMath 5.2.2)\n\n"
        + findings_table(found)
        + (
            "\n## Each method against the SFT control at the same step\n\n" + findings_table(gains, "method")
            if gains
            else ""
        )
        + "\n## Did it move\n\n"
        + moved_table(movement)
    )
    (out / "bench.md").write_text(text)
    per_step = {p["settings"]["batch_size"] for p in plans.values()}  # prompts a step: the paper's axis when all agree
    pngs = band_plots(
        {k: v for k, v in per_method.items() if k != STAGE}, out, per_step.pop() if len(per_step) == 1 else None
    )
    (out / "bench.json").write_text(
        json.dumps(
            {
                "header": header,
                "settings": {STAGE: stage["settings"], **{n: p["settings"] for n, p in plans.items()}},
                "results": results,
                "findings": found,
                "control_gains": gains,
                "moved": movement,
            },
            indent=1,
            default=str,
        )
    )
    echo(f"[bench] wrote {out / 'bench.md'}, {out / 'bench.json'}" + "".join(f", {p}" for p in pngs))
    return found
