"""Did a run move? The unified suite's line per run, and its gate.

A comparison of methods that never left pi_sft says nothing about the methods. So each stage-2 run gets one line:

- its KL to pi_sft (nats a token, on temperature-1 samples of held-out prompts: the bench's `kl_ref`);
- the held-out prompts its greedy answer flipped against pi_sft's (wrong to right, right to wrong);
- its sampled pass@1 against pi_sft's, paired over the same prompts;
- the slope of its training reward per 10 steps, and the same slope against the shared prompt order: a seed's runs see
  the same prompts in the same order, so a reward that rises in every run of a seed is the prompts getting easier, not
  learning; the step-by-step difference to the mean of the seed's other rewarded runs removes it.

The gate: after the SFT control and the reference RL method (grpo) of seed 0, the suite stops, and says so, when the
reference has not moved sampled pass@1 from pi_sft by more than that difference's MDD; the methods could not separate
at that design (`--no-gate` runs the rest anyway). The quick suite, a test of the pipeline whose random model never
answers, runs without the gate unless `--gate` asks for it.
"""

from __future__ import annotations

from typing import Any, Optional

from gcfamily.bench.findings import STAGE, paired_difference

REFERENCE = "grpo"
"""The reference RL method of the gate."""


def _slope(ys: list[tuple[int, float]]) -> Optional[float]:
    """Least-squares slope of (step, value) pairs, per 10 steps; None with fewer than 3 points."""
    if len(ys) < 3:
        return None
    n = len(ys)
    mx = sum(x for x, _ in ys) / n
    my = sum(y for _, y in ys) / n
    sxx = sum((x - mx) ** 2 for x, _ in ys)
    return 10.0 * sum((x - mx) * (y - my) for x, y in ys) / sxx if sxx > 0 else None


def _rewards(run: dict[str, Any]) -> dict[int, float]:
    return {
        int(r["step"]): float(r["reward/mean"])
        for r in run.get("per_step") or []
        if r.get("reward/mean") is not None and r.get("step") is not None
    }


def _flips(run: dict[str, Any], stage: dict[str, Any]) -> Optional[tuple[int, int, int]]:
    from gcfamily.bench.findings import _per_prompt

    a, b = _per_prompt(run, "accuracy"), _per_prompt(stage, "accuracy")
    if not a or not b:
        return None
    common = [k for k in a if k in b]
    up = sum(1 for k in common if a[k] >= 1 > b[k])
    down = sum(1 for k in common if b[k] >= 1 > a[k])
    return up, down, len(common)


def moved(results: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per stage-2 run (METHOD/seed-K): kl, flips (up, down, of n), pass1 change from pi_sft, reward slopes."""
    stage = results.get(STAGE)
    rewards = {k: _rewards(r) for k, r in results.items() if k != STAGE and r.get("returncode") == 0}
    out: dict[str, dict[str, Any]] = {}
    for key, mine in rewards.items():
        run = results[key]
        seed = key.rpartition("/")[2]
        others = [r for k, r in rewards.items() if k != key and k.endswith("/" + seed) and r]
        relative = [
            (t, y - sum(o[t] for o in others if t in o) / sum(1 for o in others if t in o))
            for t, y in sorted(mine.items())
            if any(t in o for o in others)
        ]
        row: dict[str, Any] = {
            "kl": run.get("kl_ref"),
            "flips": _flips(run, stage) if stage else None,
            "pass1": paired_difference([run], [stage], "pass1") if stage else None,
            "reward_slope": _slope(sorted(mine.items())),
            "reward_slope_vs_seed": _slope(relative) if others else None,
        }
        out[key] = row
    return out


def moved_table(rows: dict[str, dict[str, Any]]) -> str:
    """The "did it move" table of bench.md."""
    from gcfamily.bench.report import fmt

    lines = [
        "| run | KL to pi_sft | greedy flips vs pi_sft (up / down / prompts) | sampled pass@1 - pi_sft's [95%] (MDD) "
        "| reward slope per 10 steps | the same against the seed's other runs |",
        "|---|---|---|---|---|---|",
    ]
    for key, r in rows.items():
        f, d = r["flips"], r["pass1"]
        flips = f"{f[0]} / {f[1]} / {f[2]}" if f else "-"
        p1 = (
            f"{fmt(d['diff'], '+.3f')} [{fmt(d['lo'], '+.3f')}, {fmt(d['hi'], '+.3f')}] ({fmt(d.get('mdd'), '.3f')})"
            if d
            else "-"
        )
        lines.append(
            f"| {key} | {fmt(r['kl'], '.4f')} | {flips} | {p1} | {fmt(r['reward_slope'], '+.3f')} "
            f"| {fmt(r['reward_slope_vs_seed'], '+.3f')} |"
        )
    return "\n".join(lines) + "\n"


def gate(results: dict[str, dict[str, Any]], reference: str = REFERENCE) -> Optional[str]:
    """None when the reference RL method's seed-0 run moved sampled pass@1 from pi_sft by more than the difference's MDD
    (or when it or pi_sft is not measured); else the sentence saying it did not."""
    run, stage = results.get(f"{reference}/seed-0"), results.get(STAGE)
    if run is None or stage is None or run.get("returncode") != 0:
        return None
    d = paired_difference([run], [stage], "pass1") or paired_difference([run], [stage], "accuracy")
    if d is None or d.get("mdd") is None or abs(d["diff"]) > d["mdd"]:
        return None
    return (
        f"The reference RL method ({reference}, seed 0) moved sampled pass@1 from pi_sft by {d['diff']:+.3f} "
        f"[{d['lo']:+.3f}, {d['hi']:+.3f}], not more than that difference's MDD {d['mdd']:.3f}: at this design the "
        "methods cannot separate, so the suite stopped (bench.md has what was measured; --no-gate runs the rest anyway)."
    )
