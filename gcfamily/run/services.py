"""The run's side of the door (gcfamily/methods/services.py): what a method may ask, answered from the Trainer's parts."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import torch
from torch import nn

from gcfamily.core import engine
from gcfamily.methods.episodes import EpisodeLimits
from gcfamily.methods.services import LocalServices
from gcfamily.models import lora
from gcfamily.rollout import Rollout, SamplingSettings, context_length
from gcfamily.run import console
from gcfamily.run.view import TrainerView


class RunServices(LocalServices):
    """Services of a training run: the policy and its tokenizer, the run's generator, its processes and stop flag."""

    def __init__(self, trainer: TrainerView) -> None:
        self._trainer = trainer  # the Trainer, which holds this object; read lazily: the policy is wrapped for DDP/FSDP2 after the method's setup

    # -- what the run is
    @property
    def device(self) -> torch.device:  # type: ignore[override]
        return self._trainer.device

    @property
    def dtype(self) -> torch.dtype:  # type: ignore[override]
        return self._trainer.dtype

    @property
    def tokenizer(self) -> Any:
        return self._trainer.tokenizer

    @property
    def formatter(self) -> Any:
        return self._trainer.formatter

    @property
    def task(self) -> Any:
        return self._trainer.task

    @property
    def reward_functions(self) -> list | None:  # type: ignore[override]
        return self._trainer.rewards

    @property
    def envs(self) -> Any:
        return self._trainer.envs

    @property
    def episode_limits(self) -> EpisodeLimits:  # type: ignore[override]
        cfg = self._trainer.cfg
        tokens = cfg.max_episode_tokens or cfg.max_new_tokens * cfg.max_turns
        return EpisodeLimits(cfg.max_turns, tokens, context_length(self._trainer.unwrapped_policy()))

    @property
    def rank(self) -> int:  # type: ignore[override]
        return self._trainer.dist.rank if self._trainer.dist is not None else 0

    @property
    def world_size(self) -> int:  # type: ignore[override]
        return self._trainer.dist.world_size if self._trainer.dist is not None else 1

    @property
    def is_main(self) -> bool:  # type: ignore[override]
        return self._trainer.is_main

    # -- models
    def policy(self) -> nn.Module:
        return self._trainer.unwrapped_policy()

    def reference(self) -> nn.Module:
        policy = self.policy()
        if lora.is_peft(policy):
            return lora.AdapterOffReference(policy)
        from gcfamily.models import load_reference

        return load_reference(policy)

    def training_rows(self) -> list[dict[str, Any]]:
        return self._trainer.evaluation.training_rows()

    def logprobs(self, model: nn.Module, batch: dict[str, Any], temperature: float = 1.0) -> torch.Tensor:
        t, cfg = self._trainer, self._trainer.cfg
        # an FSDP2-sharded model runs through its root
        model = t.dist.logprob_module(model) if t.dist is not None else model
        with t.autocast():
            return engine.batch_logprobs(
                model, batch, temperature, cfg.micro_batch_size, cfg.chunk_size, cfg.share_prefix, t.device
            )

    def generate(self, prompt_ids: list[list[int]], group_size: int, sampling: SamplingSettings) -> Rollout:
        t = self._trainer
        policy = t.unwrapped_policy()
        was_training = policy.training
        policy.eval()
        try:
            # FSDP2: gathered, then freed
            with t.dist.full_parameters(t.policy) if t.dist is not None else contextlib.nullcontext():
                return t.rollout.generate(prompt_ids, group_size, sampling, t.generator)
        finally:
            policy.train(was_training)

    # -- processes and signals
    def all_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        return self._trainer.dist.all_sum(tensor) if self._trainer.dist is not None else tensor

    def all_finite(self, params: list[torch.Tensor]) -> bool:
        return (
            self._trainer.dist.all_finite(0.0, params)
            if self._trainer.dist is not None
            else engine.grads_finite(params)
        )

    def clip_grad_norm(self, params: list[torch.Tensor], max_norm: float) -> torch.Tensor:
        dist = self._trainer.dist
        return (
            dist.clip_grad_norm_(params, max_norm)
            if dist is not None
            else torch.nn.utils.clip_grad_norm_(params, max_norm)
        )

    def stop_requested(self) -> bool:
        return self._trainer.stop_signal is not None

    def log_samples(self, step: int, rows: list[dict[str, Any]]) -> None:
        self._trainer.saving.log_samples(step, rows)

    def say(self, line: str) -> None:
        t = self._trainer
        if t.cfg.progress and t.is_main:
            console.say(t.bar, line)

    def autocast(self) -> contextlib.AbstractContextManager:
        return self._trainer.autocast()

    def run_file(self, name: str) -> Path | None:
        return self._trainer.out_dir / name
