"""Supervised fine-tuning: maximise the log-likelihood of demonstrations.

Objective  J = sum_{(q,o) in batch} sum_t log pi(o_t | q, o_<t) / (completion tokens in the step)
GC         1 on every completion token (DeepSeekMath 5.2.1, eq. "GC_SFT = 1").
"""

from __future__ import annotations

import torch

from gcfamily.data import check_sft_row, collate, default_pad_id, encode_pairs, load_rows
from gcfamily.errors import GcfError
from gcfamily.methods.base import Batch, Method


class SFT(Method):
    name = "sft"
    data_source = "fixed demonstrations (prompt, completion)"
    gc_formula = "1"
    default_norm = "token"

    def setup(self, trainer) -> None:  # type: ignore[no-untyped-def]
        super().setup(trainer)
        cfg = self.cfg
        if cfg.dataset:
            raw = load_rows(cfg.dataset, cfg.dataset_split)
        elif trainer.task is not None:
            raw = trainer.task.rows("train")
        else:
            raise GcfError("SFT needs data: pass --dataset PATH_OR_NAME or --task NAME.")
        rows = [check_sft_row(r, i) for i, r in enumerate(raw)]
        self.examples, self.skipped = encode_pairs(trainer.tokenizer, rows, "completion", cfg.max_length, cfg.long_prompts)
        if not self.examples:
            raise GcfError(f"Every row was longer than max_length={cfg.max_length}; raise max_length.")
        self.pad_id = default_pad_id(trainer.tokenizer)

    def data(self, step: int) -> Batch:
        idx = self.step_indices(len(self.examples), step)
        batch: Batch = collate([self.examples[i] for i in idx], self.pad_id)
        batch["stat/skipped_long_prompts"] = float(self.skipped)
        return batch

    def coefficient(self, batch: Batch, logps: torch.Tensor) -> torch.Tensor:
        return torch.ones_like(logps)  # [B, L]

    def objective(self, batch: Batch, logps: torch.Tensor, Z: float) -> torch.Tensor:
        return self.aggregate(logps, batch, Z)
