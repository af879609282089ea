"""`gcf bench --suite unified`: every method from one SFT model, the paper's findings with verdicts (quick, end to end)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from gcfamily.bench.findings import FINDINGS, STAGE, findings_table, verdict
from gcfamily.bench.unified import UNIFIED
from gcfamily.errors import GcfError


def _gcf(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "gcfamily", *args], cwd=cwd, capture_output=True, text=True, timeout=900
    )


def test_quick_unified_suite_end_to_end(tmp_path: Path) -> None:
    out = tmp_path / "u"
    r = _gcf("bench", "--suite", "unified", "--quick", "--output-dir", str(out), cwd=tmp_path)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    data = json.loads((out / "bench.json").read_text())
    runs = data["results"]
    methods = UNIFIED["quick"]["methods"]
    assert set(runs) == {STAGE, *(f"{m}/seed-0" for m in methods)}
    assert all(x["returncode"] == 0 and x["steps"] > 0 for x in runs.values())
    pi_sft = str((out / STAGE).resolve())
    assert all(data["settings"][f"{m}/seed-0"]["model"] == pi_sft for m in methods)  # stage 2 starts from pi_sft
    assert (
        data["settings"]["dpo/seed-0"]["pairs"] == "own-samples"
        and (out / "dpo/seed-0" / "pools" / "dpo-pairs.jsonl").is_file()
    )
    assert (out / "rft-offline/seed-0" / "pools" / "rft-offline.jsonl").is_file()
    # the same prompts a step for every method of stage 2, the same steps: the same prompts seen
    assert len({x["prompts_seen"] for k, x in runs.items() if k != STAGE}) == 1
    # pi_sft's final evaluation is every stage-2 run's first (copied, not recomputed), and every run's last evaluation is
    # its only one at its last step; Maj@K and Pass@K take the suite's K
    from gcfamily.run.logger import read_metrics

    stage_evals = [r for r in read_metrics(out / STAGE) if "eval/accuracy" in r]
    assert [r["step"] for r in stage_evals] == [0, runs[STAGE]["steps"]]
    for m in (f"{m}/seed-0" for m in methods):
        child = json.loads((out / m / "bench_child.json").read_text())
        assert (
            child["start_eval_from"] == str(out / STAGE)
            and child["sampled_k"] == UNIFIED["quick"]["measure"]["sample_k"]
        )
        assert runs[m]["accuracy_before"] == runs[STAGE]["accuracy_after"]
        first = next(json.loads(x) for x in (out / m / "eval_details.jsonl").read_text().splitlines() if x.strip())
        last = [json.loads(x) for x in (out / STAGE / "eval_details.jsonl").read_text().splitlines() if x.strip()][-1]
        assert first == {**last, "step": 0}
    md = (out / "bench.md").read_text()
    assert "## Findings" in md and md.count("| (") == len(FINDINGS)
    assert [f["finding"] for f in data["findings"]] == [f[0] for f in FINDINGS]
    # seed by seed, the control and the reference RL method first; sampled pass@1 kept per prompt; every stage-2 run
    # compared with the control and given its "did it move" line
    assert list(runs)[:3] == [STAGE, "sft/seed-0", "grpo/seed-0"]
    k = UNIFIED["quick"]["measure"]["sample_k"]
    assert all(v * k == round(v * k) for x in runs.values() for v in x["per_prompt"]["pass1"].values())
    assert len(runs[STAGE]["per_prompt"]["pass1"]) == UNIFIED["quick"]["measure"]["sample_prompts"]
    assert sorted(g["a"] for g in data["control_gains"]) == sorted(m for m in methods if m != "sft")
    assert set(data["moved"]) == {f"{m}/seed-0" for m in methods}
    assert "## Each method against the SFT control at the same step" in md and "## Did it move" in md
    assert all(f"| {m}/seed-0 | " in md for m in methods) and "Stopped by the gate" not in md
    # the same command again keeps every finished run
    again = _gcf("bench", "--suite", "unified", "--quick", "--output-dir", str(out), cwd=tmp_path)
    assert again.returncode == 0 and again.stdout.count("kept the finished run") == len(runs)
    assert "Wall time: stage 1 (pi_sft)" in (out / "bench.md").read_text()


def test_verdicts() -> None:
    def d(lo: float, hi: float) -> dict:
        return {"diff": (lo + hi) / 2, "lo": lo, "hi": hi, "p_value": 0.5, "mdd": 0.15}

    assert verdict(d(0.01, 0.2)) == "holds" and verdict(d(-0.2, -0.01)) == "reversed"
    assert verdict(d(-0.1, 0.1)) == "not significant; no difference as large as the MDD 0.150"
    assert verdict(d(-0.1, 0.2)) == "not significant; inconclusive: could not have detected less than 0.150"
    assert verdict(None) == "not measured"
    assert verdict(d(-0.1, 0.1), want_positive=False).startswith("holds")  # (4b): no significant Pass@K gain
    assert verdict(d(0.05, 0.1), want_positive=False).startswith("does not hold")
    table = findings_table(
        [
            {
                "finding": "(1) x",
                "a": "rft",
                "b": "rft-offline",
                "figure": "accuracy",
                "difference": d(0.01, 0.2),
                "verdict": "holds",
            }
        ]
    )
    assert "+0.105" in table and "[+0.010, +0.200]" in table and "holds" in table


def test_unified_refuses_what_it_decides_itself(tmp_path: Path) -> None:
    for args, says in (
        (["--baseline", "sft"], "--baseline does not go with --suite unified"),
        (["--methods", "sft,nosuch"], "--methods nosuch is not a method of the unified suite"),
        (["--budget", "time:60"], "--budget with --suite unified is steps:N"),
    ):
        r = _gcf("bench", "--suite", "unified", "--quick", *args, "--output-dir", str(tmp_path / "x"), cwd=tmp_path)
        lines = [x for x in r.stderr.splitlines() if x.strip()]
        assert r.returncode != 0 and len(lines) == 1 and says in lines[0], r.stderr
    assert not (tmp_path / "x").exists()
    from gcfamily.bench.unified import plans_of

    with pytest.raises(GcfError, match="names no run of the unified suite"):
        plans_of(tmp_path, True, 1, {"nosuch.lr": "1"}, None, None)


def test_a_subset_and_a_budget_of_steps(tmp_path: Path) -> None:
    from gcfamily.bench.unified import plans_of

    stage, plans = plans_of(tmp_path, True, 2, {}, None, None, ["rft", "grpo", "sft"], 5)
    assert list(plans) == [f"{m}/seed-{k}" for k in (0, 1) for m in ("sft", "grpo", "rft")]
    assert {p["settings"]["max_steps"] for p in plans.values()} == {5}
    assert stage["settings"]["max_steps"] == UNIFIED["quick"]["sft_stage"]["max_steps"]  # stage 1 keeps its own


def test_the_gate_stops_a_suite_whose_reference_did_not_move(tmp_path: Path) -> None:
    out = tmp_path / "g"
    r = _gcf(
        "bench", "--suite", "unified", "--quick", "--methods", "sft,grpo,rft", "--gate", "--output-dir", str(out),
        cwd=tmp_path,
    )  # fmt: skip
    lines = [x for x in r.stderr.splitlines() if x.strip()]
    assert r.returncode == 2 and len(lines) == 1 and "The reference RL method (grpo, seed 0) moved" in lines[0], (
        r.stderr
    )
    assert not (out / "rft").exists()  # stopped before the rest
    data = json.loads((out / "bench.json").read_text())
    assert set(data["results"]) == {STAGE, "sft/seed-0", "grpo/seed-0"} and data["header"]["stopped"]
    assert "Stopped by the gate" in (out / "bench.md").read_text()


def _record(pass1: list[float], greedy: list[float], rewards: list[float] | None = None) -> dict:
    return {
        "returncode": 0,
        "per_prompt": {
            "pass1": {str(i): v for i, v in enumerate(pass1)},
            "accuracy": {str(i): v for i, v in enumerate(greedy)},
        },
        "per_step": [{"step": s + 1, "reward/mean": v} for s, v in enumerate(rewards or [])],
        "kl_ref": 0.01,
    }


def test_gate_and_moved_from_records() -> None:
    from gcfamily.bench.moved import gate, moved

    n = 200
    base = [(i % 4) / 8 for i in range(n)]  # a spread of pass@1 over prompts
    greedy = [float(i % 2) for i in range(n)]
    still = {STAGE: _record(base, greedy), "grpo/seed-0": _record(base, greedy)}
    assert "not more than that difference's MDD" in gate(still)
    up = [min(1.0, v + 0.25) for v in base]
    flipped = [1.0 if i % 4 == 0 else g for i, g in enumerate(greedy)]  # 50 prompts wrong -> right
    rising = [0.1 * s for s in range(10)]
    flat = [0.2] * 10
    went = {
        STAGE: _record(base, greedy),
        "grpo/seed-0": _record(up, flipped, rising),
        "rft/seed-0": _record(base, greedy, flat),
    }
    assert gate(went) is None
    m = moved(went)
    assert m["grpo/seed-0"]["flips"] == (50, 0, n)
    assert m["grpo/seed-0"]["pass1"]["diff"] == pytest.approx(sum(up) / n - sum(base) / n)
    assert m["grpo/seed-0"]["reward_slope"] == pytest.approx(1.0)  # 0.1 a step: 1.0 per 10 steps
    assert m["grpo/seed-0"]["reward_slope_vs_seed"] == pytest.approx(1.0)  # the other run is flat
    assert m["rft/seed-0"]["reward_slope"] == pytest.approx(0.0) and m["rft/seed-0"][
        "reward_slope_vs_seed"
    ] == pytest.approx(-1.0)
    # a rise shared by every run of the seed (the prompt order) is no slope against the seed
    shared = {
        STAGE: _record(base, greedy),
        "a/seed-0": _record(base, greedy, rising),
        "b/seed-0": _record(base, greedy, rising),
    }
    assert moved(shared)["a/seed-0"]["reward_slope_vs_seed"] == pytest.approx(0.0)


def test_curves_are_against_prompts_seen_when_every_method_takes_the_same_prompts_a_step() -> None:
    from gcfamily.bench.seeds import evaluation_points

    def run(accs: list[float]) -> dict:
        rows = [{"step": s, "budget/elapsed_s": 10.0 * s, "eval/accuracy": a} for s, a in zip((0, 6, 12), accs)]
        return {"per_step": rows}

    xs, ys = evaluation_points([run([0.4, 0.5, 0.6]), run([0.4, 0.3, 0.7])], prompts_per_step=4)
    assert xs == [0.0, 24.0, 48.0] and ys == [[0.4, 0.4], [0.5, 0.3], [0.6, 0.7]]
    assert evaluation_points([run([0.4, 0.5, 0.6])])[0] == [0.0, 60.0, 120.0]  # training seconds otherwise
