"""The Task interface and the helpers every built-in task shares: stable splits and row cycling.

A task makes prompts with references and scores completions, offline. Splits
are decided by a stable hash of the problem (sha256, never Python's salted
``hash()``), so the test set is the same on every machine and every seed, and
no test problem is ever trained on.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Callable, Hashable, Sequence
from typing import Any

from gcfamily.errors import GcfError

SPLITS = ("train", "test")


def stable_hash(key: Hashable) -> int:
    """A 64-bit hash of ``repr(key)`` that is the same in every process (unlike ``hash()``)."""
    return int.from_bytes(hashlib.sha256(repr(key).encode()).digest()[:8], "big")


def in_test_split(key: Hashable, test_fraction: float) -> bool:
    """Whether a problem belongs to the test split, by thresholding its stable hash."""
    return stable_hash(key) < test_fraction * 2**64


def lowest_hash_keys(keys: Sequence[Hashable], test_fraction: float) -> set[Hashable]:
    """The exact ``round(test_fraction * len(keys))`` keys of lowest stable hash.

    For small enumerable spaces (100 problems) a threshold would give a test
    set of noisy size; ranking by hash gives exactly the fraction asked for.
    """
    ranked = sorted(set(keys), key=stable_hash)
    return set(ranked[: round(test_fraction * len(ranked))])


def check_split(split: str, n: int | None) -> None:
    """Raise GcfError for a split name or row count a user could mistype."""
    if split not in SPLITS:
        raise GcfError(f"unknown split '{split}'; use 'train' or 'test'.")
    if n is not None and (not isinstance(n, int) or n < 0):
        raise GcfError(f"row count n={n!r} is not a non-negative integer; pass n=None for the whole split.")


def shuffled(items: Sequence[Any], *seed_parts: Any) -> list[Any]:
    """A copy of ``items`` in an order fixed by ``seed_parts`` (str seeds hash stably in ``random``)."""
    out = list(items)
    random.Random("/".join(map(str, seed_parts))).shuffle(out)
    return out


def take(rows: Sequence[dict], n: int | None) -> list[dict]:
    """The first n rows, cycling when n exceeds the split; every row is a fresh dict."""
    if n is None:
        n = len(rows)
    if n and not rows:
        raise GcfError("this split has no problems; enlarge the task (its size option) or ask for n=0.")
    return [dict(rows[i % len(rows)]) for i in range(n)]


class Task:
    """A source of prompts with reference answers, and the reward that scores completions.

    Subclasses set ``name`` and ``description``, build their problems in
    ``__init__`` (deterministic given ``seed`` and options), and implement
    ``split_rows`` and ``reward``; ``answer`` (optional) reads a completion's answer for Maj@K.
    """

    name: str = ""
    description: str = ""

    def __init__(self, seed: int = 0) -> None:
        self.seed = seed

    def split_rows(self, split: str) -> list[dict]:
        """Every row of a split, in the task's seeded order."""
        raise NotImplementedError

    def rows(self, split: str, n: int | None = None) -> list[dict]:
        """Rows ``{"prompt", "completion", "answer", ...}`` of ``split`` ("train" or "test").

        ``n=None`` returns the whole split; a larger ``n`` cycles through it
        deterministically.
        """
        check_split(split, n)
        return take(self.split_rows(split), n)

    def heldout_rows(self, n: int | None = None) -> list[dict]:
        """The held-out prompts every evaluation uses: the first ``n`` test rows, each prompt once.

        A split smaller than ``n`` cycles in ``rows``, and a mixed task cycles its small levels (arithmetic's
        single-digit ones hold 19 test problems each), so ``n`` is an upper bound: a repeated prompt would add
        no information and narrow every interval computed over the answers.
        """
        seen: set[str] = set()
        return [r for r in self.rows("test", n) if not (r["prompt"] in seen or seen.add(r["prompt"]))]

    def reward(self, prompts: list[str], completions: list[str], **columns: Any) -> list[float]:
        """The task's default reward function (TRL signature)."""
        raise NotImplementedError

    def answer(self, completion: str) -> Hashable | None:
        """The answer a completion gives, read the way ``reward`` reads it, for majority voting (Maj@K); None: no answer.

        Two completions with equal answers must get the same reward on a row, so that the vote's winner is right
        exactly when the completions carrying it score >= 1. This default reads no answer: a task that does not
        override it has no Maj@K (``run.heldout.task_answer`` tells the two apart), rather than a Maj@K of zero.
        """
        return None

    def __repr__(self) -> str:
        return f"{type(self).__name__}(seed={self.seed})"


def generate_problems(
    make: Callable[[random.Random], dict], key: Callable[[dict], Hashable], size: int, seed: int | str
) -> list[dict]:
    """Up to ``size`` distinct problems drawn with ``make`` from an RNG seeded by ``seed``.

    Stops after ``20 * size`` draws so that a small problem space cannot loop forever.
    """
    rng = random.Random(seed)
    seen: dict[Hashable, dict] = {}
    for _ in range(20 * size):
        if len(seen) >= size:
            break
        problem = make(rng)
        seen.setdefault(key(problem), problem)
    return list(seen.values())


def hash_split(
    problems: Sequence[Any],
    key: Callable[[Any], Hashable],
    to_row: Callable[[Any], dict],
    test_fraction: float,
    *seed_parts: Any,
) -> dict[str, list[dict]]:
    """Rows of each split: a problem is in test when its stable hash says so; each split in seeded order."""
    test = [in_test_split(key(p), test_fraction) for p in problems]
    return {
        split: shuffled([to_row(p) for p, t in zip(problems, test) if t == (split == "test")], *seed_parts, split)
        for split in SPLITS
    }


def check_fraction(test_fraction: float) -> None:
    """Raise GcfError unless 0 < test_fraction < 1."""
    if not 0.0 < test_fraction < 1.0:
        raise GcfError(f"test_fraction={test_fraction} is not between 0 and 1; use e.g. 0.2.")
