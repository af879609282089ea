"""What the run's adapters read of the Trainer (gcfamily/run/trainer.py): the Services a method gets (services.py), the
saving (saving.py) and the distributed save (distributed.py). They type the trainer as this Protocol, which the Trainer
meets as it is; importing the Trainer itself there would make an import circle (tests/test_layers.py counts imports
under TYPE_CHECKING too). `dist` and `saving` are Any here for the same reason: their modules import this one.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any, Protocol

import torch

from gcfamily.config import Config
from gcfamily.core import threads
from gcfamily.data.encoding import Formatter
from gcfamily.methods.base import Method
from gcfamily.rollout import RolloutBackend
from gcfamily.run.budget import Budget
from gcfamily.run.evaluation import Evaluation
from gcfamily.run.folder import RunFolder


class TrainerView(Protocol):
    """The parts of a Trainer that its adapters read (all set once the Trainer is built)."""

    cfg: Config
    device: torch.device
    dtype: torch.dtype
    dist: Any  # gcfamily.run.distributed.DistEnv under torchrun, else None
    is_main: bool
    out_dir: Path
    folder: RunFolder
    saving: Any  # gcfamily.run.saving.Saving
    evaluation: Evaluation
    policy: torch.nn.Module  # as the steps train it (DDP / FSDP2 wrapped)
    tokenizer: Any
    formatter: Formatter
    task: Any
    rewards: list | None
    method: Method
    generator: torch.Generator
    rollout: RolloutBackend  # every sampling path's engine (gcfamily/rollout/backend.py)
    envs: Any  # the run's environments (gcfamily/envs/worker.py), or None
    bar: Any  # the run's progress bar while it goes, else None
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    threads: threads.Threads
    budget: Budget
    step: int
    bad_steps: int
    skipped_steps: int
    trained_steps: int
    first_bad_step: int | None
    stop_signal: str | None

    def unwrapped_policy(self) -> torch.nn.Module: ...

    def weight_keys(self) -> set[str] | None: ...

    def autocast(self) -> contextlib.AbstractContextManager: ...
