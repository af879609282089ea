"""The unified suite's four findings (DeepSeekMath 5.2.2): each difference, its interval, its minimum detectable
difference (MDD) and its verdict: holds (the interval is above 0), reversed (below 0), or not significant, then either no
difference as large as the MDD or inconclusive (core/stats.py: `detectable`); and each method's gain over the SFT control
at the same step.

Findings (1)-(3) and the gains compare sampled pass@1, the share of a prompt's k temperature samples that are right
(about three times less noisy a prompt than one greedy answer's 0/1), with the greedy difference beside it; (4) compares
Maj@K and Pass@K from the same k samples.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

STAGE = "sft-stage"
"""pi_sft's folder: stage 1 of the suite, the start of every method and the baseline of finding 4."""
FINDINGS = (
    ("(1) Online RFT beats RFT (online sampling beats offline)", "rft", "rft-offline", "pass1"),
    ("(2) GRPO+OS beats Online RFT (a reward-weighted coefficient beats a binary one)", "grpo", "rft", "pass1"),
    ("(3) GRPO+PS beats GRPO+OS (process supervision beats outcome supervision)", "grpo-ps", "grpo", "pass1"),
    ("(4a) RL raises Maj@K", "grpo", STAGE, "maj"),
    ("(4b) ... but not Pass@K", "grpo", STAGE, "pass"),
)
CONTROL = "sft"
"""The SFT-continued control: every method's gain is measured against it, at the same step."""
FIGURES = {"accuracy": "greedy accuracy", "pass1": "sampled pass@1", "maj": "Maj@K", "pass": "Pass@K"}


def _per_prompt(run: dict[str, Any], figure: str) -> Optional[dict[tuple[int, str], float]]:
    """A run's per-prompt score: greedy correctness at its last evaluation, or from its k samples the share right
    (pass1), Maj@K right or Pass@K; from a bench.json's record (`per_prompt`, keyed by index) where the run is a record rather than a folder."""
    from gcfamily.bench.seeds import heldout

    if "folder" not in run:
        kept = (run.get("per_prompt") or {}).get(figure)
        return {(int(i), ""): float(v) for i, v in kept.items()} if kept else None

    folder = Path(run["folder"])
    if figure == "accuracy":
        return heldout(folder)
    try:
        extra = json.loads((folder / "bench_child.json").read_text())
    except (OSError, ValueError):
        return None
    rows = extra.get("sampled_per_prompt") or []
    if figure == "maj":
        if any(r.get("maj_right") is None for r in rows):
            return None
        return {(i, r["prompt"]): float(r["maj_right"]) for i, r in enumerate(rows)} or None
    if figure == "pass1":
        k = int(extra.get("sampled_k") or 0)
        if k < 1:
            return None
        return {(i, r["prompt"]): r["correct"] / k for i, r in enumerate(rows)} or None
    return {(i, r["prompt"]): float(r["correct"] > 0) for i, r in enumerate(rows)} or None  # pass@k: any sample right


def paired_difference(a: list[dict[str, Any]], b: list[dict[str, Any]], figure: str) -> Optional[dict[str, Any]]:
    """mean(a) - mean(b) of `figure` with seeds_bootstrap over the prompts every run scored (and the seeds)."""
    from gcfamily.bench.seeds import paired

    return paired(a, b, score=lambda run: _per_prompt(run, figure))


def verdict(d: Optional[dict[str, Any]], want_positive: bool = True) -> str:
    """holds / reversed / not significant for a difference the paper finds positive, for (4b) (no gain) the reverse;
    a difference that is not significant says whether the design could have detected one as large as its MDD
    (core/stats.py: `detectable`)."""
    from gcfamily.core.stats import detectable

    if d is None:
        return "not measured"
    if not want_positive:
        if d["lo"] > 0.0:
            return "does not hold (a significant gain)"
        return "holds (no significant gain" + (")" if d["hi"] < 0.0 else f"; {detectable(d)})")
    return "holds" if d["lo"] > 0.0 else ("reversed" if d["hi"] < 0.0 else f"not significant; {detectable(d)}")


def _row(label: str, a: str, b: str, figure: str, per_method: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    d = paired_difference(per_method.get(a, []), per_method.get(b, []), figure)
    if d is None and figure == "pass1" and per_method.get(a) and per_method.get(b):  # a record without pass@1: greedy
        figure, d = "accuracy", paired_difference(per_method.get(a, []), per_method.get(b, []), "accuracy")
    greedy = paired_difference(per_method.get(a, []), per_method.get(b, []), "accuracy") if figure == "pass1" else None
    return {
        "finding": label,
        "a": a,
        "b": b,
        "figure": figure,
        "difference": d,
        "greedy": greedy,
        "verdict": verdict(d, label[:4] != "(4b)"),
    }


def findings(per_method: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """The four findings: each difference, its interval and its verdict."""
    return [_row(label, a, b, figure, per_method) for label, a, b, figure in FINDINGS]


def control_gains(per_method: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Each method's gain over the SFT control at the same step (sampled pass@1, greedy beside), with its MDD."""
    if not per_method.get(CONTROL):
        return []
    return [
        _row(f"{m} over the control", m, CONTROL, "pass1", per_method) for m in per_method if m not in (CONTROL, STAGE)
    ]


def _interval(d: Optional[dict[str, Any]]) -> str:
    from gcfamily.bench.report import fmt

    if d is None:
        return "-"
    return f"{fmt(d['diff'], '+.3f')} [{fmt(d['lo'], '+.3f')}, {fmt(d['hi'], '+.3f')}], MDD {fmt(d.get('mdd'), '.3f')}"


def findings_table(rows: list[dict[str, Any]], first: str = "finding") -> str:
    from gcfamily.bench.report import fmt

    lines = [
        f"| {first} | difference | 95% interval | p | MDD | verdict | greedy accuracy beside |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        d = r["difference"]
        what = f"{FIGURES[r['figure']]}: {r['a']} - {r['b']}"
        greedy = _interval(r.get("greedy")) if r["figure"] == "pass1" else ""
        if d is None:
            lines.append(f"| {r['finding']} ({what}) | - | - | - | - | {r['verdict']} | {greedy} |")
        else:
            lines.append(
                f"| {r['finding']} ({what}) | {fmt(d['diff'], '+.3f')} | [{fmt(d['lo'], '+.3f')}, {fmt(d['hi'], '+.3f')}] "
                f"| {fmt(d['p_value'], '.3f')} | {fmt(d.get('mdd'), '.3f')} | {r['verdict']} | {greedy} |"
            )
    return "\n".join(lines) + "\n"
