"""The policy's own samples, scored: the one sampling sequence of every data source that samples (each on-policy
method's `data`, the pools of offline RFT and of DPO on own samples).

    samples = sample_scored(services, prompt_ids, rows, G, sampling, reward)
    # samples.rollout: from the run's rollout backend (Services.generate), prompt i's G samples at rows i*G ..
    # samples.scores:  the reward of each sample (a failed one has valid False), scored with the rows' other columns

With an environment (Services.envs, the run's --env) each sample is an episode (methods/episodes.py): its reward is
the environment's final reward, or where it gives none the run's reward on the last policy turn, plus the sum of its
step rewards; an episode whose environment failed is invalid (no gradient, out of the normaliser, counted).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Optional

import torch

from gcfamily.data.batches import default_pad_id
from gcfamily.errors import GcfError
from gcfamily.methods.episodes import Episodes, run_episodes
from gcfamily.methods.services import Services
from gcfamily.rewards import Scores, as_rewards
from gcfamily.rollout import Rollout, SamplingSettings


@dataclass
class Samples:
    """G samples of each prompt and their rewards, laid out prompt by prompt."""

    rollout: Rollout
    prompts: list[Any]
    """Each sample's prompt, as the row gave it (text or messages): the rows' prompts repeated G times."""
    completion_ids: list[list[int]]
    """Each sample's sampled tokens, EOS included (TRL's completion_ids)."""
    scores: Scores
    reward_s: float
    """Seconds the reward took."""
    episodes: Optional[Episodes] = None
    """The episodes, where an environment ran them (their transcripts, step rewards and figures)."""


def sample_scored(
    services: Services,
    prompt_ids: list[list[int]],
    rows: list[dict[str, Any]],
    G: int,
    sampling: SamplingSettings,
    reward: Any,
) -> Samples:
    """G samples of each prompt from the run's rollout backend, scored by `reward` (a reward function, several, or a
    Rewards) with each row's other columns as keyword arguments; a stop request abandons a running user reward."""
    if services.envs is not None:
        return episodes_scored(services, prompt_ids, rows, G, sampling, reward)
    ro = services.generate(prompt_ids, G, sampling)
    # row n of the rollout belongs to prompt n // G: repeat the prompts and their columns G times
    prompts = [r["prompt"] for r in rows for _ in range(G)]
    columns = {k: [r.get(k) for r in rows for _ in range(G)] for k in rows[0] if k not in ("prompt", "completion")}
    ids = [row[keep].tolist() for row, keep in zip(ro.input_ids, ro.completion_mask.bool())]
    t0 = time.perf_counter()
    scores = as_rewards(reward).score(prompts, ro.completions, ids, columns, should_stop=services.stop_requested)
    return Samples(ro, prompts, ids, scores, time.perf_counter() - t0)


def episodes_scored(
    services: Services,
    prompt_ids: list[list[int]],
    rows: list[dict[str, Any]],
    G: int,
    sampling: SamplingSettings,
    reward: Any,
) -> Samples:
    """G episodes of each prompt with the run's environments, scored (module docstring)."""
    eps = run_episodes(
        services.generate,
        services.formatter,
        services.envs,
        prompt_ids,
        rows,
        G,
        sampling,
        services.episode_limits,
        services.stop_requested,
        default_pad_id(services.tokenizer),
    )
    t0 = time.perf_counter()
    scores = score_episodes(eps, rows, G, reward, services.envs.name, services.stop_requested)
    prompts = [r["prompt"] for r in rows for _ in range(G)]
    ids = [ep.last_ids for ep in eps.episodes]
    return Samples(eps.rollout, prompts, ids, scores, time.perf_counter() - t0, eps)


def scored_episodes(
    draw: Any, formatter: Any, envs: Any, limits: Any, prompt_ids: list[list[int]], rows: list[dict[str, Any]],
    G: int, sampling: SamplingSettings, reward: Any,
) -> tuple[Episodes, Scores]:  # fmt: skip
    """run_episodes then score_episodes, for a caller outside a run (held-out evaluation: `draw` its backend's generate)."""
    pad = default_pad_id(formatter.tokenizer)
    eps = run_episodes(draw, formatter, envs, prompt_ids, rows, G, sampling, limits, None, pad)
    return eps, score_episodes(eps, rows, G, reward, envs.name)


def score_episodes(
    eps: Episodes, rows: list[dict[str, Any]], G: int, reward: Any, env_name: str, should_stop: Any = None
) -> Scores:
    """Each episode's reward (module docstring): the environment's final reward, or the run's reward on the last
    policy turn where it gives none, plus the step rewards; an episode whose environment failed is invalid."""
    ro, N = eps.rollout, len(eps.episodes)
    prompts = [r["prompt"] for r in rows for _ in range(G)]
    columns = {k: [r.get(k) for r in rows for _ in range(G)] for k in rows[0] if k not in ("prompt", "completion")}
    ids = [ep.last_ids for ep in eps.episodes]
    rewards, valid = torch.zeros(N), torch.ones(N, dtype=torch.bool)  # [N], [N]
    errors: dict[int, str] = {k: ep.error for k, ep in enumerate(eps.episodes) if ep.error is not None}
    failed_by = {k: f"env:{env_name}" for k in errors}
    per_reward: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    need = [k for k in range(N) if k not in errors and eps.finals[k] is None]  # the run's reward scores these
    if need:
        sub = as_rewards(reward).score(
            [prompts[k] for k in need],
            [ro.completions[k] for k in need],
            [ids[k] for k in need],
            {c: [v[k] for k in need] for c, v in columns.items()},
            should_stop=should_stop,
        )
        if sub.step_rewards:
            raise GcfError(
                f"reward '{sub.step_rewards[0]}' scores steps, but with an environment the step rewards are the "
                "environment's (step() returns them); return one number per episode from the reward."
            )
        at = torch.tensor(need)
        for name, (r, ok) in sub.per_reward.items():
            full_r, full_ok = torch.zeros(N), torch.zeros(N, dtype=torch.bool)
            full_r[at], full_ok[at] = r.float(), ok
            per_reward[name] = (full_r, full_ok)
        rewards[at] = sub.rewards.float()
        bad = iter(zip(sub.errors, sub.failed_by))
        for j, k in enumerate(need):
            if not bool(sub.valid[j]):
                errors[k], failed_by[k] = next(bad)
    for k, final in enumerate(eps.finals):
        if final is not None and k not in errors:
            rewards[k] = final
    for k, ep in enumerate(eps.episodes):
        rewards[k] += sum(score for _, score in ep.steps)
    for k in errors:
        valid[k], rewards[k] = False, 0.0
    order = sorted(errors)
    scores = Scores(rewards, valid, [errors[k] for k in order], per_reward, [failed_by[k] for k in order])
    return scores
