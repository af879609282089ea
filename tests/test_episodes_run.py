"""Runs on episodes, end to end on the tiny model: a single-turn environment trains bitwise as a run without one; every
on-policy method trains on multi-turn episodes from a user's environment file (CLI) and class (Python); an environment
that raises fails its episodes only; a method that does not sample refuses --env in one sentence."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import gcfamily as gcf
from gcfamily.envs import Environment, Step
from gcfamily.errors import GcfError

TINY = dict(model="tiny", max_steps=2, batch_size=2, group_size=2, max_new_tokens=6, progress=False, seed=3)

ENV_FILE = '''
from gcfamily.envs import Environment, Step

class Chatty(Environment):
    """Answers every turn until the third; a turn saying 'x' raises (its episode fails)."""
    role = "user"
    stop = tuple("aeiou")

    def __init__(self, row):
        super().__init__(row)
        self.n = 0

    def step(self, turn):
        self.n += 1
        if "x" in turn:
            raise ValueError("no x here")
        return Step("go on", 0.25, self.n >= 3)
'''


class OneTurn(Environment):
    """Done at once, no reward of its own: the run's reward scores the turn, as without an environment."""

    def step(self, turn: str) -> Step:
        return Step(done=True)


def _weights(run: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(run / "model.safetensors"))


def _rows(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def _vowels(completions, **_):
    return [float(sum(ch in "aeiou" for ch in c)) for c in completions]


def test_a_single_turn_environment_trains_bitwise_as_a_run_without_one(tmp_path):
    rows = [{"prompt": f"word {i}"} for i in range(8)]
    runs = [
        gcf.train(method="grpo", dataset=rows, reward=_vowels, output_dir=str(tmp_path / "a"), **TINY),
        gcf.train(method="grpo", dataset=rows, reward=_vowels, env=OneTurn, output_dir=str(tmp_path / "b"), **TINY),
    ]
    wa, wb = (_weights(r) for r in runs)
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    ra, rb = (_rows(r) for r in runs)
    assert all(r["reward/std"] > 0 and r["loss"] != 0 for r in ra)  # the steps moved the weights
    assert [r["loss"] for r in ra] == [r["loss"] for r in rb]
    assert all(r["episode/turns_mean"] == 1.0 and r["episode/env_tokens_mean"] == 0.0 for r in rb)


@pytest.mark.parametrize("method", ["grpo", "rft", "ppo", "grpo-ps", "online-dpo", "dr-grpo"])
def test_every_on_policy_method_trains_on_multi_turn_episodes_from_a_user_file(gcf, tmp_path, method):
    env = tmp_path / "chatty.py"
    env.write_text(ENV_FILE)
    out = tmp_path / "run"
    code, _, err = gcf(
        "run", "--method", method, "--model", "tiny", "--task", "arithmetic", "--env", f"{env}:Chatty",
        "--max-steps", "2", "--output-dir", str(out), "--seed", "1",
        "--set", "batch_size=2", "--set", "group_size=4", "--set", "max_new_tokens=5", "--set", "progress=false",
        "--set", "max_turns=3",
    )  # fmt: skip
    assert code == 0, err
    rows = _rows(out)
    assert max(r["episode/turns_mean"] for r in rows) > 1.0  # episodes of several turns did train
    assert all(r["episode/env_tokens_mean"] > 0 for r in rows if r["episode/turns_mean"] > 1.0)
    assert (out / "model.safetensors").is_file()


def test_a_pool_of_episodes_keeps_the_policy_mask_and_trains_again_from_its_file(gcf, tmp_path):
    env = tmp_path / "chatty.py"
    env.write_text(ENV_FILE)
    args = ["--method", "rft-offline", "--model", "tiny", "--task", "arithmetic", "--env", f"{env}:Chatty",
            "--max-steps", "1", "--set", "batch_size=2", "--set", "group_size=4", "--set", "max_new_tokens=5",
            "--set", "progress=false", "--set", "pool_prompts=4", "--set", "reward_threshold=-1"]  # fmt: skip
    code, _, err = gcf("run", *args, "--output-dir", str(tmp_path / "a"))
    assert code == 0, err
    pool = tmp_path / "a" / "pools" / "rft-offline.jsonl"
    lines = [json.loads(line) for line in pool.read_text().splitlines()[1:]]
    assert all(len(r["policy_mask"]) == len(r["completion_ids"]) for r in lines)
    assert any(0 in r["policy_mask"] for r in lines)  # episodes with the environment's tokens in them
    code, _, err = gcf("run", *args, "--set", f"pool={pool}", "--output-dir", str(tmp_path / "b"))
    assert code == 0, err
    assert (tmp_path / "b" / "pools" / "rft-offline.jsonl").read_text() == pool.read_text()


def test_an_environment_that_raises_fails_its_episodes_and_the_run_goes_on(gcf, tmp_path):
    env = tmp_path / "chatty.py"
    env.write_text(ENV_FILE.replace('if "x" in turn', 'if turn.endswith("e")'))
    out = tmp_path / "run"
    code, _, err = gcf(
        "run", "--method", "grpo", "--model", "tiny", "--task", "arithmetic", "--env", f"{env}:Chatty",
        "--max-steps", "3", "--output-dir", str(out), "--set", "batch_size=4", "--set", "group_size=4",
        "--set", "max_new_tokens=40", "--set", "progress=false",
    )  # fmt: skip
    assert code == 0, err
    rows = _rows(out)
    failed = sum(r["episode/failed"] for r in rows)
    assert failed > 0 and sum(r["reward/failed"] for r in rows) == failed  # counted, and nothing else failed
    assert "no x here" in err and "Traceback" not in err  # said once, as a failing reward is


def test_a_method_that_does_not_sample_refuses_an_environment(tmp_path):
    with pytest.raises(GcfError, match="makes each of the policy's samples an episode"):
        gcf.train(method="sft", env="calculator", output_dir=str(tmp_path / "r"), **TINY)


def test_a_task_can_be_a_users_class(gcf, tmp_path):
    f = tmp_path / "mytask.py"
    f.write_text(
        "from gcfamily.tasks import Task\n"
        "class Echo(Task):\n"
        "    name = 'echo'\n"
        "    def split_rows(self, split):\n"
        "        return [{'prompt': f'say {i}', 'completion': str(i), 'answer': str(i)} for i in range(10)]\n"
        "    def reward(self, prompts, completions, **cols):\n"
        "        return [float(a in c) for c, a in zip(completions, cols['answer'])]\n"
    )
    out = tmp_path / "run"
    code, _, err = gcf(
        "run", "--method", "grpo", "--model", "tiny", "--task", f"{f}:Echo", "--max-steps", "1",
        "--output-dir", str(out), "--set", "batch_size=2", "--set", "group_size=2", "--set", "max_new_tokens=4",
        "--set", "progress=false",
    )  # fmt: skip
    assert code == 0, err
    code, _, err = gcf("run", "--method", "grpo", "--model", "tiny", "--task", f"{f}:Nope", "--max-steps", "1",
              "--output-dir", str(tmp_path / "r2"))  # fmt: skip
    assert code != 0 and "not a subclass of gcfamily.tasks.Task" in err


def test_gcf_eval_plays_episodes_saves_their_turns_and_votes_over_them(gcf, tmp_path):
    save = tmp_path / "episodes.jsonl"
    code, out, err = gcf(
        "eval", "--model", "tiny", "--task", "guess", "--env", "guess", "--samples", "3", "--max-new-tokens", "4",
        "--max-turns", "2", "--maj-k", "2", "--save", str(save),
    )  # fmt: skip
    assert code == 0, err
    assert "held-out accuracy" in out and "maj@2" in out
    rows = [json.loads(line) for line in save.read_text().splitlines()]
    assert len(rows) == 3 and all(r["turns"][0]["role"] == "assistant" for r in rows)
    code, _, err = gcf("eval", "--model", "tiny", "--dataset", "rows.jsonl", "--reward", "numeric", "--env", "guess")
    assert code != 0 and "drop --dataset" in err
