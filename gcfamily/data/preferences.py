"""Preference pairs: an offline set built from a task, implicit-prompt rows, and tokenisation.

A preference row is `{"prompt", "chosen", "rejected"}`. DPO and its variants train on them
directly; a Bradley-Terry reward model (and PPO through it) trains on the same rows.

`preference_rows` makes such rows with no network from any built-in task: the task's
reference completion is chosen, and the rejected one is a plausible wrong answer (a number
of the reference moved by a small offset) or, for a share of the rows, a malformed reply
with no answer at all. Every rejected completion is checked with the task's own reward, so
a pair is kept only when the task scores the chosen completion strictly higher.
"""

from __future__ import annotations

import random
import re
from typing import Any, Optional, Sequence

from gcfamily.errors import GcfError

MALFORMED = (
    "I'm not sure.",
    "Let me think about it.",
    "That is a hard question.",
    "The answer is a number.",
    "?",
)
"""Replies that answer nothing: the "malformed" side of a well-formed vs malformed pair."""

OFFSETS = (-10, -2, -1, 1, 2, 10)
_INT = re.compile(r"[0-9]+")
_TRIES = 8  # candidates per row before the row is dropped


def wrong_number(completion: str, rng: random.Random) -> Optional[str]:
    """The completion with one of its integers moved by a small offset, kept non-negative; None if it has none."""
    spans = list(_INT.finditer(completion))
    if not spans:
        return None
    s = rng.choice(spans)
    old = int(s.group())
    new = old + rng.choice(OFFSETS)
    if new < 0 or new == old:
        new = old + rng.choice([1, 2, 10])
    return completion[: s.start()] + str(new) + completion[s.end() :]


def _candidates(completion: str, rng: random.Random, malformed_fraction: float) -> list[str]:
    """Rejected completions to try, in order: wrong numbers (or first a malformed reply), then malformed fallbacks."""
    out: list[str] = []
    if rng.random() < malformed_fraction:
        out.append(rng.choice(MALFORMED))
    while len(out) < _TRIES - 2:
        wrong = wrong_number(completion, rng)
        if wrong is None:
            break
        out.append(wrong)
    out += rng.sample(MALFORMED, 2)
    return [c for c in out if c != completion]


def preference_rows(
    task: Any, n: Optional[int] = None, seed: int = 0, split: str = "train", malformed_fraction: float = 0.25
) -> list[dict[str, str]]:
    """`{"prompt", "chosen", "rejected"}` rows from a task: its reference completion vs a worse one.

    Deterministic in (task, n, seed, split). A row is kept only when the task's reward scores the
    rejected completion strictly below the chosen one, so the preference is the task's own.
    """
    rows = task.rows(split, n)
    rng = random.Random(f"preferences/{getattr(task, 'name', type(task).__name__)}/{seed}/{split}")
    cands = [_candidates(str(r["completion"]), rng, malformed_fraction) for r in rows]
    chosen_score = _score(task, rows, [str(r["completion"]) for r in rows])
    rejected: dict[int, str] = {}
    pending = [i for i in range(len(rows)) if cands[i]]
    for k in range(_TRIES):  # one batched reward call per round
        pending = [i for i in pending if k < len(cands[i])]
        if not pending:
            break
        scores = _score(task, [rows[i] for i in pending], [cands[i][k] for i in pending])
        for i, s in zip(pending, scores):
            if s < chosen_score[i]:
                rejected[i] = cands[i][k]
        pending = [i for i in pending if i not in rejected]
    out = [
        {"prompt": rows[i]["prompt"], "chosen": str(rows[i]["completion"]), "rejected": rejected[i]}
        for i in sorted(rejected)
    ]
    if not out:
        raise GcfError(
            f"Task {getattr(task, 'name', task)} gave no preference pairs (its reward never preferred the reference); pass --dataset with prompt/chosen/rejected rows."
        )
    return out


def _score(task: Any, rows: Sequence[dict], completions: list[str]) -> list[float]:
    """The task's reward of completions for rows, every other column passed along (TRL signature)."""
    keys = [k for k in rows[0] if k not in ("prompt", "completion")]
    columns = {k: [r.get(k) for r in rows] for k in keys}
    return [float(x) for x in task.reward([r["prompt"] for r in rows], completions, **columns)]
