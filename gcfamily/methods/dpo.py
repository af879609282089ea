"""Direct preference optimisation and its variants: one pair loss, two hooks.

DPO (Rafailov et al. 2023, "Direct Preference Optimization", arXiv:2305.18290), per pair (q, o_w, o_l):

    h(o)  = beta * sum_t log(pi(o_t | q, o_<t) / pi_ref(o_t | q, o_<t))     implicit reward
    m     = h(o_w) - h(o_l)                                                 margin
    loss  = -log sigmoid(m)
    J     = -sum_pairs loss / Z,   Z = pairs in the step                    ("sum" normalisation)
    GC    = -dloss/dm * dh/dlogp_t = +beta * sigmoid(h_l - h_w) on o_w's tokens, the negative on o_l's

Layout: a pair is one example over two adjacent rows, chosen at 2i and rejected at 2i+1, each of
example weight 1/2 so that Z counts pairs; micro-batches never split a pair, so chosen and
rejected go through the policy in one forward.

A variant overrides one of three hooks, which `coefficient`, `objective` and `metrics` all use:
`rewards` (h per row and dh/dlogp_t), `pair_loss` (loss per pair and dloss/dm, for a loss of the margin
alone) or `pair_terms` (loss per pair and its derivatives in h_w and h_l, for a loss of each reward on its
own: NCA, BCO, APO, SPPO in `pair_losses.py`). SimPO, which changes both the reward and the margin,
overrides two.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.nn.functional as F

from gcfamily.config import Config, MethodSettings, planned_steps, resolve_settings
from gcfamily.data.batches import collate, default_pad_id, epoch_indices
from gcfamily.data.encoding import encode
from gcfamily.data.preferences import preference_rows
from gcfamily.errors import GcfError
from gcfamily.methods.base import Batch, Method, Stats, iter_chunks
from gcfamily.methods.onpolicy import make_rewards, sampling_of
from gcfamily.methods.pair_shaping import check_shaping, f_score, ld_weights
from gcfamily.methods.pools import Pool, check_drawn_for, draw, pairs_of, pool_for
from gcfamily.methods.services import Services

_UPFRONT_PAIRS = 512
"""Under an open budget (max_time, max_tokens or max_flops: the steps are not known ahead) a pool of more pairs than this
is scored as the steps reach it, by a kept pi_ref, instead of all before training."""


class DPO(Method):
    """DPO (Rafailov et al. 2023, arXiv:2305.18290): loss -log sigmoid(h_w - h_l), h = beta * sum_t log(pi/pi_ref).

    GC = +beta * sigmoid(h_l - h_w) on o_w's tokens and the negative on o_l's (derivation in the module docstring).
    """

    name = "dpo"
    data_source = "preference pairs (prompt, chosen, rejected); offline: the task's answer vs a wrong one"
    gc_formula = "+beta*sigmoid(h_l - h_w) on chosen tokens, the negative on rejected; h = beta*sum_t log(pi/pi_ref)"
    data_kind = "pairs"
    default_norm = "sum"
    rows_per_example = 2
    uses_reference = True
    """Whether h needs pi_ref log-probs (computed once per pair: in `setup`, or under an open budget as the steps reach it)."""

    @dataclass
    class Settings(MethodSettings):
        beta: float = 0.1
        """DPO's temperature: the implicit reward is beta * sum_t log(pi/pi_ref) (not a KL weight; smaller keeps closer to pi_ref)."""
        pairs: str = "dataset"
        """Where the pairs come from: dataset (the dataset's, or the task's answer against a wrong one) or own-samples:
        G samples per training prompt drawn once from the initial policy and scored by the reward, the first scoring
        >= reward_threshold paired with the first scoring below it (DeepSeekMath 5.2's DPO); prompts without such a
        pair are skipped and counted."""
        reward_threshold: float = 0.5
        """pairs=own-samples: a sample at or above it is a chosen one, below it a rejected one."""
        pool: Optional[str] = None
        """pairs=own-samples: the pools/dpo-pairs.jsonl of an earlier run to pair exactly; none: draw at setup."""
        pool_prompts: int = 0
        """pairs=own-samples: training prompts to sample (a seeded choice); 0 = every training prompt."""
        f_divergence: str = "reverse_kl"
        """f-DPO's divergence (TRL's f_divergence_type; methods/pair_shaping.py): h = beta f'(pi(o)/pi_ref(o)), f'(t) =
        log t (reverse_kl: DPO), 1 - 1/t (forward_kl), log(2t/(1+t)) (js_divergence), (t^(f_alpha-1) - 1)/(f_alpha-1)."""
        f_alpha: float = 0.5
        """f_divergence=alpha_divergence: its alpha (TRL's f_alpha_divergence_coef)."""
        ld_alpha: Optional[float] = None
        """LD-DPO (TRL's ld_alpha): the log-ratios of the tokens past the pair's shorter completion weigh ld_alpha."""

    own_shaping = False
    """Whether a subclass's own `rewards` applies f_divergence and ld_alpha (through `log_ratio` and `score`)."""
    scored = True
    """Whether h is beta times f_divergence's score of the log-ratio (False: of the log-ratio itself, as TRL's NCA)."""

    @classmethod
    def validate(cls, cfg: Config) -> None:
        s = resolve_settings(cfg, cls).settings
        check_shaping(cls, cfg, s, DPO.rewards)
        if s.beta <= 0:
            raise GcfError(f"{cfg.method} needs beta > 0 (got {s.beta}); 0.1 is usual for DPO.")
        if cfg.loss_norm not in (None, "sum"):
            raise GcfError(
                f"{cfg.method} sums log-probs over each completion; loss_norm must be sum (got {cfg.loss_norm})."
            )
        if getattr(s, "pairs", "dataset") not in ("dataset", "own-samples"):
            raise GcfError(f"pairs={s.pairs} is not a source of pairs; use dataset or own-samples.")
        if getattr(s, "pool_prompts", 0) < 0:
            raise GcfError(f"pool_prompts={s.pool_prompts} must be >= 0 (0 = every training prompt).")

    # -- data ------------------------------------------------------------------------
    @classmethod
    def task_rows(cls, task, cfg: Config, split: str = "train") -> list[dict]:  # type: ignore[no-untyped-def]
        if getattr(cfg.settings, "pairs", "dataset") == "own-samples":
            return task.rows(split)  # its prompts: the pairs are the initial policy's own samples
        return preference_rows(task, None, cfg.seed, split=split)  # the task's answer vs a wrong or malformed one

    def setup(self, services: Services) -> None:
        super().setup(services)
        self.pad_id = default_pad_id(services.tokenizer)
        self.pool_stats: Stats = {}
        self.pool_drawn_for: dict[str, Any] = {}  # pairs=own-samples: what its pool was drawn for (pools.py)
        if getattr(self.settings, "pairs", "dataset") == "own-samples":
            self.pairs, self.skipped = self._own_pairs(services)
        else:
            data = self.load_data(services)
            self.pairs, self.skipped = data.examples, data.n_skipped
        self.ref: dict[tuple[int, int], torch.Tensor] = {}
        self.ref_model = None  # pi_ref kept to score pairs as the steps reach them (an open budget over a large pool)
        if self.uses_reference:
            cfg, n = self.cfg, len(self.pairs)
            # the planned steps (max_steps, or what `epochs` passes take) read the first reach positions of the data order
            reach = min(n, planned_steps(cfg, n) * cfg.batch_size)
            if (cfg.max_time or cfg.max_tokens or cfg.max_flops) and reach > _UPFRONT_PAIRS:
                # the policy before any update: a frozen copy, or with LoRA the adapters off
                self.ref_model = services.reference()
            else:
                # setup runs before any update (and before a resumed checkpoint is loaded), so the policy here IS the
                # reference: no copy is made and no reference model stays in memory
                self.ref = self._reference_logps(services.policy(), sorted(set(epoch_indices(n, cfg.seed, 0, reach))))

    def _own_pairs(self, services: Services) -> tuple[list[tuple[list[int], list[int], list[int]]], int]:
        """pairs=own-samples: the initial policy's samples of the training prompts (drawn here, before any update, or
        read from the run folder or the pool setting), each prompt's first kept sample against its first rejected one."""
        cfg, s = self.cfg, self.settings
        data = encode(
            "prompts", services.training_rows(), services.formatter, cfg.max_length, cfg.long_prompts, self.name
        )
        n, k = len(data.examples), s.pool_prompts
        chosen = sorted(epoch_indices(n, cfg.seed, 0, k)) if 0 < k < n else list(range(n))

        def make() -> Pool:
            reward = make_rewards(cfg, services, self.name)
            try:
                rows = [data.rows[i] for i in chosen]
                drawn = draw(
                    services,
                    [data.examples[i] for i in chosen],
                    rows,
                    cfg.group_size,
                    sampling_of(cfg),
                    reward,
                    cfg.batch_size,
                    services.say,
                )
            finally:
                if hasattr(reward, "close"):
                    reward.close()
            drawn.prompt_index = [chosen[i] for i in drawn.prompt_index]
            return drawn

        # setup is before any update, resumed or not
        # a pool file read is checked against these prompts: its indices in range, its prompts these
        pool = pool_for(services, "dpo-pairs", s.pool, make, False, data.examples)
        self.pool_drawn_for = pool.drawn_for
        pairs, unpaired = pairs_of(pool, s.reward_threshold)
        if not pairs:
            raise GcfError(
                f"No prompt of the pool has both a sample scoring >= reward_threshold={s.reward_threshold} and one below; "
                "change reward_threshold or group_size, or train on the dataset's pairs."
            )
        self.pool_stats = {"dpo/pool_pairs": float(len(pairs)), "dpo/pool_unpaired_prompts": float(unpaired)}
        out = [(data.examples[p], pool.completion_ids[w], pool.completion_ids[lo]) for p, w, lo in pairs]
        return out, data.n_skipped

    def state_dict(self) -> dict[str, Any]:
        return {"pool": self.pool_drawn_for} if self.pool_drawn_for else {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        check_drawn_for(Pool(drawn_for=self.pool_drawn_for), state.get("pool"), "dpo-pairs")

    def _reference_logps(self, model, pairs: list[int]) -> dict[tuple[int, int], torch.Tensor]:  # type: ignore[no-untyped-def]
        """pi_ref log-probs of the completion tokens of the given pairs (chosen and rejected), by `model` as pi_ref."""
        rows = sorted(
            ((i, s) for i in pairs for s in (1, 2)),
            key=lambda r: len(self.pairs[r[0]][0]) + len(self.pairs[r[0]][r[1]]),
        )
        was_training = model.training
        model.eval()
        ref = {}
        for chunk in iter_chunks(rows, self.cfg.micro_batch_size):  # length-sorted: little padding
            # [b, L]
            lp = self.services.logprobs(
                model, collate([(self.pairs[i][0], self.pairs[i][s]) for i, s in chunk], self.pad_id)
            )
            for b, (i, s) in enumerate(chunk):
                start = len(self.pairs[i][0])
                ref[(i, s)] = lp[b, start : start + len(self.pairs[i][s])].clone()
        model.train(was_training)
        return ref

    def data(self, step: int) -> tuple[Batch, Stats]:
        idx = self.step_indices(len(self.pairs), step)
        rows = [(i, s) for i in idx for s in (1, 2)]  # chosen at 2k, rejected at 2k+1
        batch: Batch = collate([(self.pairs[i][0], self.pairs[i][s]) for i, s in rows], self.pad_id)
        batch.example_weight = torch.full((len(rows),), 0.5)  # [B]: a pair is one example, Z counts pairs
        if self.uses_reference:
            # every rank scores the step's whole global batch: the same forwards on each (FSDP)
            if self.ref_model is not None:
                new = sorted(
                    {
                        i
                        for i in epoch_indices(len(self.pairs), self.cfg.seed, step, self.cfg.batch_size)
                        if (i, 1) not in self.ref
                    }
                )
                self.ref.update(self._reference_logps(self.ref_model, new))
            ref = torch.zeros(batch.input_ids.shape)  # [B, L]
            for b, (i, s) in enumerate(rows):
                if (i, s) not in self.ref:
                    raise GcfError(
                        f"Pair {i} has no reference log-probs (step {step} is past the {planned_steps(self.cfg, len(self.pairs))} steps planned); raise max_steps (or epochs) and resume."
                    )
                start = len(self.pairs[i][0])
                ref[b, start : start + len(self.ref[(i, s)])] = self.ref[(i, s)]
            batch.ref_logps = ref
        return batch, {"skipped_long_prompts": float(self.skipped), **self.pool_stats}

    # -- held-out figures ------------------------------------------------------------
    def eval_batch(self, services: Services, rows: list[dict[str, Any]]) -> Batch | None:
        """Held-out preference rows as pairs laid out as in training (chosen 2i, rejected 2i+1, weight 1/2), with
        pi_ref's log-probs: the policy now, before any update. None for rows of another format (prompts a reward scores)."""
        data = self.heldout_encode(services, rows)
        if data is None:
            return None
        rows_ids = [(p, c) for p, chosen, rejected in data.examples for c in (chosen, rejected)]
        batch: Batch = collate(rows_ids, self.pad_id)
        batch.example_weight = torch.full((len(rows_ids),), 0.5)  # [B]: a pair is one example, Z counts pairs
        if self.uses_reference:
            policy = services.policy()
            was_training = policy.training
            policy.eval()
            batch.ref_logps = services.logprobs(policy, batch)  # [B, L]
            policy.train(was_training)
        return batch

    def eval_metrics(self, services: Services, batch: Batch) -> dict[str, float]:
        """eval/loss (the mean pair loss), eval/margin (the mean of m = h_w - h_l) and eval/ranking_accuracy (the
        fraction of held-out pairs with h_w > h_l, the implicit reward ranking chosen over rejected)."""
        logps = services.logprobs(services.policy(), batch, self.logprob_temperature())  # [B, L]
        h, _ = self.rewards(batch, logps)
        m = h[0::2] - h[1::2]  # [P]
        return {
            "eval/loss": self.heldout_loss(batch, logps),
            "eval/margin": float(m.mean()),
            "eval/ranking_accuracy": float((m > 0).float().mean()),
        }

    # -- the rule --------------------------------------------------------------------
    def log_ratio(self, batch: Batch, logps: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Delta = sum_t u_t log(pi/pi_ref) per row [B] and its derivative u_t [B, L]: u = 1 on the completion, and
        with ld_alpha, ld_alpha on the tokens past the shorter completion of the pair (LD-DPO)."""
        u = ld_weights(batch.loss_mask.to(logps.dtype), getattr(self.settings, "ld_alpha", None))  # [B, L]
        return ((logps - batch.ref_logps) * u).sum(-1), u

    def score(self, delta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """f-DPO's score f'(t) of t = e^Delta per row and its derivative in Delta (f_divergence)."""
        f = getattr(self.settings, "f_divergence", "reverse_kl") if self.scored else "reverse_kl"
        return f_score(delta, f, getattr(self.settings, "f_alpha", 1.0))

    def rewards(self, batch: Batch, logps: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Implicit reward h per row [B] and dh/dlogp_t [B, L]: h = beta * f'(e^Delta) (score), Delta = sum_t
        log(pi/pi_ref) over the completion (log_ratio); DPO's defaults give h = beta * Delta."""
        delta, u = self.log_ratio(batch, logps)
        f, df = self.score(delta)
        return self.settings.beta * f, self.settings.beta * df[:, None] * u

    def pair_loss(self, margin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Loss per pair [P] and its derivative in the margin: -log sigmoid(m), -sigmoid(-m)."""
        return -F.logsigmoid(margin), -torch.sigmoid(-margin)

    def pair_terms(self, h_w: torch.Tensor, h_l: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Loss per pair [P] and its derivatives in h_w and h_l: here a loss of the margin m = h_w - h_l (pair_loss),
        so dloss/dh_w = dloss/dm and dloss/dh_l = -dloss/dm."""
        loss, dloss = self.pair_loss(h_w - h_l)
        return loss, dloss, -dloss

    def coefficient(self, batch: Batch, logps: torch.Tensor) -> torch.Tensor:
        h, dh = self.rewards(batch, logps)
        _, d_w, d_l = self.pair_terms(h[0::2], h[1::2])  # [P] each
        dJ_dh = -torch.stack([d_w, d_l], 1).flatten()  # [B]: chosen at 2k, rejected at 2k+1
        return dJ_dh[:, None] * dh  # [B, L]

    def objective(self, batch: Batch, logps: torch.Tensor, Z: float) -> torch.Tensor:
        h, _ = self.rewards(batch, logps)
        loss, _, _ = self.pair_terms(h[0::2], h[1::2])
        # [P]: a masked pair counts nowhere
        kept = batch.valid[0::2].to(loss.dtype) if batch.valid is not None else torch.ones_like(loss)
        return -(loss * kept).sum() / Z

    def metrics(self, batch: Batch, logps: torch.Tensor, coef: torch.Tensor) -> dict[str, float]:
        h, _ = self.rewards(batch, logps)
        m = h[0::2] - h[1::2]  # [P]
        loss, _, _ = self.pair_terms(h[0::2], h[1::2])
        seq = (logps * batch.loss_mask).sum(-1)  # [B]
        return {
            "dpo/loss": float(loss.mean()),
            "dpo/reward_accuracy": float((m > 0).float().mean()),
            "dpo/margin": float(m.mean()),
            "dpo/chosen_rewards": float(h[0::2].mean()),
            "dpo/rejected_rewards": float(h[1::2].mean()),
            "dpo/chosen_logps": float(seq[0::2].mean()),
            "dpo/rejected_logps": float(seq[1::2].mean()),
        }


class IPO(DPO):
    """IPO (Azar et al. 2023, "A General Theoretical Paradigm to Understand Learning from Human Preferences",
    arXiv:2310.12036, eq. 17): regress the log-ratio gap onto 1/(2 beta) instead of pushing it to infinity.

    loss = (d - 1/(2 beta))^2,  d = Delta_w - Delta_l,  Delta = sum_t log(pi/pi_ref)  (sequence sums, as
    in the paper; TRL's `ipo` averages the log-ratios per token instead). With DPO's m = beta * d:
    loss = ((m - 1/2) / beta)^2.
    GC = 1/beta - 2 d on o_w's tokens, the negative on o_l's.
    """

    name = "ipo"
    gc_formula = "+(1/beta - 2 d) on chosen tokens, the negative on rejected; d = sum_t log(pi/pi_ref) over chosen minus rejected"

    def pair_loss(self, margin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        gap = (margin - 0.5) / self.settings.beta  # d - 1/(2 beta)
        return gap**2, 2 * gap / self.settings.beta


class ConservativeDPO(DPO):
    """cDPO (Mitchell 2023, "A note on DPO with noisy preferences & relationship to IPO"): each label is
    flipped with probability eps (label_smoothing).

    loss = -(1 - eps) log sigmoid(m) - eps log sigmoid(-m),  m as in DPO.
    GC = beta * ((1 - eps) sigmoid(-m) - eps sigmoid(m)) on o_w's tokens, the negative on o_l's; it is 0
    where sigmoid(m) = 1 - eps, so the margin stops growing there.
    """

    name = "cdpo"

    @dataclass
    class Settings(DPO.Settings):
        label_smoothing: float = 0.1
        """Probability that a pair's label is flipped (cDPO's eps), in [0, 0.5)."""

    gc_formula = (
        "+beta*((1-eps)*sigmoid(h_l - h_w) - eps*sigmoid(h_w - h_l)) on chosen tokens, the negative on rejected"
    )

    @classmethod
    def validate(cls, cfg: Config) -> None:
        super().validate(cfg)
        eps = cfg.settings.label_smoothing
        if not 0 <= eps < 0.5:
            raise GcfError(f"cdpo needs 0 <= label_smoothing < 0.5 (got {eps}); 0.1 is usual.")

    def pair_loss(self, margin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        eps = self.settings.label_smoothing
        loss = -(1 - eps) * F.logsigmoid(margin) - eps * F.logsigmoid(-margin)
        return loss, -(1 - eps) * torch.sigmoid(-margin) + eps * torch.sigmoid(margin)


class SimPO(DPO):
    """SimPO (Meng, Xia & Chen 2024, "SimPO: Simple Preference Optimization with a Reference-Free Reward",
    arXiv:2405.14734): a length-normalised reward with no reference model, and a target margin gamma.

    h = (beta / |o|) sum_t log pi(o_t | q, o_<t),  loss = -log sigmoid(h_w - h_l - gamma).
    GC = +(beta / |o_w|) sigmoid(gamma - h_w + h_l) on o_w's tokens, -(beta / |o_l|) * the same on o_l's.
    gamma is the paper's margin (simpo_gamma), as TRL's CPO `simpo_gamma` (benchmarks/trl_parity.py). No reference
    model is loaded or run.
    """

    name = "simpo"

    @dataclass
    class Settings(DPO.Settings):
        beta: float = 2.0
        """SimPO's reward scale: h = (beta / |o|) sum_t log pi (no reference)."""
        simpo_gamma: float = 0.5
        """SimPO's target reward margin gamma (the same number as TRL's CPO simpo_gamma)."""

    gc_formula = "+(beta/|o_w|)*sigmoid(gamma - h_w + h_l) on chosen tokens, -(beta/|o_l|)*the same on rejected; h = (beta/|o|)*sum_t log pi"
    uses_reference = False

    def rewards(self, batch: Batch, logps: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        mask = batch.loss_mask.to(logps.dtype)  # [B, L]
        dh = self.settings.beta * mask / mask.sum(-1, keepdim=True).clamp(min=1)  # [B, L]
        return (dh * logps).sum(-1), dh

    def pair_loss(self, margin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return super().pair_loss(margin - self.settings.simpo_gamma)
