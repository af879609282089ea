"""KTO: prospect-theoretic alignment from unpaired good/bad labels.

Ethayarajh et al. 2024, "KTO: Model Alignment as Prospect Theoretic Optimization" (arXiv:2402.01306, eq. 8).
Per example (q, o, label), with r = sum_t log(pi(o_t | q, o_<t) / pi_ref(o_t | q, o_<t)):

    loss = lambda_D * (1 - sigmoid(beta * (r - z0)))     label True  (desirable)
    loss = lambda_U * (1 - sigmoid(beta * (z0 - r)))     label False (undesirable)
    J    = -sum_examples loss / Z,   Z = examples in the step        ("sum" normalisation, TRL's mean)
    GC   = +lambda_D * beta * s (1 - s) on a desirable example's tokens,    s = sigmoid(beta * (r - z0))
           -lambda_U * beta * s (1 - s) on an undesirable example's tokens, s = sigmoid(beta * (z0 - r))

z0, the reference point, is computed in `prepare`, as the paper and TRL do: each example's prompt is paired
with the completion of the next example of the process's batch (the last with the first), and

    z0 = max(0, mean over those mismatched pairs, on every process, of sum_t log(pi(o'_t) / pi_ref(o'_t)))

with the policy as it is at the step (before its update). It is a constant of the step: the objective holds
it fixed and no gradient flows through it (the paper's "we do not backpropagate through z0").

Data: `--dataset` rows with prompt (text or messages), completion and a boolean label (TRL's unpaired
preference format); on a built-in task, the task's preference pairs split into rows (chosen -> True,
rejected -> False). pi_ref is a frozen copy of the initial policy (the reference of z0's pairs changes
every step, so its log-probs are computed each step rather than once).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from gcfamily.config import Config, MethodSettings, resolve_settings
from gcfamily.core.engine import example_weights
from gcfamily.data.batches import collate, default_pad_id
from gcfamily.data.preferences import preference_rows
from gcfamily.errors import GcfError
from gcfamily.methods.base import Batch, Method, Stats
from gcfamily.methods.services import Services


def unpaired_rows(pairs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Preference pairs split into unpaired rows: chosen -> label True, rejected -> label False."""
    return [
        {"prompt": p["prompt"], "completion": p[k], "label": k == "chosen"}
        for p in pairs
        for k in ("chosen", "rejected")
    ]


class KTO(Method):
    """KTO (Ethayarajh et al. 2024, arXiv:2402.01306): loss lambda_y * (1 - sigmoid(+-beta * (r - z0))), r = sum_t log(pi/pi_ref).

    GC = +-lambda_y * beta * s * (1 - s) on the example's tokens (derivation and z0 in the module docstring).
    """

    name = "kto"
    data_source = "unpaired completions labelled desirable or not; offline: the task's preference pairs, split"
    gc_formula = "+lambda_D*beta*s(1-s) on desirable tokens, s = sigmoid(beta(r - z0)); -lambda_U*beta*s(1-s) on undesirable, s = sigmoid(beta(z0 - r))"
    data_kind = "labelled"
    default_norm = "sum"

    @dataclass
    class Settings(MethodSettings):
        beta: float = 0.1
        """KTO's temperature: the value is sigmoid(beta * (r - z0)), r = sum_t log(pi/pi_ref) (TRL's default 0.1)."""
        desirable_weight: float = 1.0
        """lambda_D, the weight of desirable examples' losses."""
        undesirable_weight: float = 1.0
        """lambda_U, the weight of undesirable examples' losses (the paper keeps lambda_D n_D / (lambda_U n_U) in [1, 4/3])."""

    @classmethod
    def validate(cls, cfg: Config) -> None:
        s = resolve_settings(cfg, cls).settings
        if s.beta <= 0:
            raise GcfError(f"kto needs beta > 0 (got {s.beta}); 0.1 is usual.")
        if s.desirable_weight < 0 or s.undesirable_weight < 0 or s.desirable_weight + s.undesirable_weight == 0:
            raise GcfError("kto needs desirable_weight and undesirable_weight >= 0, not both 0.")
        if cfg.loss_norm not in (None, "sum"):
            raise GcfError(f"kto averages per-example losses; loss_norm must be sum (got {cfg.loss_norm}).")
        if cfg.batch_size < 2:
            raise GcfError("kto needs batch_size >= 2: z0 pairs each prompt with another example's completion.")

    @classmethod
    def task_rows(cls, task: Any, cfg: Config, split: str = "train") -> list[dict[str, Any]]:
        return unpaired_rows(preference_rows(task, None, cfg.seed, split=split))

    def setup(self, services: Services) -> None:
        super().setup(services)
        cfg = self.cfg
        # unpaired rows, or preference pairs split into a desirable and an undesirable row
        data = self.load_data(services)
        self.examples, self.skipped = data.examples, data.n_skipped
        self.labels = [row["label"] for row in data.rows]
        if len(self.examples) < 2:
            raise GcfError(f"kto needs at least two rows within max_length={cfg.max_length}; raise max_length.")
        world = services.world_size
        if world > 1 and cfg.batch_size // world < 2:
            raise GcfError(f"kto needs at least 2 examples per process for z0; raise batch_size to {2 * world}.")
        self.pad_id = default_pad_id(services.tokenizer)
        self.ref = services.reference()

    def data(self, step: int) -> tuple[Batch, Stats]:
        idx = self.step_indices(len(self.examples), step)
        ex = [self.examples[i] for i in idx]
        batch: Batch = collate(ex, self.pad_id)
        batch.desirable = torch.tensor([self.labels[i] for i in idx])  # [B]
        room = self.cfg.max_length
        batch.kl_pairs = collate(
            [(p, ex[(j + 1) % len(ex)][1][: room - len(p)]) for j, (p, _) in enumerate(ex)], self.pad_id
        )
        return batch, {"skipped_long_prompts": float(self.skipped)}

    @torch.no_grad()
    def prepare(self, batch: Batch) -> tuple[Batch, Stats]:
        services = self.services
        kl, batch.kl_pairs = batch.kl_pairs, None
        batch.ref_logps = services.logprobs(self.ref, batch)  # [B, L]
        d = ((services.logprobs(services.policy(), kl) - services.logprobs(self.ref, kl)) * kl.loss_mask).sum(-1)  # [B]
        total = services.all_sum(torch.stack([d.double().sum(), torch.tensor(float(len(d)), dtype=torch.float64)]))
        kl_mean = float(total[0] / total[1])
        batch.z0 = max(kl_mean, 0.0)  # a float: the same constant in every micro-batch
        return batch, {"kto/kl": kl_mean, "kto/z0": batch.z0}

    # -- the rule --------------------------------------------------------------------
    def coefficient(self, batch: Batch, logps: torch.Tensor) -> torch.Tensor:
        s, z0 = self.settings, batch.z0
        mask = batch.loss_mask.to(logps.dtype)  # [B, L]
        r = ((logps - batch.ref_logps) * mask).sum(-1)  # [B]
        good = batch.desirable.bool()  # [B]
        u = torch.where(good, s.beta * (r - z0), s.beta * (z0 - r))  # [B]
        lam = torch.where(good, s.desirable_weight, -s.undesirable_weight)  # [B]: d u / d r is -beta when undesirable
        return (lam * s.beta * torch.sigmoid(u) * torch.sigmoid(-u))[:, None] * mask  # [B, L]

    def objective(self, batch: Batch, logps: torch.Tensor, Z: float) -> torch.Tensor:
        s, z0 = self.settings, batch.z0
        r = ((logps - batch.ref_logps) * batch.loss_mask).sum(-1)  # [B]
        good = batch.desirable.bool()
        # [B]
        loss = torch.where(
            good,
            s.desirable_weight * (1 - torch.sigmoid(s.beta * (r - z0))),
            s.undesirable_weight * (1 - torch.sigmoid(s.beta * (z0 - r))),
        )
        return -(loss * example_weights(batch)).sum() / Z

    def metrics(self, batch: Batch, logps: torch.Tensor, coef: torch.Tensor) -> dict[str, float]:
        r = ((logps - batch.ref_logps) * batch.loss_mask).sum(-1)  # [B]
        good = batch.desirable.bool()
        out = {
            "kto/loss": float(-self.objective(batch, logps, len(r))),
            "kto/desirable_frac": float(good.float().mean()),
        }
        for key, sel in (("desirable", good), ("undesirable", ~good)):
            if sel.any():
                out[f"kto/{key}_reward"] = float(self.settings.beta * r[sel].mean())
        return out
