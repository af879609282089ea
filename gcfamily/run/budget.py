"""What a run has spent against its budget (max_time, max_tokens, max_flops), and when a training-time evaluation
(eval_every_s) falls due. It counts the step's reduced row (all ranks' tokens, the slowest rank's time), so every rank
stops and evaluates at the same step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gcfamily.methods.base import GENERATED


@dataclass
class Budget:
    """The run's spending so far; a checkpoint holds it (as elapsed_s, tokens_seen, flops_seen)."""

    elapsed_s: float = 0.0
    """Seconds spent in training steps, for max_time."""
    tokens_seen: float = 0.0
    """Generated plus trained tokens, for max_tokens."""
    flops_seen: float = 0.0
    """Estimated: 6 P per loss token, 2 P per generated token, for max_flops."""

    def spend(self, metrics: dict[str, float], n_params: int) -> float:
        """Count a step's reduced row (its time, its trained and generated tokens); the training time before it."""
        before_s = self.elapsed_s
        self.elapsed_s += metrics["time/step_s"]
        self.tokens_seen += metrics[GENERATED] + metrics.get("tokens", 0.0)
        self.flops_seen += n_params * (6 * metrics.get("tokens", 0.0) + 2 * metrics[GENERATED])
        return before_s

    def row(self) -> dict[str, float]:
        """The budget's figures for the step's metrics row."""
        return {"budget/elapsed_s": self.elapsed_s, "budget/tokens": self.tokens_seen, "budget/flops": self.flops_seen}

    def spent(self, cfg: Any) -> bool:
        """max_time, max_tokens or max_flops (when set) is used up."""
        return bool(
            (cfg.max_time and self.elapsed_s >= cfg.max_time)
            or (cfg.max_tokens and self.tokens_seen >= cfg.max_tokens)
            or (cfg.max_flops and self.flops_seen >= cfg.max_flops)
        )

    def crossed(self, every: float, before_s: float) -> bool:
        """The last step's training time crossed a multiple of `every` seconds (never when `every` is 0)."""
        return bool(every) and int(self.elapsed_s // every) > int(before_s // every)
