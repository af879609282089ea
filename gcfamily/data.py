"""Datasets in, tokens out: loading, row checks, chat templates, and collation.

Rows are `{"prompt", "completion"}` (strings) or conversational `{"messages": [...]}` whose
last message is the assistant's completion. Preference rows are `{"prompt", "chosen",
"rejected"}`. The prompt is formatted with the tokenizer's chat template where the model
has one; the completion is followed by EOS, which stays in the loss even where pad == eos.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Optional, Sequence

import torch

from gcfamily.errors import GcfError

FILE_TYPES = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}


def load_rows(source: str, split: str = "train") -> list[dict[str, Any]]:
    """Rows of a local file or a hub dataset, as plain dicts."""
    try:
        import datasets
        datasets.disable_progress_bars()
    except ImportError as e:  # pragma: no cover - a dependency of the package
        raise GcfError("The `datasets` package is missing; reinstall gcfamily.") from e
    path = Path(source)
    looks_local = path.suffix.lower() in FILE_TYPES or os.sep in source or source.startswith(".")
    if looks_local and not path.exists():
        raise GcfError(f"Dataset file {source} does not exist; pass an existing JSONL/JSON/parquet/CSV file or a hub dataset name.")
    try:
        if path.is_file():
            kind = FILE_TYPES.get(path.suffix.lower())
            if kind is None:
                raise GcfError(f"Dataset file {source} has an unknown type; use .jsonl, .json, .parquet or .csv.")
            ds = datasets.load_dataset(kind, data_files=str(path), split="train")
        elif path.is_dir():
            ds = datasets.load_dataset(str(path), split=split)
        else:
            ds = datasets.load_dataset(source, split=split)
        rows = [dict(r) for r in ds]  # decoding can fail too (odd nested keys)
    except GcfError:
        raise
    except Exception as e:  # datasets raises many types for unreachable hubs and bad files
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        if path.exists():
            raise GcfError(f"Dataset file {source} could not be read ({first[:200]}).") from e
        raise GcfError(
            f"Dataset {source} could not be loaded from the hub ({first[:160]}); offline, use a local file or a built-in task (--task arithmetic)."
        ) from e
    if not rows:
        raise GcfError(f"Dataset {source} is empty; it needs at least one row.")
    return rows


def _is_messages(v: Any) -> bool:
    return isinstance(v, list) and len(v) > 0 and all(isinstance(m, dict) and "role" in m and isinstance(m.get("content"), str) for m in v)


def _check_text(v: Any, col: str, i: int, what: str = "Row", allow_messages: bool = False) -> Any:
    """A non-empty string (numbers are written out), or a message list where allowed; else a clear error."""
    if allow_messages and isinstance(v, list):
        if not _is_messages(v):
            raise GcfError(f"{what} {i}: '{col}' must be a string or a non-empty list of {{role, content}} messages.")
        return v
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        v = str(v)
    if not isinstance(v, str) or not v.strip():
        # a file-backed dataset fills a column absent from one row with None, so both read alike
        raise GcfError(f"{what} {i} has a missing or empty '{col}'; it needs a non-empty text {col}.")
    return v


def check_sft_row(row: dict[str, Any], i: int) -> dict[str, Any]:
    """A prompt/completion row, or messages whose last one is the assistant's; errors name the row."""
    if row.get("messages") is not None:
        msgs = row["messages"]
        if not _is_messages(msgs) or len(msgs) < 2:
            raise GcfError(f"Row {i}: 'messages' must be a list of at least two {{role, content}} messages.")
        if msgs[-1]["role"] != "assistant" or not str(msgs[-1]["content"]).strip():
            raise GcfError(f"Row {i}: the last message must be a non-empty assistant message (the completion).")
        return {"prompt": msgs[:-1], "completion": str(msgs[-1]["content"])}
    prompt = _check_text(row.get("prompt"), "prompt", i, allow_messages=True)
    completion = _check_text(row.get("completion"), "completion", i)
    return {"prompt": prompt, "completion": completion}


def check_preference_row(row: dict[str, Any], i: int) -> dict[str, Any]:
    """A {prompt, chosen, rejected} row (strings or message lists); errors name the row."""
    what = "Preference row"
    out = {"prompt": _check_text(row.get("prompt"), "prompt", i, what, allow_messages=True)}
    for col in ("chosen", "rejected"):
        v = _check_text(row.get(col), col, i, what, allow_messages=True)
        if isinstance(v, list):  # conversational: the completion is the last assistant message
            v = _check_text(v[-1]["content"], col, i, what)
        out[col] = v
    return out


def prompt_ids(tokenizer: Any, prompt: str | list[dict[str, str]]) -> list[int]:
    """Token ids of a prompt, through the chat template when the tokenizer has one."""
    msgs = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
    if getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "keys"):
            ids = ids["input_ids"]
        return list(ids)
    text = "\n".join(m["content"] for m in msgs) + "\n"
    return list(tokenizer(text, add_special_tokens=True)["input_ids"])


def completion_ids(tokenizer: Any, completion: str) -> list[int]:
    """Token ids of a completion followed by EOS (the EOS is trained, even where pad == eos)."""
    ids = list(tokenizer(completion, add_special_tokens=False)["input_ids"])
    return ids + [tokenizer.eos_token_id]


def encode_pairs(
    tokenizer: Any, rows: Sequence[dict[str, Any]], completion_key: str = "completion", max_length: int = 512, long_prompts: str = "skip"
) -> tuple[list[tuple[list[int], list[int]]], int]:
    """(prompt ids, completion ids) per row, cut to max_length; returns the examples and the count skipped."""
    out, skipped = [], 0
    for i, row in enumerate(rows):
        p = prompt_ids(tokenizer, row["prompt"])
        c = completion_ids(tokenizer, row[completion_key])
        if len(p) >= max_length:
            if long_prompts == "error":
                raise GcfError(f"Row {i}: the prompt has {len(p)} tokens, more than max_length={max_length}; raise max_length or set long_prompts=skip.")
            skipped += 1
            continue
        out.append((p, c[: max_length - len(p)]))
    return out, skipped


def collate(examples: Sequence[tuple[list[int], list[int]]], pad_id: int) -> dict[str, torch.Tensor]:
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
    return {"input_ids": input_ids, "attention_mask": attention_mask, "loss_mask": loss_mask}


def epoch_indices(n: int, seed: int, step: int, batch_size: int) -> list[int]:
    """Row indices of a step: a fresh seeded permutation every epoch, so position == step."""
    out: list[int] = []
    start = step * batch_size
    while len(out) < batch_size:
        epoch, offset = divmod(start + len(out), n)
        perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed * 100_003 + epoch)).tolist()
        out.extend(perm[offset : offset + batch_size - len(out)])
    return out


def split_batch(batch: dict[str, Any], size: int, rows_per_example: int = 1) -> list[dict[str, Any]]:
    """Micro-batches of at most `size` rows (whole examples), each trimmed of all-padding columns."""
    B = batch["input_ids"].shape[0]
    size = max(rows_per_example, size - size % rows_per_example)
    return [trim(select(batch, slice(s, min(s + size, B)))) for s in range(0, B, size)]


def select(batch: dict[str, Any], idx: slice | torch.Tensor | list[int]) -> dict[str, Any]:
    """Rows idx of every per-row field (tensors with B rows and lists of length B)."""
    B = batch["input_ids"].shape[0]
    out = {}
    for k, v in batch.items():
        if isinstance(v, torch.Tensor) and v.ndim >= 1 and v.shape[0] == B:
            out[k] = v[idx]
        elif isinstance(v, list) and len(v) == B:
            out[k] = v[idx] if isinstance(idx, slice) else [v[i] for i in (idx.tolist() if isinstance(idx, torch.Tensor) else idx)]
        else:
            out[k] = v
    return out


def trim(batch: dict[str, Any]) -> dict[str, Any]:
    """Drop columns that are padding in every row (left and right), in every [B, L] field."""
    am = batch["attention_mask"]
    L = am.shape[1]
    cols = am.any(0).nonzero()
    if cols.numel() == 0:
        return batch
    lo, hi = int(cols[0]), int(cols[-1]) + 1
    if lo == 0 and hi == L:
        return batch
    return {k: (v[:, lo:hi] if isinstance(v, torch.Tensor) and v.ndim == 2 and v.shape[1] == L else v) for k, v in batch.items()}


def to_device(batch: dict[str, Any], device: torch.device | str) -> dict[str, Any]:
    """Move every tensor of a batch."""
    return {k: (v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v) for k, v in batch.items()}


def default_pad_id(tokenizer: Any) -> int:
    """pad id, falling back to EOS (the loss mask, not the pad id, decides what is trained)."""
    pid: Optional[int] = tokenizer.pad_token_id
    return int(pid if pid is not None else tokenizer.eos_token_id)
