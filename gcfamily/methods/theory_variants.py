"""The GRPO variants of Vojnovic & Yun (2025) as method classes, and which prediction each method has.

Each variant is GRPO with one function overridden, registered like any method (they are LM
methods too, not only bandit ones):

    grpo-shift            A_i = R_i - mean(R): no division by the group's std. (Dr. GRPO has
                          the same advantage with a constant normaliser; this keeps GRPO's.)
    grpo-direct-kl        the k3 penalty importance-weighted by r_t = pi/pi_old, so that it
                          estimates KL(pi || pi_ref) rather than KL(pi_ref || pi)
    grpo-shift-direct-kl  both: on a bandit, exactly RLHF's logarithmic pooling with
                          beta_eff = beta * G / (G - 1)

PREDICTED maps every registered method whose bandit stationary policy predictions.py gives to
that prediction (see `prediction_for`).
"""

from __future__ import annotations

from dataclasses import dataclass

from gcfamily.errors import GcfError
from gcfamily.methods.grpo import GRPO


class GRPOShift(GRPO):
    """GRPO with shift-only advantages (Vojnovic & Yun 2025, "What is the Alignment Objective of
    GRPO?", section on normalisation): A_i = R_i - mean(R) over the group, not divided by std(R).

    J  = aggregate_t[ min(r_t A_i, clip(r_t) A_i) - beta * k3_t ]   (GRPO's, with this A_i)
    GC = r_t * A_i * 1[not clipped] + beta * (pi_ref/pi - 1)

    The stationary policy then depends on the reward scale; it differs from Dr. GRPO only in the
    normaliser (GRPO's per-sequence mean here, a constant there).
    """

    name = "grpo-shift"
    gc_formula = "r_t * A_i * 1[not clipped] + beta * (pi_ref/pi - 1),  A_i = R_i - mean R (no std)"

    @dataclass
    class Settings(GRPO.Settings):
        scale_rewards: str = "none"
        """Shift-only advantages: R_i - mean(R), not divided by a std."""


class GRPODirectKL(GRPO):
    """GRPO with the importance-weighted k3 penalty (Vojnovic & Yun 2025, "direct KL"):

    J  = aggregate_t[ min(r_t A_i, clip(r_t) A_i) - beta * r_t * k3_t ],  k3 = rho - log rho - 1
    GC = r_t * A_i * 1[not clipped] - beta * r_t * log(pi/pi_ref)

    since d(r k3)/dlogp = r (k3 + 1 - rho) = -r log rho. Sampled from pi_old, r_t * k3_t is an
    unbiased estimate of KL(pi || pi_ref) (the penalty RLHF means), where plain k3's gradient is
    that of KL(pi_ref || pi). Past the clamp of |log rho| the k3 value is constant, so only the
    ratio's derivative r_t * k3_t remains there. It is GRPO with kl_estimator=k3-importance-weighted
    (TRL's default GRPO KL, use_bias_correction_kl).
    """

    name = "grpo-direct-kl"
    gc_formula = "r_t * A_i * 1[not clipped] - beta * r_t * log(pi/pi_ref)"

    @dataclass
    class Settings(GRPO.Settings):
        kl_estimator: str = "k3-importance-weighted"
        """The importance-weighted k3, r_t * k3_t (an estimate of KL(pi || pi_ref))."""


class GRPOShiftDirectKL(GRPO):
    """Shift-only advantages and the direct KL together (Vojnovic & Yun 2025): on a bandit the
    stationary policy is pi_ref exp((1 - 1/G) r / beta) / Z, RLHF's logarithmic pooling.

    J  = aggregate_t[ min(r_t A_i, clip(r_t) A_i) - beta * r_t * k3_t ],  A_i = R_i - mean R
    GC = r_t * A_i * 1[not clipped] - beta * r_t * log(pi/pi_ref)
    """

    name = "grpo-shift-direct-kl"
    gc_formula = "r_t * A_i * 1[not clipped] - beta * r_t * log(pi/pi_ref),  A_i = R_i - mean R (no std)"

    @dataclass
    class Settings(GRPO.Settings):
        scale_rewards: str = "none"
        """Shift-only advantages: R_i - mean(R), not divided by a std."""
        kl_estimator: str = "k3-importance-weighted"
        """The importance-weighted k3, r_t * k3_t (an estimate of KL(pi || pi_ref))."""


@dataclass(frozen=True)
class Prediction:
    """How a method's bandit dynamics map onto a predictions.py variant.

    The method's advantage is adv_scale(G) times the variant's, so its expected gradient is
    adv_scale times the variant's at beta / adv_scale, and so is its stationary policy's beta.
    """

    variant: str
    rloo_scale: bool = False  # RLOO: A = G/(G-1) (R - mean R)

    def adv_scale(self, G: int) -> float:
        return G / (G - 1) if self.rloo_scale else 1.0


# method -> its prediction. On a bandit (one token per output, pi_old = pi) DAPO's clip-higher
# and token normalisation, and Dr. GRPO's constant normaliser (max_new_tokens = 1), change nothing.
PREDICTED: dict[str, Prediction] = {
    "grpo": Prediction("grpo"),
    "dapo": Prediction("grpo"),
    "dr-grpo": Prediction("shift_only"),
    "rloo": Prediction("shift_only", rloo_scale=True),
    "grpo-shift": Prediction("shift_only"),
    "grpo-direct-kl": Prediction("direct_kl"),
    "grpo-shift-direct-kl": Prediction("shift_only_direct_kl"),
}
# variant -> the method that trains it
VARIANT_METHODS: dict[str, str] = {
    "grpo": "grpo",
    "direct_kl": "grpo-direct-kl",
    "shift_only": "grpo-shift",
    "shift_only_direct_kl": "grpo-shift-direct-kl",
}


def prediction_for(method: str, variant: str | None = None) -> Prediction:
    """The prediction of a method's bandit stationary policy; a clear error for one without.

    A method of your own (module:Class or path/to/file.py:Class, a GRPO subclass) has none of its
    own: `variant` names the prediction to compare it with.
    """
    if method in PREDICTED:
        pred = PREDICTED[method]
        if variant is not None and variant != pred.variant:
            raise GcfError(
                f"--method {method} trains the '{pred.variant}' variant, not '{variant}'; drop one of the two options."
            )
        return pred
    if variant is None:
        raise GcfError(
            f"No stationary-policy prediction for method '{method}'; choose one of: {', '.join(PREDICTED)}, "
            "or pass --variant NAME to compare a GRPO subclass of your own with that variant's prediction."
        )
    from gcfamily.methods import get_method

    if not issubclass(get_method(method), GRPO):
        raise GcfError(
            f"gcf theory trains GRPO and its subclasses on the bandit; {method} is not one, so pass a GRPO subclass."
        )
    return Prediction(variant)
