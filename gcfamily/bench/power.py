"""What a comparison can detect, and the design that detects what is asked: `gcf bench --plan`.

A difference between two trained methods, paired on the same held-out prompts, varies for three reasons, estimated
from a bench's own per-prompt scores (bench.json, each run's `per_prompt`: sampled pass@1, the share of a prompt's k
samples that are right, where the runs kept it, else greedy 0/1 correctness):

    sigma_run^2    a whole run's shift (another seed moves every prompt's chance together); only seeds average it
    sigma_flip^2   a prompt's score changing between seeds of one method; seeds and prompts average it
    sigma_pm^2     a method being better on some prompts than on others; only prompts average it

so a design of S seeds per method and P prompts has

    Var(mean_A - mean_B) = 2 sigma_run^2 / S + 2 sigma_flip^2 / (S P) + 2 sigma_pm^2 / P
    MDD = (z_{1 - alpha/2} + z_{power}) * sqrt(Var)        (80% power, two-sided 0.05: 2.80 standard errors)

the smallest true difference such a design finds significant four times in five. Estimates (method of moments, each
component pooled over the methods and pairs that have it; a negative estimate is 0):

    sigma_flip^2 = mean over methods and prompts of the variance of a prompt's score over the method's seeds
    sigma_run^2  = mean over methods of Var_s(run mean) - sigma_flip^2 / P
    sigma_pm^2   = mean over pairs of (Var_p(per-prompt mean of A - of B) - 2 sigma_flip^2 / S) / 2

Time is predicted from the runs' own wall times: a run's training part (its data and train seconds) per step, and the
rest (evaluations, KL, samples) in proportion to the prompts it evaluated.
"""

from __future__ import annotations

import itertools
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from gcfamily.core.stats import mdd
from gcfamily.errors import GcfError


@dataclass
class Components:
    """The variance components of a per-prompt score, and the design they were measured at."""

    run: float
    flip: float
    pm: float
    seeds: int
    prompts: int
    methods: int

    def se(self, seeds: int, prompts: int) -> float:
        """Standard error of a paired difference between two methods at S seeds each and P prompts."""
        return math.sqrt(2 * self.run / seeds + 2 * self.flip / (seeds * prompts) + 2 * self.pm / prompts)

    def mdd(self, seeds: int, prompts: int) -> float:
        return mdd(self.se(seeds, prompts))  # 80% power, two-sided 0.05


def scores(bench: dict[str, Any], figure: str = "accuracy") -> dict[str, list[list[float]]]:
    """Per method, its seeds' per-prompt scores (seeds x prompts, prompts in index order), from a bench.json."""
    out: dict[str, list[list[float]]] = {}
    for key, r in (bench.get("results") or {}).items():
        per = ((r or {}).get("per_prompt") or {}).get(figure)
        if "/seed-" not in key or not per:
            continue
        out.setdefault(key.split("/seed-")[0], []).append([float(per[i]) for i in sorted(per, key=int)])
    return {m: s for m, s in out.items() if len({len(x) for x in s}) == 1}


def compared(bench: dict[str, Any]) -> tuple[str, dict[str, list[list[float]]]]:
    """The figure a plan is for and its scores: sampled pass@1 (the unified suite's compared figure) where at least two
    methods kept it for two seeds or more, else greedy accuracy."""
    sampled = scores(bench, "pass1")
    if sum(1 for s in sampled.values() if len(s) >= 2) >= 2:
        return "sampled pass@1", sampled
    return "greedy accuracy", scores(bench)


def components(per_method: dict[str, list[list[float]]]) -> Components:
    """The variance components (module docstring) of methods that ran two or more seeds on the same prompts."""
    several = {m: s for m, s in per_method.items() if len(s) >= 2}
    if len(several) < 2:
        raise GcfError("A plan needs a bench with at least two methods of two or more seeds each; run --seeds 2 first.")
    P = len(next(iter(several.values()))[0])
    if any(len(s[0]) != P for s in several.values()):
        raise GcfError(
            "The bench's methods were scored on different numbers of prompts; a plan needs the same prompts."
        )

    def var(xs: list[float]) -> float:
        mu = sum(xs) / len(xs)
        return sum((x - mu) ** 2 for x in xs) / (len(xs) - 1)

    flip = _mean([var([s[k][p] for k in range(len(s))]) for s in several.values() for p in range(P)])
    run = _mean([max(var([sum(r) / P for r in s]) - flip / P, 0.0) for s in several.values()])
    S = min(len(s) for s in several.values())
    means = {m: [sum(r[p] for r in s) / len(s) for p in range(P)] for m, s in several.items()}
    pm = _mean(
        [max((var([x - y for x, y in zip(means[a], means[b])]) - 2 * flip / S) / 2, 0.0) for a, b in _pairs(means)]
    )
    return Components(run, flip, pm, S, P, len(several))


def _pairs(means: dict[str, list[float]]) -> list[tuple[str, str]]:
    return list(itertools.combinations(sorted(means), 2))


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs)


def run_seconds(bench: dict[str, Any], steps: int, prompts: int) -> Optional[float]:
    """Mean predicted wall time of one trained run at `steps` steps and `prompts` evaluated prompts, from the bench's runs
    (module docstring); None where the runs recorded no times."""
    out = []
    for key, r in (bench.get("results") or {}).items():
        if "/seed-" not in key or not r or not r.get("wall_s") or not r.get("steps"):
            continue
        train = float(r.get("train_s") or 0.0) + float(r.get("data_s") or 0.0)
        P = len(((r.get("per_prompt") or {}).get("accuracy") or {})) or prompts
        out.append(train / r["steps"] * steps + (float(r["wall_s"]) - train) * prompts / P)
    return _mean(out) if out else None


def plan(bench_path: Path, target: float, methods: Optional[int] = None, max_prompts: Optional[int] = None) -> str:
    """The text `gcf bench --plan` prints: the bench's variance components, its own design's MDD, and the designs (seeds,
    prompts) that reach `target`, each with its predicted wall time on the machine the bench ran on."""
    if not 0 < target < 1:
        raise GcfError(f"--target-mdd must be between 0 and 1 (a difference in accuracy), not {target}.")
    try:
        bench = json.loads(Path(bench_path).read_text())
    except (OSError, ValueError) as e:
        raise GcfError(f"--plan reads a bench.json that `gcf bench` wrote; {bench_path} cannot be read ({e}).") from e
    figure, per_method = compared(bench)
    c = components(per_method)
    n_methods = methods or c.methods
    steps = max((int(r.get("steps") or 0) for k, r in bench["results"].items() if "/seed-" in k), default=0)
    pool = max_prompts or c.prompts
    lines = [
        f"plan from {bench_path}: {c.methods} methods x {c.seeds} seeds on {c.prompts} prompts ({figure})",
        f"variance components: run shift sigma_run = {math.sqrt(c.run):.3f}, prompt flips between seeds "
        f"sigma_flip = {math.sqrt(c.flip):.3f}, method x prompt sigma_pm = {math.sqrt(c.pm):.3f}",
        f"this design ({c.seeds} seeds, {c.prompts} prompts): MDD {c.mdd(c.seeds, c.prompts):.3f} between two trained "
        f"methods (80% power, two-sided 0.05)",
        f"designs reaching MDD <= {target:.3f} ({n_methods} methods, {steps} steps each, prompts up to {pool}):",
    ]
    designs = []
    for S in range(1, 21):
        P = next((p for p in _prompt_grid(pool) if c.mdd(S, p) <= target), None)
        if P is not None:
            secs = run_seconds(bench, steps, P)
            designs.append((secs * S * n_methods if secs is not None else math.inf, S, P))
    for total, S, P in sorted(designs)[:5]:  # the cheapest first
        when = f", about {total / 3600:.1f} h of runs" if math.isfinite(total) else ""
        lines.append(f"  {S} seeds x {P} prompts: MDD {c.mdd(S, P):.3f}{when}")
    found = bool(designs)
    if not found:
        floor = c.mdd(20, pool)
        lines.append(
            f"  none up to 20 seeds and {pool} prompts (MDD {floor:.3f} there): the run-to-run shift "
            f"sigma_run = {math.sqrt(c.run):.3f} needs more seeds, or a budget where the methods move more"
        )
    return "\n".join(lines) + "\n"


def _prompt_grid(pool: int) -> list[int]:
    return sorted({min(p, pool) for p in (25, 50, 100, 150, 200, 300, 500, 1000, 2000, pool)})


def recorded_findings(bench_path: Path) -> str:
    """The unified suite's findings recomputed from a bench.json's per-prompt records, each with its MDD and verdict
    (empty for a bench of another suite)."""
    bench = json.loads(Path(bench_path).read_text())
    if (bench.get("header") or {}).get("suite") != "unified":
        return ""
    from gcfamily.bench.findings import findings, findings_table

    per_method: dict[str, list[dict[str, Any]]] = {}
    for key, r in bench["results"].items():
        if ("/seed-" in key or "/" not in key) and r and r.get("returncode") == 0:  # a seed's run, or the SFT stage
            per_method.setdefault(key.split("/seed-")[0], []).append({k: v for k, v in r.items() if k != "folder"})
    return "\nthe findings, from the runs' recorded per-prompt scores:\n" + findings_table(findings(per_method))


def reachable(pilot: Path, target: float, seeds: int, prompts: Optional[str] = None) -> str:
    """Before a suite runs: the MDD that `seeds` seeds on `prompts` prompts (default: the pilot's) are predicted to reach
    from an earlier bench.json of the same suite (the pilot); refused in one sentence when it is above `target`."""
    if not pilot.is_file():
        return (
            f"no earlier bench.json in {pilot.parent}: the MDD of this design is not predicted (it is measured after)"
        )
    c = components(compared(json.loads(pilot.read_text()))[1])
    P = int(prompts) if prompts else c.prompts
    got = c.mdd(seeds, P)
    if got > target:
        better = next((S for S in range(seeds, 101) if c.mdd(S, P) <= target), None)
        fix = f"--seeds {better}" if better else "more held-out prompts or a budget where the methods move more"
        raise GcfError(
            f"{seeds} seed(s) on {P} prompts are predicted to detect differences of {got:.3f} or more (from {pilot}), "
            f"not {target:.3f}; ask for {fix}, or see `gcf bench --plan {pilot} --target-mdd {target}`."
        )
    return f"predicted MDD {got:.3f} <= {target:.3f} at {seeds} seed(s) on {P} prompts (from {pilot})"
