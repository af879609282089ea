"""Held-out evaluation that says what it measured: each reward's mean, accuracy only from a correctness reward, and
SFT's and DPO's own objective on eval_dataset, each checked against a computation written here from a model forward."""

import json

import pytest
import torch
import torch.nn.functional as F
from conftest import metrics_rows

import gcfamily as gcf

SEED = 3
SMALL = dict(
    model="tiny",
    max_steps=1,
    batch_size=2,
    max_new_tokens=4,
    chat_format="raw",
    eval_at_ends=True,
    lr=1e-2,
    seed=SEED,
    progress=False,
    report_to="none",
)
VERDICTS = ["right", "wrong", "wrong", "right", "wrong", "wrong", "right", "wrong"]  # 3 of 8 right


@pytest.fixture(autouse=True)
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def judged(prompts, completions, verdict, **kw):
    """A correctness check whose right answers are known: the row's verdict says whether it is right."""
    return [1.0 if v == "right" else 0.0 for v in verdict]


def brevity(prompts, completions, **kw):
    """Not a correctness check: a length penalty."""
    return [-len(c) / 10 for c in completions]


def _demos(n):
    return [{"prompt": f"Q{i}: {i}+{i}=", "completion": f" {2 * i}" + "!" * (i % 3)} for i in range(n)]


# ---------------------------------------------------------------------------------- rewards


def test_builtin_correctness_checks_are_marked_and_a_user_reward_can_be():
    from gcfamily.rewards import Rewards, correctness_reward

    terms = Rewards.from_specs(["numeric", "exact", "boxed", brevity]).terms
    assert [t.correctness for t in terms] == [True, True, False, False]
    mine = correctness_reward(lambda prompts, completions, **kw: [1.0] * len(completions))
    assert Rewards.from_specs([mine]).terms[0].correctness


def test_accuracy_counts_the_correctness_reward_alone_and_each_reward_is_logged(tmp_path, monkeypatch):
    import gcfamily.run.evaluation as evaluation
    from gcfamily.rewards import correctness_reward

    written = []
    real = evaluation.append_lines
    monkeypatch.setattr(evaluation, "append_lines", lambda path, lines: (written.append(path), real(path, lines)))
    held = [{**r, "verdict": v, "answer": "1"} for r, v in zip(_demos(8), VERDICTS)]
    out = gcf.train(
        method="sft",
        dataset=_demos(6),
        eval_dataset=held,
        reward=[correctness_reward(judged), brevity],
        reward_weights=[1.0, 0.5],
        output_dir=tmp_path / "run",
        **SMALL,
    )
    evals = [r for r in metrics_rows(out) if "eval/reward_mean" in r]
    details = [json.loads(x) for x in (out / "eval_details.jsonl").read_text().splitlines()]
    assert [r["step"] for r in evals] == [0, 1] and [d["step"] for d in details] == [0, 1]
    assert written == [out / "eval_details.jsonl"] * 2
    for row, detail in zip(evals, details):
        completions = [d["completion"] for d in detail["rows"]]
        assert len(completions) == 8 and any(completions)  # the length reward has something to penalise
        lengths = [-len(c) / 10 for c in completions]
        # 3 of 8 right: the weighted total of a right one is 1 - 0.05 * len < 1, so a total >= 1 rule would read 0
        assert row["eval/accuracy"] == 3 / 8
        assert row["eval/reward/judged"] == 3 / 8
        assert row["eval/reward/brevity"] == pytest.approx(sum(lengths) / 8, abs=1e-6)
        want = sum((v == "right") + 0.5 * b for v, b in zip(VERDICTS, lengths)) / 8
        assert row["eval/reward_mean"] == pytest.approx(want, abs=1e-6)
        assert [d["correct"] for d in detail["rows"]] == [v == "right" for v in VERDICTS]
        assert "eval/loss" in row  # SFT with a reward: its held-out loss as well as the rewards


def test_no_accuracy_without_a_correctness_reward(tmp_path):
    held = [{**r, "answer": "1"} for r in _demos(4)]
    out = gcf.train(
        method="sft",
        dataset=_demos(4),
        eval_dataset=held,
        reward=[brevity],
        output_dir=tmp_path / "run",
        **{**SMALL, "max_steps": 0},
    )
    (row,) = [r for r in metrics_rows(out) if "eval/reward_mean" in r]
    assert "eval/accuracy" not in row and "eval/reward/brevity" in row  # the rows carry an answer: not enough


# ---------------------------------------------------------------------------------- the methods' own objective


def _ids(tok, prompt, completion):
    """Raw rows: the prompt with special tokens, the completion without, then EOS."""
    p = tok(prompt, add_special_tokens=True)["input_ids"]
    return p, tok(completion, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]


@torch.no_grad()
def _completion_logps(model, tok, prompt, completion):
    """log pi(o_t | q, o_<t) for each completion token, one row at a time with no padding."""
    p, c = _ids(tok, prompt, completion)
    ids = torch.tensor([p + c])
    logp = F.log_softmax(model(ids).logits[0].double(), -1)  # [T, V]
    return torch.stack([logp[len(p) + t - 1, c[t]] for t in range(len(c))])


def _models(out):
    """(the initial policy, the final one) of a run: tiny with the run's seed, and what the run saved."""
    from transformers import AutoModelForCausalLM

    from gcfamily.models import tiny_model, tiny_tokenizer

    tok = tiny_tokenizer()
    return tok, tiny_model(len(tok), seed=SEED).eval(), AutoModelForCausalLM.from_pretrained(out).eval()


def test_sft_logs_the_mean_token_nll_of_the_held_out_rows(tmp_path):
    held = _demos(5)
    out = gcf.train(method="sft", dataset=_demos(6), eval_dataset=held, output_dir=tmp_path / "run", **SMALL)
    evals = [r for r in metrics_rows(out) if "eval/loss" in r]
    assert [r["step"] for r in evals] == [0, 1] and not any("eval/reward_mean" in r for r in evals)  # no reward
    tok, before, after = _models(out)
    for row, model in zip(evals, (before, after)):
        nll = [-_completion_logps(model, tok, r["prompt"], r["completion"]) for r in held]
        want = float(torch.cat(nll).sum() / sum(len(x) for x in nll))  # per token, over every held-out row
        assert row["eval/loss"] == pytest.approx(want, rel=1e-5)
    assert evals[0]["eval/loss"] != pytest.approx(evals[1]["eval/loss"], rel=1e-4)  # the step changed the policy


def test_dpo_logs_loss_margin_and_ranking_accuracy_of_the_held_out_pairs(tmp_path):
    beta = 0.5
    pairs = [
        {"prompt": f"Q{i}: {i}+{i}=", "chosen": f" {2 * i}", "rejected": f" {2 * i + 1}" + "?" * (i % 3)}
        for i in range(6)
    ]
    flipped = {**pairs[2], "chosen": pairs[2]["rejected"], "rejected": pairs[2]["chosen"]}  # the step ranks it wrong
    held = pairs[:2] + [flipped, {"prompt": "Z: 7+7=", "chosen": " 14", "rejected": " 15 or 16"}]
    out = gcf.train(
        method="dpo",
        dataset=pairs,
        eval_dataset=held,
        beta=beta,
        output_dir=tmp_path / "run",
        **{**SMALL, "batch_size": 6},
    )
    evals = [r for r in metrics_rows(out) if "eval/loss" in r]
    assert [r["step"] for r in evals] == [0, 1]
    tok, ref, after = _models(out)
    for row, model in zip(evals, (ref, after)):
        h = {
            side: torch.stack(
                [
                    beta
                    * (
                        _completion_logps(model, tok, r["prompt"], r[side]).sum()
                        - _completion_logps(ref, tok, r["prompt"], r[side]).sum()
                    )
                    for r in held
                ]
            )
            for side in ("chosen", "rejected")
        }
        m = h["chosen"] - h["rejected"]  # [P]
        assert row["eval/loss"] == pytest.approx(float(-F.logsigmoid(m).mean()), rel=1e-5, abs=1e-6)
        assert row["eval/margin"] == pytest.approx(float(m.mean()), rel=1e-4, abs=1e-6)
        assert row["eval/ranking_accuracy"] == float((m > 0).double().mean())
    assert evals[0]["eval/margin"] == 0.0 and evals[0]["eval/loss"] == pytest.approx(0.6931471805599453)  # pi = pi_ref
    assert evals[1]["eval/margin"] != 0.0 and 0 < evals[1]["eval/ranking_accuracy"] < 1  # m > 0 both ways


@pytest.mark.parametrize("method", ["ipo", "simpo", "orpo"])
def test_dpo_variants_log_their_own_held_out_loss(tmp_path, method):
    pairs = [{"prompt": f"Q{i}: {i}+{i}=", "chosen": f" {2 * i}", "rejected": f" {2 * i + 1}?"} for i in range(4)]
    out = gcf.train(
        method=method, dataset=pairs, eval_dataset=pairs[:2], output_dir=tmp_path / "run", **{**SMALL, "max_steps": 0}
    )
    (row,) = [r for r in metrics_rows(out) if "eval/loss" in r]
    assert row["eval/loss"] > 0 and {"eval/margin", "eval/ranking_accuracy"} <= set(row)


def test_the_summary_gives_the_held_out_change_with_counts_and_a_paired_interval(tmp_path):
    """accuracy_change pairs step 0 with the last evaluation prompt by prompt; the interval is a paired bootstrap,
    checked here against a hand count and against an independent normal-approximation width."""
    import json
    import math

    from gcfamily.run.heldout import accuracy_change
    from gcfamily.run.summary import summary

    n = 200
    before = [i % 5 < 2 for i in range(n)]  # 80 right
    after = [b or i % 5 == 2 for i, b in enumerate(before)]  # 40 more right, none lost: 120
    rows = lambda got: [{"index": i, "prompt": f"p{i}", "correct": c} for i, c in enumerate(got)]  # noqa: E731
    lines = [{"step": 0, "rows": rows(before)}, {"step": 5, "rows": rows(before)}, {"step": 10, "rows": rows(after)}]
    (tmp_path / "eval_details.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    got = accuracy_change(tmp_path / "eval_details.jsonl")
    assert (got["n"], got["before"], got["after"], got["step"]) == (200, 80, 120, 10)
    assert abs(got["diff"] - 0.2) < 1e-12 and got["lo"] < 0.2 < got["hi"]
    half = 1.96 * math.sqrt(0.2 * 0.8 / n)  # d_i is 1 on 40 prompts, 0 elsewhere: sd of d = sqrt(p(1-p))
    assert abs((got["hi"] - got["lo"]) / 2 - half) < 0.01
    text = summary([{"step": 0, "eval/accuracy": 0.4}, {"step": 10, "eval/accuracy": 0.6}], 10, 60.0, tmp_path, False)
    assert "held-out accuracy 0.400 (80/200) -> 0.600 (120/200) at step 10: +0.200, 95% interval [+0." in text
    assert "eval/accuracy" not in text  # said once, with counts
    (tmp_path / "eval_details.jsonl").write_text(json.dumps(lines[0]) + "\n")  # no evaluation after training
    assert accuracy_change(tmp_path / "eval_details.jsonl") is None


def test_the_last_step_is_evaluated_once_when_eval_every_lands_on_it(tmp_path):
    """eval_every landing on the last step is the evaluation after training: eval_at_ends adds no second one (each
    evaluation of the same weights is the same greedy decoding, so a second one is only time)."""
    for every, want in ((2, [0, 2, 4]), (3, [0, 3, 4])):
        out = tmp_path / f"e{every}"
        gcf.train(
            "sft",
            **{**SMALL, "max_steps": 4, "eval_every": every},
            dataset=_demos(8),
            eval_dataset=_demos(4),
            output_dir=out,
        )
        got = [r["step"] for r in metrics_rows(out) if any(k.startswith("eval/") for k in r)]
        assert got == want
