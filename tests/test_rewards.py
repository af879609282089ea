"""Verifiable rewards: extraction, each reward, loading user rewards, and score()'s masking."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gcfamily.errors import GcfError
from gcfamily.rewards import (
    REWARDS,
    RewardFailure,
    exact_match,
    extract_answer,
    format_reward,
    load_reward,
    numeric_match,
    parse_number,
    score,
    weighted_sum,
)

# --------------------------------------------------------------------------- extraction


@pytest.mark.parametrize(
    "text, expected",
    [
        (r"so the result is \boxed{\frac{3}{4}}.", r"\frac{3}{4}"),  # nested braces
        (r"\boxed{1} then \boxed{{2}}", "{2}"),  # the last box wins
        (r"\boxed{7} and an unclosed \boxed{8", "7"),
        ("Answer: -3", "-3"),
        ("**Answer:** 42 apples", "42"),
        ("Answer: 7 + 5 = 12", "12"),  # the result, not the first operand
        ("The answer is 12 apples, 2 more than 10", "12"),
        ("I think the answer is 1,234.", "1,234"),
        ("The answer is 3/4", "3/4"),
        ("The answer is Paris.", "Paris"),
        ("She has 48 + 24 = 72 clips.\n#### 1,234", "1,234"),
        ("#### 72\nAnswer: 5", "72"),  # GSM8K marker outranks an answer cue
        ("7 + 5 = 12", "12"),  # last number
        ("it costs $2.50 total", "2.50"),
        ("5-3 leaves 2", "2"),
        ("from 5-3", "3"),  # a minus glued to a digit is an operator, not a sign
        ("temperature is -4 degrees", "-4"),
        ("no number here", None),
        ("", None),
    ],
)
def test_extract_answer(text, expected):
    assert extract_answer(text) == expected


@pytest.mark.parametrize(
    "text, expected",
    [
        ("1,234", 1234.0),
        ("-3", -3.0),
        ("2.50", 2.5),
        ("3/4", 0.75),
        ("-3/4", -0.75),
        (r"\frac{3}{4}", 0.75),
        ("$18", 18.0),
        (" 7 ", 7.0),
        ("\u22125", -5.0),  # unicode minus
        (12, 12.0),
        ("1/0", None),
        ("nan", None),
        ("inf", None),
        ("1e5", None),  # not a form answers are written in; refuse rather than guess
        ("12 apples", None),
        ("__import__('os')", None),
        (None, None),
    ],
)
def test_parse_number(text, expected):
    assert parse_number(text) == expected


# --------------------------------------------------------------------------- reward functions


def test_numeric_match():
    completions = ["7 + 5 = 12", "It is 12.0", "Answer: 13", "\\boxed{1,234}", "none", "\\boxed{x = -2}", "Answer: 1/3"]
    answers = ["12", "12", "12", "1234", "3", "-2", "0.3333333"]  # 1/3 vs 0.3333333: within 1e-6 relative
    assert numeric_match([""] * 7, completions, answer=answers) == [1.0, 1.0, 0.0, 1.0, 0.0, 1.0, 1.0]
    assert numeric_match([""], ["0.333"], answer=["1/3"]) == [0.0]


def test_numeric_match_reads_a_gsm8k_style_reference():
    assert numeric_match(["q"], ["Answer: 72"], answer=["... #### 72"]) == [1.0]


def test_numeric_match_needs_the_answer_column():
    with pytest.raises(GcfError, match="'answer'"):
        numeric_match(["q"], ["1"])


def test_exact_match():
    completions = ["Answer: Paris", "  Paris ", "Lyon", "the result is 4", "Answer: 4.0"]
    answers = ["Paris", "Paris", "Paris", "4", "4"]
    # "4.0" != "4": exact is string equality; use numeric for numbers.
    assert exact_match([""] * 5, completions, answer=answers) == [1.0, 1.0, 0.0, 1.0, 0.0]


def test_format_reward_search_and_fullmatch():
    search = format_reward(r"\\boxed\{")
    assert search(["", ""], ["x \\boxed{3}", "3"]) == [1.0, 0.0]
    full = format_reward(r"-?\d+", fullmatch=True)
    assert full(["", "", ""], [" 12\n", "12 apples", "-4"]) == [1.0, 0.0, 1.0]


def test_format_reward_bad_pattern():
    with pytest.raises(GcfError, match="not a valid regular expression"):
        format_reward("(unclosed")


def test_weighted_sum():
    fn = weighted_sum([(numeric_match, 1.0), (format_reward(r"^\d+$"), 0.5)])
    # "12": right and well formatted = 1.5; "so 12": right only = 1.0; "13": format only = 0.5
    assert fn(["", "", ""], ["12", "so 12", "13"], answer=["12"] * 3) == [1.5, 1.0, 0.5]


def test_weighted_sum_rejects_bad_terms_and_lengths():
    with pytest.raises(GcfError):
        weighted_sum([])
    with pytest.raises(GcfError):
        weighted_sum([("numeric", 1.0)])
    with pytest.raises(GcfError):
        weighted_sum([(numeric_match, math.nan)])
    short = weighted_sum([(lambda p, c, **k: [1.0], 1.0)])
    with pytest.raises(GcfError, match="returned 1 values for 2"):
        short(["", ""], ["a", "b"])


# --------------------------------------------------------------------------- loading


def test_load_builtin():
    assert load_reward("numeric") is numeric_match
    assert set(REWARDS) >= {"numeric", "exact", "boxed"}


def test_load_module_function():
    assert load_reward("gcfamily.rewards.verifiable:exact_match") is exact_match


def test_load_from_file(tmp_path):
    path = tmp_path / "my_rewards.py"
    path.write_text(
        "def shortness(prompts, completions, **kw):\n    return [1.0 / (1 + len(c)) for c in completions]\n"
    )
    fn = load_reward(f"{path}:shortness")
    assert fn(["q"], ["abc"]) == [0.25]


@pytest.mark.parametrize(
    "spec, message",
    [
        ("nonsense", "unknown reward"),
        ("no_such_module_xyz:fn", "could not import"),
        ("gcfamily.rewards.verifiable:missing", "no attribute 'missing'"),
        ("gcfamily.rewards.verifiable:REWARDS", "not a function"),
        ("/no/such/file.py:fn", "does not exist"),
        (":fn", "module:function"),
    ],
)
def test_load_bad_specs(spec, message):
    with pytest.raises(GcfError, match=message):
        load_reward(spec)


def test_load_file_that_fails_to_import(tmp_path):
    path = tmp_path / "broken.py"
    path.write_text("def oops(:\n")
    with pytest.raises(GcfError, match="failed to import"):
        load_reward(f"{path}:oops")


# --------------------------------------------------------------------------- score


def _by_completion(prompts, completions, **columns):
    """Raises on 'boom', returns NaN on 'nan', None on 'none', a string on 'str', else 1.0."""
    if "boom" in completions:
        raise RuntimeError("boom")
    special = {"nan": math.nan, "none": None, "str": "1.0", "inf": math.inf}
    return [special.get(c, 1.0) for c in completions]


def test_score_all_good():
    rewards, valid, errors = score(numeric_match, ["a", "b"], ["1", "2"], {"answer": ["1", "3"]})
    assert rewards.dtype == torch.float32 and rewards.tolist() == [1.0, 0.0]
    assert valid.tolist() == [True, True] and errors == []


def test_score_masks_raising_and_non_finite_samples():
    completions = ["ok", "boom", "nan", "none", "str", "inf", "ok"]
    rewards, valid, errors = score(_by_completion, ["p"] * 7, completions, {})
    assert valid.tolist() == [True, False, False, False, False, False, True]
    assert rewards.tolist() == [1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0]  # zeros where invalid, to be masked
    assert len(errors) == int((~valid).sum()) == 5
    assert "RuntimeError: boom" in errors[0] and "sample 1" in errors[0]


def test_score_slices_columns_when_retrying():
    def needs_positive(prompts, completions, answer):
        if any(a < 0 for a in answer):
            raise ValueError("negative reference")
        return [float(a) for a in answer]

    rewards, valid, _ = score(needs_positive, ["p"] * 3, ["a", "b", "c"], {"answer": [2, -1, 3]})
    assert rewards.tolist() == [2.0, 0.0, 3.0] and valid.tolist() == [True, False, True]


def test_score_masks_non_numeric_references():
    rewards, valid, errors = score(numeric_match, ["p", "p"], ["1", "1"], {"answer": ["1", "Paris"]})
    assert valid.tolist() == [True, False] and "not a number" in errors[0]


def test_score_accepts_tensor_output():
    fn = lambda p, c, **k: torch.tensor([0.5] * len(c))  # noqa: E731
    rewards, valid, _ = score(fn, ["p", "q"], ["a", "b"], {})
    assert rewards.tolist() == [0.5, 0.5] and valid.all()


def test_score_all_fail_raises_reward_failure():
    with pytest.raises(RewardFailure, match="_by_completion.*all 2 samples"):
        score(_by_completion, ["p", "q"], ["boom", "nan"], {})


def test_score_empty_batch():
    rewards, valid, errors = score(numeric_match, [], [], {"answer": []})
    assert rewards.shape == valid.shape == (0,) and errors == []


def test_score_wrong_length_names_the_function():
    def two_few(prompts, completions, **kw):
        return [1.0]

    with pytest.raises(GcfError, match="two_few.*returned 1 values for 2"):
        score(two_few, ["p", "q"], ["a", "b"], {})
    with pytest.raises(GcfError, match="returned a float"):
        score(lambda p, c, **k: 1.0, ["p"], ["a"], {})


def test_score_user_errors_pass_through():
    with pytest.raises(GcfError, match="column 'answer' has 1 values for 2"):
        score(numeric_match, ["p", "q"], ["a", "b"], {"answer": ["1"]})
    with pytest.raises(GcfError, match="needs a column 'answer'"):
        score(numeric_match, ["p"], ["a"], {})
    with pytest.raises(GcfError, match="prompts"):
        score(numeric_match, ["p"], ["a", "b"], {"answer": ["1", "2"]})


# --------------------------------------------------------------------------- properties

# Text mixing arbitrary unicode with the characters the extractors care about.
answerish = st.text(alphabet=st.sampled_from(list("0123456789-+−.,/ $#{}\\boxedAnswer:is\n*")), max_size=60)
any_text = st.one_of(st.text(max_size=200), answerish)


@settings(max_examples=300, deadline=None)
@given(any_text)
def test_extraction_never_raises(text):
    answer = extract_answer(text)
    assert answer is None or isinstance(answer, str)
    value = parse_number(text)
    assert value is None or math.isfinite(value)
    numeric_match(["q"], [text], answer=["3"])
    exact_match(["q"], [text], answer=["3"])


@settings(deadline=None)
@given(
    st.integers(-(10**12), 10**12),
    st.sampled_from(["{:,}", "{}", "{:.2f}"]),
    st.sampled_from(["#### {}", "Answer: {}", "so \\boxed{{{}}}", "we get {}."]),
)
def test_written_numbers_round_trip(n, number_format, frame):
    text = frame.format(number_format.format(n))
    assert parse_number(extract_answer(text)) == pytest.approx(n, rel=1e-12)
