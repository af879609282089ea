"""What a comparison can detect (gcfamily/bench/power.py, core/stats.mdd): the MDD of a design, the variance components
it comes from, and `gcf bench --plan`."""

import json
import math

import numpy as np
import pytest
from click.testing import CliRunner

from gcfamily.bench import power
from gcfamily.bench.command import bench
from gcfamily.core.stats import detectable, mdd, seeds_bootstrap
from gcfamily.errors import GcfError

BENCH = power.__file__.rsplit("/gcfamily/", 1)[0] + "/docs/bench/unified/chained-12-steps/bench.json"


def test_mdd_is_2_80_standard_errors_at_80_percent_power():
    # z_0.975 = 1.959964, z_0.80 = 0.841621
    assert mdd(1.0) == pytest.approx(2.801585, abs=1e-6)
    assert mdd(0.01, confidence=0.9, power=0.5) == pytest.approx(0.01 * 1.644854, abs=1e-8)


def _simulate(rng, methods, S, P, sd_run, sd_pm, delta=0.0):
    """0/1 scores: prompt difficulty, a method x prompt effect, a shift per run, then a coin per prompt and seed."""
    base = rng.uniform(0.1, 0.9, P)
    out = {}
    for m in range(methods):
        pm = rng.normal(0, sd_pm, P) + (delta if m == 0 else 0.0)
        runs = []
        for _ in range(S):
            p = np.clip(base + pm + rng.normal(0, sd_run), 0, 1)
            runs.append((rng.random(P) < p).astype(float).tolist())
        out[f"m{m}"] = runs
    return out


def test_the_predicted_standard_error_matches_replications_of_the_design():
    """Components from one pilot predict the spread of the difference over 400 fresh replications of the design."""
    rng = np.random.default_rng(0)
    pilot = power.components(_simulate(rng, 4, 6, 300, sd_run=0.04, sd_pm=0.08))
    S, P = 3, 100
    diffs = []
    for _ in range(400):
        runs = _simulate(rng, 2, S, P, sd_run=0.04, sd_pm=0.08)
        diffs.append(np.mean(runs["m0"]) - np.mean(runs["m1"]))
    observed = float(np.std(diffs, ddof=1))
    assert pilot.se(S, P) == pytest.approx(observed, rel=0.2)
    assert pilot.run == pytest.approx(0.04**2, rel=0.6) and pilot.pm == pytest.approx(0.08**2, rel=0.5)


def test_the_bootstrap_reports_the_mdd_of_its_design():
    rng = np.random.default_rng(1)
    runs = _simulate(rng, 2, 3, 200, sd_run=0.03, sd_pm=0.05)
    d = seeds_bootstrap(runs["m0"], runs["m1"], n_boot=4000)
    assert d["mdd"] == pytest.approx(mdd(d["se"])) and 0 < d["se"] < (d["hi"] - d["lo"]) / 3.0
    assert d["se"] == pytest.approx((d["hi"] - d["lo"]) / (2 * 1.96), rel=0.15)  # a bootstrap close to normal


def test_detectable_tells_a_ruled_out_difference_from_an_undetectable_one():
    inside = {"significant": False, "lo": -0.05, "hi": 0.06, "mdd": 0.1}
    wide = {"significant": False, "lo": -0.08, "hi": 0.12, "mdd": 0.1}
    assert detectable(inside) == "no difference as large as the MDD 0.100"
    assert detectable(wide) == "inconclusive: could not have detected less than 0.100"
    assert detectable({**wide, "lo": 0.01}) == "significant"


def test_the_plan_of_the_unified_bench_reproduces_its_mdd():
    """docs/bench/unified/chained-12-steps/bench.json (7 methods x 3 seeds x 100 prompts): MDD 0.09-0.13 between two trained methods,
    as the variance components and the two-level bootstrap measured it."""
    c = power.components(power.scores(json.loads(open(BENCH).read())))
    assert (c.methods, c.seeds, c.prompts) == (7, 3, 100)
    assert 0.085 <= c.mdd(3, 100) <= 0.13
    assert c.mdd(6, 100) < c.mdd(3, 100) and c.mdd(3, 400) < c.mdd(3, 100)
    text = power.plan(BENCH, 0.05, max_prompts=205) + power.recorded_findings(BENCH)
    assert "this design (3 seeds, 100 prompts): MDD 0.09" in text and "seeds x" in text and " h of runs" in text
    found = [line for line in text.splitlines() if line.startswith("| (")]
    assert len(found) == 5 and all("MDD" in line or "not measured" in line for line in found)
    mdds = [float(line.split(" | ")[4]) for line in found[:3]]  # the bootstrap's MDD of findings 1-3
    assert all(0.09 <= m <= 0.14 for m in mdds), mdds


def test_gcf_bench_plan_and_a_suite_that_cannot_reach_its_target(tmp_path):
    res = CliRunner().invoke(bench, ["--plan", BENCH, "--target-mdd", "0.08"])
    assert res.exit_code == 0 and "designs reaching MDD <= 0.080" in res.output, res.output
    (tmp_path / "bench.json").write_text(open(BENCH).read())
    res = CliRunner().invoke(
        bench, ["--suite", "unified", "--out", str(tmp_path), "--seeds", "3", "--target-mdd", "0.05"]
    )
    assert res.exit_code != 0 and isinstance(res.exception, GcfError)
    assert "predicted to detect differences of 0.09" in str(res.exception) and "--seeds" in str(res.exception)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bench.json"]  # refused before any run
    with pytest.raises(GcfError, match="between 0 and 1"):
        power.plan(BENCH, 1.5)
    assert math.isfinite(power.components(power.scores(json.loads(open(BENCH).read()))).se(1, 1))


def test_a_plan_is_for_sampled_pass_at_1_where_the_runs_kept_it():
    rng = np.random.default_rng(2)
    greedy = _simulate(rng, 2, 2, 50, sd_run=0.03, sd_pm=0.05)
    results = {}
    for m, runs in greedy.items():
        for k, row in enumerate(runs):
            per = {"accuracy": {str(i): v for i, v in enumerate(row)}}
            if m == "m0" or k == 0:  # pass@1 kept by m0's two seeds and m1's first only: not enough for a plan
                per["pass1"] = {str(i): v / 4 for i, v in enumerate(rng.integers(0, 5, 50).tolist())}
            results[f"{m}/seed-{k}"] = {"per_prompt": per}
    figure, scores = power.compared({"results": results})
    assert figure == "greedy accuracy" and scores == greedy
    results["m1/seed-1"]["per_prompt"]["pass1"] = {str(i): 0.25 for i in range(50)}
    figure, scores = power.compared({"results": results})
    assert figure == "sampled pass@1" and scores["m1"][1] == [0.25] * 50
