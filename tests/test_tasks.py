"""Built-in tasks: deterministic disjoint splits, demonstrations that score 1.0, a parser that never evals."""

import builtins
import re
import sys
import types

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gcfamily.errors import GcfError
from gcfamily.rewards import RewardFailure, score
from gcfamily.tasks import TASKS, get_task, gsm8k_row, parse_expression
from gcfamily.tasks.countdown import countdown_reward, final_expression
from gcfamily.tasks.sorting import sorting_partial_reward, sorting_reward

OFFLINE = ["arithmetic", "countdown", "sorting"]


@pytest.fixture(scope="module")
def tasks():
    """One instance per offline task (building them is the slow part of this file)."""
    return {name: get_task(name, seed=0) for name in OFFLINE}


def columns(rows):
    """Rows -> the extra columns a reward function receives."""
    return {k: [r[k] for r in rows] for k in rows[0] if k not in ("prompt", "completion")}


def call_reward(task, rows, completions):
    return task.reward([r["prompt"] for r in rows], completions, **columns(rows))


# --------------------------------------------------------------------------- registry


def test_registry_and_errors():
    assert set(TASKS) >= {"arithmetic", "countdown", "sorting", "gsm8k"}
    with pytest.raises(GcfError, match="unknown task 'nope'.*arithmetic"):
        get_task("nope")
    with pytest.raises(GcfError, match="no option 'levle'.*level"):
        get_task("arithmetic", levle="1d-add")
    with pytest.raises(GcfError, match="unknown arithmetic level"):
        get_task("arithmetic", level="3d-add")
    with pytest.raises(GcfError, match="split"):
        get_task("arithmetic").rows("validation")
    with pytest.raises(GcfError, match="n=-1"):
        get_task("arithmetic").rows("train", n=-1)


# --------------------------------------------------------------------------- splits


@pytest.mark.parametrize("name", OFFLINE)
def test_rows_are_deterministic(name, tasks):
    again = get_task(name, seed=0)
    for split in ("train", "test"):
        assert again.rows(split) == tasks[name].rows(split)
    # The seed orders the problems; the problems themselves (and so the test set) stay put.
    # (Mixed arithmetic's n=None takes a seeded share of the big level, so check one level.)
    options = {"level": "1d-mul"} if name == "arithmetic" else {"size": 500}
    ours, theirs = get_task(name, seed=0, **options), get_task(name, seed=1, **options)
    for split in ("train", "test"):
        assert ours.rows(split) != theirs.rows(split)
        assert sorted(map(str, ours.rows(split))) == sorted(map(str, theirs.rows(split)))


def problem_key(name, prompt):
    """What makes two prompts the same problem: unordered operands, the multiset of numbers (and target)."""
    nums = list(map(int, re.findall(r"\d+", prompt)))
    if name == "arithmetic":
        return ("*" in prompt, tuple(sorted(nums)))
    if name == "countdown":
        nums = nums[:-4]  # drop the "(1 + 2) * 3 = 9" format example
        return tuple(sorted(nums[:-1])), nums[-1]
    return tuple(sorted(nums))


@pytest.mark.parametrize("name", OFFLINE)
def test_splits_are_disjoint_and_sizable(name, tasks):
    train, test = tasks[name].rows("train"), tasks[name].rows("test")
    assert len(test) >= 50 and len(train) > len(test)
    train_keys = {problem_key(name, r["prompt"]) for r in train}
    test_keys = {problem_key(name, r["prompt"]) for r in test}
    assert not train_keys & test_keys
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in test}


@pytest.mark.parametrize("level", ["1d-add", "1d-mul"])
def test_small_arithmetic_spaces_keep_a_fifth_for_test(level):
    task = get_task("arithmetic", level=level)
    train, test = task.rows("train"), task.rows("test")
    assert len(train) + len(test) == 100
    assert 15 <= len(test) <= 25
    pairs = lambda rows: {frozenset(map(int, re.findall(r"\d+", r["prompt"]))) for r in rows}  # noqa: E731
    assert not pairs(train) & pairs(test)  # "3 + 5" tested means "5 + 3" is never trained on


def test_split_is_pinned():
    # sha256 of the problem, not Python's salted hash(): the same test set in every process
    # and on every machine. Changing this list means changing every reported test score.
    task = get_task("arithmetic", level="1d-add")
    pairs = {tuple(sorted(map(int, re.findall(r"\d+", r["prompt"])))) for r in task.rows("test")}
    assert sorted(pairs) == [(0, 2), (0, 3), (0, 5), (0, 9), (1, 7), (1, 8), (5, 5), (6, 6), (6, 8), (7, 8), (8, 8)]


def test_mixed_arithmetic_takes_turns_and_cycles():
    task = get_task("arithmetic")
    test = task.rows("test")
    levels = [r["level"] for r in test]
    assert levels[:3] == ["1d-add", "1d-mul", "2d-add"] and len(set(levels)) == 3
    assert levels.count("1d-add") == levels.count("2d-add")
    big = task.rows("test", n=600)
    assert big[: len(test)] == test and len(big) == 600
    assert len({r["prompt"] for r in big if r["level"] == "2d-add"}) == 200  # the big level keeps giving fresh problems


def test_heldout_rows_hold_each_prompt_once_in_the_order_of_rows(tasks):
    task = get_task("arithmetic")
    big = task.rows("test", n=500)
    held = task.heldout_rows(500)
    prompts = [r["prompt"] for r in held]
    assert (
        len(prompts) == len(set(prompts)) == 205
    )  # 19 + 19 one-digit problems (each cycled in rows) + 167 two-digit ones
    assert held == [r for i, r in enumerate(big) if r["prompt"] not in {x["prompt"] for x in big[:i]}]
    assert task.heldout_rows(64) == held[: len(task.heldout_rows(64))]  # a smaller n: a prefix of the same prompts
    sorting = tasks["sorting"]
    assert sorting.heldout_rows(5) == sorting.rows("test", 5)  # nothing repeats within a split: the rows themselves
    assert len(sorting.heldout_rows(10**6)) == len(sorting.rows("test"))


def test_n_cycles_deterministically(tasks):
    task = tasks["sorting"]
    test = task.rows("test")
    assert task.rows("test", n=len(test) + 3) == test + test[:3]
    assert task.rows("test", n=0) == []
    rows = task.rows("test", n=2)
    rows[0]["prompt"] = "mutated"
    assert task.rows("test", n=1)[0]["prompt"] != "mutated"  # callers get copies


# --------------------------------------------------------------------------- rewards


def wrong(name, row):
    """A completion that is surely wrong for the row: off by one, or one number short."""
    if name == "arithmetic":
        return str(int(row["answer"]) + 1)
    if name == "countdown":  # the expression's value becomes target + 1
        return row["completion"].split("=")[0].strip() + " + 1"
    return row["completion"].rsplit(",", 1)[0]


@pytest.mark.parametrize("name", OFFLINE)
def test_demonstrations_score_one_and_wrong_answers_zero(name, tasks):
    task = tasks[name]
    for split in ("train", "test"):
        rows = task.rows(split)
        assert call_reward(task, rows, [r["completion"] for r in rows]) == [1.0] * len(rows)
    rows = task.rows("test", n=300)
    assert call_reward(task, rows, [wrong(name, r) for r in rows]) == [0.0] * len(rows)
    assert call_reward(task, rows, ["I don't know"] * len(rows)) == [0.0] * len(rows)


def test_arithmetic_reward_examples(tasks):
    task = tasks["arithmetic"]
    row = {"prompt": "What is 7 + 5? Reply with just the number.", "answer": "12"}
    assert call_reward(task, [row] * 4, ["12", "7 + 5 = 12", "13", "The answer is 12.5"]) == [1.0, 1.0, 0.0, 0.0]


def test_countdown_reward_examples():
    completions = [
        "(3 + 5) * 2 = 16",
        "Answer: (3+5)*2",
        "Let me think.\n(3 \u00d7 2) + 5 * 2 = 16",  # last line only; "\u00d7" is *
        "(3 + 5) * 2 * 1 = 16",  # 1 is not given
        "(5 + 5) + 3 * 2 = 16",  # 5 used twice
        "8 * 2 = 16",  # 8 is not given
        "16",
        "3 + 5 * 2 = 13",  # wrong value
    ]
    n = len(completions)
    got = countdown_reward([""] * n, completions, numbers=[[3, 5, 2]] * n, answer=["16"] * n)
    assert got == [1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]
    assert countdown_reward([""], ["(3 + 5) * 2"], numbers=["3, 5, 2"], answer=["16"]) == [1.0]
    assert countdown_reward([""], ["(6 + 2) / 2 * 4"], numbers=[[6, 2, 2, 4]], answer=["16"]) == [1.0]  # / is allowed


def test_final_expression():
    assert final_expression("blah\nAnswer: (1 + 2) * 3 = 9.\n\n") == "(1 + 2) * 3"
    assert final_expression("") == ""


@pytest.mark.parametrize(
    "expr, value, used",
    [("(3 + 5) * 2", 16, [3, 5, 2]), ("10 - 2 - 3", 5, [10, 2, 3]), ("7 / 2 * 2", 7, [7, 2, 2]), (" 4 ", 4, [4])],
)
def test_parse_expression_values(expr, value, used):
    assert parse_expression(expr) == (value, used)


@pytest.mark.parametrize(
    "expr",
    [
        "__import__('os').system('echo pwned')",
        "().__class__.__bases__[0]",
        "2 ** 100",
        "1 / 0",
        "(1 + 2",
        "1 + 2)",
        "-3 + 5",
        "1.5 * 2",
        "3 5",
        "",
        "(" * 500 + "1" + ")" * 500,
        "+".join(["1"] * 500),
    ],
)
def test_parse_expression_refuses_without_evaluating(expr, monkeypatch):
    def forbidden(*args, **kwargs):
        raise AssertionError("the countdown parser must never evaluate code")

    monkeypatch.setattr(builtins, "eval", forbidden)
    monkeypatch.setattr(builtins, "exec", forbidden)
    monkeypatch.setattr(builtins, "compile", forbidden)
    assert parse_expression(expr) is None


def test_sorting_rewards():
    row = {"answer": "1, 3, 7, 9"}
    completions = ["1, 3, 7, 9", "Sorted:\n1,3,7,9.", "1, 3, 9, 7", "1, 3, 7", "9, 7, 3, 1"]
    n = len(completions)
    assert sorting_reward([""] * n, completions, answer=[row["answer"]] * n) == [1.0, 1.0, 0.0, 0.0, 0.0]
    # partial: positions right over the longer list; 1,3 right in "1, 3, 9, 7" -> 2/4, 3 of 4 in "1, 3, 7"
    assert sorting_partial_reward([""] * n, completions, answer=[row["answer"]] * n) == [1.0, 1.0, 0.5, 0.75, 0.0]
    assert get_task("sorting", partial=True, size=50).reward([""], ["1, 3, 9, 7"], answer=["1, 3, 7, 9"]) == [0.5]


def test_task_reward_works_with_score(tasks):
    rows = tasks["countdown"].rows("test", n=4)
    completions = [rows[0]["completion"], "nonsense", rows[2]["completion"], ""]
    rewards, valid, errors = score(tasks["countdown"].reward, [r["prompt"] for r in rows], completions, columns(rows))
    assert rewards.tolist() == [1.0, 0.0, 1.0, 0.0] and valid.all() and errors == []
    with pytest.raises(GcfError, match="numbers"):
        score(tasks["countdown"].reward, ["p"], ["1"], {"answer": ["1"]})


# --------------------------------------------------------------------------- gsm8k

GSM8K_EXAMPLE = {
    "question": "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
    "How many clips did Natalia sell altogether in April and May?",
    "answer": "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n"
    "Natalia sold 48+24 = <<48+24=72>>72 clips altogether in April and May.\n#### 72",
}


def test_gsm8k_row():
    row = gsm8k_row(GSM8K_EXAMPLE)
    assert row["answer"] == "72"
    assert row["prompt"].startswith("Natalia sold clips") and "Answer:" in row["prompt"]
    assert "<<" not in row["completion"] and row["completion"].endswith("Answer: 72")
    big = gsm8k_row({"question": "q", "answer": "It is 1,234 + 0.\n#### 1,234"})
    assert big["answer"] == "1234"
    task = get_task("gsm8k")
    assert task.reward([row["prompt"]] * 2, [row["completion"], "Answer: 71"], answer=["72", "72"]) == [1.0, 0.0]


@pytest.mark.parametrize("bad", [{"question": "q", "answer": "no marker"}, {"answer": "#### 1"}, {}])
def test_gsm8k_row_rejects_malformed(bad):
    with pytest.raises(GcfError, match="GSM8K example"):
        gsm8k_row(bad)


def fake_datasets(load_dataset):
    module = types.ModuleType("datasets")
    module.load_dataset = load_dataset
    return module


def test_gsm8k_unreachable_hub_is_a_clear_error(monkeypatch):
    def unreachable(*args, **kwargs):
        raise ConnectionError("no network")

    monkeypatch.setitem(sys.modules, "datasets", fake_datasets(unreachable))
    with pytest.raises(GcfError, match="hub.*arithmetic, countdown or sorting"):
        get_task("gsm8k").rows("train")


def test_gsm8k_rows_from_a_loaded_dataset(monkeypatch):
    calls = []

    def load(path, config, split):
        calls.append((path, config, split))
        return [GSM8K_EXAMPLE, {"question": "What is 2 + 2?", "answer": "2 + 2 = 4\n#### 4"}]

    monkeypatch.setitem(sys.modules, "datasets", fake_datasets(load))
    task = get_task("gsm8k", seed=3)
    rows = task.rows("test", n=3)
    assert calls == [("openai/gsm8k", "main", "test")]
    assert len(rows) == 3 and rows[2] == rows[0]
    assert call_reward(task, rows, [r["completion"] for r in rows]) == [1.0, 1.0, 1.0]
    task.rows("test")
    assert len(calls) == 1  # loaded once


# --------------------------------------------------------------------------- properties

arbitrary = st.one_of(
    st.text(max_size=200),
    st.text(alphabet=st.sampled_from(list("0123456789+-*/()=., :\nAnswer\u00d7\u2212")), max_size=80),
)


@settings(max_examples=200, deadline=None)
@given(arbitrary, st.sampled_from(OFFLINE + ["gsm8k"]), st.integers(0, 10**6))
def test_task_rewards_never_raise_on_arbitrary_text(tasks, text, name, pick):
    task = tasks[name] if name in tasks else get_task(name)
    row = tasks["arithmetic"].rows("test")[0] if name == "gsm8k" else tasks[name].rows("test")[pick % 50]
    rewards = call_reward(task, [row], [text])
    assert len(rewards) == 1 and 0.0 <= rewards[0] <= 1.0
    assert parse_expression(text) is None or isinstance(parse_expression(text)[1], list)


def test_reward_failure_when_every_reference_is_broken(tasks):
    with pytest.raises(RewardFailure, match="countdown_reward|reward"):
        score(tasks["countdown"].reward, ["p", "q"], ["1", "2"], {"numbers": [[1], [2]], "answer": ["x", "y"]})
