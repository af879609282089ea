"""Honest logging: every step to metrics.jsonl (for benchmarks) and TensorBoard (for people)."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any


class RunLogger:
    """Writes one JSON line per logged step and the same scalars to TensorBoard; rank 0 only."""

    def __init__(self, out_dir: Path, enabled: bool = True, tensorboard: bool = True) -> None:
        self.enabled = enabled
        self.path = out_dir / "metrics.jsonl"
        self.tb = None
        if enabled and tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(log_dir=str(out_dir / "tensorboard"))
        self.t0 = time.time()

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        """Append a step's metrics; non-finite numbers are written as null in JSON."""
        if not self.enabled:
            return
        row = {"step": step, "time": round(time.time() - self.t0, 3)}
        for k, v in metrics.items():
            if isinstance(v, float) and not math.isfinite(v):
                row[k] = None
            else:
                row[k] = v
        with self.path.open("a") as f:
            f.write(json.dumps(row) + "\n")
        if self.tb is not None:
            for k, v in metrics.items():
                if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(float(v)):
                    self.tb.add_scalar(k, v, step)

    def close(self) -> None:
        """Flush TensorBoard."""
        if self.tb is not None:
            self.tb.flush()
            self.tb.close()


def read_metrics(path: Path | str) -> list[dict[str, Any]]:
    """The rows of a metrics.jsonl file."""
    p = Path(path)
    if p.is_dir():
        p = p / "metrics.jsonl"
    return [json.loads(line) for line in p.read_text().splitlines() if line.strip()]
