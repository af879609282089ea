"""Rewards: verifiable reward functions, loading user rewards, and calling them safely."""

from gcfamily.rewards.scoring import RewardFailure, load_reward, score
from gcfamily.rewards.verifiable import (
    REWARDS,
    RewardFn,
    exact_match,
    extract_answer,
    format_reward,
    numeric_match,
    parse_number,
    require_column,
    weighted_sum,
)

__all__ = [
    "REWARDS",
    "RewardFailure",
    "RewardFn",
    "exact_match",
    "extract_answer",
    "format_reward",
    "load_reward",
    "numeric_match",
    "parse_number",
    "require_column",
    "score",
    "weighted_sum",
]
