"""Training the Bradley-Terry reward model: stage two of the chapter's pipeline (SFT -> reward model -> RL).

Loss (Bradley & Terry 1952; Ouyang et al. 2022, InstructGPT, arXiv:2203.02155, section 3.5), per pair:

    loss = -log sigmoid(r(q, o_w) - r(q, o_l)),   mean over the step's pairs

This is not a policy-gradient method: it trains no policy, so it has no coefficient for the engine.
It declares `trains_policy = False`, and the trainer runs only its `auxiliary_step` (the reward
model's backward, through `bradley_terry_loss`) and `auxiliary_step_end` (its optimizer step), and
saves the reward model, not the policy, as the run's output. The reward model starts as a copy of
the policy's backbone (`--model`, e.g. an SFT run's folder) with a zero scalar head.

Data: `--dataset` rows {prompt, chosen, rejected} (a seeded tenth held out), or, offline, the task's
preference pairs (`preferences.preference_rows`: its answer vs a wrong or malformed one); held-out
pairs then come from the task's test split. Held-out pair accuracy is `rm/heldout_accuracy`.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import torch

from gcfamily.config import Config, planned_steps
from gcfamily.core.engine import build_optimizer, lr_lambda, second_model_step
from gcfamily.core.memory import module_mb
from gcfamily.data.batches import collate, default_pad_id, epoch_indices
from gcfamily.data.encoding import encode
from gcfamily.data.preferences import preference_rows
from gcfamily.errors import GcfError
from gcfamily.methods.base import Batch, Method, Stats
from gcfamily.methods.services import Services
from gcfamily.rewards.model import RewardModel, bradley_terry_loss


class RewardModelTraining(Method):
    """Bradley-Terry reward model: loss -log sigmoid(r(q, o_w) - r(q, o_l)); the policy is not trained (GC = 0)."""

    name = "reward-model"
    data_source = "preference pairs (prompt, chosen, rejected); offline: the task's answer vs a wrong or malformed one"
    gc_formula = "none: trains no policy; a scalar-head model learns -log sigmoid(r(q, o_w) - r(q, o_l))"
    data_kind = "pairs"
    default_norm = "sum"
    rows_per_example = 2
    trains_policy = False
    offline_pairs: int = 4096
    """Pairs built from a task: its small levels repeat (with other wrong answers), its large ones stay fresh."""

    @classmethod
    def task_rows(cls, task: Any, cfg: Config, split: str = "train") -> list[dict[str, Any]]:
        return preference_rows(task, cls.offline_pairs, cfg.seed, split=split)

    @classmethod
    def validate(cls, cfg: Config) -> None:
        if cfg.reward_model:
            raise GcfError(
                "reward_model is the input of on-policy methods; `--method reward-model` trains one and writes it to --output-dir."
            )

    # -- data and the model ----------------------------------------------------------
    def setup(self, services: Services) -> None:
        if services.world_size > 1:  # the reward model is not wrapped for data parallelism
            raise GcfError("reward-model training runs in one process for now; run it with --nproc 1.")
        super().setup(services)
        cfg = self.cfg
        data = self.load_data(services)  # preference rows: the dataset's, or pairs made from the task
        self.skipped = data.n_skipped
        if services.task is None:
            order = list(range(len(data.examples)))
            random.Random(f"reward-model/{cfg.seed}").shuffle(order)
            n_held = min(len(order) // 10, cfg.eval_samples)  # a seeded tenth, never trained on
            self.heldout, self.pairs = (
                [data.examples[i] for i in order[:n_held]],
                [data.examples[i] for i in order[n_held:]],
            )
        else:
            self.pairs = data.examples
            held = preference_rows(services.task, cfg.eval_samples, cfg.seed, split="test")
            self.heldout = encode(
                self.data_kind, held, services.formatter, cfg.max_length, cfg.long_prompts, self.name
            ).examples
        self.pad_id = default_pad_id(services.tokenizer)
        self.rm = RewardModel.from_causal_lm(services.policy(), services.tokenizer, cfg.max_length).train()
        if cfg.activation_checkpointing and hasattr(self.rm.model, "gradient_checkpointing_enable"):
            self.rm.model.gradient_checkpointing_enable()
        # the reward model is the model this run trains: it takes the run's lr and schedule
        self.planned = planned_steps(cfg, len(self.pairs))  # the run's steps: max_steps, or what `epochs` passes take
        self.optimizer = build_optimizer(self.rm.parameters(), cfg.lr, cfg.weight_decay, tuple(cfg.adam_betas))
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lr_lambda(cfg.lr_schedule, cfg.warmup_steps, self.planned, cfg.min_lr_ratio)
        )
        self.pairs_in_step = 0

    def data(self, step: int) -> tuple[Batch, Stats]:
        idx = epoch_indices(len(self.pairs), self.cfg.seed, step, self.cfg.batch_size)
        # chosen 2k, rejected 2k+1
        batch: Batch = collate([(self.pairs[i][0], self.pairs[i][s]) for i in idx for s in (1, 2)], self.pad_id)
        return batch, {"skipped_long_prompts": float(self.skipped)}

    # -- the policy's coefficient: none ----------------------------------------------
    def coefficient(self, batch: Batch, logps: torch.Tensor) -> torch.Tensor:
        return torch.zeros_like(logps)  # the policy is not trained (the trainer never asks)

    def objective(self, batch: Batch, logps: torch.Tensor, Z: float) -> torch.Tensor:
        return (0.0 * logps).sum()

    # -- the reward model's loss and step --------------------------------------------
    def auxiliary_step(self, batch: Batch) -> dict[str, float]:
        """The Bradley-Terry loss's backward on this micro-batch's pairs (summed; the step's pair count divides it)."""
        scores = self.rm(batch.input_ids, batch.attention_mask)  # [2P]
        chosen, rejected = scores[0::2], scores[1::2]  # [P]
        loss = bradley_terry_loss(chosen, rejected)  # [P]
        loss.sum().backward()
        self.pairs_in_step += int(loss.shape[0])
        m = (chosen - rejected).detach()
        return {
            "loss": float(loss.detach().mean()),
            "rm/accuracy": float((m > 0).float().mean() + 0.5 * (m == 0).float().mean()),
            "rm/margin": float(m.mean()),
            "rm/chosen_score": float(chosen.detach().mean()),
            "rm/rejected_score": float(rejected.detach().mean()),
        }

    def auxiliary_step_end(self) -> dict[str, float]:
        """Mean over the step's pairs, then clip and step; a non-finite step is skipped and counted."""
        status, norm = second_model_step(
            self.optimizer, list(self.rm.parameters()), self.pairs_in_step, self.cfg.grad_clip
        )
        out: dict[str, float] = {"skipped": float(status == "skipped")}
        if status == "stepped":
            out["grad_norm"] = norm
            self.scheduler.step()
        self.pairs_in_step = 0
        param_mb, optim_mb = module_mb(self.rm, self.optimizer)
        return {**out, "rm/lr": self.scheduler.get_last_lr()[0], "rm/memory_mb": param_mb + optim_mb}

    # -- held-out accuracy, state, output --------------------------------------------
    def heldout_accuracy(self) -> float:
        """Fraction of held-out pairs the model orders right (a tie counts one half: chance is 0.5)."""
        if not self.heldout:
            return float("nan")
        seqs = [p + c for p, w, l in self.heldout for c in (w, l)]
        s = self.rm.score_ids(seqs, self.cfg.micro_batch_size)
        m = torch.tensor(s[0::2]) - torch.tensor(s[1::2])
        return float((m > 0).float().mean() + 0.5 * (m == 0).float().mean())

    def after_step(self, step: int) -> dict[str, float]:
        every = self.cfg.eval_every
        if (every and step % every == 0) or step == self.planned:
            return {"rm/heldout_accuracy": self.heldout_accuracy()}
        return {}

    def state_dict(self) -> dict[str, Any]:
        return {
            "rm": {k: v.detach().cpu().clone() for k, v in self.rm.model.state_dict().items()},
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "rm" in state:
            self.rm.model.load_state_dict(state["rm"])
            self.optimizer.load_state_dict(state["optimizer"])
            self.scheduler.load_state_dict(state["scheduler"])

    def save_final(self, out_dir: Path) -> bool:
        if self.services.is_main:
            self.rm.save(out_dir)
        return True
