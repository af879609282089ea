"""Token ids in, batches out: collation, the seeded data order, micro-batches.

Rows are loaded by dataset.py and turned into token ids by formats.py; a completion ends with
EOS, which stays in the loss even where pad == eos (the loss mask, not the pad id, decides).
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch

from gcfamily.core.batch import Batch, select, trim


def collate(examples: Sequence[tuple[list[int], list[int]]], pad_id: int) -> Batch:
    """Right-padded [B, L] input_ids, attention_mask and loss_mask (1 on completion tokens)."""
    L = max(len(p) + len(c) for p, c in examples)
    B = len(examples)
    input_ids = torch.full((B, L), pad_id, dtype=torch.long)  # [B, L]
    attention_mask = torch.zeros(B, L, dtype=torch.long)  # [B, L]
    loss_mask = torch.zeros(B, L, dtype=torch.long)  # [B, L]
    for b, (p, c) in enumerate(examples):
        n = len(p) + len(c)
        input_ids[b, :n] = torch.tensor(p + c)
        attention_mask[b, :n] = 1
        loss_mask[b, len(p) : n] = 1
    return Batch(input_ids=input_ids, attention_mask=attention_mask, loss_mask=loss_mask)


def collate_masked(examples: Sequence[tuple[list[int], list[int]]], pad_id: int) -> Batch:
    """Right-padded [B, L] input_ids, attention_mask and loss_mask from (ids, loss mask) examples."""
    L = max(len(ids) for ids, _ in examples)
    B = len(examples)
    input_ids = torch.full((B, L), pad_id, dtype=torch.long)  # [B, L]
    attention_mask = torch.zeros(B, L, dtype=torch.long)  # [B, L]
    loss_mask = torch.zeros(B, L, dtype=torch.long)  # [B, L]
    for b, (ids, mask) in enumerate(examples):
        input_ids[b, : len(ids)] = torch.tensor(ids)
        attention_mask[b, : len(ids)] = 1
        loss_mask[b, : len(ids)] = torch.tensor(mask)
    return Batch(input_ids=input_ids, attention_mask=attention_mask, loss_mask=loss_mask)


def epoch_indices(n: int, seed: int, step: int, batch_size: int) -> list[int]:
    """Row indices of a step: a fresh seeded permutation every epoch, so position == step."""
    out: list[int] = []
    start = step * batch_size
    while len(out) < batch_size:
        epoch, offset = divmod(start + len(out), n)
        perm = torch.randperm(n, generator=torch.Generator().manual_seed((seed * 100_003 + epoch) % 2**64)).tolist()
        out.extend(perm[offset : offset + batch_size - len(out)])
    return out


def split_batch(batch: Batch, size: int, rows_per_example: int = 1) -> list[Batch]:
    """Micro-batches of at most `size` rows (whole examples), each trimmed of all-padding columns."""
    B = batch.rows
    size = max(rows_per_example, size - size % rows_per_example)
    return [trim(select(batch, slice(s, min(s + size, B)))) for s in range(0, B, size)]


def default_pad_id(tokenizer: Any) -> int:
    """pad id, falling back to EOS (the loss mask, not the pad id, decides what is trained)."""
    pid: Optional[int] = tokenizer.pad_token_id
    return int(pid if pid is not None else tokenizer.eos_token_id)
