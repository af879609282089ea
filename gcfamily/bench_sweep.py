"""`gcf bench --sweep KEY=V1,V2,...`: each method's setting chosen on a validation split, the held-out result reported at the choice.

Every sweep run keeps `validation_rows` (= eval_samples) rows at the end of the task's train split out of training
and evaluates on them (eval/val_accuracy); it never reads the test split. Per method the value with the highest
final validation accuracy wins (ties: the first value given). Only then is the chosen run's final model evaluated
on the held-out test prompts, once, beside the base model's held-out accuracy (the same for every method).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

from gcfamily.bench_report import fmt
from gcfamily.errors import GcfError


def parse_sweep(text: str) -> tuple[str, list[str]]:
    """'lr=1e-6,3e-6,1e-5' -> ('lr', ['1e-6', '3e-6', '1e-5']); one setting, at least two values."""
    key, _, values = text.partition("=")
    vals = [v.strip() for v in values.split(",") if v.strip()]
    if not key.strip() or len(vals) < 2:
        raise GcfError(f"--sweep {text!r} must look like KEY=V1,V2[,...] with at least two values, e.g. lr=1e-6,3e-6,1e-5.")
    return key.strip(), vals


def final_validation(folder: Path) -> Optional[float]:
    """The last eval/val_accuracy a run logged after training (None if it has none)."""
    from gcfamily.logger import read_metrics

    if not (folder / "metrics.jsonl").is_file():
        return None
    rows = [r for r in read_metrics(folder) if r.get("eval/val_accuracy") is not None and r["step"] > 0]
    return rows[-1]["eval/val_accuracy"] if rows else None


def choose(values: list[str], scores: list[Optional[float]]) -> Optional[int]:
    """Index of the best validation score (the first of equal ones); None when no run has one."""
    best = None
    for i, s in enumerate(scores):
        if s is not None and (best is None or s > scores[best]):
            best = i
    return best


def heldout_of(folder: Optional[Path], settings: dict[str, Any]) -> float:
    """Held-out test accuracy of a model folder (None: the suite's base model), as the trainer measures it (greedy, eval_samples)."""
    import torch

    from gcfamily.evaluate import heldout_accuracy
    from gcfamily.formats import Formatter
    from gcfamily.models import load_model
    from gcfamily.tasks import get_task

    from gcfamily.config import resolve

    cfg = resolve(None, settings)  # typed, as the run read them
    task = get_task(cfg.task, seed=cfg.seed if cfg.task_seed is None else cfg.task_seed, **cfg.task_options)
    model, tok = load_model(str(folder) if folder is not None else cfg.model, torch.float32, "cpu")
    fmt_ = Formatter(tok, cfg.chat_format, cfg.system_prompt, cfg.assistant_only_loss, cfg.chat_template)
    return heldout_accuracy(model, tok, task, cfg.eval_samples, cfg.max_new_tokens, formatter=fmt_)


def sweep_table(key: str, values: list[str], per_method: dict[str, list[dict[str, Any]]], base_acc: float, header: dict[str, Any]) -> str:
    """bench.md of a sweep: validation accuracy per value, the choice, and the held-out accuracy at it."""
    lines = [f"# gcf bench --sweep {key}: {header['model']} on {header['task']}, budget {header['budget']}", "",
             f"{header['machine']}; {header['date']}; total {header['total_s']:.0f} s of runs.", "",
             "| method | " + " | ".join(f"{key}={v}: validation acc" for v in values) + f" | chosen {key} | held-out acc before | after, at the chosen |",
             "|---" * (len(values) + 4) + "|"]
    for m, runs in per_method.items():
        scores = [r.get("val_accuracy") for r in runs]
        i = choose(values, scores)
        after = runs[i].get("heldout_after") if i is not None else None
        if len(runs) != len(values):  # the method has no such setting: one run
            cells, chosen = [fmt(scores[0], ".3f")] + ["same run"] * (len(values) - 1), f"({key} is not its setting)"
        else:
            cells, chosen = [fmt(x, ".3f") for x in scores], values[i] if i is not None else "-"
        lines.append("| " + " | ".join([m, *cells, chosen, fmt(base_acc, ".3f"), fmt(after, ".3f")]) + " |")
    lines += ["", "Validation: the last eval_samples rows of the task's train split, kept out of training (validation_rows); the choice "
              "reads only these. Held-out: the test split, read once per method for the chosen run's final model, and once for the base model."]
    return "\n".join(lines) + "\n"


def record(folder: Path, result: dict[str, Any]) -> None:
    (folder / "bench_sweep.json").write_text(json.dumps(result))
