"""The chained task: hand-worked rows, a stable disjoint split, the outcome reward, the process reward (end, score)."""

import json
import re

import pytest
from conftest import metrics_rows
from hypothesis import given, settings
from hypothesis import strategies as st

from gcfamily.errors import GcfError
from gcfamily.rewards import score
from gcfamily.tasks import TASKS, ChainedTask, chained_process_reward, chained_reward, get_task, task_options

# ((3 + 4) * 2) - 5, worked by hand: 3 + 4 = 7, 7 * 2 = 14, 14 - 5 = 9.
EXPR, ANSWER = "((3 + 4) * 2) - 5", "9"
RIGHT = "3 + 4 = 7\n7 * 2 = 14\n14 - 5 = 9\nAnswer: 9"


@pytest.fixture(scope="module")
def task():
    return get_task("chained", seed=0)


def columns(rows):
    return {k: [r[k] for r in rows] for k in rows[0] if k not in ("prompt", "completion")}


def outcome(completions, expression=EXPR, answer=ANSWER):
    n = len(completions)
    return chained_reward([""] * n, completions, answer=[answer] * n, expression=[expression] * n)


def process(completions, expression=EXPR, answer=ANSWER):
    n = len(completions)
    return chained_process_reward([""] * n, completions, answer=[answer] * n, expression=[expression] * n)


def left_to_right(expression):
    """Independent oracle: the numbers and operators of the prompt's expression, applied left to right."""
    tokens = re.findall(r"\d+|[-+*]", expression)
    assert re.fullmatch(r"[\d\s()+*-]+", expression) and len(tokens) % 2 == 1
    values = [int(tokens[0])]
    for op, y in zip(tokens[1::2], map(int, tokens[2::2])):
        values.append({"+": values[-1] + y, "-": values[-1] - y, "*": values[-1] * y}[op])
    return tokens, values


# --------------------------------------------------------------------------- registry and rows


def test_registered_with_its_options(gcf):
    assert TASKS["chained"] is ChainedTask
    assert task_options("chained") == ["steps", "max_operand", "size", "test_fraction"]
    code, out, _ = gcf("tasks")
    assert code == 0 and "chained: " in out
    with pytest.raises(GcfError, match="no option 'step'.*steps"):
        get_task("chained", step=2)
    for bad in ({"steps": 0}, {"steps": 9}, {"max_operand": 0}, {"steps": "3"}, {"size": 0}):
        with pytest.raises(GcfError, match="chained options need"):
            get_task("chained", **bad)
    with pytest.raises(GcfError, match="test_fraction"):
        get_task("chained", test_fraction=1.0)


def test_a_hand_worked_row(task):
    # The first test row of the default task (seed 0), worked by hand: 10 - 4 = 6, 6 + 2 = 8, 8 + 3 = 11.
    # This pins the split and its order as test_tasks.py's test_split_is_pinned does for arithmetic.
    row = task.rows("test")[0]
    assert row == {
        "prompt": "Compute ((10 - 4) + 2) + 3 step by step. Write one operation per line as 'x op y = z', each line "
        "starting from the previous line's result, then a last line 'Answer: <number>'.",
        "completion": "10 - 4 = 6\n6 + 2 = 8\n8 + 3 = 11\nAnswer: 11",
        "answer": "11",
        "expression": "((10 - 4) + 2) + 3",
    }


@pytest.mark.parametrize(
    "options, steps, max_operand", [({}, 3, 19), ({"steps": 2, "max_operand": 4, "size": 300}, 2, 4)]
)
def test_every_row_shows_its_chain_step_by_step(options, steps, max_operand):
    for split in ("train", "test"):
        for row in get_task("chained", **options).rows(split):
            tokens, values = left_to_right(row["expression"])
            operands = [int(t) for t in tokens[0::2]]
            assert len(operands) == steps + 1 and all(1 <= x <= max_operand for x in operands)
            assert min(values) >= 0 and row["answer"] == str(values[-1])  # a subtraction never goes below 0
            assert (
                f"Compute {row['expression']} step by step" in row["prompt"] and "'Answer: <number>'" in row["prompt"]
            )
            ops = tokens[1::2]
            want = [f"{values[i]} {ops[i]} {operands[i + 1]} = {values[i + 1]}" for i in range(steps)]
            assert row["completion"].split("\n") == want + [f"Answer: {values[-1]}"]


# --------------------------------------------------------------------------- split


def first_step_key(row):
    """What makes two rows one problem: the chain, with a commutative first operation's operands unordered."""
    tokens, _ = left_to_right(row["expression"])
    first = tokens[:3] if tokens[1] == "-" else [tuple(sorted(tokens[0:3:2])), tokens[1]]
    return repr((first, tokens[3:]))


def test_split_is_stable_and_disjoint(task):
    again = get_task("chained", seed=0)
    train, test = task.rows("train"), task.rows("test")
    assert again.rows("train") == train and again.rows("test") == test
    assert len(test) >= 50 and len(train) > 3 * len(test)
    assert not {first_step_key(r) for r in train} & {first_step_key(r) for r in test}  # "4 + 3 ..." never trains
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in test}
    other = get_task("chained", seed=1)  # the seed orders the problems; the test set stays put
    for split in ("train", "test"):
        assert other.rows(split) != task.rows(split)
        assert sorted(map(str, other.rows(split))) == sorted(map(str, task.rows(split)))
    assert task.heldout_rows(200) == test[:200]


# --------------------------------------------------------------------------- outcome reward


def test_outcome_reward(task):
    rows = task.rows("test")
    assert task.reward([r["prompt"] for r in rows], [r["completion"] for r in rows], **columns(rows)) == [1.0] * len(
        rows
    )
    completions = [
        RIGHT,
        "Answer: 9",
        "14 - 5 = 9",  # no "Answer:" line: the last number is the answer
        "3 + 4 = 7\n7 * 2 = 15\n15 - 5 = 10\nAnswer: 10",
        "Answer: 9.0",  # not an integer
        "Answer: 10\n",
        "",
        "I don't know",
        "Answer: " + "9" * 10_000,
        "\x00\ufffd((((",
    ]
    assert outcome(completions) == [1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]
    assert outcome([[{"role": "assistant", "content": RIGHT}]]) == [1.0]  # a conversational completion
    rewards, valid, _ = score(
        task.reward, ["p", "q"], [RIGHT, RIGHT], {"answer": ["9", "nine"], "expression": [EXPR] * 2}
    )
    assert rewards[0] == 1.0 and valid.tolist() == [True, False]  # a broken reference masks its sample only
    with pytest.raises(GcfError, match="answer"):
        task.reward([""], [RIGHT], expression=[EXPR])


# --------------------------------------------------------------------------- process reward


def test_process_reward_on_a_correct_completion():
    # "3 + 4 = 7" is 9 characters (0..8), its "\n" at 9; "7 * 2 = 14" runs 10..19; "14 - 5 = 9" 21..30;
    # "Answer: 9" 32..40, the end of the string (41 characters).
    assert process([RIGHT]) == [[(9, 1.0), (20, 1.0), (31, 1.0), (41, 1.0)]]


def test_process_reward_with_an_arithmetic_slip_in_the_middle():
    slip = "3 + 4 = 7\n7 * 2 = 15\n15 - 5 = 10\nAnswer: 10"
    # The middle step is wrong arithmetic: 0. The chain does not move past a wrong step, so "15 - 5 = 10", right
    # arithmetic on the wrong result, is not the next step (that is still 7 * 2) and scores 0; the wrong answer 0.
    assert process([slip]) == [[(9, 1.0), (20, 0.0), (32, 0.0), (43, 0.0)]]
    # Redoing the missed step puts the chain back on track, and the steps after it count again.
    fixed = "3 + 4 = 7\n7 * 2 = 15\n7 * 2 = 14\n14 - 5 = 9\nAnswer: 9"
    assert [s for _, s in process([fixed])[0]] == [1.0, 0.0, 1.0, 1.0, 1.0]


def test_process_reward_without_steps():
    assert process(["", "   ", "\n\n  \n"]) == [[], [], []]


@pytest.mark.parametrize(
    "completion, scores",
    [
        ("4 + 3 = 7\n2 * 7 = 14\n14 - 5 = 9", [1.0, 1.0, 1.0]),  # + and * in either order
        ("3 + 4 = 7\n7 * 2 = 14\n5 - 14 = -9", [1.0, 1.0, 0.0]),  # - is not commutative
        ("3 + 4 = 7\n3 + 4 = 7\n7 * 2 = 14", [1.0, 0.0, 1.0]),  # a repeated step adds nothing
        ("3 + 4 = 7\n7 + 2 = 9", [1.0, 0.0]),  # the chain's next operator is *
        ("3 + 4 = 7\n7 * 3 = 21", [1.0, 0.0]),  # ... and its next operand is 2
        ("3 * 4 = 12", [0.0]),
        ("Let me think.\n3+4=7.\n  7 \u00d7 2 = 14  \n14 \u2212 5 = 9", [0.0, 1.0, 1.0, 1.0]),  # chatter is a step
        ("3 + 4 = 7\n7 * 2 = 14\n14 - 5 = 9\n9 - 1 = 8\nAnswer: 9", [1.0, 1.0, 1.0, 0.0, 1.0]),  # past the chain
        ("Answer: 9", [1.0]),  # the answer line is judged on its own
        ("3 + 4 = 7\n7 * 2 = 14\n14 - 5 = 9\nAnswer: 8", [1.0, 1.0, 1.0, 0.0]),
        ("Answer: 9\nAnswer: 9\n3 + 4 = 7", [1.0, 0.0, 0.0]),  # the first answer ends the solution
        ("answer:9.", [1.0]),
        ("Answer: 9 apples", [0.0]),
        ("3 + 4 = 7 because 3 + 4 is 7", [0.0]),
    ],
)
def test_process_reward_rules(completion, scores):
    assert [s for _, s in process([completion])[0]] == scores


def check_ends(completion, pairs):
    """Each end points just after a non-blank line: at its "\\n" or the end of the string, one step per line."""
    lines = [(m.start(), m.end()) for m in re.finditer(r"[^\n]+", completion) if m.group().strip()]
    assert [end for end, _ in pairs] == [end for _, end in lines]
    for end, s in pairs:
        assert 0 < end <= len(completion) and (end == len(completion) or completion[end] == "\n")
        assert completion[:end].rsplit("\n", 1)[-1].strip() and s in (0.0, 1.0)


def test_each_end_points_just_after_its_line(task):
    rows = task.rows("test", n=50)
    cases = [
        RIGHT,
        "\n\n3 + 4 = 7\r\n\n  7 * 2 = 14   \n\nAnswer: 9\n\n",
        "junk\n\n\nAnswer: 9",
        "x" * 300 + "\nAnswer: 9",
    ]
    for completion in cases:
        check_ends(completion, process([completion])[0])
    got = task.process_reward([r["prompt"] for r in rows], [r["completion"] for r in rows], **columns(rows))
    for row, pairs in zip(rows, got):
        check_ends(row["completion"], pairs)
        assert [s for _, s in pairs] == [1.0] * 4  # every demonstration step is right
    assert process(["\n\n3 + 4 = 7\r\n"])[0] == [(12, 1.0)]  # at the "\n": a "\r" before it is the step's


def test_process_reward_on_huge_and_broken_input():
    huge = [
        "9" * 100_000 + " + 4 = 7\nAnswer: 9",
        "3 + 4 = " + "7" * 50 + "\nAnswer: 9",
        "\n".join(["3 + 4 = 7"] * 20_000),
        "x" * 1_000_000,
        "Answer: " + "9" * 1_000,
    ]
    got = process(huge)
    assert [s for _, s in got[0]] == [0.0, 1.0] and [s for _, s in got[1]] == [0.0, 1.0]
    assert len(got[2]) == 20_000 and sum(s for _, s in got[2]) == 1.0
    assert got[3] == [(1_000_000, 0.0)] and got[4] == [(1_008, 0.0)]
    assert process([None, 7, [{"role": "assistant", "content": RIGHT}]]) == [[], [], process([RIGHT])[0]]
    with pytest.raises(ValueError, match="chain"):
        process([RIGHT], expression="3 + + 4")
    with pytest.raises(ValueError, match="integer"):
        process([RIGHT], answer="nine")
    with pytest.raises(GcfError, match="expression"):
        chained_process_reward([""], [RIGHT], answer=["9"])


text = st.one_of(
    st.text(max_size=200),
    st.text(alphabet=st.sampled_from(list("0123456789+-*=. :\n\rAnswer\u00d7\u2212")), max_size=120),
)


@settings(max_examples=300, deadline=None)
@given(text)
def test_rewards_never_raise_on_arbitrary_text(completion):
    [pairs] = process([completion])
    check_ends(completion, pairs)
    assert outcome([completion])[0] in (0.0, 1.0)


# --------------------------------------------------------------------------- end to end


def test_gcf_run_sft_on_chained_trains(gcf, tmp_path):
    out = tmp_path / "run"
    code, _, err = gcf(
        "run",
        "--method",
        "sft",
        "--model",
        "tiny",
        "--task",
        "chained",
        "--max-steps",
        "2",
        "--output-dir",
        str(out),
        "--set",
        "progress=false",
        "--set",
        "report_to=none",
        "--set",
        "task_options={steps: 2, max_operand: 5}",
    )
    assert code == 0, err
    assert [r["step"] for r in metrics_rows(out)] == [1, 2]
    assert json.loads((out / "run_config.json").read_text())["task_options"] == {"steps": 2, "max_operand": 5}
    code, out, err = gcf(
        "eval", "--model", "tiny", "--task", "chained", "--samples", "2", "--max-new-tokens", "2", "--set", "steps=2"
    )
    assert code == 0 and "held-out accuracy" in out, err
    code, _, err = gcf("eval", "--model", "tiny", "--task", "chained", "--samples", "2", "--set", "steps=two")
    assert code == 2 and "chained options need" in err and len(err.strip().splitlines()) == 1, err


def test_answer_is_the_integer_the_outcome_reward_compares() -> None:
    from gcfamily.tasks import get_task

    t = get_task("chained")
    assert (
        t.answer("3 + 4 = 7\n7 * 2 = 14\nAnswer: 14") == 14 and t.answer("Answer: 9.0") is None and t.answer("") is None
    )
    row = t.rows("test")[0]
    right = row["completion"]
    assert t.answer(right) == int(row["answer"]) and t.reward([row["prompt"]], [right], answer=[row["answer"]]) == [1.0]
