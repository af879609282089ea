"""Loading rewards and scoring samples with one or several of them, so that no reward can sink or pollute a batch.

A sample is valid when every reward gives it a finite number; its reward is then the weighted
sum sum_k w_k r_k. A sample whose reward raised, returned None (TRL's "no reward"), a
non-number or a non-finite value is masked (valid=False) and counted, never silently scored 0.

Where each reward runs: built-in rewards (``numeric``, ``exact``, ``boxed``), a task's reward,
a reward model and any function object passed in Python run in this process (they are ours,
or the caller's own); a ``module:function`` or ``path/file.py:function`` reward runs in the
reward worker process (guard.py), where a crash, ``sys.exit``, ``os._exit`` or a hang past
``timeout`` fails that call's samples instead of ending the run.

Conversational data: when a sample's prompt is a list of messages, its completion is given to
the rewards as ``[{"role": "assistant", "content": text}]``, as TRL does.

Process supervision: a reward may score each step of a completion instead of the whole. Its value
for a completion is then a list of ``(end, score)`` pairs, ``end`` the character offset in the
completion just after the step (1 <= end <= len(completion)) and ``score`` a finite number; an
empty list means no step was scored. A number is one step ending at the completion's end, so
outcome supervision is the special case. With several rewards, each step's score is weighted by
its reward's weight and steps ending at the same offset add (``Scores.steps``). Outcome methods
read one number per completion and refuse step scores (``Scores.require_outcome``).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from gcfamily.errors import GcfError
from gcfamily.rewards.calling import call_values, load_user_reward, shorten, split_spec
from gcfamily.rewards.verifiable import _FLOAT32_MAX, REWARDS, RewardFn, _name, is_correctness


class RewardFailure(GcfError):
    """Raised when the rewards fail on every sample of a step (on every process, under torch.distributed)."""


def load_reward(spec: str) -> RewardFn:
    """Resolve a reward in this process: a built-in name (see ``REWARDS``) or ``module:function``.

    ``module`` is a dotted module name or a path to a .py file, e.g. ``my_rewards.py:length_penalty``.
    (`Rewards.from_specs` loads the same specs in the reward worker instead.)
    """
    if spec in REWARDS:
        return REWARDS[spec]
    if ":" not in spec:
        raise GcfError(f"unknown reward '{spec}'; use one of {', '.join(REWARDS)} or module:function.")
    return load_user_reward(spec)


def reward_specs(value: Any) -> list[str]:
    """The `reward` setting as a list of specs: None -> [], "numeric" -> ["numeric"], a list as it is."""
    if value is None:
        return []
    return [value] if isinstance(value, str) else list(value)


def as_completions(prompts: Sequence[Any], completions: Sequence[Any]) -> list[Any]:
    """Each completion as the rewards see it: a message list where its prompt is one (TRL's conversational form)."""
    return [
        [{"role": "assistant", "content": c}] if isinstance(p, list) and isinstance(c, str) else c
        for p, c in zip(prompts, completions)
    ]


def _as_steps(value: Any, text_len: int) -> list[tuple[int, float]] | None:
    """A step list [(end, score), ...] checked and sorted by end, or None when it is not one (see the module docstring)."""
    if isinstance(value, (str, bytes, dict)) or not isinstance(value, Sequence):
        return None
    out = []
    for item in value:
        if isinstance(item, (str, bytes)) or not isinstance(item, Sequence) or len(item) != 2:
            return None
        end, score = item
        if isinstance(end, bool) or not isinstance(end, numbers.Integral) or not 1 <= int(end) <= max(text_len, 1):
            return None
        score = _as_reward(score)
        if score is None:
            return None
        out.append((int(end), score))
    return sorted(out)


def _as_reward(value: Any) -> float | None:
    """A finite float, or None when the value is missing, non-numeric or non-finite."""
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()
    if not isinstance(value, numbers.Real):
        return None
    value = float(value)
    # Beyond float32's range the reward tensor would hold inf: as unusable as NaN.
    return value if math.isfinite(value) and abs(value) <= _FLOAT32_MAX else None


# --------------------------------------------------------------------------- several rewards


@dataclass
class Term:
    """One reward of a `Rewards`: a function called here, or a spec called in the worker."""

    name: str
    fn: Optional[RewardFn] = None
    spec: Optional[str] = None
    weight: float = 1.0
    correctness: bool | None = None
    """Whether this reward is a correctness check, 1 for a right answer and 0 otherwise (what eval/accuracy counts);
    None: as its function is marked (verifiable.correctness_reward; the built-ins numeric and exact are)."""

    def __post_init__(self) -> None:
        if self.correctness is None:
            self.correctness = self.fn is not None and is_correctness(self.fn)


@dataclass
class Scores:
    """What scoring a batch gives: the weighted total, who is valid, why the others are not, and each reward alone."""

    rewards: torch.Tensor  # [N] float32, sum_k w_k r_k where valid, 0 elsewhere
    valid: torch.Tensor  # [N] bool, every reward valid
    errors: list[str]  # one per invalid sample: its first failing reward's message
    # name -> (r_k [N], valid_k [N])
    per_reward: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    failed_by: list[str] = field(default_factory=list)  # per invalid sample, the name of its first failing reward
    steps: Optional[list[list[tuple[int, float]]]] = None
    """Per sample, its weighted step rewards [(end, score), ...] sorted by end, where any reward scored steps; None when
    every reward gave one number per completion (then `rewards` is all there is)."""
    step_rewards: tuple[str, ...] = ()
    """The rewards that returned step scores."""

    def require_outcome(self, method: str) -> None:
        """Refuse step scores for a method that reads one number per completion (one sentence naming the reward)."""
        if self.step_rewards:
            raise GcfError(
                f"reward '{self.step_rewards[0]}' scores steps (a list of (end, score) per completion), which {method} "
                "cannot use: it reads one number per completion; train with grpo-ps, or return one number per completion."
            )

    def failure_message(self) -> str:
        """One sentence for a batch where every sample failed, naming the function(s)."""
        names = list(dict.fromkeys(self.failed_by))
        who = (
            f"reward function '{names[0]}'"
            if len(names) == 1
            else "reward functions " + ", ".join(f"'{n}'" for n in names)
        )
        return f"{who} failed on all {len(self.valid)} samples (first: {self.errors[0]}); fix the function or its input columns."

    def stats(self) -> dict[str, float]:
        """Mean and std of each reward over the samples it scored, for the log (reward/<name>/mean, /std)."""
        out = {}
        for name, (r, ok) in self.per_reward.items():
            mean, std = mean_std(r, ok)
            out[f"reward/{name}/mean"], out[f"reward/{name}/std"] = mean, std
        return out


def mean_std(r: torch.Tensor, ok: torch.Tensor) -> tuple[float, float]:
    """Mean and (population) std of r over the samples where ok."""
    w = ok.double()
    n = max(float(w.sum()), 1.0)
    mean = float((r.double() * w).sum()) / n
    return mean, math.sqrt(float((((r.double() - mean) * w) ** 2).sum()) / n)


class Rewards:
    """Several rewards with weights, scored together; callable as one reward function (the weighted sum, None where invalid)."""

    def __init__(self, terms: Sequence[Term], worker: Any = None) -> None:
        if not terms:
            raise GcfError("no reward was given; pass --reward NAME (repeatable) or a task with a reward.")
        self.terms = list(terms)
        self.worker = worker  # guard.RewardWorker for the terms given as specs

    @classmethod
    def from_specs(cls, specs: Sequence[Any], weights: Sequence[float] = (), timeout: float = 0.0) -> "Rewards":
        """Built-in names and function objects (from Python) run here; module:function and file.py:function in one worker process (timeout per call)."""
        weights = list(weights) or [1.0] * len(specs)
        if len(weights) != len(specs):
            raise GcfError(
                f"reward_weights has {len(weights)} values for {len(specs)} rewards; give one weight per reward."
            )
        terms, taken = [], set()
        for spec, w in zip(specs, weights):
            if callable(spec):
                name = _name(spec)
            elif not isinstance(spec, str):
                raise GcfError(
                    f"reward {spec!r} is neither a reward name, module:function, path/file.py:function nor a function."
                )
            elif spec not in REWARDS and ":" not in spec:
                load_reward(spec)  # the unknown-name sentence
            if not callable(spec):
                name = spec if spec in REWARDS else split_spec(spec)[1]
            base, k = name, 2
            while name in taken:  # two rewards of the same name keep apart in the log
                name, k = f"{base}_{k}", k + 1
            taken.add(name)
            if callable(spec):
                terms.append(Term(name, fn=spec, weight=float(w)))
            else:
                terms.append(Term(name, fn=REWARDS.get(spec), spec=None if spec in REWARDS else spec, weight=float(w)))
        user = [t.spec for t in terms if t.spec is not None]
        worker = None
        if user:
            from gcfamily.rewards.guard import RewardWorker

            worker = RewardWorker(list(dict.fromkeys(user)), timeout)
        return cls(terms, worker)

    def close(self) -> None:
        """End the worker process, if any."""
        if self.worker is not None:
            self.worker.close()

    def _values(
        self, term: Term, prompts: list, completions: list, ids: Any, columns: dict, should_stop: Any
    ) -> tuple[list, dict]:
        if term.spec is not None:
            return self.worker.call(term.spec, term.name, prompts, completions, ids, columns, should_stop)
        return call_values(term.fn, term.name, prompts, completions, ids, columns)

    def score(
        self,
        prompts: Sequence[Any],
        completions: Sequence[str],
        completion_ids: Optional[Sequence[list[int]]] = None,
        columns: Optional[dict[str, Sequence[Any]]] = None,
        should_stop: Optional[Callable[[], bool]] = None,
    ) -> Scores:
        """Score N samples with every reward; never raises for a failing sample (see `Scores`), only for the user's setup."""
        n, columns = len(completions), dict(columns or {})
        if len(prompts) != n:
            raise GcfError(f"got {len(prompts)} prompts for {n} completions; pass one prompt per completion.")
        for key, col in columns.items():
            if len(col) != n:
                raise GcfError(f"column '{key}' has {len(col)} values for {n} completions; align it with the prompts.")
        if completion_ids is not None and len(completion_ids) != n:
            raise GcfError(f"got {len(completion_ids)} completion_ids for {n} completions; pass one per completion.")
        for reserved in ("prompts", "completions", "completion_ids"):
            columns.pop(reserved, None)  # the call's own arguments win over a column of the same name
        prompts, shown = list(prompts), as_completions(prompts, completions)
        ids = None if completion_ids is None else [list(x) for x in completion_ids]
        total = torch.zeros(n, dtype=torch.float64)  # [N]
        valid = torch.ones(n, dtype=torch.bool)  # [N]
        first_error: dict[int, tuple[str, str]] = {}  # sample -> (reward name, message)
        per_reward = {}
        steps: list[dict[int, float]] = [{} for _ in range(n)]  # per sample: end -> weighted score
        stepped: list[str] = []
        lengths = [len(c) if isinstance(c, str) else 0 for c in completions]
        for term in self.terms:
            values, raised = self._values(term, prompts, shown, ids, columns, should_stop)
            r = torch.zeros(n, dtype=torch.float64)  # [N]
            ok = torch.zeros(n, dtype=torch.bool)  # [N]
            for i, value in enumerate(values):
                reward = None if i in raised else _as_reward(value)
                these = None if i in raised or reward is not None else _as_steps(value, lengths[i])
                if these is not None:  # step scores: the sample's total is their sum (logged; outcome methods refuse)
                    reward = float(sum(sc for _, sc in these))
                    if term.name not in stepped:
                        stepped.append(term.name)
                else:
                    these = [(max(lengths[i], 1), reward)] if reward is not None else None  # one step at the end
                if reward is None:
                    why = raised[i] if i in raised else f"returned {shorten(repr(value))}"
                    first_error.setdefault(i, (term.name, f"reward function '{term.name}' {why} on sample {i}"))
                else:
                    r[i], ok[i] = reward, True
                    for end, sc in these:
                        steps[i][end] = steps[i].get(end, 0.0) + term.weight * sc
            per_reward[term.name] = (r.float(), ok)
            total += term.weight * r
            valid &= ok
        valid &= total.abs() <= _FLOAT32_MAX  # a weighted sum past float32's range would be inf
        total = torch.where(valid, total, torch.zeros_like(total)).float()
        for i in range(n):
            if not valid[i] and i not in first_error:
                first_error[i] = ("weighted sum", f"the weighted sum of the rewards overflows float32 on sample {i}")
        failed = [first_error[i] for i in sorted(first_error)]
        step_lists = [sorted(d.items()) if valid[i] else [] for i, d in enumerate(steps)] if stepped else None
        return Scores(
            total, valid, [m for _, m in failed], per_reward, [k for k, _ in failed], step_lists, tuple(stepped)
        )

    def __call__(self, prompts: list, completions: list, **columns: Any) -> list[Optional[float]]:
        """The weighted sum per completion, None where a reward failed (TRL's convention)."""
        ids = columns.pop("completion_ids", None)
        s = self.score(prompts, completions, ids, columns)
        return [float(r) if ok else None for r, ok in zip(s.rewards.tolist(), s.valid.tolist())]


def as_rewards(fn: Any) -> Rewards:
    """A `Rewards` as it is; any other reward function as a single reward called in this process."""
    return fn if isinstance(fn, Rewards) else Rewards([Term(_name(fn), fn=fn)])


def score(
    fn: RewardFn,
    prompts: list[Any],
    completions: list[str],
    columns: dict[str, Sequence[Any]],
    completion_ids: Optional[Sequence[list[int]]] = None,
) -> tuple[torch.Tensor, torch.Tensor, list[str]]:
    """Call one reward function so that one bad sample cannot sink, or silently pollute, a batch.

    Returns ``rewards`` [N] float32, ``valid`` [N] bool and one error message per
    invalid sample. If the batch call raises, each sample is retried alone. A
    sample whose call raises, or whose value is None, non-numeric or non-finite,
    gets valid=False and reward 0; callers must mask it. Raises ``RewardFailure``
    when every sample is invalid, and ``GcfError`` when the function returns the
    wrong number of values.
    """
    s = as_rewards(fn).score(prompts, completions, completion_ids, columns)
    if len(s.valid) and not s.valid.any():
        raise RewardFailure(s.failure_message())
    return s.rewards, s.valid, s.errors
