"""Rewards as the ecosystem writes them (TRL's keyword call, None, conversational completions, several weighted
rewards) and a user reward that cannot take the run down (worker process: sys.exit, os._exit, a hang, a stop).

Oracles are computed in the test from the completions themselves (by hand, or from the batch's decoded
completions); the signal tests bound their subprocesses with generous timeouts, never a speed threshold.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gcfamily.config import Config
from gcfamily.errors import GcfError
from gcfamily.rewards import REWARDS, Rewards, Term, numeric_match, score

ROOT = Path(__file__).resolve().parents[1]
FAST = {"batch_size": 2, "group_size": 4, "max_new_tokens": 8, "micro_batch_size": 8, "progress": False}
SETS = [arg for k, v in FAST.items() for arg in ("--set", f"{k}={v}")]
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}

# TRL's quickstart reward, as its documentation writes it
QUICKSTART = """
def reward_len(completions, **kwargs):
    return [-abs(20 - len(c)) for c in completions]
"""

REWARDS_PY = """
import os, pathlib, sys, time

def chars(completions, **kwargs):
    return [float(len(c)) for c in completions]

def tokens(completions, completion_ids, **kwargs):
    return [float(len(ids)) for ids in completion_ids]

def conversational(prompts, completions, **kwargs):
    assert all(isinstance(p, list) for p in prompts), prompts
    return [float(len(completion[0]["content"])) for completion in completions]

def exits(completions, **kwargs):
    sys.exit(0)

def exits_on_odd(completions, **kwargs):
    if any(len(c) % 2 for c in completions):
        sys.exit(3)
    return [1.0] * len(completions)

def hard_exit(completions, **kwargs):
    os._exit(0)

def hangs(completions, **kwargs):
    pathlib.Path(os.environ["GCF_TEST_MARK"]).write_text(str(os.getpid()))
    time.sleep(3600)

def hangs_once(completions, **kwargs):
    mark = pathlib.Path(os.environ["GCF_TEST_MARK"])
    if not mark.exists():
        mark.write_text(str(os.getpid()))
        time.sleep(3600)
    return [1.0] * len(completions)
"""


@pytest.fixture
def rewards_py(tmp_path: Path) -> Path:
    path = tmp_path / "my_rewards.py"
    path.write_text(REWARDS_PY)
    return path


@pytest.fixture
def alarm():
    """A safety net, not a speed check: a call that never returns fails the test instead of hanging the suite."""

    def ring(*_):
        raise TimeoutError("the reward call never returned")

    old = signal.signal(signal.SIGALRM, ring)
    signal.alarm(300)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, old)


def _metrics(out: Path) -> list[dict]:
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x.strip()]


def _run_args(out: Path, *args: str) -> list[str]:
    return ["run", "--method", "grpo", "--model", "tiny", "--max-steps", "1", "--output-dir", str(out), *SETS, *args]


def _trainer(tmp_path: Path, **kw):
    from gcfamily.run.trainer import Trainer

    return Trainer(
        Config(method="grpo", model="tiny", task="arithmetic", output_dir=str(tmp_path / "trainer"), **{**FAST, **kw})
    )


def _alive(pid: int) -> bool:
    """A process that exists and is not a zombie."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, IndexError):
        return False


# --------------------------------------------------------------------------- the calling convention


def test_keyword_and_positional_functions_get_the_same_arguments():
    prompts, completions, ids = ["p1", "p2"], ["ab", "abcd"], [[5, 6, 2], [7, 2]]
    seen = {}

    def trl_style(prompts, completions, completion_ids, answer, **kwargs):
        seen["kwargs"] = sorted(kwargs)
        return [len(c) + 10 * len(i) + float(a) for c, i, a in zip(completions, completion_ids, answer)]

    def only_what_it_names(completions, answer):  # no **kwargs: passed only these two
        return [len(c) * float(a) for c, a in zip(completions, answer)]

    def old_style(p, c, **columns):  # positional, as gcfamily called rewards before
        return [len(x) + float(a) for x, a in zip(c, columns["answer"])]

    cols = {"answer": ["1", "2"], "level": ["easy", "hard"]}
    r, valid, _ = score(trl_style, prompts, completions, cols, completion_ids=ids)
    assert r.tolist() == [2 + 30 + 1, 4 + 20 + 2] and valid.all()  # len(c) + 10 len(ids) + answer, by hand
    assert seen["kwargs"] == ["level"]  # every other column arrives by name
    assert score(only_what_it_names, prompts, completions, cols, completion_ids=ids)[0].tolist() == [2.0, 8.0]
    assert score(old_style, prompts, completions, cols, completion_ids=ids)[0].tolist() == [3.0, 6.0]


def test_a_keyword_function_needing_a_missing_column_is_one_sentence():
    def needs_solution(completions, solution):
        return [1.0] * len(completions)

    with pytest.raises(
        GcfError, match=r"reward function 'needs_solution' needs an argument 'solution'.*columns: answer"
    ):
        score(needs_solution, ["p"], ["c"], {"answer": ["1"]})


def test_trl_quickstart_reward_runs_unchanged_through_gcf_run(gcf, tmp_path):
    path = tmp_path / "quickstart.py"
    path.write_text(QUICKSTART)
    code, _, err = gcf(*_run_args(tmp_path / "run", "--reward", f"{path}:reward_len"))
    assert code == 0, err
    [row] = _metrics(tmp_path / "run")
    assert row["reward/failed"] == 0
    # the same run's step-1 completions (same seed), scored by the formula here
    tr = _trainer(tmp_path, reward=f"{path}:reward_len")
    batch, _ = tr.method.data(0)
    tr.method.reward_fn.close()
    expected = [-abs(20 - len(c)) for c in batch.completions]
    assert batch.rewards.tolist() == expected and batch.valid.all()
    assert len(set(expected)) > 1  # the completions differ in length: the reward is not a constant
    assert row["reward/mean"] == pytest.approx(sum(expected) / len(expected), abs=1e-6)


def test_conversational_prompts_give_message_completions():
    prompts = [[{"role": "user", "content": "2+2?"}], "plain prompt", [{"role": "user", "content": "3+3?"}]]
    completions = ["four 4", "text", "6"]
    seen = []

    def reads_content(prompts, completions, **kwargs):
        seen.extend(completions)
        return [float(len(c[0]["content"])) if isinstance(c, list) else -1.0 for c in completions]

    r, valid, _ = score(reads_content, prompts, completions, {})
    assert seen == [[{"role": "assistant", "content": "four 4"}], "text", [{"role": "assistant", "content": "6"}]]
    assert r.tolist() == [6.0, -1.0, 1.0] and valid.all()
    # the built-ins read a message completion's text
    assert score(numeric_match, prompts, completions, {"answer": ["4", "1", "6"]})[0].tolist() == [1.0, 0.0, 1.0]
    assert score(REWARDS["exact"], prompts, completions, {"answer": ["4", "text", "6"]})[0].tolist() == [1.0, 1.0, 1.0]


def test_conversational_dataset_through_gcf_run(gcf, tmp_path, rewards_py):
    data = tmp_path / "chat.jsonl"
    rows = [{"prompt": [{"role": "user", "content": f"What is {a} + {a}?"}], "answer": str(2 * a)} for a in range(6)]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    code, _, err = gcf(*_run_args(tmp_path / "run", "--dataset", str(data), "--reward", f"{rewards_py}:conversational"))
    assert code == 0, err
    [row] = _metrics(tmp_path / "run")
    assert row["reward/failed"] == 0 and row["reward/mean"] > 0  # every sample read completion[0]["content"]


def test_none_means_no_reward_a_failed_sample():
    def sometimes(completions, **kwargs):
        return [None if c == "skip" else 2.0 for c in completions]

    r, valid, errors = score(sometimes, ["p"] * 3, ["a", "skip", "b"], {})
    assert valid.tolist() == [True, False, True] and r.tolist() == [2.0, 0.0, 2.0]
    assert errors == ["reward function 'sometimes' returned None on sample 1"]


# --------------------------------------------------------------------------- several rewards


def test_several_rewards_weighted_sum_by_hand():
    def a(completions, **kw):
        return [1.0, 2.0, 3.0]

    def b(completions, **kw):
        return [4.0, None, 8.0]  # sample 1 has no b reward: the sample fails, a's own figures keep it

    s = Rewards([Term("a", fn=a, weight=1.0), Term("b", fn=b, weight=0.5)]).score(["p"] * 3, ["x", "y", "z"])
    assert s.valid.tolist() == [True, False, True]
    assert s.rewards.tolist() == [1 + 0.5 * 4, 0.0, 3 + 0.5 * 8]
    assert s.failed_by == ["b"]
    stats = s.stats()
    assert stats["reward/a/mean"] == 2.0 and stats["reward/a/std"] == pytest.approx(math.sqrt(2 / 3))
    assert stats["reward/b/mean"] == 6.0 and stats["reward/b/std"] == 2.0


def test_several_rewards_with_weights_through_gcf_run(gcf, tmp_path, rewards_py):
    out = tmp_path / "run"
    code, _, err = gcf(
        *_run_args(
            out,
            "--reward",
            f"{rewards_py}:chars",
            "--reward",
            f"{rewards_py}:tokens",
            "--set",
            "reward_weights=[1,0.5]",
            "--max-steps",
            "2",
        )
    )
    assert code == 0, err
    for row in _metrics(out):
        a, b = row["reward/chars/mean"], row["reward/tokens/mean"]
        assert a != b and {"reward/chars/std", "reward/tokens/std"} <= row.keys()
        # every sample valid, so the mean of the weighted sum is the weighted sum of the means
        assert row["reward/failed"] == 0 and row["reward/mean"] == pytest.approx(1 * a + 0.5 * b, rel=1e-6)
    assert json.loads((out / "run_config.json").read_text())["reward"] == [
        f"{rewards_py}:chars",
        f"{rewards_py}:tokens",
    ]


def test_set_reward_list(gcf, tmp_path):
    out = tmp_path / "run"
    code, _, err = gcf(*_run_args(out, "--set", "reward=[numeric,exact]"))
    assert code == 0, err
    [row] = _metrics(out)
    assert {"reward/numeric/mean", "reward/exact/mean", "reward/numeric/std", "reward/exact/std"} <= row.keys()
    assert row["reward/mean"] == pytest.approx(row["reward/numeric/mean"] + row["reward/exact/mean"])


def test_reward_weights_length_mismatch_is_one_sentence(gcf, tmp_path):
    code, _, err = gcf(
        *_run_args(tmp_path / "run", "--set", "reward=[numeric,exact]", "--set", "reward_weights=[1,2,3]")
    )
    assert code == 2 and "Traceback" not in err
    assert err.strip().splitlines() == [
        "error: Invalid setting: reward_weights has 3 values for 2 reward(s); give one weight per reward."
    ]


# --------------------------------------------------------------------------- a reward cannot take the run down


def test_sys_exit_in_a_reward_fails_its_samples(tmp_path, rewards_py):
    tr = _trainer(tmp_path, reward=f"{rewards_py}:exits_on_odd")
    batch, stats = tr.method.data(0)
    tr.method.reward_fn.close()
    odd = [len(c) % 2 == 1 for c in batch.completions]
    assert any(odd) and not all(odd)  # both branches: samples that exited and samples that scored
    assert (~batch.valid).tolist() == odd
    assert stats["reward/failed"] == sum(odd)


def test_sys_exit_everywhere_stops_with_one_line_naming_the_function(gcf, tmp_path, rewards_py):
    code, _, err = gcf(*_run_args(tmp_path / "run", "--reward", f"{rewards_py}:exits"))
    assert code == 2 and "Traceback" not in err  # a stop, never exit 0
    assert (
        err.strip()
        .splitlines()[-1]
        .startswith(
            "error: reward function 'exits' failed on all 8 samples (first: reward function 'exits' raised SystemExit: 0 on sample 0)"
        )
    )


def test_os_exit_in_a_reward_is_a_stop_naming_the_function_not_a_clean_exit(tmp_path, rewards_py):
    cmd = [sys.executable, "-m", "gcfamily", *_run_args(tmp_path / "run", "--reward", f"{rewards_py}:hard_exit")]
    res = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=600)
    assert res.returncode == 2, res.stderr[-3000:]
    assert "Traceback" not in res.stderr
    assert (
        res.stderr.strip()
        .splitlines()[-1]
        .startswith(
            "error: reward function 'hard_exit' failed on all 8 samples (first: reward function 'hard_exit' "
            "ended the reward worker process with exit code 0"
        )
    ), res.stderr[-3000:]


def test_a_hanging_call_times_out_as_failed_and_the_next_call_gets_a_new_worker(
    tmp_path, rewards_py, monkeypatch, alarm
):
    monkeypatch.setenv("GCF_TEST_MARK", str(tmp_path / "mark"))
    rewards = Rewards.from_specs([f"{rewards_py}:hangs_once", "numeric"], timeout=2)
    try:
        first = rewards.score(["p"] * 3, ["1", "2", "3"], None, {"answer": ["1", "2", "3"]})
        assert first.valid.tolist() == [False] * 3
        assert first.errors[0] == "reward function 'hangs_once' did not return within reward_timeout=2 s on sample 0"
        hung = int((tmp_path / "mark").read_text())
        assert not _alive(hung)  # killed, not left running
        second = rewards.score(["p"] * 3, ["1", "2", "4"], None, {"answer": ["1", "2", "3"]})
        assert second.valid.all() and second.rewards.tolist() == [2.0, 2.0, 1.0]  # hangs_once 1 + numeric 1/1/0
        assert rewards.worker.starts == 2
    finally:
        rewards.close()


def test_reward_timeout_from_the_command_line(tmp_path, rewards_py):
    cmd = [
        sys.executable,
        "-m",
        "gcfamily",
        *_run_args(tmp_path / "run", "--reward", f"{rewards_py}:hangs", "--set", "reward_timeout=2"),
    ]
    res = subprocess.run(
        cmd, cwd=ROOT, env={**ENV, "GCF_TEST_MARK": str(tmp_path / "mark")}, capture_output=True, text=True, timeout=600
    )
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr[-3000:]
    assert "reward function 'hangs' did not return within reward_timeout=2 s" in res.stderr.strip().splitlines()[-1]


@pytest.mark.parametrize("sig, to_group", [(signal.SIGTERM, False), (signal.SIGINT, True)], ids=["sigterm", "ctrl-c"])
def test_a_stop_while_a_reward_hangs_saves_a_checkpoint(tmp_path, rewards_py, sig, to_group):
    """SIGTERM to the trainer, or Ctrl-C (SIGINT to the whole process group, as a terminal sends it)."""
    out, mark = tmp_path / "run", tmp_path / "mark"
    cmd = [
        sys.executable,
        "-m",
        "gcfamily",
        *_run_args(out, "--reward", f"{rewards_py}:hangs", "--set", "reward_timeout=3600", "--max-steps", "3"),
    ]
    proc = subprocess.Popen(
        cmd,
        cwd=ROOT,
        env={**ENV, "GCF_TEST_MARK": str(mark)},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 300
        while not mark.exists() and time.monotonic() < deadline:  # the reward is running (and will not return)
            assert proc.poll() is None, proc.communicate()
            time.sleep(0.2)
        assert mark.exists()
        time.sleep(0.5)  # the trainer is waiting on the reward
        os.killpg(proc.pid, sig) if to_group else proc.send_signal(sig)
        _, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    assert proc.returncode == 128 + sig, err[-3000:]
    assert "Traceback" not in err and f"Stopped by {sig.name} at step 1" in err.strip().splitlines()[-1], err[-3000:]
    assert (out / "checkpoints" / "step-1" / "COMPLETE").exists()
    assert not _alive(int(mark.read_text()))  # the hung worker went with the run
    [row] = _metrics(out)
    assert row["reward/failed"] == 8  # the abandoned call's samples, counted


# --------------------------------------------------------------------------- every sample failed, over all ranks

RANKED = """
import os
def by_rank(completions, **kwargs):
    failing = {failing!r}
    return [None] * len(completions) if os.environ["RANK"] in failing else [1.0] * len(completions)
"""


@pytest.mark.parametrize("failing", [("0",), ("0", "1")], ids=["one-rank-fails", "every-rank-fails"])
def test_every_sample_failed_is_decided_over_all_ranks(tmp_path, failing):
    path = tmp_path / "ranked.py"
    path.write_text(RANKED.format(failing=set(failing)))
    out = tmp_path / "run"
    cmd = [
        sys.executable,
        "-m",
        "gcfamily",
        *_run_args(out, "--reward", f"{path}:by_rank", "--nproc", "2", "--strategy", "ddp"),
    ]
    res = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=600, start_new_session=True)
    if len(failing) == 1:  # rank 0's 4 samples all fail, rank 1's score: the group takes the step
        assert res.returncode == 0, res.stderr[-4000:]
        [row] = _metrics(out)
        assert row["reward/failed"] == 4
    else:
        assert res.returncode == 2, res.stderr[-4000:]
        assert "reward function 'by_rank' failed on all 4 samples" in res.stderr.strip().splitlines()[-1]
