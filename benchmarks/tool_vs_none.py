"""Held-out accuracy with and without an environment (a tool) after the same steps: two run folders, paired by prompt.

    python benchmarks/tool_vs_none.py runs/calc-none runs/calc-tool

Each run's eval_details.jsonl holds every held-out prompt's verdict before the first step and after the last (the runs
evaluate with eval_at_ends on the same prompts: the task's held-out rows; the run with the environment plays greedy
episodes). Prints each run's accuracy with its Wilson 95% interval at both ends, the paired difference of the two runs'
final accuracies with its bootstrap 95% interval and MDD (core/stats.paired_bootstrap), each run's gain over its own
start, and (from metrics.jsonl) the mean turns and tool tokens of its training episodes.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from gcfamily.core.stats import paired_bootstrap, wilson


def verdicts(run: Path) -> dict[int, dict[int, float]]:
    """step -> prompt index -> 1.0 if right."""
    out = {}
    for line in (run / "eval_details.jsonl").read_text().splitlines():
        got = json.loads(line)
        out[got["step"]] = {r["index"]: float(bool(r.get("correct"))) for r in got["rows"]}
    return out


def describe(name: str, run: Path) -> tuple[dict[int, float], dict[int, float]]:
    v = verdicts(run)
    first, last = v[min(v)], v[max(v)]
    for step, got in ((min(v), first), (max(v), last)):
        k, n = int(sum(got.values())), len(got)
        lo, hi = wilson(k, n)
        print(f"{name:>10} step {step:>3}: accuracy {k / n:.3f} ({k}/{n}), Wilson 95% [{lo:.3f}, {hi:.3f}]")
    keys = sorted(first)
    gain = paired_bootstrap([last[i] for i in keys], [first[i] for i in keys])
    print(
        f"{name:>10} gain over its start: {gain['diff']:+.3f} [{gain['lo']:+.3f}, {gain['hi']:+.3f}], MDD {gain['mdd']:.3f}"
    )
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    trained = [r for r in rows if "reward/mean" in r]
    turns = [r["episode/turns_mean"] for r in trained if "episode/turns_mean" in r]
    if turns:
        env = sum(r["episode/env_tokens_mean"] for r in trained) / len(trained)
        print(f"{name:>10} training episodes: {sum(turns) / len(turns):.2f} turns, {env:.1f} tool tokens on average")
    steps = [r["time/step_s"] for r in trained]
    print(f"{name:>10} {len(trained)} steps, {sum(steps):.0f} s of steps, reward/mean first 5 "
          f"{sum(r['reward/mean'] for r in trained[:5]) / 5:.3f}, last 5 {sum(r['reward/mean'] for r in trained[-5:]) / 5:.3f}")  # fmt: skip
    return first, last


def main(none: str, tool: str) -> None:
    _, a = describe("no tool", Path(none))
    _, b = describe("tool", Path(tool))
    keys = sorted(set(a) & set(b))
    d = paired_bootstrap([b[i] for i in keys], [a[i] for i in keys])
    print(
        f"tool - no tool after the last step, paired over {len(keys)} prompts: {d['diff']:+.3f} "
        f"[{d['lo']:+.3f}, {d['hi']:+.3f}], p = {d['p_value']:.3f}, MDD {d['mdd']:.3f}"
    )


if __name__ == "__main__":
    main(*sys.argv[1:3])
