"""The policy's own samples, scored: the one sampling sequence of every data source that samples (each on-policy
method's `data`, the pools of offline RFT and of DPO on own samples).

    samples = sample_scored(services, prompt_ids, rows, G, sampling, reward)
    # samples.rollout: from the run's rollout backend (Services.generate), prompt i's G samples at rows i*G ..
    # samples.scores:  the reward of each sample (a failed one has valid False), scored with the rows' other columns
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

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
    ro = services.generate(prompt_ids, G, sampling)
    # row n of the rollout belongs to prompt n // G: repeat the prompts and their columns G times
    prompts = [r["prompt"] for r in rows for _ in range(G)]
    columns = {k: [r.get(k) for r in rows for _ in range(G)] for k in rows[0] if k not in ("prompt", "completion")}
    ids = [row[keep].tolist() for row, keep in zip(ro.input_ids, ro.completion_mask.bool())]
    t0 = time.perf_counter()
    scores = as_rewards(reward).score(prompts, ro.completions, ids, columns, should_stop=services.stop_requested)
    return Samples(ro, prompts, ids, scores, time.perf_counter() - t0)
