"""Rewards: verifiable reward functions, loading user rewards, and calling them safely."""

from gcfamily.rewards.verifiable import (
    REWARDS,
    RewardFailure,
    RewardFn,
    exact_match,
    extract_answer,
    format_reward,
    load_reward,
    numeric_match,
    parse_number,
    require_column,
    score,
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
