"""`gcf bench` end to end on the tiny model, and the token / time budgets it stops runs on."""

import contextlib
import json

import pytest
from conftest import metrics_rows

from gcfamily.bench import DEFAULT_METHODS, SUITES, check_sets, default_methods, method_name, parse_budget, run_settings
from gcfamily.errors import GcfError
from gcfamily.methods import resolve
from gcfamily.run.trainer import Trainer

METHODS = ["sft", "grpo", "dpo"]  # one of each data source; every child pays a few seconds of imports


def test_quick_bench_writes_table_plots_and_json(gcf, tmp_path):
    out = tmp_path / "bench"
    code, stdout, stderr = gcf(
        "bench",
        "--quick",
        "--methods",
        ",".join(METHODS),
        "--budget",
        "steps:2",
        "--out",
        str(out),
        "--set",
        "eval_samples=8",
    )
    assert code == 0, stdout + stderr
    table = (out / "bench.md").read_text()
    rows = [line for line in table.splitlines() if line.startswith("| ") and not line.startswith("| method")]
    assert [r.split("|")[1].strip() for r in rows] == METHODS  # one row per method, none failed
    for png in ("reward.png", "accuracy.png", "gc.png"):
        assert (out / png).stat().st_size > 1000, png
    res = json.loads((out / "bench.json").read_text())["results"]
    for name in METHODS:
        r = res[name]
        assert r["returncode"] == 0 and r["steps"] == 2, name
        assert r["accuracy_before"] is not None and r["accuracy_after"] is not None  # eval_at_ends in every run
        assert r["kl_ref"] is not None and r["kl_ref"] >= 0  # k3 is never negative
        assert r["max_rss_mb"] > 0 and r["gc"]["tokens"] > 0
        assert sum(r["gc"]["hist"]["counts"]) == r["gc"]["tokens"]
    assert res["sft"]["gc"]["quantiles"]["p50"] == 1.0  # SFT: GC = 1 on every loss token
    assert res["sft"]["generated_tokens"] == 0 and res["grpo"]["generated_tokens"] > 0
    assert res["grpo"]["reward_final"] is not None and res["sft"]["reward_final"] is None
    for name in METHODS:  # a finished child keeps its final model, not its resumable checkpoints
        assert not (out / name / "checkpoints").exists() and (out / name / "config.json").is_file(), name
    # one evaluation before training for the suite: grpo and dpo take sft's, and it is what they would have computed
    assert res["sft"]["start_eval_from"] is None and res["grpo"]["start_eval_from"] == res["dpo"][
        "start_eval_from"
    ] == str(out / "sft")
    first = [start_details(out / name) for name in METHODS]
    assert first[0]["rows"] and first[1] == first[2] == first[0]
    alone = tmp_path / "alone"  # grpo first: it evaluates itself, and dpo takes grpo's
    code, stdout, stderr = gcf(
        "bench",
        "--quick",
        "--methods",
        "grpo,dpo",
        "--budget",
        "steps:1",
        "--out",
        str(alone),
        "--set",
        "eval_samples=8",
    )
    assert code == 0, stdout + stderr
    assert start_details(alone / "grpo") == first[1] and start_details(alone / "dpo") == first[2]

    def start_figures(folder):
        return [{k: v for k, v in r.items() if k.startswith("eval/")} for r in metrics_rows(folder) if r["step"] == 0]

    assert (
        start_figures(alone / "grpo") == start_figures(out / "grpo")
        and start_figures(out / "grpo")[0]["eval/accuracy"] is not None
    )
    # the same command again keeps every finished run instead of training it again
    code, stdout, stderr = gcf(
        "bench",
        "--quick",
        "--methods",
        ",".join(METHODS),
        "--budget",
        "steps:2",
        "--out",
        str(out),
        "--set",
        "eval_samples=8",
    )
    assert code == 0 and stdout.count("kept the finished run") == len(METHODS), stdout + stderr
    assert json.loads((out / "bench.json").read_text())["results"]["grpo"]["steps"] == 2


def test_a_finished_run_is_kept_however_its_folder_was_spelled(tmp_path, monkeypatch):
    from gcfamily.bench import finished_run

    monkeypatch.chdir(tmp_path)
    folder = tmp_path / "runs" / "b" / "sft"
    folder.mkdir(parents=True)
    spec = {"method_spec": "sft", "settings": {"lr": 1e-5, "output_dir": "runs/b/sft"}, "start_eval_from": "runs/b/rft"}
    (folder / "bench_spec.json").write_text(json.dumps(spec))
    (folder / "bench_proc.json").write_text(json.dumps({"returncode": 0, "wall_s": 1.0}))
    (folder / "bench_child.json").write_text("{}")
    absolute = {
        "method_spec": "sft",
        "settings": {"lr": 1e-5, "output_dir": str(folder)},
        "start_eval_from": str(tmp_path / "runs/b/rft"),
    }
    assert finished_run(folder, absolute) == {
        "returncode": 0,
        "wall_s": 1.0,
    }  # the same run, its path spelled otherwise
    assert (
        finished_run(folder, {**absolute, "settings": {"lr": 3e-5, "output_dir": str(folder)}}) is None
    )  # other settings: run again


def start_details(folder):
    """A run's per-prompt record of its evaluation before the first step."""
    return next(
        r
        for r in (json.loads(x) for x in (folder / "eval_details.jsonl").read_text().splitlines() if x.strip())
        if r["step"] == 0
    )


def test_start_key_shares_only_what_cannot_change_the_start():
    from gcfamily.bench import start_key

    base = {
        "model": "smollm2-135m",
        "task": "arithmetic",
        "seed": 0,
        "eval_samples": 500,
        "max_new_tokens": 16,
        "method": "sft",
        "lr": 2e-5,
    }
    same = {
        **base,
        "method": "grpo",
        "lr": 3e-6,
        "beta": 0.04,
        "group_size": 8,
        "seed": 2,
        "output_dir": "x",
        "max_time": 210,
    }
    assert start_key(same) == start_key(base)  # a pretrained model loads the same weights whatever the seed
    for change in (
        {"eval_samples": 64},
        {"max_new_tokens": 8},
        {"task_seed": 1},
        {"lora_r": 16},
        {"model": "tiny"},
        {"chat_format": "raw"},
    ):
        assert start_key({**base, **change}) != start_key(base), change
    tiny = {**base, "model": "tiny"}
    assert start_key({**tiny, "seed": 1}) != start_key(tiny)  # the seed initialises the tiny random model


def test_token_and_time_budgets_stop_the_trainer(gcf, tmp_path):
    out = tmp_path / "tokens"
    code, _, err = gcf(
        "run",
        "--method",
        "grpo",
        "--model",
        "tiny",
        "--max-steps",
        "50",
        "--output-dir",
        str(out),
        "--set",
        "max_tokens=300",
        "--set",
        "batch_size=2",
        "--set",
        "group_size=4",
        "--set",
        "max_new_tokens=8",
        "--set",
        "progress=false",
    )
    assert code == 0, err
    rows = metrics_rows(out)
    seen = [r["budget/tokens"] for r in rows]
    assert seen[-1] >= 300 and all(s < 300 for s in seen[:-1]) and len(rows) < 50  # stops on the first step past it
    for r in rows:  # generated (sampled completions) plus trained (loss tokens)
        assert r["tokens/generated"] > 0
    assert seen[0] == rows[0]["tokens/generated"] + rows[0]["tokens"]

    out = tmp_path / "flops"
    from gcfamily.models import tiny_model, tiny_tokenizer

    P = sum(p.numel() for p in tiny_model(len(tiny_tokenizer())).parameters())
    budget = 40 * 6 * P  # about a step's worth of loss tokens
    code, _, err = gcf(
        "run",
        "--method",
        "grpo",
        "--model",
        "tiny",
        "--max-steps",
        "50",
        "--output-dir",
        str(out),
        "--set",
        f"max_flops={budget}",
        "--set",
        "batch_size=2",
        "--set",
        "group_size=4",
        "--set",
        "max_new_tokens=8",
        "--set",
        "progress=false",
    )
    assert code == 0, err
    rows = [r for r in metrics_rows(out) if "loss" in r]
    flops = [r["budget/flops"] for r in rows]
    assert flops[-1] >= budget and all(f < budget for f in flops[:-1]) and len(rows) < 50
    assert flops[0] == P * (6 * rows[0]["tokens"] + 2 * rows[0]["tokens/generated"])

    out = tmp_path / "time"
    code, _, err = gcf(
        "run",
        "--method",
        "sft",
        "--model",
        "tiny",
        "--max-steps",
        "50",
        "--output-dir",
        str(out),
        "--set",
        "max_time=1e-9",
        "--set",
        "progress=false",
        "--eval",
    )
    assert code == 0, err
    rows = metrics_rows(out)
    assert [r["step"] for r in rows if "loss" in r] == [1]  # any step spends the budget
    assert rows[-1]["step"] == 1 and "eval/accuracy" in rows[-1]  # the final evaluation still runs


def test_eval_every_s_evaluates_each_time_the_training_clock_crosses_a_multiple(tmp_path, monkeypatch):
    """A fake clock: each step takes 3 s of training time; eval_every_s=7 evaluates after steps 3, 5 and 7
    (9, 15, 21 s), and the last step leaves its evaluation to eval_at_ends; rows are logged when evaluated."""
    import types

    import gcfamily.run.trainer as trainer_module

    ticks = iter(range(10**6))
    monkeypatch.setattr(trainer_module, "time", types.SimpleNamespace(perf_counter=lambda: float(next(ticks))))
    cfg = resolve(
        None,
        {
            "method": "sft",
            "model": "tiny",
            "task": "arithmetic",
            "max_steps": 8,
            "eval_every_s": 7,
            "eval_at_ends": True,
            "log_every": 100,
            "eval_samples": 4,
            "max_new_tokens": 4,
            "output_dir": str(tmp_path),
            "progress": False,
        },
    )
    Trainer(cfg).run()
    rows = metrics_rows(tmp_path)
    assert [r["step"] for r in rows if "loss" in r] == [3, 5, 7, 8]  # log_every=100: evaluated steps and the last
    assert [r["step"] for r in rows if "eval/accuracy" in r] == [0, 3, 5, 7, 8]
    assert [r["budget/elapsed_s"] for r in rows if "loss" in r] == [9.0, 15.0, 21.0, 24.0]


def test_every_method_of_the_zoo_gets_a_recipe_of_its_family(tmp_path):
    from gcfamily.bench import data_label, recipe
    from gcfamily.methods import all_methods

    for name in all_methods():
        for suite in SUITES.values():
            run_settings(suite, name, name, "tiny", "arithmetic", {"max_steps": 1}, {}, tmp_path)  # validates
    quick = SUITES["quick"]
    assert recipe(quick, "gspo", "gspo") == quick["methods"]["grpo"]  # on-policy: GRPO's shape, lr and KL weight
    assert recipe(quick, "orpo", "orpo")["lr"] == quick["methods"]["dpo"]["lr"] and "beta" not in recipe(
        quick, "orpo", "orpo"
    )
    assert [data_label(m) for m in ("sft", "grpo", "dpo", "kto")] == [
        "demonstrations",
        "own samples",
        "offline pairs",
        "labelled completions",
    ]


def test_default_suite_resolves_every_method():
    assert [method_name(m) for m in default_methods()] == list(
        DEFAULT_METHODS
    )  # ppo by module:Class until it is registered
    assert set(SUITES["default"]["methods"]) == set(SUITES["quick"]["methods"]) == set(DEFAULT_METHODS)


def test_budget_and_settings_errors(gcf, tmp_path):
    assert parse_budget("steps:5") == {"max_steps": 5}
    assert parse_budget("time:90") == {"max_time": 90.0, "max_steps": 10000}
    assert parse_budget("flops:1e15") == {"max_flops": 1e15, "max_steps": 10000}
    with pytest.raises(GcfError, match="steps:N, tokens:N, time:SECONDS or flops:N"):
        parse_budget("weeks:2")
    s = resolve(
        None,
        run_settings(
            SUITES["quick"],
            "grpo",
            "grpo",
            "tiny",
            "arithmetic",
            {"max_steps": 3},
            {"lr": "0.5", "dpo.beta": "0.3"},
            tmp_path,
        ),
    )
    assert s.lr == 0.5 and s.settings.beta == 0.04 and s.max_steps == 3  # METHOD.KEY only reaches that method
    # a plain KEY reaches the methods that have it: beta is GRPO's KL weight and DPO's temperature; SFT has none
    sets = {"beta": "0.2"}
    grpo, dpo, sft = (
        resolve(None, run_settings(SUITES["quick"], m, m, "tiny", "arithmetic", {"max_steps": 3}, sets, tmp_path))
        for m in ("grpo", "dpo", "sft")
    )
    assert grpo.settings.beta == 0.2 and dpo.settings.beta == 0.2 and "beta" not in sft.method_options
    with pytest.raises(GcfError, match="no method of this suite"):
        check_sets({"kl_estimator": "k1"}, ["sft", "dpo"])
    check_sets({"kl_estimator": "k1"}, ["sft", "grpo"])
    code, _, err = gcf("bench", "--quick", "--budget", "weeks:2", "--out", str(tmp_path / "b"))
    assert code == 2 and "--budget 'weeks:2'" in err
    code, _, err = gcf("bench", "--quick", "--methods", "sft,nope", "--out", str(tmp_path / "b"))
    assert code == 2 and "Unknown method 'nope'" in err
    code, _, err = gcf("bench", "--quick", "--methods", "sft", "--set", "bogus=1", "--out", str(tmp_path / "b"))
    assert code == 2 and "Unknown setting 'bogus'" in err


def test_sigterm_to_bench_stops_the_running_method_at_a_checkpoint(tmp_path):
    """SIGTERM to `gcf bench` reaches the running method, which saves a checkpoint; bench waits for it,
    says so in one line and exits 143, and leaves no run behind it."""
    import os
    import signal
    import subprocess
    import sys
    import time
    from pathlib import Path

    out = tmp_path / "bench"
    cmd = [
        sys.executable,
        "-m",
        "gcfamily",
        "bench",
        "--quick",
        "--methods",
        "sft,rft",
        "--budget",
        "steps:100000",
        "--out",
        str(out),
    ]
    proc = subprocess.Popen(
        cmd,
        cwd=Path(__file__).resolve().parents[1],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    metrics = out / "sft" / "metrics.jsonl"
    # wait for the method to be training (its stop handler installed), however long a loaded machine takes to get
    # there: sending SIGTERM earlier, as a fixed deadline did, raced the child's start; the limit only guards a hang
    deadline = time.monotonic() + 1800
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 3):
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "the sft run logged no 3 steps in 30 minutes"
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=1800)
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert "Traceback" not in err and err.strip().splitlines()[-1].startswith(
        "error: Stopped by SIGTERM while sft was running"
    ), err
    assert list((out / "sft" / "checkpoints").glob("step-*/COMPLETE")), "the method did not stop at a checkpoint"
    assert (
        not (out / "sft" / "bench_proc.json").exists() and not (out / "rft").exists()
    )  # the same command runs sft again, then rft


def test_seeds_give_intervals_paired_differences_and_the_same_heldout_prompts(gcf, tmp_path):
    from gcfamily.bench.seeds import heldout, prompts_of

    out = tmp_path / "b"
    code, stdout, stderr = gcf(
        "bench",
        "--quick",
        "--methods",
        "sft,grpo",
        "--budget",
        "steps:2",
        "--seeds",
        "2",
        "--baseline",
        "sft",
        "--output-dir",
        str(out),
        "--set",
        "eval_samples=6",
        "--set",
        "max_new_tokens=4",
        "--set",
        "group_size=2",
    )
    assert code == 0, stderr
    folders = [out / m / f"seed-{k}" for m in ("sft", "grpo") for k in (0, 1)]
    prompts = [prompts_of(f) for f in folders]
    assert prompts[0] and all(p == prompts[0] for p in prompts)  # every method and seed: the same held-out prompts
    assert [json.loads((f / "run_config.json").read_text())["seed"] for f in folders] == [0, 1, 0, 1]
    assert all(len(heldout(f)) == 6 for f in folders)
    md = (out / "bench.md").read_text()
    assert (
        "2 seed(s)" in md
        and "vs sft (bootstrap over prompts and seeds, 95%)" in md
        and "| sft | demonstrations | 2 |" in md
        and "baseline" in md
    )
    grpo_row = next(line for line in md.splitlines() if line.startswith("| grpo |"))
    assert "significant" in grpo_row and "(n=12)" in grpo_row
    assert (
        (out / "accuracy_bands.png").is_file()
        and (out / "reward_bands.png").is_file()
        and (out / "frontier.png").is_file()
    )
    code, _, err = gcf("bench", "--quick", "--methods", "sft", "--baseline", "dpo", "--output-dir", str(tmp_path / "c"))
    assert code == 2 and "--baseline dpo is not one of the suite's methods" in err


def test_sweep_chooses_the_value_with_the_best_mean_over_seeds(monkeypatch, tmp_path):
    import gcfamily.bench.sweep as bs

    val = {
        ("1e-3", 0): 0.9,
        ("1e-3", 1): 0.1,
        ("3e-3", 0): 0.6,
        ("3e-3", 1): 0.6,
    }  # seed 0 alone favours 1e-3, the mean 3e-3
    folders = {(v, k): str(tmp_path / "m" / f"lr={v}" / f"seed-{k}") for v, k in val}
    monkeypatch.setattr(
        bs, "final_validation", lambda folder: next(x for key, x in val.items() if folders[key] == str(folder))
    )
    read = []
    monkeypatch.setattr(
        bs, "heldout_of", lambda folder, settings: read.append(folder) or (0.4 if folder is None else 0.7)
    )
    runs = [{"folder": folders[key], "returncode": 0} for key in val]  # values in the order given, seeds within
    plans = {f: {"settings": {"output_dir": f}} for f in folders.values()}
    header = {"model": "tiny", "task": "arithmetic", "budget": "steps:1", "machine": "m", "date": "d", "total_s": 1.0}
    bs.write_sweep(("lr", ["1e-3", "3e-3"]), {"m": runs}, plans, 2, header, tmp_path)
    assert [r["val_mean"] for r in runs] == [0.5, 0.5, 0.6, 0.6] and [r["chosen"] for r in runs] == [
        False,
        False,
        True,
        True,
    ]
    assert read[1:] == [
        tmp_path / "m" / "lr=3e-3" / f"seed-{k}" for k in (0, 1)
    ]  # the test split: the base model, the chosen runs
    assert "| m | 0.500 | 0.600 | 3e-3 | 0.400 | 0.700 [0.700, 0.700] |" in (tmp_path / "bench.md").read_text()
    # a failed seed's last validation is not its final one: its value has no mean and is not chosen
    runs = [{**r, "returncode": 1 if r["folder"] == folders[("3e-3", 1)] else 0} for r in runs]
    bs.write_sweep(("lr", ["1e-3", "3e-3"]), {"m": runs}, plans, 2, header, tmp_path)
    assert [r["val_mean"] for r in runs] == [0.5, 0.5, None, None] and [r["chosen"] for r in runs] == [
        True,
        True,
        False,
        False,
    ]


def test_paired_difference_resamples_seeds_pairs_by_prompt_text_and_skips_failed_runs(tmp_path):
    from gcfamily.bench.seeds import paired, seeds_table

    def run(name, correct, prompts=None, returncode=0, seed=0):
        folder = tmp_path / name
        folder.mkdir()
        rows = [
            {
                "index": i,
                "prompt": (prompts or [f"q{j}" for j in range(len(correct))])[i],
                "completion": "",
                "reward": float(c),
            }
            for i, c in enumerate(correct)
        ]
        (folder / "eval_details.jsonl").write_text(
            json.dumps({"step": 0, "rows": rows}) + "\n" + json.dumps({"step": 5, "rows": rows}) + "\n"
        )
        return {
            "folder": str(folder),
            "returncode": returncode,
            "seed": seed,
            "data": "d",
            "accuracy_after": sum(correct) / len(correct),
        }

    n = 200
    base = [run(f"b{s}", [i % 10 < 6 for i in range(n)], seed=s) for s in range(3)]
    meth = [run(f"m{s}", [(i * 7 + s) % 10 < k for i in range(n)], seed=s) for s, k in enumerate((9, 5, 7))]
    c = paired(meth, base)
    assert c["diff"] == pytest.approx(0.1) and c["seeds"] == (3, 3) and c["n"] == n
    assert (
        c["lo"] < 0 < c["hi"] and not c["significant"]
    )  # one seed below the baseline: the seeds' spread is in the interval
    # a failed run is left out, not paired: the two good seeds (0.9, 0.7) are both above the baseline
    failed = [meth[0], {**meth[1], "returncode": 1}, meth[2]]
    assert paired(failed, base)["seeds"] == (2, 3) and paired(failed, base)["diff"] == pytest.approx(0.2)
    # runs that answered other prompts at the same positions are not paired on them
    other = [run("o0", [1] * n, prompts=[f"other{j}" for j in range(n)])]
    assert paired(other, base) is None
    header = {
        "model": "m",
        "task": "t",
        "budget": "b",
        "machine": "x",
        "load_start": 0,
        "load_end": 0,
        "date": "d",
        "total_s": 1,
    }
    md = seeds_table({"base": base, "meth": failed}, header, "base")
    row = next(line for line in md.splitlines() if line.startswith("| meth |"))
    assert "| 2 (1 failed) |" in row and "+0.200 [" in row


def test_accuracy_bands_align_seeds_by_evaluation_not_by_step():
    from gcfamily.bench.seeds import evaluation_points

    def run(evals):  # (step, training seconds, accuracy); the end evaluation is logged on a row of its own
        rows = [{"step": 0, "eval/accuracy": evals[0][2]}]
        for step, secs, acc in evals[1:]:
            rows += [{"step": step, "budget/elapsed_s": secs}, {"step": step, "eval/accuracy": acc}]
        return {"per_step": rows}

    xs, ys = evaluation_points(
        [run([(0, 0, 0.4), (11, 106.0, 0.5), (22, 212.0, 0.6)]), run([(0, 0, 0.4), (13, 110.0, 0.7), (25, 214.0, 0.8)])]
    )
    assert xs == [0.0, 108.0, 213.0] and ys == [[0.4, 0.4], [0.5, 0.7], [0.6, 0.8]]
    xs, ys = evaluation_points(
        [run([(0, 0, 0.4), (22, 212.0, 0.6)]), run([(0, 0, 0.4), (13, 110.0, 0.7), (25, 214.0, 0.8)])]
    )
    assert xs == [0.0, 213.0] and ys == [[0.4, 0.4], [0.6, 0.8]]  # a seed without the middle evaluation: first and last


def test_several_tasks_run_one_suite_each_and_presets_carry_their_options(gcf, tmp_path):
    out = tmp_path / "b"
    code, _, err = gcf(
        "bench",
        "--quick",
        "--methods",
        "sft",
        "--task",
        "arithmetic,sorting-short",
        "--budget",
        "steps:1",
        "--output-dir",
        str(out),
        "--set",
        "eval_samples=2",
        "--set",
        "max_new_tokens=2",
        "--set",
        "group_size=2",
    )
    assert code == 0, err
    assert (out / "arithmetic" / "bench.md").is_file() and (out / "sorting-short" / "bench.md").is_file()
    cfg = json.loads((out / "sorting-short" / "sft" / "run_config.json").read_text())
    assert cfg["task"] == "sorting" and cfg["task_options"] == {"min_len": 2, "max_len": 3}


def test_bench_on_a_users_dataset_runs_the_methods_its_format_feeds(gcf, tmp_path):
    train, held = tmp_path / "train.jsonl", tmp_path / "held.jsonl"
    train.write_text(
        "".join(
            json.dumps({"prompt": f"What is {a} + {b}?", "completion": str(a + b), "answer": str(a + b)}) + "\n"
            for a in range(6)
            for b in range(6)
        )
    )
    held.write_text(
        "".join(
            json.dumps({"prompt": f"What is {a} + {b}?", "answer": str(a + b)}) + "\n"
            for a in (7, 8)
            for b in (7, 8, 9)
        )
    )
    out = tmp_path / "b"
    code, stdout, err = gcf(
        "bench",
        "--quick",
        "--methods",
        "sft,grpo,dpo",
        "--budget",
        "steps:1",
        "--dataset",
        str(train),
        "--eval-dataset",
        str(held),
        "--reward",
        "numeric",
        "--output-dir",
        str(out),
        "--set",
        "max_new_tokens=2",
        "--set",
        "group_size=2",
    )
    assert code == 0, stdout + err
    assert (
        "dpo: left out: it trains on preference (prompt, chosen, rejected" in stdout
        and "prompt-completion (prompt, completion)" in stdout
    )
    res = json.loads((out / "bench.json").read_text())
    assert sorted(res["results"]) == ["grpo", "sft"] and res["header"]["task"] == "train"
    for name in ("sft", "grpo"):
        r = res["results"][name]
        cfg = json.loads((out / name / "run_config.json").read_text())
        assert cfg["task"] is None and cfg["dataset"] == str(train) and cfg["reward"] == ["numeric"]
        assert r["returncode"] == 0 and r["heldout_figure"] == "eval/accuracy" and r["accuracy_before"] is not None
        assert r["kl_ref"] is not None and r["pass_at_1"] is not None  # on the eval rows, scored by --reward
    assert [row["prompt"] for row in start_details(out / "grpo")["rows"]] == [
        f"What is {a} + {b}?" for a in (7, 8) for b in (7, 8, 9)
    ]
    for args, msg in [((), "--dataset needs --reward"), (("--reward", "numeric"), "--dataset needs --eval-dataset")]:
        code, _, err = gcf("bench", "--quick", "--dataset", str(train), *args, "--output-dir", str(tmp_path / "c"))
        assert code == 2 and msg in err and len(err.strip().splitlines()) == 1, err
    code, _, err = gcf(
        "bench",
        "--quick",
        "--methods",
        "dpo",
        "--dataset",
        str(train),
        "--eval-dataset",
        str(held),
        "--reward",
        "numeric",
        "--output-dir",
        str(tmp_path / "d"),
    )
    assert code == 2 and "No method of the suite can train on prompt-completion" in err, err
    code, _, err = gcf("bench", "--quick", "--reward", "numeric", "--output-dir", str(tmp_path / "e"))
    assert code == 2 and "--eval-dataset and --reward go with --dataset" in err, err


def test_gcf_eval_types_task_options(gcf):
    code, out, err = gcf(
        "eval",
        "--model",
        "tiny",
        "--task",
        "sorting",
        "--samples",
        "2",
        "--max-new-tokens",
        "2",
        "--device",
        "cpu",
        "--set",
        "min_len=2",
        "--set",
        "max_len=3",
    )
    assert code == 0 and "held-out accuracy" in out, err
    code, out, err = gcf("eval", "--model", "tiny", "--task", "sorting", "--samples", "2", "--set", "min_len=two")
    assert (
        code == 2
        and err.startswith("error: task 'sorting' cannot take the options")
        and len(err.strip().splitlines()) == 1
    ), err


def test_sweep_chooses_on_validation_rows_and_never_reads_the_test_split(gcf, tmp_path):
    from gcfamily.bench.seeds import prompts_of
    from gcfamily.bench.sweep import choose, parse_sweep
    from gcfamily.tasks import get_task

    assert parse_sweep("lr=1e-6, 3e-6") == ("lr", ["1e-6", "3e-6"])
    with pytest.raises(GcfError, match="at least two values"):
        parse_sweep("lr=1e-6")
    assert choose(["a", "b", "c"], [0.5, 0.7, 0.7]) == 1 and choose(["a"], [None]) is None
    out = tmp_path / "s"
    code, _, err = gcf(
        "bench",
        "--quick",
        "--methods",
        "sft",
        "--budget",
        "steps:1",
        "--sweep",
        "lr=1e-3,3e-3",
        "--output-dir",
        str(out),
        "--set",
        "eval_samples=5",
        "--set",
        "max_new_tokens=2",
    )
    assert code == 0, err
    task = get_task("arithmetic", seed=0)
    test = {r["prompt"] for r in task.rows("test")}
    validation = [r["prompt"] for r in task.rows("train")[-5:]]
    for v in ("1e-3", "3e-3"):
        folder = out / "sft" / f"lr={v}"
        assert (
            prompts_of(folder) == validation and not set(prompts_of(folder)) & test
        )  # the run evaluated validation rows only
        assert all("eval/accuracy" not in r for r in metrics_rows(folder))
    md = (out / "bench.md").read_text()
    assert "| sft | " in md and "chosen lr" in md and "after, at the chosen" in md


def test_sweep_with_seeds_chooses_on_the_mean_validation_and_reads_the_test_split_for_the_chosen_value_only(
    gcf, tmp_path
):
    from gcfamily.bench.seeds import prompts_of
    from gcfamily.tasks import get_task

    out = tmp_path / "s"
    code, _, err = gcf(
        "bench",
        "--quick",
        "--methods",
        "sft,grpo",
        "--budget",
        "steps:1",
        "--sweep",
        "lr=1e-3,3e-2",
        "--seeds",
        "2",
        "--output-dir",
        str(out),
        "--set",
        "eval_samples=5",
        "--set",
        "max_new_tokens=2",
        "--set",
        "group_size=2",
    )
    assert code == 0, err
    test = {r["prompt"] for r in get_task("arithmetic", seed=0).rows("test")}
    res = json.loads((out / "bench.json").read_text())["results"]
    for m in ("sft", "grpo"):
        runs = {v: [res[f"{m}/lr={v}/seed-{k}"] for k in (0, 1)] for v in ("1e-3", "3e-2")}
        means = {v: sum(r["val_accuracy"] for r in rs) / 2 for v, rs in runs.items()}
        chosen = "1e-3" if means["1e-3"] >= means["3e-2"] else "3e-2"  # ties: the first value given
        for v, rs in runs.items():
            for r in rs:
                assert r["val_mean"] == means[v] and r["chosen"] == (v == chosen)
                assert (r.get("heldout_after") is not None) == (
                    v == chosen
                )  # the test split, for the chosen value's runs only
                assert not set(prompts_of(out / m / f"lr={v}" / r["folder"].rsplit("/", 1)[1])) & test
        assert [
            json.loads((out / m / f"lr={chosen}" / f"seed-{k}" / "run_config.json").read_text())["seed"] for k in (0, 1)
        ] == [0, 1]
    md = (out / "bench.md").read_text()
    assert "--sweep lr --seeds 2" in md and "(mean [95% CI over seeds])" in md and "averaged over the seeds" in md


def test_validation_rows_never_train(tmp_path):
    from gcfamily.config import Config

    tr = Trainer(
        Config(
            method="sft",
            model="tiny",
            task="arithmetic",
            output_dir=str(tmp_path / "r"),
            validation_rows=10,
            progress=False,
        )
    )
    held = {r["prompt"] for r in tr.evaluation.validation_rows()}
    assert len(held) == 10 and not held & {r["prompt"] for r in tr.evaluation.training_rows()}
    tr.folder.lock.release()


def test_kl_to_reference_is_k3_over_the_sampled_tokens(monkeypatch):
    """The bench's KL: mean over the sampled tokens of exp(d) - 1 - d, d = log pi_ref - log pi, equal to the same figure
    from plain, unpacked forwards of both models over each row (an oracle sharing no code with the engine)."""
    from types import SimpleNamespace

    import torch

    from gcfamily.bench import child as bench_child
    from gcfamily.data.encoding import Formatter
    from gcfamily.models import tiny_model, tiny_tokenizer
    from gcfamily.rollout import SamplingSettings, generate
    from gcfamily.tasks import get_task

    tok = tiny_tokenizer()
    policy, ref = tiny_model(len(tok), seed=1).eval(), tiny_model(len(tok), seed=2).eval()
    monkeypatch.setattr("gcfamily.models.load_model", lambda *a, **k: (ref, tok))
    task, fmt = get_task("arithmetic", seed=0), Formatter(tok)
    cfg = SimpleNamespace(
        seed=0,
        max_new_tokens=6,
        model="tiny",
        trust_remote_code=False,
        validation_rows=0,
        micro_batch_size=4,
        chunk_size=256,
        share_prefix=True,
    )
    trainer = SimpleNamespace(
        cfg=cfg,
        method=SimpleNamespace(trains_policy=True),
        task=task,
        tokenizer=tok,
        formatter=fmt,
        unwrapped_policy=lambda: policy,
        dtype=torch.float32,
        device="cpu",
        dist=None,
        autocast=contextlib.nullcontext,
    )
    from gcfamily.core.engine import batch_logprobs

    def logprobs(model, batch):  # noqa: ANN001, ANN202  (the run's no-grad pass, as RunServices makes it)
        return batch_logprobs(
            model, batch, 1.0, cfg.micro_batch_size, cfg.chunk_size, cfg.share_prefix, torch.device("cpu")
        )

    trainer.services = SimpleNamespace(logprobs=logprobs)
    got = bench_child.kl_to_reference(trainer, 5)
    rows = task.heldout_rows(5)
    ro = generate(
        policy,
        tok,
        [fmt.prompt_ids(r["prompt"]) for r in rows],
        1,
        SamplingSettings(temperature=1.0, max_new_tokens=6),
        torch.Generator().manual_seed(cfg.seed + 1),
    )
    ds = []
    with torch.no_grad():
        for ids, am, cm in zip(ro.input_ids, ro.attention_mask, ro.completion_mask):
            keep = am.bool()
            x, on = ids[keep][None], cm[keep].bool()
            lp = {}
            for name, m in (("pi", policy), ("ref", ref)):
                logp = m(input_ids=x).logits[0, :-1].double().log_softmax(-1).gather(-1, x[0, 1:, None])[:, 0]
                lp[name] = logp[on[1:]]
            ds.append(lp["ref"] - lp["pi"])
    d = torch.cat(ds)
    assert d.numel() > 5 and d.abs().max() > 0.01  # two different models, several tokens
    assert got == pytest.approx(float((torch.expm1(d) - d).mean()), rel=1e-4)
    # float32: the samples' own log-probs stand for pi, so pi_ref alone scores them; in a narrower compute dtype both
    # models score them through the same pass (their roundings would not cancel otherwise)
    scored = []
    trainer.services.logprobs = lambda model, batch: scored.append(model) or logprobs(model, batch)
    for compute, models in ((torch.float32, [ref]), (torch.bfloat16, [policy, ref])):
        scored.clear()
        trainer.precision = SimpleNamespace(compute=compute)
        assert bench_child.kl_to_reference(trainer, 5) == pytest.approx(
            got, rel=1e-4
        )  # autocast is off here: float32 either way
        assert scored == models
