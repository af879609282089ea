"""Online DPO: DPO's loss on pairs the policy samples itself, ranked by the reward.

Guo et al. 2024, "Direct Language Model Alignment from Online AI Feedback" (arXiv:2402.04792): each step
samples G completions per prompt from the current policy (OnPolicy's data source), scores them with the
reward (the paper asks an LLM annotator; here the task's reward, --reward or --reward-model), and trains on
the pair (best, worst) of each prompt with DPO's loss against the frozen initial policy pi_ref:

    h(o) = beta * sum_t log(pi(o_t) / pi_ref(o_t)),   J = -sum_pairs -log sigmoid(h(o_w) - h(o_l)) / Z
    GC   = +beta * sigmoid(h_l - h_w) on o_w's tokens, the negative on o_l's          (DPO's, dpo.py)

o_w is the prompt's highest-scored valid sample and o_l its lowest (the first of equals). A prompt whose
valid rewards are all equal (or that has fewer than two) forms no pair: its two rows stay in the batch with
valid=False, so they get no gradient and no place in Z, every process keeps the same number of rows, and
the count is logged (online_dpo/skipped_prompts). Layout, normalisation (sum, Z = pairs) and the hooks
`rewards`/`pair_loss` are DPO's; log-probs, the policy's and pi_ref's, are at the sampling temperature.

The sampler correction (tis) is refused: online DPO's loss is one sigmoid term per pair of whole sequences, not a sum
of per-token terms a ratio could weigh, TRL has no correction for it (OnlineDPOTrainer), and weighing a pair by its
two samples' sequence ratios would be a rule of gcfamily's own that nothing checks it against. The settings tis,
tis_max and tis_min are there so that giving one is refused with this reason; the mismatch figures
(rollout/logp_diff_mean, _max) are still logged.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

import torch
from einops import rearrange, repeat

from gcfamily.config import Config
from gcfamily.core.batch import select
from gcfamily.errors import GcfError
from gcfamily.methods.base import Batch, Stats
from gcfamily.methods.dpo import DPO
from gcfamily.methods.onpolicy import OnPolicy, all_equal_groups
from gcfamily.methods.services import Services

TIS_DEFAULTS = {f.name: f.default for f in fields(OnPolicy.Settings)}
"""tis off and its bounds as they are by default: online-dpo refuses any other value (the module docstring says why)."""


class OnlineDPO(DPO, OnPolicy):
    """Online DPO (Guo et al. 2024, arXiv:2402.04792): OnPolicy's samples, paired best vs worst, DPO's GC."""

    name = "online-dpo"
    data_source = "the policy's own samples: G per prompt, the best and worst by reward form a pair"
    gc_formula = "+beta*sigmoid(h_l - h_w) on the best sample's tokens, the negative on the worst's; h = beta*sum_t log(pi/pi_ref)"

    @dataclass
    class Settings(DPO.Settings, OnPolicy.Settings):
        """DPO's settings and the on-policy sampler correction's, which stays off (the module docstring says why)."""

    @classmethod
    def validate(cls, cfg: Config) -> None:
        super().validate(cfg)  # DPO's: beta > 0, loss_norm sum
        given = [f"{k}={getattr(cfg.settings, k)}" for k, v in TIS_DEFAULTS.items() if getattr(cfg.settings, k) != v]
        if given:
            raise GcfError(
                f"{cls.name} refuses {given[0]}: its loss is one term per pair of whole sequences, with no per-token "
                "term for the sampler ratio to weigh (TRL has no such correction for online DPO); leave tis off."
            )
        if cfg.settings.f_divergence != "reverse_kl" or cfg.settings.ld_alpha is not None:
            raise GcfError(
                f"{cls.name} takes neither f_divergence nor ld_alpha: they shape offline DPO's reward, as in TRL; leave them unset."
            )
        if cfg.group_size < 2:
            raise GcfError(f"{cls.name} needs group_size >= 2: a pair is the best and the worst of a prompt's samples.")
        if cfg.settings.pairs != "dataset":
            raise GcfError(
                f"{cls.name} pairs the current policy's samples at every step; pairs={cfg.settings.pairs} is DPO's setting."
            )

    def setup(self, services: Services) -> None:
        OnPolicy.setup(self, services)  # prompts and the reward; DPO's offline pairs are not loaded
        self.ref = services.reference()  # pi_ref: the policy as it is before any step

    data = OnPolicy.data
    data_kind = OnPolicy.data_kind  # prompts, not DPO's offline pairs
    task_rows = OnPolicy.task_rows
    state_dict = OnPolicy.state_dict  # no pool of DPO's own-sample pairs to record
    load_state_dict = OnPolicy.load_state_dict

    @torch.no_grad()
    def prepare(self, batch: Batch) -> tuple[Batch, Stats]:
        G = self.cfg.group_size
        rewards = rearrange(batch.rewards.float(), "(n g) -> n g", g=G)  # [n, G]
        valid = rearrange(batch.valid.bool(), "(n g) -> n g", g=G)  # [n, G]
        skip = all_equal_groups(rewards, valid)  # [n]
        best = rewards.masked_fill(~valid, -math.inf).argmax(-1)  # [n]
        worst = rewards.masked_fill(~valid, math.inf).argmin(-1)  # [n]
        start = torch.arange(rewards.shape[0]) * G  # [n]
        pairs = select(batch, torch.stack([start + best, start + worst], 1).flatten())  # [2n]: chosen 2i, rejected 2i+1
        pairs.valid = repeat(~skip, "n -> (n two)", two=2)  # [2n]
        pairs.example_weight = torch.full((2 * len(skip),), 0.5)  # [2n]: a pair is one example
        pairs.ref_logps = self.services.logprobs(self.ref, pairs, self.logprob_temperature())
        kept = ~skip
        gap = rewards.gather(1, best[:, None]) - rewards.gather(1, worst[:, None])  # [n, 1]
        return pairs, {
            "online_dpo/skipped_prompts": float(skip.sum()),
            "online_dpo/reward_gap": float(gap[kept].mean()) if kept.any() else 0.0,
        }

    @staticmethod
    def formed(batch: Batch) -> torch.Tensor:
        """Indices of the rows of formed pairs (all rows when the batch has no `valid`, as the engine reads it)."""
        valid = batch.valid
        return torch.arange(len(batch.input_ids)) if valid is None else valid.bool().nonzero().flatten()

    def objective(self, batch: Batch, logps: torch.Tensor, Z: float) -> torch.Tensor:
        """DPO's objective over the pairs formed (a skipped prompt's rows are valid=False)."""
        keep = self.formed(batch)
        return DPO.objective(self, select(batch, keep), logps[keep], Z)

    def metrics(self, batch: Batch, logps: torch.Tensor, coef: torch.Tensor) -> dict[str, float]:
        keep = self.formed(batch)
        if not len(keep):
            return {}
        out = DPO.metrics(self, select(batch, keep), logps[keep], coef[keep])
        out = {k.replace("dpo/", "online_dpo/", 1): v for k, v in out.items()}
        return {**out, **OnPolicy.metrics(self, batch, logps, coef)}  # the sampler mismatch of the pairs' rows
