"""What a caller configures a run to hand out or take in, given to the Trainer at construction (never a patched object).

`gcf bench`'s child (gcfamily/bench/child.py) records every loss token's GC and reuses an evaluation an earlier run of
the same start already made; a user can do the same from Python:

    Trainer(cfg, hooks=RunHooks(on_coefficients=lambda step, parts: ...))
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import torch

from gcfamily.run.folder.writes import append_lines

Coefficients = list[tuple[torch.Tensor, torch.Tensor]]
"""One optimizer step's (GC [b, L], effective mask [b, L]) per micro-batch, detached."""


@dataclass
class StartEvaluation:
    """The evaluation before the first step, taken from elsewhere instead of computed: its figures (eval/...) and its
    line of eval_details.jsonl (at step 0)."""

    figures: dict[str, float]
    details: str


@dataclass
class RunHooks:
    on_coefficients: Optional[Callable[[int, Coefficients], None]] = None
    """Called after each optimizer step's backward with the step's number (as logged) and its coefficients."""
    environment: Optional[type] = None
    """An Environment subclass from Python (gcfamily.train(env=MyEnv)): the run's environment, in this process."""
    start_evaluation: Optional[StartEvaluation] = None
    """Recorded as the step-0 evaluation of a run that starts at step 0, instead of evaluating the policy."""

    def record_start_evaluation(self, out_dir: Path, is_main: bool) -> dict[str, float]:
        """The given start evaluation's figures, its details line appended to the run's eval_details.jsonl (rank 0)."""
        given = self.start_evaluation
        assert given is not None
        if is_main:
            append_lines(out_dir / "eval_details.jsonl", [given.details], run_dir=out_dir)
        return dict(given.figures)
