"""The episode runner: a prompt, then policy turns and environment answers until the environment says done.

    eps = run_episodes(services.generate, formatter, envs, prompt_ids, rows, G, sampling, limits)
    # eps.rollout: one row per episode, laid out as a single-turn rollout is: the left-padded prompt, then the episode
    #              (policy turns and the environment's tokens, right-padded); completion_mask and sample_logps on the
    #              policy's sampled tokens only, so the environment's tokens are context and carry no gradient
    # eps.finals:  the environment's final reward per episode (None: the run's reward scores the last turn)

Turn 1 is one call of the rollout backend for every prompt's G samples, the very call a single-turn run makes; each
later turn samples once more for the episodes still running, from their whole context (prompt, turns, answers). The
policy's tokens are kept as sampled (token in, token out): the context a turn was sampled from is exactly the one the
trainer scores it in. An episode ends when

    the environment says done                     (ended_by "done")
    its policy turn hit max_new_tokens            (the turn never ended: "length"; the environment does not see it)
    it has taken max_turns policy turns           ("turns"; the environment's last answer is not shown)
    the next turn would have no room left         ("tokens": max_episode_tokens or the model's context is reached)
    a turn reached the room its episode had left  ("length": sampled with the largest room of the turn's episodes,
                                                   its first tokens up to its own room kept, as a cap of its own would)
    its environment failed (raised, hung, answered garbage): the episode is invalid, with the reason

An observation longer than the room left is cut to leave one token for the policy's next turn (counted in
episode/obs_truncated, said once per run).
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch

from gcfamily.rollout import Rollout, SamplingSettings


@dataclass
class EpisodeLimits:
    """How long an episode may run."""

    max_turns: int = 4
    """Policy turns per episode (an environment's own max_turns lowers it)."""
    max_episode_tokens: int = 512
    """Tokens after the prompt: the policy's turns and the environment's answers together."""
    context: Optional[int] = None
    """The model's positions (prompt and episode together), where it has a limit."""


@dataclass
class Episode:
    """One episode as it runs: its pieces after the prompt, and what ended it."""

    prompt: list[int]
    pieces: list[tuple[list[int], Optional[list[float]]]] = field(default_factory=list)
    """(ids, sampled log-probs) per policy turn; (ids, None) per environment answer."""
    turns: list[dict[str, Any]] = field(default_factory=list)
    """The readable transcript: {"role": "assistant" | the environment's role, "content": text}."""
    last_ids: list[int] = field(default_factory=list)
    last_text: str = ""
    steps: list[tuple[int, float]] = field(default_factory=list)
    """(index of the turn's last policy token among the episode's tokens, step reward)."""
    ended_by: str = ""
    truncated: bool = False
    error: Optional[str] = None

    @property
    def used(self) -> int:
        return sum(len(ids) for ids, _ in self.pieces)

    def context(self) -> list[int]:
        return self.prompt + [t for ids, _ in self.pieces for t in ids]


@dataclass
class Episodes:
    """What run_episodes returns."""

    rollout: Rollout
    episodes: list[Episode]
    finals: list[Optional[float]]
    """The environment's final reward per episode (None: the run's reward scores the last policy turn)."""
    stats: dict[str, float]


def _turn(ro: Rollout, r: int) -> tuple[list[int], list[float], str, str]:
    """Row r of a rollout: its sampled ids, their log-probs, its text and why it ended."""
    keep = ro.completion_mask[r].bool()
    return ro.input_ids[r][keep].tolist(), ro.sample_logps[r][keep].tolist(), ro.completions[r], ro.ended_by[r]


def run_episodes(
    draw: Callable[[list[list[int]], int, SamplingSettings], Rollout],
    formatter: Any,
    envs: Any,
    prompt_ids: list[list[int]],
    rows: list[dict[str, Any]],
    G: int,
    sampling: SamplingSettings,
    limits: EpisodeLimits,
    should_stop: Optional[Callable[[], bool]] = None,
    pad_id: int = 0,
) -> Episodes:
    """G episodes of each prompt (module docstring); prompt i's at rows i*G .. i*G+G-1, as a rollout lays them out."""
    desc = envs.description
    max_turns = min(limits.max_turns, desc["max_turns"] or limits.max_turns)
    sampling = dataclasses.replace(sampling, stop_strings=tuple(dict.fromkeys((*sampling.stop_strings, *desc["stop"]))))
    N = len(prompt_ids) * G
    eps = [Episode(list(prompt_ids[k // G])) for k in range(N)]
    prompts = [rows[k // G]["prompt"] for k in range(N)]
    t0 = time.perf_counter()
    failed = envs.open({k: rows[k // G] for k in range(N)}, should_stop)
    env_s = time.perf_counter() - t0
    for k, why in failed.items():
        eps[k].error, eps[k].ended_by = f"environment {envs.name}: {why}", "error"
    stats = {"episode/obs_truncated": 0.0}
    first: Optional[Rollout] = None
    active = list(range(N))
    for turn in range(max_turns):
        room = {k: _room(eps[k], limits) for k in active}
        active = [k for k in active if room[k] > 0 or not _end(eps[k], "tokens")]
        if not active:
            break
        if turn == 0:  # every prompt's G samples at once, as a single-turn run draws them
            cap = min(room.values())
            ro = first = draw(prompt_ids, G, _capped(sampling, cap))
            rows_of = {k: k for k in range(N)}
        else:  # the largest room, but no row past the model's context; a turn past its own room is cut below
            cap = max(room[k] for k in active)
            if limits.context is not None:
                cap = min(cap, min(limits.context - len(eps[k].prompt) - eps[k].used for k in active))
            ro = draw([eps[k].context() for k in active], 1, _capped(sampling, cap))
            rows_of = {k: j for j, k in enumerate(active)}
        answering: dict[int, str] = {}
        for k in active:
            ids, logps, text, ended = _turn(ro, rows_of[k])
            if len(ids) > room[k]:  # as if sampled with its own room as max_new_tokens: the first room[k] tokens
                ids, logps, ended = ids[: room[k]], logps[: room[k]], "length"
                text = formatter.tokenizer.decode(ids, skip_special_tokens=True)
            ep = eps[k]
            ep.pieces.append((ids, logps))
            ep.turns.append({"role": "assistant", "content": text})
            ep.last_ids, ep.last_text = ids, text
            if ep.error is not None:  # its environment never opened: one turn, then nothing
                continue
            if ended == "length":
                ep.truncated = _end(ep, "length")
            else:
                answering[k] = text
        t0 = time.perf_counter()
        answers, errors = envs.step(answering, should_stop) if answering else ({}, {})
        env_s += time.perf_counter() - t0
        going = []
        for k in answering:
            ep = eps[k]
            if k in errors:
                ep.error, ep.ended_by = f"environment {envs.name}: {errors[k]}", "error"
                continue
            observation, reward, done = answers[k]
            if reward is not None:
                ep.steps.append((ep.used - 1, float(reward)))
            if done:
                _end(ep, "done")
            elif turn + 1 >= max_turns:
                _end(ep, "turns")
            else:
                obs = formatter.observation_ids(
                    prompts[k], observation or "", desc["role"], ep.last_ids[-1:] == [formatter.eos]
                )
                left = _room(ep, limits) - 1  # leave the next turn at least one token
                if left <= 0:
                    _end(ep, "tokens")
                    continue
                if len(obs) > left:
                    obs, stats["episode/obs_truncated"] = obs[:left], stats["episode/obs_truncated"] + 1
                ep.pieces.append((obs, None))
                ep.turns.append({"role": desc["role"], "content": observation or ""})
                going.append(k)
        active = going
    for ep in eps:
        if not ep.ended_by:
            _end(ep, "turns")
    ended = [k for k in range(N) if eps[k].error is None]
    t0 = time.perf_counter()
    finals_by, errors = envs.final(ended, should_stop) if ended else ({}, {})
    envs.drop([k for k in range(N) if eps[k].error is not None])
    stats["time/env_s"] = env_s + time.perf_counter() - t0  # the environment's calls, the worker's round trips included
    for k, why in errors.items():
        eps[k].error = f"environment {envs.name}: {why}"
    assert first is not None
    rollout = _layout(eps, first, pad_id)
    stats.update(_stats(eps))
    return Episodes(rollout, eps, [finals_by.get(k) for k in range(N)], stats)


def _end(ep: Episode, why: str) -> bool:
    ep.ended_by = ep.ended_by or why
    return True


def _room(ep: Episode, limits: EpisodeLimits) -> int:
    """Tokens the episode may still add."""
    room = limits.max_episode_tokens - ep.used
    if limits.context is not None:
        room = min(room, limits.context - len(ep.prompt) - ep.used)
    return max(room, 0)


def _capped(sampling: SamplingSettings, room: int) -> SamplingSettings:
    return sampling if room >= sampling.max_new_tokens else dataclasses.replace(sampling, max_new_tokens=max(room, 1))


def _layout(eps: list[Episode], first: Rollout, pad_id: int) -> Rollout:
    """The episodes as a Rollout: [N, P + C], left-padded prompts then each episode, right-padded."""
    N = len(eps)
    P = max(len(ep.prompt) for ep in eps)
    C = max(max(ep.used for ep in eps), 1)
    input_ids = torch.full((N, P + C), pad_id, dtype=torch.long)  # [N, P + C]
    attention = torch.zeros((N, P + C), dtype=torch.long)  # [N, P + C]
    policy = torch.zeros((N, P + C), dtype=torch.long)  # [N, P + C] 1 on the policy's sampled tokens
    logps = torch.zeros((N, P + C), dtype=first.sample_logps.dtype)  # [N, P + C]
    for k, ep in enumerate(eps):
        p = len(ep.prompt)
        input_ids[k, P - p : P] = torch.tensor(ep.prompt, dtype=torch.long)
        attention[k, P - p : P] = 1
        at = P
        for ids, lp in ep.pieces:
            n = len(ids)
            input_ids[k, at : at + n] = torch.tensor(ids, dtype=torch.long)
            attention[k, at : at + n] = 1
            if lp is not None:
                policy[k, at : at + n] = 1
                logps[k, at : at + n] = torch.tensor(lp, dtype=logps.dtype)
            at += n
    return Rollout(
        input_ids=input_ids,
        attention_mask=attention,
        completion_mask=policy,
        sample_logps=logps,
        truncated=torch.tensor([ep.truncated for ep in eps]),
        completion_lengths=policy.sum(-1),
        completions=[ep.last_text for ep in eps],
        prompt_index=first.prompt_index.cpu(),
        ended_by=[ep.ended_by for ep in eps],
        stats=dict(first.stats),
    )


def _stats(eps: list[Episode]) -> dict[str, float]:
    """The step's episode figures: turns, environment tokens, how episodes ended, failures."""
    n = max(len(eps), 1)
    turns = [sum(1 for _, lp in ep.pieces if lp is not None) for ep in eps]
    env_tokens = [sum(len(ids) for ids, lp in ep.pieces if lp is None) for ep in eps]
    out = {
        "episode/turns_mean": sum(turns) / n,
        "episode/turns_max": float(max(turns, default=0)),
        "episode/env_tokens_mean": sum(env_tokens) / n,
        "episode/failed": float(sum(ep.error is not None for ep in eps)),
    }
    for why in ("done", "length", "turns", "tokens"):
        out[f"episode/ended_{why}_frac"] = sum(ep.ended_by == why for ep in eps) / n
    return out
