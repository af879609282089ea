"""The one door between a method and the run: everything a method may ask for, written down as a Protocol.

A method receives a `Services` in `setup(services)` and keeps it as `self.services`; it never sees the Trainer. Three
things implement it: the run's (gcfamily/run/services.py), the checker's stand-in (gcfamily/check/world.py) and the
theory bench's bandit runner (gcfamily/theory/train.py). `LocalServices` holds the parts that are the same for every
single-process implementation (reductions that are the identity, no stop, nowhere to log samples), so a stand-in writes
only what differs. tests/test_services.py checks each implementation against the Protocol.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any, Optional, Protocol, runtime_checkable

import torch
from torch import nn

from gcfamily.core.batch import Batch
from gcfamily.core.engine import grads_finite
from gcfamily.methods.episodes import EpisodeLimits
from gcfamily.rollout import Rollout, SamplingSettings


@runtime_checkable
class Services(Protocol):
    """What a method may ask of the run. Attributes are fixed for the run; functions may be called at any step."""

    device: torch.device
    """Where the method's own models live (a reference, a critic, a reward model)."""
    dtype: torch.dtype
    """The dtype models are loaded in (the master dtype)."""
    tokenizer: Any
    """The policy's tokenizer."""
    formatter: Any
    """The run's Formatter (gcfamily/data/encoding.py): rows to token ids."""
    task: Any
    """The built-in task, or None when the run trains on a dataset."""
    reward_functions: Optional[list]
    """Reward functions passed from Python (gcfamily.train(reward=fn)); None: the settings name the rewards."""
    envs: Any
    """The run's environments (gcfamily/envs/worker.py: every sample an episode), or None: one turn per sample."""
    episode_limits: EpisodeLimits
    """How long an episode may run (max_turns, max_episode_tokens, the model's context)."""
    rank: int
    """This process's index among world_size (0 in one process)."""
    world_size: int
    """Processes training together (1 in one process)."""
    is_main: bool
    """True in the process that writes files (rank 0)."""

    def policy(self) -> nn.Module:
        """The plain causal LM being trained (under any DDP/FSDP2 wrapper); for copies, critics, state dicts."""
        ...

    def reference(self) -> nn.Module:
        """A frozen pi_ref equal to the policy as it is now: a copy, or with LoRA the base with the adapters off."""
        ...

    def training_rows(self) -> list[dict[str, Any]]:
        """The rows the method trains on: the dataset's (columns renamed), else its task's (Method.task_rows)."""
        ...

    def logprobs(self, model: nn.Module, batch: Batch, temperature: float = 1.0) -> torch.Tensor:
        """Log-probs [B, L] of a whole batch under `model`, without grad, micro-batched like the training step."""
        ...

    def generate(self, prompt_ids: list[list[int]], group_size: int, sampling: SamplingSettings) -> Rollout:
        """group_size samples per prompt from the policy, with the run's generator; the policy in eval mode and (FSDP2)
        with whole parameters while it samples, as it was after."""
        ...

    def all_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """The tensor summed over the processes (the identity in one process)."""
        ...

    def all_finite(self, params: list[torch.Tensor]) -> bool:
        """Every gradient of `params` is finite on every process."""
        ...

    def clip_grad_norm(self, params: list[torch.Tensor], max_norm: float) -> torch.Tensor:
        """Clip the gradients of `params` to a global norm (over every shard under FSDP2); returns the norm before."""
        ...

    def stop_requested(self) -> bool:
        """A SIGTERM or Ctrl-C arrived: a running reward may be abandoned; the run stops at the end of the step."""
        ...

    def log_samples(self, step: int, rows: list[dict[str, Any]]) -> None:
        """Prompts, completions and rewards of a step for completions.jsonl and the trackers."""
        ...

    def say(self, line: str) -> None:
        """A progress line for a long phase of the method's own (drawing a pool), above the run's progress bar; quiet
        with progress=false and on every process but the first."""
        ...

    def autocast(self) -> contextlib.AbstractContextManager:
        """Forwards in the run's compute dtype (a method's own model outside the trainer's passes)."""
        ...

    def run_file(self, name: str) -> Optional[Path]:
        """The path of a file of the run folder where the method keeps data of its own (a pool of samples), removed by
        --overwrite with the rest of the run; None where there is no run folder. Only the main process writes."""
        ...


class LocalServices:
    """The parts of Services that are the same for every single-process implementation; subclass and add the rest."""

    device = torch.device("cpu")
    dtype = torch.float32
    tokenizer: Any = None
    formatter: Any = None
    task: Any = None
    reward_functions: Optional[list] = None
    envs: Any = None
    episode_limits = EpisodeLimits()
    rank = 0
    world_size = 1
    is_main = True

    def all_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def all_finite(self, params: list[torch.Tensor]) -> bool:
        return grads_finite(params)

    def clip_grad_norm(self, params: list[torch.Tensor], max_norm: float) -> torch.Tensor:
        return torch.nn.utils.clip_grad_norm_(params, max_norm)

    def stop_requested(self) -> bool:
        return False

    def log_samples(self, step: int, rows: list[dict[str, Any]]) -> None:
        return None

    def say(self, line: str) -> None:
        return None

    def autocast(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def training_rows(self) -> list[dict[str, Any]]:
        return self.task.rows("train") if self.task is not None else []

    def run_file(self, name: str) -> Optional[Path]:
        return None
