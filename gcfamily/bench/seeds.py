"""`gcf bench --seeds N`: every method run N times, figures with intervals, paired differences to a baseline, curves with bands.

Every run of a suite uses `task_seed: 0`, so all methods and seeds are evaluated on the same held-out prompts
(their per-prompt results are in each run's eval_details.jsonl); a run's own `seed` changes its data order,
sampling and the initialisation of anything random. Per method:

- each figure's mean over seeds and a 95% t interval across seeds (none with one seed);
- held-out accuracy pooled over seeds, with a Wilson interval on the pooled answers (prompts x seeds);
- the difference to the baseline method in final held-out accuracy, with a two-level bootstrap interval (stats.seeds_bootstrap:
  the prompts resampled in pairs, each method's seeds resampled apart; 10,000 resamples, seed 0); significant when 0 is
  outside it. Runs pair only on prompts every one of them answered, matched by position and text.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Callable, Optional

from gcfamily.bench.report import fmt
from gcfamily.core.stats import detectable, mean_interval, seeds_bootstrap, wilson

FIGURES = (
    "accuracy_before",
    "accuracy_after",
    "pass_at_1",
    "pass_at_k",
    "maj_at_k",
    "reward_final",
    "kl_ref",
    "steps",
    "step_s_median",
    "peak_memory_mb",
    "train_tokens",
    "generated_tokens",
    "elapsed_s",
    "prompts_seen",
    "train_flops",
)


def heldout(folder: Path, final: bool = True, accuracy: bool = True) -> Optional[dict[tuple[int, str], float]]:
    """{(prompt index, prompt): 1.0 if correct} at the run's last evaluation (final) or its first (before training);
    with accuracy=False the reward itself (0.0 where it failed), for held-out rows without an answer.

    Keyed by the prompt's text as well as its position, so that runs pair only where they answered the same prompt.
    """
    path = Path(folder) / "eval_details.jsonl"
    if not path.is_file():
        return None
    records = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    records = [r for r in records if (r["step"] > 0) == final]
    if not records:
        return None
    rec = max(records, key=lambda r: r["step"]) if final else records[0]

    def score(row: dict[str, Any]) -> float:
        r = row["reward"]
        if not accuracy:
            return float(r or 0.0)
        return float(row.get("correct", r is not None and r >= 1.0))  # `correct`: the evaluation's own verdict

    return {(int(row["index"]), str(row["prompt"])): score(row) for row in rec["rows"]}


def prompts_of(folder: Path) -> Optional[list[str]]:
    """The held-out prompts of a run's last evaluation, in order (identical across methods and seeds of one suite)."""
    path = Path(folder) / "eval_details.jsonl"
    if not path.is_file():
        return None
    last = json.loads(path.read_text().splitlines()[-1])
    return [str(r["prompt"]) for r in last["rows"]]


def _finite(xs: list[Any]) -> list[float]:
    return [float(x) for x in xs if isinstance(x, (int, float)) and math.isfinite(x)]


def is_accuracy(per_method: dict[str, list[dict[str, Any]]]) -> bool:
    """Whether the suite's held-out figure is accuracy (a task, or eval rows with an answer), not mean reward."""
    return all(
        r.get("heldout_figure", "eval/accuracy") == "eval/accuracy" for runs in per_method.values() for r in runs
    )


def aggregate(runs: list[dict[str, Any]], accuracy: bool = True) -> dict[str, Any]:
    """A method's figures over its seeds: {figure: (mean, lo, hi)}, the pooled accuracy and its Wilson interval (accuracy only)."""
    ok = [r for r in runs if r.get("returncode") == 0]
    out: dict[str, Any] = {"seeds": len(runs), "ok": len(ok)}
    for key in FIGURES:
        vals = _finite([r.get(key) for r in ok])
        out[key] = mean_interval(vals) if vals else None
    k = n = 0
    for r in ok if accuracy else []:
        got = heldout(Path(r["folder"]))
        if got:
            k, n = k + int(sum(got.values())), n + len(got)
    out["pooled"] = (k / n, *wilson(k, n)) if n else None
    out["pooled_n"] = n
    return out


def paired(
    runs: list[dict[str, Any]],
    base: list[dict[str, Any]],
    accuracy: bool = True,
    score: Optional[Callable[[dict[str, Any]], Optional[dict[tuple[int, str], float]]]] = None,
) -> Optional[dict[str, Any]]:
    """The difference in final held-out accuracy to the baseline (or in `score`, a run's per-prompt figure keyed by
    (index, prompt)): `seeds_bootstrap` over each method's successful seeds, on the prompts every one of those runs
    answered (matched by position and text)."""
    score = score or (lambda r: heldout(Path(r["folder"]), accuracy=accuracy))
    got = [[score(r) for r in rs if r.get("returncode") == 0] for rs in (runs, base)]
    got = [[x for x in g if x] for g in got]
    if not got[0] or not got[1]:
        return None
    keys = sorted(set.intersection(*(set(x) for g in got for x in g)))
    if not keys:
        return None
    a, b = ([[x[k] for k in keys] for x in g] for g in got)
    return seeds_bootstrap(a, b)


def runs_k(runs: list[dict[str, Any]]) -> Optional[int]:
    return next((r["k"] for r in runs if r.get("k")), None)


def _ci(v: Optional[tuple[float, float, float]], spec: str = ".3f", interval: bool = True) -> str:
    if v is None:
        return "-"
    mean, lo, hi = v
    shown = interval and math.isfinite(lo) and math.isfinite(hi)
    return f"{fmt(mean, spec)} [{fmt(lo, spec)}, {fmt(hi, spec)}]" if shown else fmt(mean, spec)


def seeds_table(per_method: dict[str, list[dict[str, Any]]], header: dict[str, Any], baseline: Optional[str]) -> str:
    """bench.md for several seeds: intervals, pooled accuracy, the paired difference to the baseline, what each budget bought."""
    acc = is_accuracy(per_method)
    figure = "held-out acc" if acc else "held-out mean reward"
    agg = {m: aggregate(runs, acc) for m, runs in per_method.items()}
    comp = {
        m: paired(runs, per_method[baseline], acc)
        for m, runs in per_method.items()
        if baseline in per_method and m != baseline
    }
    seeds = max(len(r) for r in per_method.values())
    lines = [
        f"# gcf bench: {header['model']} on {header['task']}, budget {header['budget']}, {seeds} seed(s)",
        "",
        f"{header['machine']}; load average {header['load_start']} at the start, {header['load_end']} at the end; {header['date']}; "
        f"total {header['total_s']:.0f} s of runs.",
        "",
        f"| method | data | seeds | {figure} before | after (mean [95% CI over seeds]) | pooled after [Wilson 95%] | vs {baseline or '-'} (bootstrap over prompts and seeds, 95%) "
        "| pass@1 / pass@k / maj@k (sampled) | final reward | KL to ref | steps | prompts seen | tokens trained | tokens generated | train FLOPs | s/step | peak MB |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for m, a in agg.items():
        pooled = a["pooled"]
        pooled_s = "-" if pooled is None else f"{pooled[0]:.3f} [{pooled[1]:.3f}, {pooled[2]:.3f}] (n={a['pooled_n']})"
        c = comp.get(m)
        vs = (
            "baseline"
            if m == baseline
            else "-"
            if c is None
            else (
                f"{c['diff']:+.3f} [{c['lo']:+.3f}, {c['hi']:+.3f}], MDD {c['mdd']:.3f}"
                + (" **significant**" if c["significant"] else f" (not significant; {detectable(c)})")
            )
        )
        failed = a["seeds"] - a["ok"]
        lines.append(
            "| "
            + " | ".join(
                [
                    m,
                    next((r["data"] for r in per_method[m] if r.get("data")), "-"),
                    f"{a['ok']}" + (f" ({failed} failed)" if failed else ""),
                    _ci(a["accuracy_before"]),
                    _ci(a["accuracy_after"]),
                    pooled_s,
                    vs,
                    f"{_ci(a['pass_at_1'], '.3f', False)} / {_ci(a['pass_at_k'], '.3f', False)} / "
                    f"{_ci(a['maj_at_k'], '.3f', False)}"
                    + (f" (k={runs_k(per_method[m])})" if runs_k(per_method[m]) else ""),
                    _ci(a["reward_final"]),
                    _ci(a["kl_ref"], ".2g"),
                    *(
                        _ci(a[k], spec, interval=False)
                        for k, spec in (
                            ("steps", ".0f"),
                            ("prompts_seen", ".0f"),
                            ("train_tokens", ".3g"),
                            ("generated_tokens", ".3g"),
                            ("train_flops", ".2e"),
                            ("step_s_median", ".3g"),
                            ("peak_memory_mb", ".0f"),
                        )
                    ),
                ]
            )
            + " |"
        )
    lines += [
        "",
        "Every method and seed is evaluated on the same held-out prompts (task_seed 0): greedy, each distinct prompt of the first "
        "`eval_samples` test rows once. Before: one evaluation, shared by every run that starts from the same model. Intervals "
        "over seeds are Student t intervals of the per-seed figures (none with one seed). Pooled: correct answers over prompts x "
        "seeds, Wilson interval. pass@1 / pass@k: k = group_size completions sampled at the run's temperature per held-out prompt "
        "(the unbiased estimator, averaged over prompts), mean over seeds; maj@k: the share of those prompts whose most common "
        "answer among the same k samples is right (a tie goes to the answer sampled first; - where the held-out rows have no "
        "answer function), mean over seeds. The budget columns (steps to peak MB) are means over seeds. The difference to the baseline is in mean final accuracy over seeds; its interval is a two-level bootstrap: each "
        "resample draws the held-out prompts with replacement (the same prompts for both methods: paired) and each method's seeds "
        "with replacement, apart (10,000 resamples, seed 0), so it holds the spread between training runs as well as the "
        "prompts'; significant when its 95% interval excludes 0. MDD: the minimum detectable difference of this design, the "
        "difference it finds significant four times in five (80% power, two-sided 0.05: 2.80 bootstrap standard errors); a "
        "difference that is not significant is either no difference as large as the MDD (its interval inside +-MDD) or "
        "inconclusive (the design could not have detected less than the MDD); `gcf bench --plan OUT/bench.json` says what "
        "design reaches a smaller one. "
        "Train FLOPs: 6 x parameters x loss tokens + 2 x parameters x generated tokens (an estimate: packing, prefix sharing and "
        "the loss-token-only head do less). Prompts seen: steps x batch_size.",
    ]
    return "\n".join(lines) + "\n"


def band_plots(
    per_method: dict[str, list[dict[str, Any]]], out: Path, prompts_per_step: Optional[int] = None
) -> list[Path]:
    """reward_bands.png and accuracy_bands.png: each method's mean over seeds at each step, the band from the lowest to the
    highest seed. Against training seconds, or, given prompts_per_step (every method's batch_size), prompts seen."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    for key, fname, label in (
        ("reward/mean", "reward_bands.png", "reward (mean of the step's samples)"),
        ("eval/accuracy", "accuracy_bands.png", "held-out accuracy (greedy)"),
    ):
        fig, ax = plt.subplots(figsize=(6.5, 4))
        for i, (m, all_runs) in enumerate(per_method.items()):
            # a failed run's last figures are not its final ones
            runs = [r for r in all_runs if r.get("returncode") == 0]
            if not runs:
                continue
            # k-th evaluation of every seed: seeds evaluate at other steps under a time budget
            if key == "eval/accuracy":
                xs, ys = evaluation_points(runs, prompts_per_step)
            else:
                by_step: dict[int, list[float]] = {}
                for r in runs:
                    for row in r.get("per_step") or []:
                        if row.get(key) is not None:
                            by_step.setdefault(int(row["step"]), []).append(float(row[key]))
                steps = sorted(s for s, v in by_step.items() if len(v) == len(runs))  # steps every seed reached
                xs, ys = [float(s * (prompts_per_step or 1)) for s in steps], [by_step[s] for s in steps]
            if not xs:
                continue
            ax.plot(
                xs,
                [sum(y) / len(y) for y in ys],
                color=f"C{i}",
                label=f"{m} ({len(runs)} seeds)",
                marker="o" if key == "eval/accuracy" else None,
                ms=3,
            )
            ax.fill_between(xs, [min(y) for y in ys], [max(y) for y in ys], color=f"C{i}", alpha=0.2)
        ax.set_xlabel(
            "prompts seen"
            if prompts_per_step
            else "optimizer step"
            if key != "eval/accuracy"
            else "training seconds (mean over seeds at each evaluation)"
        )
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        if ax.has_data():
            ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out / fname, dpi=110)
        plt.close(fig)
        written.append(out / fname)
    return written


def evaluation_points(
    runs: list[dict[str, Any]], prompts_per_step: Optional[int] = None
) -> tuple[list[float], list[list[float]]]:
    """(x, accuracies of every seed) at each evaluation: the k-th of every seed (before, during, after), at the mean of the
    seeds' training seconds then (or of the prompts seen, step x prompts_per_step, when given). Seeds with fewer
    evaluations than the rest are aligned at their first ones and their last."""
    per_run = []
    for r in runs:
        pts, elapsed = [], 0.0
        for row in r.get("per_step") or []:
            elapsed = float(row.get("budget/elapsed_s", elapsed))
            if row.get("eval/accuracy") is not None:
                x = int(row["step"]) * prompts_per_step if prompts_per_step else elapsed
                pts.append((0.0 if int(row["step"]) == 0 else float(x), float(row["eval/accuracy"])))
        if pts:
            per_run.append(pts)
    if len(per_run) != len(runs):
        return [], []
    n = min(len(p) for p in per_run)
    aligned = [p[: n - 1] + [p[-1]] for p in per_run]
    xs = [sum(p[k][0] for p in aligned) / len(aligned) for k in range(n)]
    return xs, [[p[k][1] for p in aligned] for k in range(n)]


def kl_of(row: dict[str, Any]) -> Optional[float]:
    """The KL to the reference a step logged (grpo/kl, ppo/kl, ...: the method's own estimator), if any."""
    for k, v in row.items():
        if k.endswith("/kl") and isinstance(v, (int, float)) and math.isfinite(v):
            return float(v)
    return None


def frontier_plot(per_method: dict[str, list[dict[str, Any]]], out: Path) -> Optional[Path]:
    """frontier.png: each on-policy method's training reward against its KL to the reference along training (one line per seed),
    and the final held-out accuracy against the final KL (k3 of a fresh sample, the same estimate for every method)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for i, (m, runs) in enumerate(per_method.items()):
        for j, r in enumerate(r for r in runs if r.get("returncode") == 0):
            pts = [
                (kl_of(row), row["reward/mean"])
                for row in r.get("per_step") or []
                if row.get("reward/mean") is not None and kl_of(row) is not None
            ]
            if pts:
                axes[0].plot(
                    *zip(*pts),
                    color=f"C{i}",
                    alpha=0.8 if j == 0 else 0.35,
                    lw=1,
                    marker=".",
                    ms=3,
                    label=m if j == 0 else None,
                )
            if r.get("kl_ref") is not None and r.get("accuracy_after") is not None:
                axes[1].scatter([r["kl_ref"]], [r["accuracy_after"]], color=f"C{i}", label=m if j == 0 else None, s=18)
    axes[0].set_xlabel("KL to the reference (the method's own per-token estimate, logged each step)")
    axes[0].set_ylabel("training reward (mean of the step's samples)")
    axes[1].set_xlabel("final KL to the initial model (k3 per token, one sample per held-out prompt)")
    axes[1].set_ylabel("final held-out accuracy")
    for ax in axes:
        ax.grid(alpha=0.3)
        if ax.has_data():
            ax.legend(fontsize=8)
    if not any(ax.has_data() for ax in axes):
        plt.close(fig)
        return None
    fig.tight_layout()
    fig.savefig(out / "frontier.png", dpi=110)
    plt.close(fig)
    return out / "frontier.png"
