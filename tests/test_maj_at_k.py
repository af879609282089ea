"""Maj@K: the vote worked by hand, each task's answer extraction, one sampling pass for pass@k and Maj@k, `gcf eval --maj-k`."""

from __future__ import annotations

import re
from fractions import Fraction
from types import SimpleNamespace

import pytest
import torch

from gcfamily.errors import GcfError
from gcfamily.run.heldout import (
    answer_extractor,
    maj_at_k,
    majority_answer,
    majority_right,
    sampled_eval,
    sampled_pass_at_k,
    task_answer,
)
from gcfamily.tasks import ArithmeticTask, CountdownTask, GSM8KTask, SortingTask, Task

T, F = True, False

# ----------------------------------------------------------------------------- the vote, by hand


def test_a_clear_majority_wins_and_is_right_when_its_samples_score_1():
    answers = [3, 5, 3, None, 3]  # 3 has three votes, 5 one; None votes for nothing
    assert majority_answer(answers) == 3
    assert majority_right(answers, [T, F, T, F, T])
    assert not majority_right(answers, [F, T, F, F, F])  # only the minority answer 5 scored


def test_a_tie_goes_to_the_tied_answer_sampled_first():
    # 7 and 4 have two votes each; 7 appears first, so 7 is the vote, and it scored 0
    assert majority_answer([7, 4, 4, 7]) == 7
    assert not majority_right([7, 4, 4, 7], [F, T, T, F])
    # the same samples in the other order: 4 comes first and wins
    assert majority_answer([4, 7, 7, 4]) == 4
    assert majority_right([4, 7, 7, 4], [T, F, F, T])
    # a three-way tie after dropping the non-answers: 9 appears first among the answers
    assert majority_answer([None, 9, 2, None, 5]) == 9


def test_non_answers_never_win_and_a_prompt_with_none_is_wrong():
    assert majority_answer([None, None, 5]) == 5  # None is the most common entry, but it is not an answer
    assert majority_answer([None, None, None]) is None and majority_answer([]) is None
    # no sample gave an answer: wrong, even where the reward (not reading answers) scored a sample 1
    assert not majority_right([None, None], [T, F])


def test_the_vote_can_be_wrong_where_pass_at_k_is_right():
    from gcfamily.core.stats import pass_at_k

    answers, correct = [8, 8, 9], [F, F, T]  # 8 wins two to one, only 9 is right
    assert not majority_right(answers, correct)
    assert pass_at_k(3, sum(correct), 3) == 1.0  # one of the three samples is right: pass@3 = 1


def test_maj_at_k_is_the_share_of_prompts_whose_vote_is_right():
    answers = [[3, 5, 3], [7, 4, 4, 7], [None, None], [8, 8, 9]]
    correct = [[T, F, T], [T, F, F, T], [F, F], [F, F, T]]
    # right: prompt 0 (3 wins, scored 1) and prompt 1 (7 wins the tie, scored 1); wrong: 2 (no answer), 3 (8 scored 0)
    assert maj_at_k(answers, correct) == 2 / 4
    assert maj_at_k([], []) == 0.0


# ----------------------------------------------------------------------------- each task's answer


def _pools_only_alike(task, completions, **columns):
    """Every two completions with one answer get one reward from the task's own reward (the oracle), and some do share."""
    answers = [task.answer(c) for c in completions]
    rewards = task.reward(
        [""] * len(completions), completions, **{k: [v] * len(completions) for k, v in columns.items()}
    )
    shared = 0
    for i, a in enumerate(answers):
        for j in range(i):
            if a is not None and a == answers[j]:
                shared += 1
                assert rewards[i] == rewards[j], (completions[i], completions[j])
    assert shared > 0  # the check compared something
    return answers, rewards


def test_arithmetic_answer_reads_the_number_its_reward_reads():
    task = ArithmeticTask()
    assert task.answer("12") == 12.0
    assert task.answer("The answer is 12.") == 12.0
    assert task.answer("7 + 5 = 12") == 12.0  # the last number
    assert task.answer("12.0") == task.answer("12")  # one vote
    assert task.answer("Answer: 1,234") == 1234.0
    assert task.answer("\\boxed{3/4}") == 0.75
    assert task.answer("no number here") is None and task.answer("") is None
    comps = ["12", "12.0", "The answer is 12.", "13", "thirteen 13", "none"]
    answers, rewards = _pools_only_alike(task, comps, answer="12")
    assert rewards == [1.0, 1.0, 1.0, 0.0, 0.0, 0.0] and answers[-1] is None


def test_gsm8k_answer_reads_the_number_its_reward_reads():
    task = GSM8KTask()  # loads nothing until asked for rows
    assert task.answer("She has 3 + 4 = 7 apples.\nAnswer: 72") == 72.0
    assert task.answer("so 48/2 = 24\n#### 1,080") == 1080.0
    assert task.answer("Answer: $18.50") == 18.5
    assert task.answer("I cannot tell.") is None
    comps = ["Answer: 72", "#### 72", "The answer is 72 apples", "Answer: 71"]
    _, rewards = _pools_only_alike(task, comps, answer="72")
    assert rewards == [1.0, 1.0, 1.0, 0.0]


def test_sorting_answer_is_the_tuple_of_integers_its_reward_reads():
    task = SortingTask(size=20)
    assert task.answer("1, 2, 3") == (1, 2, 3)
    assert task.answer("Sorted: 1,2,3.") == (1, 2, 3)  # the same vote
    assert task.answer("-4, 7") == (-4, 7)
    assert task.answer("3, 2, 1") == (3, 2, 1)
    assert task.answer("no numbers") is None
    assert task.answer("1, " + "9" * 31) is None  # an over-long digit run reads as None in the reward: no vote
    comps = ["1, 2, 3", "Sorted: 1,2,3.", "[1, 2, 3]", "3, 2, 1", "1 2 3 4"]
    _, rewards = _pools_only_alike(task, comps, answer="1, 2, 3")
    assert rewards == [1.0, 1.0, 1.0, 0.0, 0.0]


def test_countdown_answer_is_the_value_and_the_numbers_used():
    task = CountdownTask(size=20)
    assert task.answer("(2 + 3) * 4 = 20") == (Fraction(20), (2, 3, 4))
    assert task.answer("4 * (3 + 2)") == (Fraction(20), (2, 3, 4))  # another spelling, the same vote
    assert task.answer("Answer: 10 / 4") == (Fraction(5, 2), (4, 10))
    assert task.answer("20") == (Fraction(20), (20,))  # the value alone, using a number not given: another vote
    assert task.answer("2 +") is None and task.answer("import os") is None and task.answer("") is None
    comps = ["(2 + 3) * 4 = 20", "4 * (3 + 2)", "Answer: (3 + 2) * 4", "20", "5 * 4", "2 * 3 * 4"]
    answers, rewards = _pools_only_alike(task, comps, answer="20", numbers=[2, 3, 4])
    # "20" and "5 * 4" reach the target with numbers not given: a vote on the value would have pooled them with the first three
    assert rewards == [1.0, 1.0, 1.0, 0.0, 0.0, 0.0]
    assert len({a[0] for a in answers[:5]}) == 1 and len(set(answers[:5])) == 3


def test_a_task_without_answer_has_no_maj_at_k():
    class Plain(Task):
        name = "plain"

        def reward(self, prompts, completions, **columns):
            return [1.0] * len(completions)

    assert Plain().answer("42") is None  # the default reads nothing
    assert task_answer(Plain()) is None and task_answer(None) is None
    assert task_answer(ArithmeticTask())("5") == 5.0
    with pytest.raises(GcfError) as err:
        answer_extractor(Plain())
    msg = str(err.value)
    assert msg.startswith("Maj@K needs an answer extractor: task 'plain' defines no answer(completion)")
    assert msg.endswith(".") and ". " not in msg and "\n" not in msg  # one sentence
    assert answer_extractor(Plain(), answer=len) is len  # an answer function given wins


def test_rows_scored_by_reward_functions_need_an_answer_function():
    with pytest.raises(GcfError) as err:
        answer_extractor(None)
    msg = str(err.value)
    assert msg.startswith("Maj@K needs an answer extractor: rows scored by reward functions")
    assert msg.endswith(".") and ". " not in msg and "\n" not in msg  # one sentence


# ----------------------------------------------------------------------------- one sampling pass, both figures


class _Tok:  # characters in, enough to encode prompts (generate is replaced below)
    pad_token_id, eos_token_id, chat_template = 0, 1, None

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [2 + ord(c) % 90 for c in text]}


def _fake_generate(monkeypatch, completions, calls):
    import gcfamily.rollout.native as rollout  # the native backend samples through it

    def generate(model, tokenizer, prompt_ids, num_samples, settings, generator=None):
        calls.append((len(prompt_ids), num_samples, settings.temperature))
        start = sum(n * k for n, k, _ in calls[:-1])  # prompt i's k samples are rows i*k .. i*k+k-1
        return SimpleNamespace(completions=completions[start : start + len(prompt_ids) * num_samples])

    monkeypatch.setattr(rollout, "generate", generate)


def test_one_sampling_pass_gives_pass_at_k_and_maj_at_k(monkeypatch):
    from gcfamily.data.encoding import Formatter

    task = ArithmeticTask()
    rows = [
        {"prompt": "What is 2 + 3?", "answer": "5"},
        {"prompt": "What is 4 * 4?", "answer": "16"},
        {"prompt": "What is 1 + 1?", "answer": "2"},
    ]
    completions = [
        *["5", "It is 6", "5.0", "no idea"],  # 5 wins 2 to 1 and is right; c = 2
        *["15", "16", "15", "16"],  # a tie: 15 is sampled first and wins, wrong; c = 2
        *["", "?", "none", "x"],  # no answer at all: wrong; c = 0
    ]
    calls = []
    _fake_generate(monkeypatch, completions, calls)
    got = sampled_eval(
        torch.nn.Module(),
        Formatter(_Tok(), "raw"),
        rows,
        task.reward,
        4,
        temperature=0.7,
        batch_prompts=2,
        answer=answer_extractor(task),
    )
    assert calls == [(2, 4, 0.7), (1, 4, 0.7)]  # two batches of prompts, 4 samples each, at the given temperature
    assert got.maj_at_k == pytest.approx(1 / 3)
    # pass@1 = c/4 averaged: (2/4 + 2/4 + 0) / 3; pass@2 = 1 - C(2,2)/C(4,2) = 5/6 for each of the first two
    assert got.pass_at_k[1] == pytest.approx(1 / 3)
    assert got.pass_at_k[2] == pytest.approx((5 / 6 + 5 / 6 + 0) / 3)
    assert got.pass_at_k[4] == pytest.approx(2 / 3)  # pass@4 right on two prompts where maj@4 is right on one
    assert got.prompts == 3 and got.unanswered == 1
    calls.clear()
    no_answer = sampled_eval(torch.nn.Module(), Formatter(_Tok(), "raw"), rows, task.reward, 4, batch_prompts=2)
    assert no_answer.maj_at_k is None and no_answer.pass_at_k == got.pass_at_k
    calls.clear()
    assert sampled_pass_at_k(torch.nn.Module(), Formatter(_Tok(), "raw"), rows, task.reward, 4, batch_prompts=2) == (
        got.pass_at_k
    )  # the old entry point: the dict, as before


def test_a_broken_answer_function_is_one_sentence(monkeypatch):
    from gcfamily.data.encoding import Formatter

    rows = [{"prompt": "What is 0 + 1?", "answer": "1"}]
    reward = ArithmeticTask().reward
    for bad, why in ((lambda c: [c], "TypeError"), (lambda c: 1 / 0, "ZeroDivisionError")):
        _fake_generate(monkeypatch, ["1", "2"], [])
        with pytest.raises(GcfError, match=f"the answer function .* failed on the completion '1' \\({why}"):
            sampled_eval(torch.nn.Module(), Formatter(_Tok(), "raw"), rows, reward, 2, answer=bad)


# ----------------------------------------------------------------------------- gcf eval --maj-k

FIGURES = re.compile(
    r"^tiny on arithmetic: maj@4 (\d\.\d{3}), pass@4 (\d\.\d{3}), pass@1 (\d\.\d{3}) from 4 samples per prompt "
    r"at temperature 1 over (\d+) prompts \((\d+) with no answer in any sample\) in [\d.]+ s$",
    re.MULTILINE,
)


def test_gcf_eval_prints_greedy_accuracy_maj_at_k_and_pass_at_k(gcf):
    code, out, err = gcf("eval", "--model", "tiny", "--task", "arithmetic", "--samples", "4", "--maj-k", "4")
    assert code == 0, err
    assert re.search(r"^tiny on arithmetic: held-out accuracy \d\.\d{3} \(\d+/4\) in [\d.]+ s$", out, re.MULTILINE), out
    found = FIGURES.search(out)
    assert found, out
    maj, pass_k, pass_1 = (float(x) for x in found.groups()[:3])
    assert int(found.group(4)) == 4 and int(found.group(5)) <= 4
    assert maj <= pass_k and pass_1 <= pass_k  # a right vote has a right sample; pass@k grows with k


def test_gcf_eval_maj_k_on_a_run_folder(gcf, tmp_path):
    run = tmp_path / "run"
    code, _, err = gcf(
        "run",
        "--method",
        "sft",
        "--model",
        "tiny",
        "--task",
        "arithmetic",
        "--max-steps",
        "1",
        "--output-dir",
        str(run),
    )
    assert code == 0, err
    code, out, err = gcf("eval", "--model", str(run), "--samples", "3", "--maj-k", "2", "--max-new-tokens", "4")
    assert code == 0, err
    assert "held-out accuracy" in out and re.search(r"maj@2 \d\.\d{3}, pass@2 \d\.\d{3}, pass@1 \d\.\d{3}", out), out


def test_gcf_eval_maj_k_refusals_are_one_line(gcf, tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text('{"prompt": "2+2=", "answer": "4"}\n')
    code, out, err = gcf("eval", "--model", "tiny", "--dataset", str(data), "--reward", "numeric", "--maj-k", "4")
    assert code == 2 and not out and err.startswith("error: Maj@K needs an answer extractor: rows scored by reward")
    assert len(err.strip().splitlines()) == 1, err
    code, _, err = gcf("eval", "--model", "tiny", "--temperature", "0.5")
    assert code == 2 and "--temperature sets the temperature of the --maj-k samples" in err, err
    assert len(err.strip().splitlines()) == 1, err


# ----------------------------------------------------------------------------- the bench tables


HEADER = {"model": "tiny", "task": "arithmetic", "budget": "steps:1", "machine": "m", "date": "d", "total_s": 1.0}
HEADER.update(load_start=0.0, load_end=0.0)
FIGS = {
    "returncode": 0,
    "steps": 1,
    "accuracy_before": 0.5,
    "accuracy_after": 0.5,
    "reward_final": None,
    "kl_ref": None,
    "step_s_median": 1.0,
    "train_tokens_per_s": None,
    "generation_tokens_per_s": None,
    "peak_memory_mb": None,
    "gc_mean": None,
    "gc_abs_mean": None,
    "gc_zero_frac": None,
}


def _cell(table, method):
    row = next(line for line in table.splitlines() if line.startswith(f"| {method} |"))
    header = next(line for line in table.splitlines() if line.startswith("| method |"))
    col = next(i for i, h in enumerate(header.split("|")) if "maj@k" in h)
    return row.split("|")[col].strip()


def test_bench_tables_show_maj_at_k_and_a_dash_for_old_results(tmp_path):
    import json

    from gcfamily.bench.report import summarise, table
    from gcfamily.bench.seeds import seeds_table

    old = tmp_path / "old"  # a result written before maj@k
    old.mkdir()
    (old / "metrics.jsonl").write_text(json.dumps({"step": 1, "time/step_s": 1.0, "time/data_s": 0.0}) + "\n")
    (old / "bench_child.json").write_text(json.dumps({"pass_at_k": {"1": 0.25, "4": 0.5}}))
    assert summarise(old, {"returncode": 0})["maj_at_k"] is None
    results = {
        "grpo": {**FIGS, "pass_at_1": 0.25, "pass_at_k": 0.5, "k": 4, "maj_at_k": 0.375},
        "sft": {**FIGS, "pass_at_1": 0.25, "pass_at_k": 0.5, "k": 4},
    }
    md = table(results, HEADER)
    assert _cell(md, "grpo") == "0.250 / 0.500 / 0.375 (k=4)"
    assert _cell(md, "sft") == "0.250 / 0.500 / - (k=4)"
    per_method = {
        "grpo": [{**r, "folder": str(tmp_path / "none"), "maj_at_k": m} for m, r in ((0.25, results["grpo"]),) * 2],
        "sft": [{**results["sft"], "folder": str(tmp_path / "none")}],
    }
    per_method["grpo"][1]["maj_at_k"] = 0.5
    md = seeds_table(per_method, HEADER, "sft")
    assert _cell(md, "grpo") == "0.250 / 0.500 / 0.375 (k=4)"  # maj@k: the mean of the two seeds' 0.25 and 0.5
    assert _cell(md, "sft") == "0.250 / 0.500 / - (k=4)"
