"""What `gcf bench` writes: one method's figures from its run folder, the Markdown table and the plots.

Read-only over the run folders (metrics.jsonl, bench_child.json); gcfamily/bench/suite.py runs them.
"""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path
from typing import Any, Optional


def _median(xs: list[float]) -> Optional[float]:
    xs = [x for x in xs if x is not None and math.isfinite(x)]
    return statistics.median(xs) if xs else None


def _mean(xs: list[Any]) -> Optional[float]:
    xs = [x for x in xs if x is not None and math.isfinite(x)]
    return sum(xs) / len(xs) if xs else None


def summarise(folder: Path, proc: dict[str, Any]) -> dict[str, Any]:
    """One method's figures from its metrics.jsonl and bench_child.json."""
    from gcfamily.run.logger import read_metrics

    res: dict[str, Any] = {"folder": str(folder), **proc}
    if not (folder / "metrics.jsonl").is_file():
        return res
    rows = read_metrics(folder)
    steps = [r for r in rows if "time/step_s" in r]
    # held-out accuracy, or the mean reward where the held-out rows carry no answer (a dataset scored by a reward of its own)
    key = "eval/accuracy" if any(r.get("eval/accuracy") is not None for r in rows) else "eval/reward_mean"
    evals = [r for r in rows if r.get(key) is not None]
    extra = json.loads((folder / "bench_child.json").read_text()) if (folder / "bench_child.json").is_file() else {}
    train_s = sum(r["time/step_s"] - r["time/data_s"] for r in steps)
    data_s = sum(r["time/data_s"] for r in steps)
    generated = sum(r.get("tokens/generated", 0.0) for r in steps)
    rewards = [r["reward/mean"] for r in steps if r.get("reward/mean") is not None]
    last = rewards[-min(len(rewards), 3) :]  # the last few steps: one step's reward is noisy
    res.update(
        {
            "steps": len(steps),
            "accuracy_before": evals[0][key] if evals and evals[0]["step"] == 0 else None,
            "accuracy_after": evals[-1][key] if evals and evals[-1]["step"] > 0 else None,
            "heldout_figure": key,
            "reward_first": rewards[0] if rewards else None,
            "reward_final": sum(last) / len(last) if last else None,
            "kl_ref": extra.get("kl_ref"),
            "start_eval_from": extra.get("start_eval_from"),
            "kl_logged": _mean([r.get("grpo/kl", r.get("ppo/kl")) for r in steps[-3:]]),
            "step_s_median": _median([r["time/step_s"] for r in steps]),
            "step_s_mean": _mean([r["time/step_s"] for r in steps]),
            "train_s": train_s,
            "data_s": data_s,
            "train_tokens": sum(r.get("tokens", 0.0) for r in steps),
            "train_tokens_per_s": sum(r.get("tokens", 0.0) for r in steps) / train_s if train_s > 0 else None,
            "generated_tokens": generated,
            "generation_tokens_per_s": generated / data_s if generated and data_s > 0 else None,
            "peak_memory_mb": max((r.get("peak_memory_mb", 0.0) for r in steps), default=None),
            "elapsed_s": steps[-1].get("budget/elapsed_s") if steps else None,
            "tokens_total": steps[-1].get("budget/tokens") if steps else None,
            "gc_mean": _mean([r.get("gc/mean") for r in steps]),
            "gc_abs_mean": _mean([r.get("gc/abs_mean") for r in steps]),
            "gc_zero_frac": _mean([r.get("gc/zero_frac") for r in steps]),
            "gc_std": _mean([r.get("gc/std") for r in steps]),
            "gc": extra.get("gc"),
            "kl_s": extra.get("kl_s"),
            "params": extra.get("params"),
            "threads": extra.get("threads"),
            # other processes' use of the cores as the run began: a run beside busy ones is slower for it, not its method
            "busy_cores_at_start": extra.get("busy_cores_at_start"),
            "per_step": rows,
        }
    )
    cfg = json.loads((folder / "run_config.json").read_text()) if (folder / "run_config.json").is_file() else {}
    res["seed"] = cfg.get("seed")
    pk = {int(k): v for k, v in (extra.get("pass_at_k") or {}).items()}
    res["pass_at_1"], res["pass_at_k"], res["k"] = pk.get(1), pk.get(max(pk)) if pk else None, max(pk) if pk else None
    res["maj_at_k"] = extra.get("maj_at_k")  # absent from results written before maj@k, None without an answer function
    res["prompts_seen"] = len(steps) * cfg["batch_size"] if "batch_size" in cfg else None
    params = extra.get("params")
    # forward+backward, sampling
    res["train_flops"] = 6 * params * res["train_tokens"] + 2 * params * generated if params else None
    return res


def fmt(v: Any, spec: str = ".3g") -> str:
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return "-"
    return format(v, spec)


def table(results: dict[str, dict[str, Any]], header: dict[str, Any]) -> str:
    """bench.md: the settings line and one row per method."""
    lines = [
        f"# gcf bench: {header['model']} on {header['task']}, budget {header['budget']}",
        "",
        f"{header['machine']}; load average {header['load_start']} at the start, {header['load_end']} at the end; "
        f"{header['date']}; total {header['total_s']:.0f} s of runs"
        + (
            f" ({', '.join(header['kept'])} kept from an earlier invocation with the same settings)"
            if header.get("kept")
            else ""
        )
        + ".",
        "",
        "| method | data | steps | held-out acc before | after | pass@1 / pass@k / maj@k | final reward | KL to ref | s/step | train tok/s | gen tok/s | peak MB | GC mean | GC abs mean | GC zero frac | GC p5 / p50 / p95 |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, r in results.items():
        if r.get("returncode") != 0:
            lines.append(
                f"| {name} | failed (exit {r.get('returncode')}; see {r.get('folder')}/bench.log) |" + " |" * 14
            )
            continue
        q = (r.get("gc") or {}).get("quantiles") or {}
        gcq = " / ".join(fmt(q.get(k), ".2g") for k in ("p5", "p50", "p95")) if q else "-"
        lines.append(
            "| "
            + " | ".join(
                [
                    name,
                    r.get("data", "-"),
                    str(r["steps"]),
                    fmt(r["accuracy_before"], ".3f"),
                    fmt(r["accuracy_after"], ".3f"),
                    f"{fmt(r.get('pass_at_1'), '.3f')} / {fmt(r.get('pass_at_k'), '.3f')} / "
                    f"{fmt(r.get('maj_at_k'), '.3f')}" + (f" (k={r['k']})" if r.get("k") else ""),
                    fmt(r["reward_final"], ".3f"),
                    fmt(r["kl_ref"], ".2g"),
                    fmt(r["step_s_median"], ".3g"),
                    fmt(r["train_tokens_per_s"], ".0f"),
                    fmt(r["generation_tokens_per_s"], ".0f"),
                    fmt(r["peak_memory_mb"], ".0f"),
                    fmt(r["gc_mean"], ".3g"),
                    fmt(r["gc_abs_mean"], ".3g"),
                    fmt(r["gc_zero_frac"], ".2f"),
                    gcq,
                ]
            )
            + " |"
        )
    busy = [
        f"{n} {r['busy_cores_at_start']:.1f}" for n, r in results.items() if r.get("busy_cores_at_start") is not None
    ]
    if busy:
        lines += ["", f"Cores that other processes kept busy as each run started: {', '.join(busy)}."]
    lines += [
        "",
        "Held-out accuracy: greedy, each distinct prompt of the first `eval_samples` test rows once (with --dataset: the eval rows' accuracy where they carry an `answer`, else their mean reward). Final reward: mean of `reward/mean` over the last 3 steps "
        "(on-policy methods). KL to ref: mean k3 per token of one temperature-1 sample per held-out prompt from the final "
        "policy against the initial model. pass@1 / pass@k: k = group_size completions sampled per held-out prompt at the run's "
        "temperature (unbiased estimator); maj@k: the share of those prompts whose most common answer among the same k samples "
        "is right (a tie goes to the answer sampled first; - where the held-out rows have no answer function). s/step: median. Train tok/s: loss tokens over the step time outside sampling "
        "and scoring. Gen tok/s: completion tokens over sampling + scoring time. Peak MB: peak resident memory during "
        "training (GPU: allocated). GC: over every loss token of the run (gc.png).",
    ]
    return "\n".join(lines) + "\n"


def plots(results: dict[str, dict[str, Any]], out: Path) -> list[Path]:
    """reward.png, accuracy.png (against step and training wall time) and gc.png (histogram per method)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = {n: r for n, r in results.items() if r.get("per_step")}
    color = {n: f"C{i}" for i, n in enumerate(results)}  # one colour per method across the figures
    written = []

    def series(rows: list[dict], key: str) -> tuple[list[float], list[float], list[float]]:
        xs, ts, ys, t = [], [], [], 0.0
        for r in rows:
            t = r.get("budget/elapsed_s", t)
            if r.get(key) is not None:
                xs.append(r["step"])
                ts.append(t if r["step"] > 0 else 0.0)
                ys.append(r[key])
        return xs, ts, ys

    for key, fname, label in (
        ("reward/mean", "reward.png", "reward (mean of the step's samples)"),
        ("eval/accuracy", "accuracy.png", "held-out accuracy (greedy)"),
    ):
        fig, axes = plt.subplots(1, 2, figsize=(11, 4))
        for name, r in ok.items():
            xs, ts, ys = series(r["per_step"], key)
            if ys:
                axes[0].plot(xs, ys, marker="o", ms=3, label=name, color=color[name])
                axes[1].plot(ts, ys, marker="o", ms=3, label=name, color=color[name])
        axes[0].set_xlabel("optimizer step")
        axes[1].set_xlabel("training wall time (s, evaluation excluded)")
        for ax in axes:
            ax.set_ylabel(label)
            ax.grid(alpha=0.3)
        if any(ax.has_data() for ax in axes):
            axes[0].legend()
        fig.tight_layout()
        fig.savefig(out / fname, dpi=110)
        plt.close(fig)
        written.append(out / fname)

    with_gc = {n: r["gc"] for n, r in ok.items() if (r.get("gc") or {}).get("hist")}
    n = max(len(with_gc), 1)
    cols = min(n, 3)
    fig, axes = plt.subplots(
        (n + cols - 1) // cols, cols, figsize=(4.2 * cols, 3.2 * ((n + cols - 1) // cols)), squeeze=False
    )
    for ax, (name, gc) in zip(axes.flat, with_gc.items()):
        h = gc["hist"]
        width = (h["hi"] - h["lo"]) / len(h["counts"])
        ax.bar(
            [h["lo"] + (i + 0.5) * width for i in range(len(h["counts"]))], h["counts"], width=width, color=color[name]
        )
        ax.set_yscale("log")
        q = gc["quantiles"]
        ax.set_title(
            f"{name}: GC of {gc['tokens']} loss tokens\np50 {q['p50']:.3g}, zero {100 * gc['zero_frac']:.0f}%",
            fontsize=9,
        )
        ax.set_xlabel("GC")
    for ax in list(axes.flat)[len(with_gc) :]:
        ax.axis("off")
    fig.tight_layout()
    fig.savefig(out / "gc.png", dpi=110)
    plt.close(fig)
    written.append(out / "gc.png")
    return written
