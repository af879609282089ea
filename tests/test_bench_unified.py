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
    r = _gcf(
        "bench", "--suite", "unified", "--quick", "--methods", "sft", "--output-dir", str(tmp_path / "x"), cwd=tmp_path
    )
    assert (
        r.returncode == 2 and "--methods does not go with --suite unified" in r.stderr and "Traceback" not in r.stderr
    )
    from gcfamily.bench.unified import plans_of

    with pytest.raises(GcfError, match="names no run of the unified suite"):
        plans_of(tmp_path, True, 1, {"nosuch.lr": "1"}, None, None)


def test_curves_are_against_prompts_seen_when_every_method_takes_the_same_prompts_a_step() -> None:
    from gcfamily.bench.seeds import evaluation_points

    def run(accs: list[float]) -> dict:
        rows = [{"step": s, "budget/elapsed_s": 10.0 * s, "eval/accuracy": a} for s, a in zip((0, 6, 12), accs)]
        return {"per_step": rows}

    xs, ys = evaluation_points([run([0.4, 0.5, 0.6]), run([0.4, 0.3, 0.7])], prompts_per_step=4)
    assert xs == [0.0, 24.0, 48.0] and ys == [[0.4, 0.4], [0.5, 0.3], [0.6, 0.7]]
    assert evaluation_points([run([0.4, 0.5, 0.6])])[0] == [0.0, 60.0, 120.0]  # training seconds otherwise
