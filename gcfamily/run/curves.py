"""curves.png: a run's learning curves at a glance, written beside metrics.jsonl when the run ends.

Up to three panels against the optimizer step, each drawn only where the run logged it: the training loss, the mean
reward of the step's samples, and the held-out figures (eval/accuracy with its 95% Wilson interval as error bars where
eval_details.jsonl gives the count; eval/reward_mean, eval/loss). Written through write_atomic, so a full disk leaves
no half image and ends, like every other write, in one sentence that says what is kept.
"""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

from gcfamily.run.folder.writes import write_atomic

NAME = "curves.png"


def _series(rows: list[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    xs, ys = [], []
    for r in rows:
        v = r.get(key)
        if isinstance(v, (int, float)) and not isinstance(v, bool) and v == v:  # not NaN
            xs.append(int(r.get("step", 0)))
            ys.append(float(v))
    return xs, ys


def _counts(out_dir: Path) -> dict[int, tuple[int, int]]:
    """{step: (right, prompts)} of each evaluation that recorded a verdict per prompt."""
    path = out_dir / "eval_details.jsonl"
    found: dict[int, tuple[int, int]] = {}
    if not path.is_file():
        return found
    for line in path.read_text().splitlines():
        try:
            rec = json.loads(line)
            rows = [r for r in rec["rows"] if "correct" in r]
            if rows:
                found[int(rec["step"])] = (sum(bool(r["correct"]) for r in rows), len(rows))
        except (ValueError, KeyError, TypeError):
            continue
    return found


def write_curves(out_dir: Path, rows: list[dict[str, Any]]) -> Path | None:
    """Draw `rows` (the run's metrics) into out_dir/curves.png; None when the run logged nothing to draw."""
    from gcfamily.core.stats import wilson

    panels = []
    for keys, title in (
        (("loss",), "training loss"),
        (("reward/mean",), "reward (mean of the step's samples)"),
        (("eval/accuracy", "eval/reward_mean", "eval/loss"), "held-out"),
    ):
        drawn = [(k, *_series(rows, k)) for k in keys]
        drawn = [d for d in drawn if d[2]]
        if drawn:
            panels.append((title, drawn))
    if not panels:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    counts = _counts(out_dir)
    fig, axes = plt.subplots(1, len(panels), figsize=(4.6 * len(panels), 3.6), squeeze=False)
    for ax, (title, drawn) in zip(axes[0], panels):
        for key, xs, ys in drawn:
            if key == "eval/accuracy" and all(x in counts for x in xs):
                bands = [wilson(*counts[x]) for x in xs]
                err = [[y - lo for y, (lo, _) in zip(ys, bands)], [hi - y for y, (_, hi) in zip(ys, bands)]]
                ax.errorbar(xs, ys, yerr=err, marker="o", ms=4, capsize=3, label=f"{key} (95% Wilson)")
            else:
                ax.plot(xs, ys, marker="o" if len(xs) < 40 else None, ms=3, label=key)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("optimizer step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(out_dir.name, fontsize=10)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100)
    plt.close(fig)
    path = out_dir / NAME
    write_atomic(path, buf.getvalue(), run_dir=out_dir)
    return path


def where(out_dir: Path) -> list[str]:
    """Where a run's metrics are, for the console's closing lines: curves.png, metrics.jsonl, and the TensorBoard command
    when it logged events."""
    import shlex

    lines = []
    if (out_dir / "curves.png").is_file():
        lines.append(f"  curves: {out_dir / 'curves.png'}")
    if (out_dir / "metrics.jsonl").is_file():
        lines.append(f"  metrics: {out_dir / 'metrics.jsonl'}")
    if (out_dir / "tensorboard").is_dir():
        lines.append(f"  tensorboard: tensorboard --logdir {shlex.quote(str(out_dir / 'tensorboard'))}")
    return lines
