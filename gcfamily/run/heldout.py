"""Held-out generation and scoring: greedy (or sampled) completions of held-out prompts, scored by a reward. Plain
functions of a policy and rows, used by `gcf eval` and by the run's Evaluation (gcfamily/run/evaluation.py).

On a built-in task the reward is the task's and the figure is accuracy (the share of prompts whose
completion scores >= 1). On your own data (`gcf eval --dataset D --reward R`, or `eval_dataset`
during training) the figures are the mean of the weighted total reward (eval/reward_mean), the mean of
each reward alone (eval/reward/<name>, over the samples it scored), and eval/accuracy only where a reward
is a correctness check: one that returns 1 for a right answer and 0 otherwise, the built-in `numeric`
and `exact` or a function marked with `rewards.correctness_reward`. Accuracy is then the fraction of
samples that every correctness reward scored exactly 1 (a sample a correctness reward failed on counts
as wrong); the other rewards and the weights play no part in it. Prompts go through the same Formatter
as training.

From K completions sampled per prompt (`sampled_eval`, one pass) come pass@1..K and Maj@K: the share of prompts
whose majority answer is right. A sample's answer is read by the task's `answer` (Task.answer); the majority
answer is the most common one among the samples that give an answer, a tie going to the tied answer that appears
first among the K samples; a prompt none of whose samples gives an answer counts as wrong. The voted answer is
right when a sample carrying it scores >= 1 under the reward. That is exact when the reward depends on a
completion only through its answer, so that every sample carrying one answer scores the same: true of the
built-in tasks (arithmetic and gsm8k read the number `numeric_match` reads, sorting the integers `sorting_reward`
reads, countdown the value and numbers `countdown_reward` checks). For a reward that reads more than the answer,
an answer some but not all of whose samples score >= 1 counts as right.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from gcfamily.core.onednn import packed_linears
from gcfamily.data.encoding import Formatter, encode
from gcfamily.errors import GcfError
from gcfamily.run.console import ticking

Answer = Callable[[str], Hashable | None]  # a completion's answer for the vote, None where it gives none


@torch.no_grad()
def evaluate_rows(
    model: Any,
    formatter: Formatter,
    rows: list[dict[str, Any]],
    reward: Any,
    max_new_tokens: int = 32,
    batch_size: int = 128,
    n: int | None = None,
    accuracy: bool | None = None,
    details: list[dict[str, Any]] | None = None,
    bar: Any = None,
    episodes: tuple[Any, Any] | None = None,
) -> dict[str, float]:
    """Greedy completions (with `episodes`, (envs, EpisodeLimits): greedy episodes, methods/episodes.py) of the first n rows scored by `reward` (see the module docstring for each figure); `bar`, a
    tqdm bar (gcfamily/run/console.py), moves by prompts and shows the token each batch decodes.

    eval/reward_mean (the weighted total), eval/reward/<name> (each reward of a rewards.Rewards alone),
    eval/reward_failed, eval/prompts and eval/accuracy. accuracy=True (a task's reward): the share of rows whose
    total scores >= 1; None: the share of rows that every correctness reward scored 1, reported only where a reward
    is one (scoring.Term.correctness); False: none.
    rows are prompt-only or prompt-completion rows; `reward` is a rewards.Rewards or any reward function.
    `details`, when given, receives one {index, prompt, completion, reward} per row (reward None where it failed;
    `correct` too where accuracy is reported), what `gcf bench` pairs across methods and seeds.
    """
    from gcfamily.methods.samples import scored_episodes
    from gcfamily.rewards import as_rewards
    from gcfamily.rollout import SamplingSettings, build_backend

    data = encode("prompts", rows[: n if n is not None else len(rows)], formatter, 1 << 30, "skip", "evaluation")
    rewards = as_rewards(reward)
    checks = [t.name for t in rewards.terms if t.correctness]
    counted = bool(accuracy) or (accuracy is None and bool(checks))
    model.eval()
    sampler = build_backend("native", model, formatter.tokenizer)  # the rollout interface, as a run's sampling
    settings = SamplingSettings(greedy=True, max_new_tokens=max_new_tokens)
    total, ok, correct, turns = 0.0, 0, 0, 0
    if bar is not None:
        bar.total = len(data.rows)
    each = {t.name: [0.0, 0] for t in rewards.terms}  # name -> [sum of its valid values, samples it scored]
    with packed_linears(model, batch_size):  # the CPU weights packed once for every batch, not once a batch
        for s in range(0, len(data.rows), batch_size):
            part = data.rows[s : s + batch_size]
            prompts = data.examples[s : s + batch_size]
            with ticking(model, bar, max_new_tokens):  # with an environment, greedy episodes scored as in training
                eps, scored = scored_episodes(sampler.generate, formatter, *episodes, prompts, part, 1, settings, rewards) if episodes else (None, None)  # fmt: skip
                out = sampler.generate(prompts, 1, settings) if eps is None else eps.rollout
            columns = {k: [r.get(k) for r in part] for k in part[0] if k not in ("prompt", "completion")}
            if eps is None:
                scored = rewards.score([r["prompt"] for r in part], out.completions, None, columns)
            else:
                turns += sum(sum(lp is not None for _, lp in ep.pieces) for ep in eps.episodes)
            for name, (r_k, ok_k) in scored.per_reward.items():
                each[name][0] += float((r_k.double() * ok_k).sum())
                each[name][1] += int(ok_k.sum())
            for j, (r, valid) in enumerate(zip(scored.rewards.tolist(), scored.valid.tolist())):
                if accuracy:  # a task's reward: right when the whole reward reaches 1
                    right = valid and r >= 1.0
                else:  # every correctness reward gave this sample exactly 1
                    right = bool(checks) and all(
                        bool(scored.per_reward[c][1][j]) and float(scored.per_reward[c][0][j]) == 1.0 for c in checks
                    )
                if valid:
                    total, ok = total + r, ok + 1
                correct += right
                if details is not None:
                    row = {
                        "index": s + j,
                        "prompt": part[j]["prompt"],
                        "completion": out.completions[j],
                        "reward": r if valid else None,
                        **({"turns": eps.episodes[j].turns} if eps is not None else {}),
                    }
                    details.append({**row, "correct": right} if counted else row)
            if bar is not None:
                bar.update(len(part))
    m = len(data.rows)
    metrics = {"eval/reward_mean": total / max(ok, 1), "eval/reward_failed": float(m - ok), "eval/prompts": float(m)}
    metrics.update({f"eval/reward/{name}": v / max(k, 1) for name, (v, k) in each.items()})
    if counted:
        metrics["eval/accuracy"] = correct / max(m, 1)
    if episodes is not None:
        metrics["eval/turns_mean"] = turns / max(m, 1)
    return metrics


@torch.no_grad()
def heldout_accuracy(
    model: Any,
    tokenizer: Any,
    task: Any,
    n: int = 64,
    max_new_tokens: int = 32,
    batch_size: int = 128,
    formatter: Formatter | None = None,
    details: list[dict[str, Any]] | None = None,
    bar: Any = None,
    episodes: tuple[Any, Any] | None = None,
) -> float:
    """Fraction of the held-out prompts (the first n test rows, each prompt once) of a task whose greedy completion
    (or episode) scores >= 1 under the task's reward; `details`, `bar` and `episodes` as in evaluate_rows."""
    rows = task.heldout_rows(n)
    if not rows:
        return 0.0
    fmt = formatter or Formatter(tokenizer)
    got = evaluate_rows(model, fmt, rows, task.reward, max_new_tokens, batch_size, accuracy=True, details=details, bar=bar, episodes=episodes)  # fmt: skip
    return got["eval/accuracy"]


def accuracy_rule(rewards: Any, rows: list[dict[str, Any]]) -> tuple[bool | None, str]:
    """How `gcf eval --dataset` counts accuracy: evaluate_rows' `accuracy` argument and what the figure measures, or
    False and the one sentence that says why there is none. A correctness reward decides where there is one; else,
    where every row carries an `answer`, a row is right when its total reward reaches 1 (a user's reward that
    returns 1 for a right answer and 0 for a wrong one counts as correctness that way)."""
    checks = [t.name for t in rewards.terms if t.correctness]
    if checks:
        return None, f"rows that {' and '.join(checks)} scored 1"
    if rows and all("answer" in r for r in rows):
        return True, "rows whose total reward reached 1"
    return False, (
        "no accuracy: the rows carry no `answer` column and no reward is a correctness check (numeric, exact, or a "
        "function marked with gcfamily.rewards.correctness_reward), so nothing says which completions are right."
    )


def save_details(path: str, details: list[dict[str, Any]]) -> None:
    """Every scored prompt as one JSON line: index, prompt, completion, reward (None where it failed) and correct (the
    verdict; None where no accuracy is counted)."""
    import json
    from pathlib import Path

    try:
        Path(path).write_text("".join(json.dumps({"correct": None, **d}) + "\n" for d in details), encoding="utf-8")
    except OSError as e:
        raise GcfError(f"--save could not write {path} ({e.strerror or e}); give a file in a writable folder.") from e


def majority_answer(answers: Sequence[Hashable | None]) -> Hashable | None:
    """The most common answer among one prompt's samples (None votes for nothing); a tie goes to the tied answer that
    appears first among the samples; None when no sample gives an answer."""
    counts = Counter(a for a in answers if a is not None)  # in order of first appearance
    best = max(counts.values(), default=0)
    return next((a for a, c in counts.items() if c == best), None)


def majority_right(answers: Sequence[Hashable | None], correct: Sequence[bool]) -> bool:
    """Whether one prompt's majority answer is right: a sample carrying it scored >= 1 (`correct`); False without one."""
    voted = majority_answer(answers)
    return voted is not None and any(ok for a, ok in zip(answers, correct) if a is not None and a == voted)


def maj_at_k(answers: Sequence[Sequence[Hashable | None]], correct: Sequence[Sequence[bool]]) -> float:
    """Maj@K: the share of prompts whose majority answer is right; answers[i][j] and correct[i][j] are prompt i's
    sample j's answer and whether it scored >= 1."""
    return sum(majority_right(a, c) for a, c in zip(answers, correct)) / max(len(answers), 1)


def task_answer(task: Any) -> Answer | None:
    """The task's `answer` where its class defines one (Task's default reads none), else None."""
    from gcfamily.tasks.base import Task

    if task is None or getattr(type(task), "answer", Task.answer) is Task.answer:
        return None
    return task.answer


def answer_extractor(task: Any = None, answer: Answer | None = None) -> Answer:
    """What Maj@K votes with: `answer` when given, else the task's; GcfError when there is neither."""
    found = answer if answer is not None else task_answer(task)
    if found is not None:
        return found
    if task is not None:
        raise GcfError(
            f"Maj@K needs an answer extractor: task '{getattr(task, 'name', type(task).__name__)}' defines no "
            "answer(completion) method; give it one that reads the answer its reward reads, or leave out Maj@K."
        )
    raise GcfError(
        "Maj@K needs an answer extractor: rows scored by reward functions come with no function that reads the answer "
        "out of a completion; evaluate a built-in task (--task), or pass answer=fn to sampled_eval from Python."
    )


def _answers(answer: Answer, completions: Sequence[str]) -> list[Hashable | None]:
    """answer(c) for each completion; a raising or unhashable answer is one sentence."""
    name = getattr(answer, "__qualname__", type(answer).__name__)
    out = []
    for c in completions:
        try:
            a = answer(c)
            hash(a)
        except Exception as err:  # a user's function: its failure is theirs to fix, said in one sentence
            raise GcfError(
                f"the answer function '{name}' failed on the completion {c[:60]!r} ({type(err).__name__}: {err}); "
                "it must return a hashable answer (a number, a string, a tuple) or None."
            ) from None
        out.append(a)
    return out


@dataclass
class SampledEval:
    """What k samples per prompt give: pass@1..k and, with an answer function, Maj@k."""

    pass_at_k: dict[int, float]
    """pass@j for j = 1..k, the unbiased estimator averaged over prompts."""
    maj_at_k: float | None
    """The share of prompts whose majority answer is right; None without an answer function."""
    prompts: int
    """Prompts sampled."""
    unanswered: int
    """Prompts none of whose samples gave an answer (wrong under Maj@k); 0 without an answer function."""
    per_prompt: list[dict[str, Any]] = field(default_factory=list)
    """Per prompt, in order: its text, how many of the k samples scored >= 1, and whether its majority answer was right
    (None without an answer function), for paired comparisons across runs."""


@torch.no_grad()
def check_fits(model: Any, rows: int, max_new_tokens: int, what: str) -> None:
    """Refuse, in one sentence, a generation of `rows` rows at once whose key-value cache alone (float32, max_new_tokens
    + 1 positions) would not fit this machine's memory: `--maj-k 1000000` tried to allocate 94 GB."""
    from gcfamily.models.safety import machine_memory

    config = getattr(model, "config", None)
    layers = getattr(config, "num_hidden_layers", 1) or 1
    width = getattr(config, "hidden_size", 1) or 1
    need, memory = rows * (max_new_tokens + 1) * 2 * layers * width * 4, machine_memory()
    if need > memory:
        raise GcfError(
            f"{what} samples {rows:,} completions of up to {max_new_tokens} tokens at once, whose cache alone needs "
            f"{need / 2**30:,.0f} GiB, more than this machine's {memory / 2**30:,.0f} GiB; lower it."
        )


def sampled_eval(
    model: Any,
    formatter: Formatter,
    rows: list[dict[str, Any]],
    reward: Any,
    k: int,
    temperature: float = 1.0,
    max_new_tokens: int = 32,
    seed: int = 0,
    batch_prompts: int = 16,
    answer: Answer | None = None,
    episodes: tuple[Any, Any] | None = None,
) -> SampledEval:
    """pass@1..k and (with `answer`, e.g. `answer_extractor(task)`) Maj@k from the same k sampled completions per prompt
    (with `episodes`, as in evaluate_rows, k episodes, voted on their last turns). A sample is correct when it scores
    >= 1; pass@j is the unbiased estimator over the k samples, Maj@k as in the module docstring."""
    from gcfamily.core.stats import pass_at_k
    from gcfamily.methods.samples import scored_episodes
    from gcfamily.rewards import as_rewards
    from gcfamily.rollout import SamplingSettings, build_backend

    check_fits(model, min(batch_prompts, len(rows)) * k, max_new_tokens, f"--maj-k {k}")
    data = encode("prompts", rows, formatter, 1 << 30, "skip", "evaluation")
    rewards = as_rewards(reward)
    model.eval()
    sampler = build_backend("native", model, formatter.tokenizer)  # the rollout interface, as a run's sampling
    settings = SamplingSettings(temperature=temperature, max_new_tokens=max_new_tokens)
    gen = torch.Generator().manual_seed(seed)
    correct: list[list[bool]] = []  # [prompts][k]
    answers: list[list[Hashable | None]] = []  # [prompts][k]
    with packed_linears(model, batch_prompts * k):  # the CPU weights packed once for every batch, not once a batch
        for s in range(0, len(data.rows), batch_prompts):
            part, prompts = data.rows[s : s + batch_prompts], data.examples[s : s + batch_prompts]
            if episodes is not None:  # k episodes of each prompt, scored as training scores them
                sample = lambda p, G, st: sampler.generate(p, G, st, gen)  # noqa: E731
                eps, scored = scored_episodes(sample, formatter, *episodes, prompts, part, k, settings, rewards)
                out = eps.rollout
            else:
                out = sampler.generate(prompts, k, settings, gen)
                columns = {key: [r.get(key) for r in part for _ in range(k)] for key in part[0] if key not in ("prompt", "completion")}  # fmt: skip
                scored = rewards.score([r["prompt"] for r in part for _ in range(k)], out.completions, None, columns)
            ok = [(v and r >= 1.0) for r, v in zip(scored.rewards.tolist(), scored.valid.tolist())]
            correct += [ok[i * k : (i + 1) * k] for i in range(len(part))]  # generate returns each prompt's k together
            if answer is not None:
                got = _answers(answer, out.completions)
                answers += [got[i * k : (i + 1) * k] for i in range(len(part))]
    n = len(correct)
    details = [
        {
            "prompt": str(row["prompt"]),
            "correct": sum(c),
            "maj_right": majority_right(a, c) if answer is not None else None,
        }
        for row, c, a in zip(data.rows, correct, answers if answer is not None else [[]] * n)
    ]
    return SampledEval(
        pass_at_k={j: sum(pass_at_k(k, sum(c), j) for c in correct) / max(n, 1) for j in range(1, k + 1)},
        maj_at_k=maj_at_k(answers, correct) if answer is not None else None,
        prompts=n,
        unanswered=sum(all(a is None for a in row) for row in answers),
        per_prompt=details,
    )


def sampled_pass_at_k(
    model: Any,
    formatter: Formatter,
    rows: list[dict[str, Any]],
    reward: Any,
    k: int,
    temperature: float = 1.0,
    max_new_tokens: int = 32,
    seed: int = 0,
    batch_prompts: int = 16,
) -> dict[int, float]:
    """pass@j for j = 1..k from k sampled completions per prompt: `sampled_eval`'s pass_at_k."""
    return sampled_eval(model, formatter, rows, reward, k, temperature, max_new_tokens, seed, batch_prompts).pass_at_k


def accuracy_change(details_path: Any, confidence: float = 0.95) -> dict[str, Any] | None:
    """Held-out accuracy before training and after it, on the same prompts, from a run's eval_details.jsonl: the
    evaluation at step 0 against the last one, paired by (index, prompt) where both recorded a verdict (`correct`).

    {"n", "before", "after" (counts right), "diff" (after - before, as a share), "lo", "hi" (the paired bootstrap
    interval of diff over prompts, gcfamily/core/stats.py), "step"}; None without both evaluations.
    """
    import json
    from pathlib import Path

    from gcfamily.core.stats import paired_bootstrap

    path = Path(details_path)
    if not path.is_file():
        return None
    records = []
    for line in path.read_text().splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if isinstance(rec, dict) and isinstance(rec.get("rows"), list):
            records.append(rec)
    first = next((r for r in records if r.get("step") == 0), None)
    later = [r for r in records if isinstance(r.get("step"), int) and r["step"] > 0]
    if first is None or not later:
        return None
    last = max(later, key=lambda r: r["step"])

    def verdicts(rec: dict[str, Any]) -> dict[tuple[Any, Any], bool]:
        return {(r.get("index"), r.get("prompt")): bool(r["correct"]) for r in rec["rows"] if "correct" in r}

    a, b = verdicts(last), verdicts(first)
    keys = sorted(set(a) & set(b), key=lambda k: (str(k[0]), str(k[1])))
    if not keys:
        return None
    after, before = [float(a[k]) for k in keys], [float(b[k]) for k in keys]
    boot = paired_bootstrap(after, before, confidence=confidence)
    return {
        "n": len(keys),
        "before": int(sum(before)),
        "after": int(sum(after)),
        "diff": boot["diff"],
        "lo": boot["lo"],
        "hi": boot["hi"],
        "step": last["step"],
    }
