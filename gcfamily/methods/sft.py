"""Supervised fine-tuning: maximise the log-likelihood of demonstrations.

Objective  J = sum_{(q,o) in batch} sum_t log pi(o_t | q, o_<t) / (completion tokens in the step)
GC         1 on every completion token (DeepSeekMath 5.2.1, eq. "GC_SFT = 1").
"""

from __future__ import annotations

from typing import Any

import torch

from gcfamily.data.batches import collate_masked, default_pad_id
from gcfamily.methods.base import Batch, Method, Stats
from gcfamily.methods.services import Services


class SFT(Method):
    name = "sft"
    data_source = "fixed demonstrations: prompt-completion rows, or language-modeling rows (text, messages)"
    data_kind = "demonstrations"
    gc_formula = "1"
    default_norm = "token"

    def setup(self, services: Services) -> None:
        super().setup(services)
        # (ids, loss mask) per row: completions, or every assistant turn, or all of a text
        data = self.load_data(services)
        self.examples, self.skipped = data.examples, data.n_skipped
        self.pad_id = default_pad_id(services.tokenizer)

    def data(self, step: int) -> tuple[Batch, Stats]:
        idx = self.step_indices(len(self.examples), step)
        batch: Batch = collate_masked([self.examples[i] for i in idx], self.pad_id)
        return batch, {"skipped_long_prompts": float(self.skipped)}

    def eval_batch(self, services: Services, rows: list[dict[str, Any]]) -> Batch | None:
        """Held-out demonstrations as one batch: eval/loss is then their NLL per trained token (per row with
        loss_norm=sequence), as training normalises it (Method.eval_metrics)."""
        data = self.heldout_encode(services, rows)
        return None if data is None else collate_masked(data.examples, self.pad_id)

    def coefficient(self, batch: Batch, logps: torch.Tensor) -> torch.Tensor:
        return torch.ones_like(logps)  # [B, L]

    def objective(self, batch: Batch, logps: torch.Tensor, Z: float) -> torch.Tensor:
        return self.aggregate(logps, batch, Z)
