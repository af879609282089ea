"""Held-out accuracy: greedy completions of a task's test prompts, scored by its reward."""

from __future__ import annotations

from typing import Any

import torch

from gcfamily.data import prompt_ids


@torch.no_grad()
def heldout_accuracy(model: Any, tokenizer: Any, task: Any, n: int = 64, max_new_tokens: int = 32, batch_size: int = 64) -> float:
    """Fraction of the first n test rows whose greedy completion scores >= 1 under the task's reward."""
    from gcfamily.rollout import SamplingSettings, generate

    rows = task.rows("test", n)
    model.eval()
    correct = 0.0
    settings = SamplingSettings(greedy=True, max_new_tokens=max_new_tokens)
    for s in range(0, len(rows), batch_size):
        part = rows[s : s + batch_size]
        ids = [prompt_ids(tokenizer, r["prompt"]) for r in part]
        out = generate(model, tokenizer, ids, 1, settings)
        columns = {k: [r[k] for r in part] for k in part[0] if k not in ("prompt", "completion")}
        rewards = task.reward([r["prompt"] for r in part], out.completions, **columns)
        correct += sum(1.0 for r in rewards if r is not None and r >= 1.0)
    return correct / max(len(rows), 1)
