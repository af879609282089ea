"""A run's figures and final folder read back for people, shared by the model card (card.py) and the console summary
(summary.py): the rows of metrics.jsonl, the held-out keys and a key's (step, value) series, a number and a duration
formatted, and what the final folder holds with the transformers class that loads it.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any


def fmt(value: Any) -> str:
    """A metric for people: floats to 4 significant digits; None, NaN and infinities as n/a."""
    if value is None or isinstance(value, bool):
        return "n/a" if value is None else str(value)
    if isinstance(value, (int, float)):
        try:
            return f"{value:.4g}" if math.isfinite(value) else "n/a"
        except (OverflowError, ValueError, TypeError):
            return "n/a"
    return str(value)


def metric_rows(metrics: Any) -> list[dict]:
    """The rows of `metrics` that are dicts (none when it is not a list)."""
    try:
        return [r for r in metrics if isinstance(r, dict)]
    except TypeError:
        return []


def eval_keys(rows: list[dict]) -> list[str]:
    """The held-out figures: the evaluation's (eval/...) and a method's own (a reward model's rm/heldout_accuracy)."""
    return sorted({k for r in rows for k in r if isinstance(k, str) and (k.startswith("eval/") or "heldout" in k)})


def series(rows: list[dict], key: str) -> list[tuple[Any, Any]]:
    """(step, value) of every row that holds `key`, in file order."""
    return [(r.get("step"), r[key]) for r in rows if key in r]


def duration(seconds: float) -> str:
    """Seconds for people: one decimal under two minutes, then minutes beside them; n/a when not a number."""
    try:
        s = float(seconds)
    except (TypeError, ValueError):
        return "n/a"
    if not math.isfinite(s):
        return "n/a"
    return f"{s:.1f} s" if s < 120 else f"{s:.0f} s ({s / 60:.1f} min)"


def folder_layout(out_dir: Path) -> str:
    """What the final folder holds: "reward-model" (a sequence classifier), "adapter" (a LoRA adapter alone),
    "merged" (a LoRA run's merged model, its adapter in adapter/) or "model"."""
    try:
        archs = json.loads((out_dir / "config.json").read_text(encoding="utf-8")).get("architectures") or []
    except (OSError, ValueError, AttributeError):
        archs = []
    if any(str(a).endswith("ForSequenceClassification") for a in archs):
        return "reward-model"
    if (out_dir / "adapter_config.json").is_file():
        return "adapter"
    return "merged" if (out_dir / "adapter" / "adapter_config.json").is_file() else "model"


def loader_class(layout: str) -> str:
    """The transformers class that loads a final folder of this layout."""
    return "AutoModelForSequenceClassification" if layout == "reward-model" else "AutoModelForCausalLM"
