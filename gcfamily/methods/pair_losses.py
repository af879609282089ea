"""TRL 1.16's other DPO loss types as rules of the zoo, each a hook of DPO (methods/dpo.py).

Notation, as in DPO: Delta(o) = sum_t log(pi(o_t | q, o_<t) / pi_ref(o_t | q, o_<t)), h = beta * Delta (DPO's
`rewards`), m = h_w - h_l; per pair (q, o_w, o_l), J = -mean over pairs of the loss below. A loss of m alone is a
`pair_loss(m)` (loss, dloss/dm); a loss of h_w and h_l each is a `pair_terms(h_w, h_l)` (loss, dloss/dh_w,
dloss/dh_l); GC is -dloss/dh times dh/dlogp_t (beta on the row's tokens). `benchmarks/trl_parity.py` runs each
against `DPOTrainer._compute_loss` of TRL 1.16 (its `loss_type` in each class's docstring).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from gcfamily.config import Config
from gcfamily.errors import GcfError
from gcfamily.methods.base import Batch
from gcfamily.methods.dpo import DPO, IPO


def _sig_prime(x: torch.Tensor) -> torch.Tensor:
    return torch.sigmoid(x) * torch.sigmoid(-x)


def _eps_in(cfg: Config, low_open: bool, high: float) -> None:
    eps, lo = cfg.settings.label_smoothing, "0 <" if low_open else "0 <="
    if not ((eps > 0) if low_open else (eps >= 0)) or not eps < high:
        raise GcfError(f"{cfg.method} needs {lo} label_smoothing < {high:g} (got {eps}).")


class Hinge(DPO):
    """SLiC's hinge on DPO's reward (TRL `hinge`): loss = max(0, 1 - m). GC = beta on o_w's tokens where m < 1,
    -beta on o_l's, 0 where m >= 1 (TRL's relu passes no gradient at m = 1 either)."""

    name, gc_formula = "hinge", "+beta on chosen tokens and -beta on rejected while h_w - h_l < 1, else 0"

    def pair_loss(self, margin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.relu(1 - margin), -(margin < 1).to(margin.dtype)


class RobustDPO(DPO):
    """Robust DPO (Chowdhury et al. 2024, arXiv:2403.00409; TRL `robust`), labels flipped with probability eps:
    loss = [-(1 - eps) log sigmoid(m) + eps log sigmoid(-m)] / (1 - 2 eps), an unbiased loss under the flips."""

    name = "robust-dpo"
    gc_formula = "+beta*((1-eps)*sigmoid(-m) + eps*sigmoid(m))/(1-2eps) on chosen tokens, the negative on rejected"

    @dataclass
    class Settings(DPO.Settings):
        label_smoothing: float = 0.1
        """Probability eps that a pair's label is flipped, in [0, 0.5)."""

    @classmethod
    def validate(cls, cfg: Config) -> None:
        super().validate(cfg)
        _eps_in(cfg, False, 0.5)

    def pair_loss(self, margin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        e = self.settings.label_smoothing
        loss = (-(1 - e) * F.logsigmoid(margin) + e * F.logsigmoid(-margin)) / (1 - 2 * e)
        return loss, -((1 - e) * torch.sigmoid(-margin) + e * torch.sigmoid(margin)) / (1 - 2 * e)


class EXOPair(DPO):
    """EXO (Ji et al. 2024, arXiv:2402.00856, eq. 16; TRL `exo_pair`): loss = KL(q || p) over {o_w, o_l},
    q = (sigmoid(m), sigmoid(-m)), p = (1 - eps, eps); dloss/dm = sigmoid(m) sigmoid(-m) (m - log((1 - eps)/eps))."""

    name = "exo-pair"
    gc_formula = "+beta*sigmoid(m)*sigmoid(-m)*(log((1-eps)/eps) - m) on chosen tokens, the negative on rejected"

    @dataclass
    class Settings(DPO.Settings):
        label_smoothing: float = 1e-3
        """EXO's eps, the target probability of the rejected completion, in (0, 1) (the paper's 1e-3)."""

    @classmethod
    def validate(cls, cfg: Config) -> None:
        super().validate(cfg)
        _eps_in(cfg, True, 1.0)

    def pair_loss(self, margin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        e, m = self.settings.label_smoothing, margin
        loss = torch.sigmoid(m) * (F.logsigmoid(m) - math.log1p(-e)) + torch.sigmoid(-m) * (
            F.logsigmoid(-m) - math.log(e)
        )
        return loss, _sig_prime(m) * (m - math.log((1 - e) / e))


class DiscoPOP(DPO):
    """DiscoPOP (Chris Lu et al. 2024, arXiv:2406.08414, eq. 5; TRL `discopop`): the log-ratio modulated loss
    loss = (1 - g) softplus(-m) + g exp(-m), g = sigmoid(m / tau), the gate's derivative included."""

    name = "discopop"
    gc_formula = "-beta*dloss/dm on chosen tokens, the negative on rejected; loss = (1-g) softplus(-m) + g exp(-m), g = sigmoid(m/tau)"

    @dataclass
    class Settings(DPO.Settings):
        discopop_tau: float = 0.05
        """The gate's temperature tau (the paper's and TRL's 0.05), > 0."""

    @classmethod
    def validate(cls, cfg: Config) -> None:
        super().validate(cfg)
        if not cfg.settings.discopop_tau > 0:
            raise GcfError(f"discopop needs discopop_tau > 0 (got {cfg.settings.discopop_tau}); 0.05 is the paper's.")

    def pair_loss(self, margin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        tau, sp, ex = self.settings.discopop_tau, F.softplus(-margin), torch.exp(-margin)
        g = torch.sigmoid(margin / tau)
        loss = (1 - g) * sp + g * ex
        return loss, -(1 - g) * torch.sigmoid(-margin) - g * ex + (ex - sp) * _sig_prime(margin / tau) / tau


class NCAPair(DPO):
    """NCA (Chen et al. 2024, arXiv:2402.05369; TRL `nca_pair`), each reward against an absolute 0:
    loss = -log sigmoid(h_w) - 1/2 log sigmoid(-h_w) - 1/2 log sigmoid(-h_l)."""

    name = "nca-pair"
    gc_formula = "+beta*(sigmoid(-h_w) - sigmoid(h_w)/2) on chosen tokens, -beta*sigmoid(h_l)/2 on rejected"

    scored = False  # h = beta * Delta: TRL's loss reads the log-ratios, not f_divergence's scores

    def pair_terms(self, h_w: torch.Tensor, h_l: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        loss = -F.logsigmoid(h_w) - 0.5 * F.logsigmoid(-h_w) - 0.5 * F.logsigmoid(-h_l)
        return loss, -torch.sigmoid(-h_w) + 0.5 * torch.sigmoid(h_w), 0.5 * torch.sigmoid(h_l)


class BCOPair(DPO):
    """BCO on pairs (Jung et al. 2024, arXiv:2404.04656, without its running reward shift; TRL `bco_pair`): the
    chosen classified as good and the rejected as bad, loss = -log sigmoid(h_w) - log sigmoid(-h_l)."""

    name = "bco-pair"
    gc_formula = "+beta*sigmoid(-h_w) on chosen tokens, -beta*sigmoid(h_l) on rejected"

    scored = False  # h = beta * Delta: TRL's loss reads the log-ratios, not f_divergence's scores

    def pair_terms(self, h_w: torch.Tensor, h_l: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return -F.logsigmoid(h_w) - F.logsigmoid(-h_l), -torch.sigmoid(-h_w), torch.sigmoid(h_l)


class SPPOHard(DPO):
    """SPPO with hard labels (Wu et al. 2024, arXiv:2405.00675, eq. 4.7 at P = 1 and 0; TRL `sppo_hard`):
    loss = (Delta_w - 1/(2 beta))^2 + (Delta_l + 1/(2 beta))^2 = ((h_w - 1/2)^2 + (h_l + 1/2)^2) / beta^2."""

    name = "sppo-hard"
    gc_formula = "-2(h_w - 1/2)/beta on chosen tokens, -2(h_l + 1/2)/beta on rejected"

    scored = False  # h = beta * Delta: TRL's loss reads the log-ratios, not f_divergence's scores

    def pair_terms(self, h_w: torch.Tensor, h_l: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        b2 = self.settings.beta**2
        return ((h_w - 0.5) ** 2 + (h_l + 0.5) ** 2) / b2, 2 * (h_w - 0.5) / b2, 2 * (h_l + 0.5) / b2


class APOZero(DPO):
    """APO-zero (D'Oosterlinck et al. 2024, arXiv:2408.06266, eq. 7; TRL `apo_zero`), chosen outputs better than
    the model's: loss = 1 - sigmoid(h_w) + sigmoid(h_l)."""

    name = "apo-zero"
    gc_formula = "+beta*sigmoid'(h_w) on chosen tokens, -beta*sigmoid'(h_l) on rejected"

    scored = False  # h = beta * Delta: TRL's loss reads the log-ratios, not f_divergence's scores

    def pair_terms(self, h_w: torch.Tensor, h_l: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return 1 - torch.sigmoid(h_w) + torch.sigmoid(h_l), -_sig_prime(h_w), _sig_prime(h_l)


class APODown(DPO):
    """APO-down (D'Oosterlinck et al. 2024, eq. 8; TRL `apo_down`), chosen outputs worse than the model's:
    loss = sigmoid(h_w) + 1 - sigmoid(h_w - h_l)."""

    name = "apo-down"
    gc_formula = "-beta*(sigmoid'(h_w) - sigmoid'(m)) on chosen tokens, -beta*sigmoid'(m) on rejected"

    scored = False  # h = beta * Delta: TRL's loss reads the log-ratios, not f_divergence's scores

    def pair_terms(self, h_w: torch.Tensor, h_l: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        m = h_w - h_l
        return torch.sigmoid(h_w) + 1 - torch.sigmoid(m), _sig_prime(h_w) - _sig_prime(m), _sig_prime(m)


class SigmoidNorm(DPO):
    """DPO on the per-token mean log-ratio (TRL `sigmoid_norm`): h = beta Delta / |o|, loss = -log sigmoid(m)
    (with f_divergence, beta f'(e^Delta) / |o|)."""

    name = "sigmoid-norm"
    gc_formula = "+(beta/|o_w|)*sigmoid(-m) on chosen tokens, -(beta/|o_l|)*sigmoid(-m) on rejected; h = beta*Delta/|o|"

    own_shaping = True  # f_divergence's score of the (LD-weighted) log-ratio, then divided by the length, as TRL's

    def rewards(self, batch: Batch, logps: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        delta, u = self.log_ratio(batch, logps)  # [B], [B, L]
        f, df = self.score(delta)
        n = batch.loss_mask.to(logps.dtype).sum(-1).clamp(min=1)  # [B] the completion's length
        return self.settings.beta * f / n, (self.settings.beta * df / n)[:, None] * u


class IPONorm(SigmoidNorm, IPO):
    """IPO on the per-token mean log-ratio (TRL 1.16's `ipo`): loss = (Delta_w/|o_w| - Delta_l/|o_l| - 1/(2 beta))^2,
    IPO's loss of sigmoid-norm's rewards."""

    name = "ipo-norm"
    gc_formula = (
        "+(1/|o_w|)*(1/beta - 2 d) on chosen tokens, -(1/|o_l|)*the same on rejected; d = Delta_w/|o_w| - Delta_l/|o_l|"
    )
