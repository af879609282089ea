"""The method table: an explicit dict from name to class (imported on first use)."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from gcfamily.errors import GcfError

if TYPE_CHECKING:
    from gcfamily.methods.base import Method

# name -> "module:Class"; a new method adds one line here
METHODS: dict[str, str] = {
    "sft": "gcfamily.methods.sft:SFT",
    "dpo": "gcfamily.methods.dpo:DPO",
    "ipo": "gcfamily.methods.dpo:IPO",
    "cdpo": "gcfamily.methods.dpo:ConservativeDPO",
    "simpo": "gcfamily.methods.dpo:SimPO",
    "rft": "gcfamily.methods.rft:RFT",
    "grpo": "gcfamily.methods.grpo:GRPO",
    "rloo": "gcfamily.methods.grpo_variants:RLOO",
    "dr-grpo": "gcfamily.methods.grpo_variants:DrGRPO",
    "dapo": "gcfamily.methods.grpo_variants:DAPO",
    "ppo": "gcfamily.methods.ppo:PPO",
    "reward-model": "gcfamily.methods.reward_model:RewardModelTraining",
    "grpo-shift": "gcfamily.theory.variants:GRPOShift",
    "grpo-direct-kl": "gcfamily.theory.variants:GRPODirectKL",
    "grpo-shift-direct-kl": "gcfamily.theory.variants:GRPOShiftDirectKL",
}


def get_method(name: str) -> type["Method"]:
    """The class registered under name; an unknown name is a clear error listing the known ones."""
    if name not in METHODS:
        raise GcfError(f"Unknown method '{name}'; choose one of: {', '.join(METHODS)}.")
    module, cls = METHODS[name].split(":")
    return getattr(importlib.import_module(module), cls)


def all_methods() -> dict[str, type["Method"]]:
    """Every registered method class, by name."""
    return {name: get_method(name) for name in METHODS}
