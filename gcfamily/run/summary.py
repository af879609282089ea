"""The console's closing lines of `gcf run`: steps and time, the held-out and reward change, the last loss, and where
the model is and what loads it.
"""

from __future__ import annotations

from pathlib import Path

from gcfamily.run.figures import duration, eval_keys, fmt, folder_layout, loader_class, metric_rows, series
from gcfamily.run.heldout import accuracy_change


def summary(metrics: list[dict], steps: int, seconds: float, out_dir: Path, final_saved: bool) -> str:
    """A few lines for the end of `gcf run`: steps and time, held-out and reward change, last loss, the model."""
    rows = metric_rows(metrics)
    lines = [f"done: {steps} step{'' if steps == 1 else 's'} in {duration(seconds)}"]
    change = accuracy_change(Path(out_dir) / "eval_details.jsonl")
    if change is not None:
        n, b, a = change["n"], change["before"], change["after"]
        lines.append(
            f"  held-out accuracy {b / n:.3f} ({b}/{n}) -> {a / n:.3f} ({a}/{n}) at step {change['step']}: "
            f"{change['diff']:+.3f}, 95% interval [{change['lo']:+.3f}, {change['hi']:+.3f}] "
            "(paired bootstrap over the same prompts)"
        )
    for key in eval_keys(rows):
        if change is not None and key == "eval/accuracy":
            continue  # said above, with its counts and interval
        seen = series(rows, key)
        if len(seen) >= 2 and seen[0][0] != seen[-1][0]:
            (s0, v0), (s1, v1) = seen[0], seen[-1]
            when = "before -> after" if s0 == 0 else f"step {fmt(s0)} -> {fmt(s1)}"
            lines.append(f"  {key} {fmt(v0)} -> {fmt(v1)} (held-out, {when})")
        elif "heldout" in key:  # a held-out figure measured once (a reward model's, at its last step)
            lines.append(f"  {key} {fmt(seen[-1][1])} (held-out, step {fmt(seen[-1][0])})")
    seen = series(rows, "reward/mean")
    if len(seen) >= 2:
        lines.append(f"  reward/mean {fmt(seen[0][1])} -> {fmt(seen[-1][1])} (first -> last step)")
    elif seen:
        lines.append(f"  reward/mean {fmt(seen[0][1])} (step {seen[0][0]})")
    seen = series(rows, "loss")
    if seen:
        lines.append(f"  loss {fmt(seen[-1][1])} (last step)")
    if final_saved:
        layout = folder_layout(Path(out_dir))
        how = f"{loader_class(layout)}.from_pretrained"
        if layout == "adapter":
            how += "; a LoRA adapter, needs peft"
        elif layout == "merged":
            how += "; LoRA merged, the adapter in adapter/"
        if steps == 0:
            how += "; no training step was taken: the base model as loaded"
        lines.append(f"  model: {out_dir} ({how})")
    else:
        lines.append("  no final model was written")
    return "\n".join(lines)
