"""`gcf eval` on your own rows: accuracy wherever the rows carry an `answer` (a correctness reward decides where there
is one; else a row is right when its total reward reaches 1), named for what it measured, or one sentence why there is
none; `--save FILE` writes every prompt, completion, reward and verdict as JSON lines (issue 50)."""

from __future__ import annotations

import json

import pytest

ROWS = [{"prompt": f"What is {i} + {i}?", "answer": "yes" if i % 3 == 0 else "no"} for i in range(7)]
RIGHT = sum(r["answer"] == "yes" for r in ROWS)  # 3 of 7: rows 0, 3, 6

# a user's reward that reads the `answer` column and not the completion: its verdict is known without the model
OWN = """
def verdict(completions, answer, **kw):
    return [1.0 if a == "yes" else 0.0 for a in answer]

def length(completions, **kw):
    return [float(len(c)) / 100 for c in completions]
"""


def _files(tmp_path, rows=ROWS):
    data, reward = tmp_path / "rows.jsonl", tmp_path / "my.py"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    reward.write_text(OWN)
    return data, reward


def _eval(gcf, data, *args):
    return gcf("eval", "--model", "tiny", "--dataset", str(data), "--split", "train", "--max-new-tokens", "3", *args)


def _lines(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_a_users_reward_on_rows_with_answers_gives_accuracy_and_save_writes_every_row(gcf, tmp_path):
    data, reward = _files(tmp_path)
    saved = tmp_path / "scored.jsonl"
    code, out, err = _eval(gcf, data, "--reward", f"{reward}:verdict", "--save", str(saved))
    assert code == 0, err
    assert f"accuracy {RIGHT / len(ROWS):.3f} ({RIGHT}/{len(ROWS)} rows whose total reward reached 1)" in out, out
    got = _lines(saved)
    assert [g["prompt"] for g in got] == [r["prompt"] for r in ROWS] and [g["index"] for g in got] == list(range(7))
    assert [g["correct"] for g in got] == [r["answer"] == "yes" for r in ROWS]  # both verdicts occur
    assert [g["reward"] for g in got] == [1.0 if r["answer"] == "yes" else 0.0 for r in ROWS]
    assert all(isinstance(g["completion"], str) for g in got)
    assert f"saved 7 prompts, completions, rewards and verdicts to {saved}" in out


def test_a_correctness_reward_decides_and_the_other_rewards_do_not(gcf, tmp_path):
    rows = [{"prompt": f"{i}+{i}=", "answer": str(10_000 + i)} for i in range(4)]  # no tiny completion says 10000+
    data, reward = _files(tmp_path, rows)
    saved = tmp_path / "s.jsonl"
    code, out, err = _eval(gcf, data, "--reward", "numeric", "--reward", f"{reward}:length", "--save", str(saved))
    assert code == 0, err
    assert "accuracy 0.000 (0/4 rows that numeric scored 1)" in out, out
    assert [g["correct"] for g in _lines(saved)] == [False] * 4


def test_rows_without_answers_and_no_correctness_reward_say_why_there_is_no_accuracy(gcf, tmp_path):
    data, reward = _files(tmp_path, [{"prompt": r["prompt"]} for r in ROWS])
    saved = tmp_path / "s.jsonl"
    code, out, err = _eval(gcf, data, "--reward", f"{reward}:length", "--save", str(saved))
    assert code == 0, err
    assert "accuracy" not in out.splitlines()[0] and "mean reward" in out.splitlines()[0], out
    assert "no accuracy: the rows carry no `answer` column and no reward is a correctness check" in out, out
    got = _lines(saved)
    assert len(got) == 7 and all(g["correct"] is None for g in got)
    assert [g["reward"] for g in got] == pytest.approx([len(g["completion"]) / 100 for g in got], rel=1e-6)  # float32


def test_save_on_a_task_and_into_a_missing_folder(gcf, tmp_path):
    saved = tmp_path / "task.jsonl"
    code, out, err = gcf("eval", "--model", "tiny", "--samples", "3", "--max-new-tokens", "2", "--save", str(saved))
    assert code == 0, err
    got = _lines(saved)
    right = sum(g["correct"] for g in got)
    assert len(got) == 3 and f"held-out accuracy {right / 3:.3f} ({right}/3)" in out
    assert all((g["reward"] >= 1) == g["correct"] for g in got)  # a task's verdict: its reward reached 1
    code, _, err = gcf("eval", "--model", "tiny", "--samples", "3", "--save", str(tmp_path / "nowhere" / "x.jsonl"))
    assert code == 2 and "its folder does not exist" in err and len(err.strip().splitlines()) == 1, err
