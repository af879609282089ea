"""The built-in environments: the calculator's parser and evaluator (never eval), its calls in both formats; the
guessing game's reward over turns; reasoning-gym's task and environment with the gym's own scorer, and a run on it."""

from __future__ import annotations

import json

import pytest

from gcfamily.envs.calculator import Calculator, evaluate, find_call
from gcfamily.envs.guess import GuessNumber
from gcfamily.tasks import get_task


def test_the_calculator_evaluates_integer_arithmetic_and_refuses_anything_else():
    assert evaluate("((3 + 4) * 2) - 5") == 9  # (3 + 4) = 7, * 2 = 14, - 5 = 9
    assert evaluate("-7 // 2") == -4 and evaluate("+3") == 3
    for bad, why in [
        ("__import__('os')", "only integers"),
        ("2 ** 10", "only integers"),
        ("1.5 + 1", "only integers"),
        ("1 // 0", "division by zero"),
        ("9" * 31, "more than 30 digits"),
        ("1 +", "does not parse"),
        ("1+" * 150 + "1", "longer than 200"),
    ]:
        with pytest.raises(ValueError, match=why):
            evaluate(bad)


def test_a_call_is_read_in_the_plain_and_the_templates_format_and_its_answer_is_the_value():
    assert find_call("first <calc>2*3</calc>") == "2*3"
    hermes = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "7 - 10"}}\n</tool_call>'
    assert find_call("x " + hermes) == "7 - 10"
    assert find_call("<calc>1+1</calc> then " + hermes) == "7 - 10"  # the last call is the one answered
    assert find_call("Answer: 9") is None
    env = Calculator({"prompt": "p"})
    assert env.step("<calc>(3 + 4) * 2</calc>").observation == "14"
    assert env.step("<calc>2 ** 99</calc>").observation.startswith("error: only integers")
    assert env.step('<tool_call>{"name": "calculator"}</tool_call>').observation.startswith("error:")
    final = env.step("3 + 4 = 7\nAnswer: 7")
    assert final.done and env.reward() is None and env.calls == 3  # the task's reward scores the final turn


def test_the_guessing_game_rewards_finding_the_number_in_fewer_turns():
    env = GuessNumber({"answer": "12"})
    assert env.step("I guess 5").observation == "Higher."
    assert env.step("20").observation == "Lower."
    assert env.step("no idea").observation == "Say one number."
    assert env.step("12").done and env.reward() == pytest.approx(1 / 4)
    lost = GuessNumber({"answer": "3"})
    lost.step("9")
    assert lost.reward() == 0.0
    rows = get_task("guess", seed=1, max_value=8, copies=3).rows("train")
    assert {int(r["answer"]) for r in rows} <= set(range(1, 9)) and "from 1 to 8" in rows[0]["prompt"]


def test_reasoning_gym_rows_are_scored_by_the_gyms_own_verifier_single_and_multi_turn():
    pytest.importorskip("reasoning_gym")
    from gcfamily.envs.gym import ReasoningGymEnv

    task = get_task("reasoning-gym", seed=0, dataset="basic_arithmetic", size=20)
    row = task.rows("train")[0]
    entry = json.loads(row["entry"])
    assert row["prompt"].startswith(entry["question"]) and row["answer"] == str(entry["answer"])
    right, wrong = f"work\nAnswer: {entry['answer']}", "Answer: not a number"
    assert task.reward([row["prompt"]] * 2, [right, wrong], entry=[row["entry"]] * 2) == [1.0, 0.0]
    one = ReasoningGymEnv(row)
    assert one.step(wrong).done and one.reward() == 0.0
    two = ReasoningGymEnv(row, tries=2)
    again = two.step(wrong)
    assert not again.done and "not right" in again.observation
    assert two.step(right).done and two.reward() == 1.0


def test_a_reasoning_gym_task_trains_through_the_environment_from_the_command_line(gcf, tmp_path):
    pytest.importorskip("reasoning_gym")
    out = tmp_path / "run"
    code, _, err = gcf(
        "run", "--method", "grpo", "--model", "tiny", "--task", "reasoning-gym", "--env", "reasoning-gym",
        "--max-steps", "2", "--output-dir", str(out), "--set", "env_options={tries: 2}", "--set", "batch_size=2",
        "--set", "group_size=4", "--set", "max_new_tokens=30", "--set", "progress=false",
        "--set", "stop_strings=[a, e, i, o, u, ' ']",
    )  # fmt: skip
    assert code == 0, err
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert max(r["episode/turns_mean"] for r in rows) > 1.0  # wrong answers were told so and tried again
