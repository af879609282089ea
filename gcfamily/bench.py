"""`gcf bench`: several methods on one model, task and budget; a table, plots and every figure in JSON.

    gcf bench                                   # SFT, RFT, GRPO, PPO, DPO on smollm2-135m / arithmetic
    gcf bench --quick                           # the same suite on the tiny random model, in minutes
    gcf bench --methods sft,grpo --budget time:300 --set eval_samples=100 --set grpo.lr=1e-6

Each method is a normal Trainer run in its own folder OUT/<method>/ and its own subprocess, so the
peak memory is that method's alone (the child's ru_maxrss, read with wait4). All runs share the
seed, model, task and budget, and evaluate held-out accuracy before and after (eval_at_ends).
The budget is the same number of optimizer steps (`steps:N`), of generated plus trained tokens
(`tokens:N`, the trainer's max_tokens), of seconds spent in training steps (`time:S`, the
trainer's max_time; evaluation is not counted) or of estimated training FLOPs (`flops:N`, the
trainer's max_flops: 6 x parameters per loss token + 2 x parameters per generated token). With a
token, time or FLOPs budget max_steps is only a cap (10000 unless --set max_steps=N).

Besides what the trainer logs, each child records two things the trainer does not:
- the GC distribution: it wraps the method's `coefficient` and keeps the GC of every loss token
  (those of the effective mask; a random subsample past 200,000), from which OUT/bench.json gets
  per-step quantiles and a histogram, and gc.png one histogram per method;
- KL to the reference, the same way for every method: one completion per held-out prompt sampled
  from the final policy at temperature 1, and the mean k3 estimator (rho - log rho - 1,
  rho = pi_ref / pi) over its tokens against the untouched initial model.

A method that already finished in the output folder with exactly the same settings is kept, not
run again (so after a failure, the same command runs only what is missing); --fresh runs all.
A finished child deletes its resumable checkpoints and keeps its final model.

Outputs (written by gcfamily/bench_report.py): bench.md (the table), bench.json (every figure,
per-step rows included), reward.png and accuracy.png (against step and against training wall
time, one line per method), gc.png.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Optional

import click

from gcfamily.bench_report import fmt, plots, summarise, table
from gcfamily.errors import GcfError, Interrupted, install_stop_handlers

DEFAULT_METHODS = ("sft", "rft", "grpo", "ppo", "dpo")
TASK_PRESETS: dict[str, tuple[str, dict[str, Any]]] = {
    "sorting-short": ("sorting", {"min_len": 2, "max_len": 3}),  # SmolLM2-135M-Instruct starts at 0.296 (148/500 held-out, greedy)
}
"""Task names with options, for a second task where the base model starts between 10% and 60%. SmolLM2-135M-Instruct, greedy,
16 new tokens (`gcf eval --samples 500 --max-new-tokens 16`): arithmetic (mixed levels) 0.400 on its 205 distinct held-out prompts,
sorting of 2-3 numbers 0.296 (148/500); with `--samples 100`, countdown 0.00 and sorting of 3-6 numbers 0.06."""
BUDGET_KINDS = ("steps", "tokens", "time", "flops")
STEP_CAP = 10000
GC_KEEP = 200_000

# Settings every run of a suite shares, then each method's own recipe (lr, batch shape, beta).
# The on-policy methods sample 4 prompts x 8 completions of at most 16 tokens (answers are short).
_ONPOLICY = {"batch_size": 4, "group_size": 8, "max_new_tokens": 16, "temperature": 0.7, "micro_batch_size": 32}
SUITES: dict[str, dict[str, Any]] = {
    "default": {
        "model": "smollm2-135m",
        "budget": "time:210",  # the same training seconds for each method: 5 x (210 s + evaluations) stays within 30 min
        # held-out accuracy on up to 500 distinct test prompts (arithmetic has 205: its one-digit levels hold 19 each) before, once
        # in the middle and after: 19 s and 53 s an evaluation at 2 threads on arithmetic and sorting-short
        "common": {"eval_samples": 500, "max_new_tokens": 16, "max_length": 256, "eval_every_s": 105},
        "methods": {
            "sft": {"batch_size": 8, "micro_batch_size": 8, "lr": 2e-5},
            "rft": {**_ONPOLICY, "lr": 1e-5},
            "grpo": {**_ONPOLICY, "lr": 3e-6, "beta": 0.04},
            "ppo": {**_ONPOLICY, "lr": 3e-6, "beta": 0.04, "critic_lr": 1e-5},
            "dpo": {"batch_size": 8, "micro_batch_size": 16, "lr": 1e-6, "beta": 0.1},
        },
    },
    "quick": {
        "model": "tiny",
        "budget": "steps:60",
        "common": {"eval_samples": 32, "max_new_tokens": 8, "max_length": 128, "eval_every": 20},
        "methods": {
            "sft": {"batch_size": 8, "micro_batch_size": 8, "lr": 3e-3},
            "rft": {**_ONPOLICY, "max_new_tokens": 8, "lr": 3e-3},
            "grpo": {**_ONPOLICY, "max_new_tokens": 8, "lr": 1e-3, "beta": 0.04},
            "ppo": {**_ONPOLICY, "max_new_tokens": 8, "lr": 1e-3, "beta": 0.04, "critic_lr": 1e-3},
            "dpo": {"batch_size": 8, "micro_batch_size": 16, "lr": 1e-3, "beta": 0.1},
        },
    },
}


# ----------------------------------------------------------------------------------
# settings


def parse_budget(budget: str) -> dict[str, Any]:
    """`steps:N`, `tokens:N` or `time:SECONDS` -> the trainer settings that stop on it."""
    kind, _, value = budget.partition(":")
    try:
        amount = float(value)
    except ValueError:
        amount = -1.0
    if kind not in BUDGET_KINDS or amount <= 0:
        raise GcfError(f"--budget {budget!r} must look like steps:N, tokens:N, time:SECONDS or flops:N with a positive number.")
    if kind == "steps":
        return {"max_steps": int(amount)}
    if kind == "tokens":
        return {"max_tokens": int(amount), "max_steps": STEP_CAP}
    if kind == "flops":
        return {"max_flops": amount, "max_steps": STEP_CAP}
    return {"max_time": amount, "max_steps": STEP_CAP}


def method_name(spec: str) -> str:
    """The name of a method spec in the table and its folder (gcfamily.methods.method_label; errors are one sentence)."""
    from gcfamily.methods import method_label

    return method_label(spec)


def default_methods() -> list[str]:
    """The default suite; a method not (yet) in the table but shipped as a module runs by module:Class."""
    from gcfamily.methods import METHODS

    return [m if m in METHODS else f"gcfamily.methods.{m}:{m.upper()}" for m in DEFAULT_METHODS]


def recipe(suite: dict[str, Any], spec: str, name: str) -> dict[str, Any]:
    """A method's recipe in the suite: its own, else its family's (an on-policy method takes GRPO's batch shape, lr and beta;
    a preference method DPO's; a demonstration method SFT's), so that every method of the zoo runs on the same budget."""
    if name in suite["methods"]:
        return dict(suite["methods"][name])
    from gcfamily.methods import get_method

    kind = get_method(spec).data_kind
    family = {"prompts": "grpo", "pairs": "dpo", "labelled": "dpo", "demonstrations": "sft"}.get(kind)
    own = dict(suite["methods"].get(family, {})) if family else {}
    from gcfamily.config import setting_names

    known = setting_names(spec)
    return {k: v for k, v in own.items() if k in known}  # beta is GRPO's KL weight or DPO's temperature: only where the method has it


DATA_KINDS = {"demonstrations": "demonstrations", "prompts": "own samples", "pairs": "offline pairs", "labelled": "labelled completions"}


def data_label(spec: str) -> str:
    """What a method trained on, for the table: demonstrations, own samples (on-policy), offline pairs, labelled completions."""
    from gcfamily.methods import get_method

    cls = get_method(spec)
    return DATA_KINDS.get(cls.data_kind, cls.data_kind or "-")


def run_settings(suite: dict[str, Any], spec: str, name: str, model: str, task: str, budget: dict[str, Any],
                 sets: dict[str, str], out: Path) -> dict[str, Any]:
    """Settings of one method's run: common, the method's recipe, the budget, then --set (KEY or METHOD.KEY).

    A plain KEY reaches every method that has that setting (a shared one, or one of its own: `beta` is GRPO's
    KL weight and DPO's temperature, and SFT has none); `check_sets` refuses a key no method of the suite has."""
    from gcfamily.config import resolve, setting_names, validate

    task, options = TASK_PRESETS.get(task, (task, {}))
    s: dict[str, Any] = {"method": spec, "model": model, "task": task, "seed": 0, "eval_at_ends": True, "progress": False,
                         "save_every": 0, "keep_last": 1, "output_dir": str(out / name), "overwrite": True}
    if options:
        s["task_options"] = dict(options)
    s.update(suite["common"])
    s.update(recipe(suite, spec, name))
    s.update(budget)
    own = setting_names(spec)
    for key, value in sets.items():
        target, _, field = key.rpartition(".")
        if not target and key.replace("-", "_") in own:
            s[key] = value
        elif target == name:
            s[field] = value

    validate(resolve(None, s))  # unknown keys and bad values fail here, before any run starts
    return s


def check_sets(sets: dict[str, str], methods: list[str]) -> None:
    """A plain --set KEY that no method of the suite has is one sentence (METHOD.KEY is checked by that method)."""
    from gcfamily.config import setting_names

    known = set().union(*(setting_names(m) for m in methods))
    for key in sets:
        if "." not in key and key.replace("-", "_") not in known:
            raise GcfError(f"Unknown setting '{key}': no method of this suite ({', '.join(methods)}) has it; see `gcf settings --method M`.")


# ----------------------------------------------------------------------------------
# one method's run (the child process)


class GCRecorder:
    """Wraps a method's `coefficient` and keeps the GC of every loss token, per step."""

    def __init__(self, trainer: Any) -> None:
        import torch

        from gcfamily.engine import effective_mask

        self.trainer, self.values, self.per_step, self.n = trainer, [], {}, 0
        self.gen = torch.Generator().manual_seed(0)
        method = trainer.method
        inner = method.coefficient

        def recording(batch: dict, logps: torch.Tensor) -> torch.Tensor:
            coef = inner(batch, logps)
            v = coef.detach()[effective_mask(batch).bool()].float().cpu()
            self.per_step.setdefault(trainer.step + 1, []).append(v)
            return coef

        method.coefficient = recording

    def summary(self) -> dict[str, Any]:
        """Per-step quantiles, overall quantiles and a 40-bin histogram of the recorded GC values."""
        import torch

        qs = torch.tensor([0.05, 0.25, 0.5, 0.75, 0.95])
        steps = {}
        for step, parts in sorted(self.per_step.items()):
            v = torch.cat(parts)
            if v.numel():
                steps[step] = dict(zip(["p5", "p25", "p50", "p75", "p95"], _quantiles(v, qs)))
        allv = torch.cat([torch.cat(p) for p in self.per_step.values()]) if self.per_step else torch.zeros(0)
        if allv.numel() > GC_KEEP:
            allv = allv[torch.randperm(allv.numel(), generator=self.gen)[:GC_KEEP]]
        if not allv.numel():
            return {"per_step": steps, "tokens": 0}
        lo, hi = float(allv.min()), float(allv.max())
        if hi - lo < 1e-12:
            lo, hi = lo - 0.5, hi + 0.5
        counts = torch.histc(allv.double(), bins=40, min=lo, max=hi)
        return {
            "per_step": steps, "tokens": int(allv.numel()),
            "quantiles": dict(zip(["p5", "p25", "p50", "p75", "p95"], _quantiles(allv, qs))),
            "mean": float(allv.mean()), "std": float(allv.std()) if allv.numel() > 1 else 0.0,
            "zero_frac": float((allv == 0).float().mean()),
            "hist": {"counts": [int(c) for c in counts.tolist()], "lo": lo, "hi": hi},
        }


def _quantiles(v: Any, qs: Any) -> list[float]:
    import torch

    v = v.double()
    if v.numel() > 1_000_000:  # torch.quantile's limit
        v = v[:: v.numel() // 1_000_000 + 1]
    return [float(x) for x in torch.quantile(v, qs.double())]


def kl_to_reference(trainer: Any, n_prompts: int) -> Optional[float]:
    """Mean k3(pi_ref / pi) over the tokens of one temperature-1 sample per held-out prompt of the final policy."""
    import torch

    from gcfamily.models import load_model
    from gcfamily.rollout import SamplingSettings, generate

    cfg, task = trainer.cfg, trainer.task
    if task is None or not trainer.method.trains_policy:
        return None
    policy = trainer.unwrapped_policy().eval()
    rows = task.heldout_rows(n_prompts)
    gen = torch.Generator().manual_seed(cfg.seed + 1)
    ro = generate(policy, trainer.tokenizer, [trainer.formatter.prompt_ids(r["prompt"]) for r in rows], 1,
                  SamplingSettings(temperature=1.0, max_new_tokens=cfg.max_new_tokens), gen)
    batch = {"input_ids": ro.input_ids.cpu(), "attention_mask": ro.attention_mask.cpu(), "loss_mask": ro.completion_mask.cpu()}
    ref, _ = load_model(cfg.model, trainer.dtype, trainer.device, cfg.trust_remote_code, cfg.seed)  # the untouched initial model
    lp, lr = trainer.logprobs(policy, batch), trainer.logprobs(ref.eval(), batch)  # [N, L] each
    mask = batch["loss_mask"].bool()
    d = (lr - lp).double()[mask]
    return float((torch.expm1(d) - d).mean()) if d.numel() else None


def child(spec_path: str) -> None:
    """Run one method as a normal Trainer run; write the GC record and the KL next to its metrics."""
    from gcfamily.config import resolve
    from gcfamily.trainer import Trainer

    spec = json.loads(Path(spec_path).read_text())
    cfg = resolve(None, spec["settings"])  # as `gcf run --set`: these count as given, over any method default
    trainer = Trainer(cfg)
    recorder = GCRecorder(trainer)
    t0 = time.perf_counter()
    trainer.run()
    run_s = time.perf_counter() - t0
    t1 = time.perf_counter()
    kl = kl_to_reference(trainer, min(cfg.eval_samples, 64))
    kl_s = time.perf_counter() - t1
    extra = {"gc": recorder.summary(), "kl_ref": kl, "kl_s": kl_s, "run_s": run_s, "steps": trainer.step,
             "params": sum(p.numel() for p in trainer.unwrapped_policy().parameters())}
    if trainer.task is not None and trainer.method.trains_policy:  # pass@k beside greedy accuracy: k samples per held-out prompt
        from gcfamily.evaluate import sampled_pass_at_k

        t2 = time.perf_counter()
        k = max(cfg.group_size, 1)
        rows = trainer.task.heldout_rows(min(cfg.eval_samples, 64))
        extra["pass_at_k"] = sampled_pass_at_k(trainer.unwrapped_policy(), trainer.formatter, rows, trainer.task.reward, k,
                                               cfg.temperature, cfg.max_new_tokens, cfg.seed + 2)
        extra["pass_s"] = time.perf_counter() - t2
    (Path(cfg.output_dir) / "bench_child.json").write_text(json.dumps(extra))
    # the finished run keeps its final model; its resumable checkpoints (weights and optimizer state) go
    shutil.rmtree(Path(cfg.output_dir) / "checkpoints", ignore_errors=True)


# ----------------------------------------------------------------------------------
# the parent: launch, collect, write


def launch(spec: dict[str, Any], folder: Path, env: dict[str, str]) -> dict[str, Any]:
    """Run one child to the end; returns its exit code, wall time and peak resident memory."""
    folder.mkdir(parents=True, exist_ok=True)
    spec_path = folder / "bench_spec.json"
    spec_path.write_text(json.dumps(spec, indent=2))
    t0 = time.perf_counter()
    received: list[int] = []
    with (folder / "bench.log").open("w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "gcfamily.bench", str(spec_path)], stdout=log, stderr=subprocess.STDOUT, env=env)

        def forward(signum: int, _frame: Any) -> None:  # the child stops at a checkpoint; we wait for it
            received.append(signum)
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signum)

        restore = install_stop_handlers(forward)
        try:
            _, status, usage = os.wait4(proc.pid, 0)  # retried after each handler (PEP 475)
        finally:
            restore()
        proc.returncode = os.waitstatus_to_exitcode(status)
    if received:
        name = signal.Signals(received[0]).name
        raise Interrupted(f"Stopped by {name} while {folder.name} was running (its log: {folder / 'bench.log'}); "
                          "the runs that finished are kept, and the same command runs the rest.", 128 + received[0])
    return {"returncode": proc.returncode, "wall_s": time.perf_counter() - t0, "max_rss_mb": usage.ru_maxrss / 1024}


def finished_run(folder: Path, spec: dict[str, Any]) -> Optional[dict[str, Any]]:
    """The launch record of a run in `folder` that finished with exactly this spec, else None."""
    try:
        same = json.loads((folder / "bench_spec.json").read_text()) == spec
        proc = json.loads((folder / "bench_proc.json").read_text())
    except (OSError, ValueError):
        return None
    return proc if same and proc.get("returncode") == 0 and (folder / "bench_child.json").is_file() else None


def _load() -> str:
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:  # pragma: no cover
        return "?"


def run_bench(methods: list[str], model: Optional[str], task: str, budget: Optional[str], quick: bool,
              out: Path, sets: dict[str, str], threads: Optional[int] = None, echo: Any = print, fresh: bool = False,
              seeds: int = 1, baseline: Optional[str] = None, sweep: Optional[str] = None) -> dict[str, Any]:
    """Run every method (seeds times: OUT/METHOD/seed-K) in its own subprocess, then write bench.md, bench.json and the plots into out."""
    suite = SUITES["quick" if quick else "default"]
    model = model or suite["model"]
    budget = budget or suite["budget"]
    stop = parse_budget(budget)
    names = {spec: method_name(spec) for spec in methods}
    if len(set(names.values())) != len(names):
        raise GcfError(f"--methods names a method twice ({', '.join(methods)}).")
    check_sets(sets, methods)
    if baseline is not None and baseline not in names.values():
        raise GcfError(f"--baseline {baseline} is not one of the suite's methods ({', '.join(names.values())}).")
    if seeds < 1:
        raise GcfError("--seeds must be at least 1.")
    plans = {}
    swept = None
    if sweep is not None:
        from gcfamily.bench_sweep import parse_sweep
        from gcfamily.config import setting_names

        if seeds > 1:
            raise GcfError("--sweep and --seeds are not combined yet; run the sweep with one seed, then --seeds at the chosen values.")
        swept = parse_sweep(sweep)
        for spec in methods:
            values = swept[1] if swept[0].replace("-", "_") in setting_names(spec) else [None]
            for v in values:
                extra = dict(sets) if v is None else {**sets, swept[0]: v}
                key = names[spec] if v is None else f"{names[spec]}/{swept[0]}={v}"
                settings = run_settings(suite, spec, names[spec], model, task, stop, extra, out)
                settings.update(task_seed=settings.get("task_seed", settings.get("seed", 0)), output_dir=str(out / key),
                                validation_rows=int(settings.get("eval_samples", 64)))  # the choice never reads the test split
                plans[key] = {"method_spec": spec, "settings": settings}
    for spec in methods if sweep is None else []:
        for k in range(seeds):
            key = names[spec] if seeds == 1 else f"{names[spec]}/seed-{k}"
            settings = run_settings(suite, spec, names[spec], model, task, stop, sets, out)
            base = int(settings.get("seed", 0))
            # seeds base..base+N-1; the task (its problems, split and held-out prompts) stays at the base seed for every method and seed
            settings.update(seed=base + k, task_seed=settings.get("task_seed", base), output_dir=str(out / key))
            plans[key] = {"method_spec": spec, "settings": settings}
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    threads = threads or (1 if quick else None)  # a tiny model gains nothing from a second thread, and loses much on a busy machine
    if threads:
        env["OMP_NUM_THREADS"] = env["MKL_NUM_THREADS"] = str(threads)
    header = {"model": model, "task": task, "budget": budget, "load_start": _load(), "date": time.strftime("%Y-%m-%d %H:%M"),
              "machine": f"{platform.machine()} {os.cpu_count()} CPUs ({threads or 'all'} torch threads), {platform.system()}, python {platform.python_version()}"}
    results, kept = {}, []
    for name, plan in plans.items():
        proc = None if fresh else finished_run(out / name, plan)
        if proc is not None:
            kept.append(name)
            echo(f"[bench] {name}: kept the finished run with the same settings in {out / name} (--fresh runs it again)")
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
            echo(f"[bench] {name}: {r.get('steps')} steps, {proc['wall_s']:.0f} s, accuracy {fmt(r.get('accuracy_before'), '.3f')} -> "
                 f"{fmt(r.get('accuracy_after'), '.3f')}, {fmt(r.get('step_s_median'), '.3g')} s/step, peak {proc['max_rss_mb']:.0f} MB")
    header.update(load_end=_load(), total_s=sum(r.get("wall_s", 0.0) for r in results.values()), kept=kept)
    per_method: dict[str, list[dict[str, Any]]] = {}
    for key, r in results.items():
        per_method.setdefault(key.split("/")[0], []).append(r)
    if swept is not None:
        from gcfamily.bench_sweep import choose, final_validation, heldout_of, sweep_table

        first = next(iter(plans.values()))["settings"]
        base_acc = heldout_of(None, first)
        for m, runs in per_method.items():
            for r in runs:
                r["val_accuracy"] = final_validation(Path(r["folder"]))
            i = choose([str(j) for j in range(len(runs))], [r["val_accuracy"] for r in runs])
            if i is not None:  # only now, and only for the chosen run, is the test split read
                runs[i]["heldout_after"] = heldout_of(Path(runs[i]["folder"]), plans[f"{m}/{swept[0]}={swept[1][i]}" if len(runs) > 1 else m]["settings"])
        values = swept[1]
        (out / "bench.md").write_text(sweep_table(swept[0], values, per_method, base_acc, header))
        pngs = []
    elif seeds > 1 or baseline is not None:
        from gcfamily.bench_seeds import band_plots, seeds_table

        (out / "bench.md").write_text(seeds_table(per_method, header, baseline or next(iter(per_method))))
        pngs = band_plots(per_method, out) + plots({k: r for k, r in results.items() if k.endswith("seed-0") or "/" not in k}, out)
    else:
        (out / "bench.md").write_text(table(results, header))
        pngs = plots(results, out)
    if swept is None:
        from gcfamily.bench_seeds import frontier_plot

        pngs += [p for p in [frontier_plot(per_method, out)] if p is not None]
    (out / "bench.json").write_text(json.dumps({"header": header, "settings": {n: p["settings"] for n, p in plans.items()},
                                                "results": results}, indent=1, default=str))
    echo(f"[bench] wrote {out / 'bench.md'}, {out / 'bench.json'}, " + ", ".join(str(p) for p in pngs))
    return {"header": header, "results": results}


@click.command("bench")
@click.option("--methods", default=None, help=f"Comma-separated methods (names, module:Class or path/to/file.py:Class), or all (the whole zoo); default {','.join(DEFAULT_METHODS)}.")
@click.option("--model", default=None, help="Model for every method; default smollm2-135m (tiny with --quick).")
@click.option("--task", default="arithmetic", show_default=True,
              help="Built-in task, a preset (sorting-short: sorting of 2-3 numbers), or several comma-separated (one suite each, OUT/TASK/).")
@click.option("--budget", default=None, help="steps:N | tokens:N | time:SECONDS | flops:N (estimated training FLOPs), the same for each method; default time:210 (steps:60 with --quick).")
@click.option("--quick", is_flag=True, help="The suite on the tiny random model: minutes on a laptop CPU.")
@click.option("--output-dir", "--out", "out", default=None, help="Output folder (--out is the older spelling); default runs/bench (runs/bench-quick with --quick).")
@click.option("--set", "sets", multiple=True, help="Override a setting for every method (key=value) or one (grpo.lr=1e-6).")
@click.option("--threads", type=int, default=None, help="CPU threads per run; default 1 with --quick, else torch's default.")
@click.option("--fresh", is_flag=True, help="Run every method again, even one that already finished in --out with the same settings.")
@click.option("--seeds", type=click.IntRange(1, 100), default=1, show_default=True, help="Runs per method (seeds 0..N-1): means, intervals and bands.")
@click.option("--baseline", default=None, help="Method every other is compared with, paired over prompts and seeds; default the first.")
@click.option("--sweep", default=None, help="KEY=V1,V2,...: each method's value chosen on a validation split (never the held-out prompts), "
              "then its held-out accuracy reported.")
def bench(methods: Optional[str], model: Optional[str], task: str, budget: Optional[str], quick: bool, out: Optional[str],
          sets: tuple[str, ...], threads: Optional[int], fresh: bool, seeds: int, baseline: Optional[str], sweep: Optional[str]) -> None:
    """Run several methods on one model, task and budget; write a table, plots and a JSON of every figure."""
    from gcfamily.config import parse_sets

    if methods == "all":  # every method of the zoo: built in, and registered by installed packages
        from gcfamily.methods import all_methods

        chosen = list(all_methods())
    else:
        chosen = [m.strip() for m in methods.split(",") if m.strip()] if methods else default_methods()
    folder = Path(out or ("runs/bench-quick" if quick else "runs/bench"))
    tasks = [t.strip() for t in task.split(",") if t.strip()]
    failed = []
    for t in tasks:  # several tasks: one suite each, in OUT/<task>/
        res = run_bench(chosen, model, t, budget, quick, folder / t if len(tasks) > 1 else folder, parse_sets(sets), threads,
                        echo=click.echo, fresh=fresh, seeds=seeds, baseline=baseline, sweep=sweep)
        failed += [f"{n} ({t})" if len(tasks) > 1 else n for n, r in res["results"].items() if r.get("returncode") != 0]
    if failed:
        raise GcfError(f"{', '.join(failed)} failed; the table marks them and each folder's bench.log says why.")


if __name__ == "__main__":
    try:
        child(sys.argv[1])
    except GcfError as err:  # the parent reports the exit code and points at this log
        print(f"error: {err}", file=sys.stderr)
        sys.exit(getattr(err, "exit_code", 2))
