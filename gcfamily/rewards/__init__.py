"""Rewards: verifiable reward functions, loading user rewards, and calling them safely (user ones in a worker process)."""

from gcfamily.rewards.scoring import RewardFailure, Rewards, Scores, Term, as_rewards, load_reward, reward_specs, score
from gcfamily.rewards.verifiable import (
    REWARDS,
    RewardFn,
    completion_text,
    correctness_reward,
    exact_match,
    extract_answer,
    format_reward,
    is_correctness,
    numeric_match,
    parse_number,
    require_column,
    weighted_sum,
)

__all__ = [
    "REWARDS",
    "RewardFailure",
    "RewardFn",
    "Rewards",
    "Scores",
    "Term",
    "as_rewards",
    "completion_text",
    "correctness_reward",
    "exact_match",
    "extract_answer",
    "format_reward",
    "is_correctness",
    "load_reward",
    "numeric_match",
    "parse_number",
    "require_column",
    "reward_specs",
    "score",
    "weighted_sum",
]
