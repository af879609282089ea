"""Truncated importance sampling against the sampler (settings tis, tis_max, tis_min of every on-policy method):
TRL's weights worked by hand, what each rule multiplies, the refusals, the mismatch figures and how a step combines
them (a max is the max of its micro-batches, not their mean), and a two-step run that logs them.

The gradient identity with tis on is gcf check's (tests/test_check_tis.py); TRL's semantics are read from TRL 1.16's
grpo_trainer.py (`_generate_and_score_completions`, `_compute_loss`)."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import metrics_rows

from gcfamily.config import Config
from gcfamily.core.batch import Batch
from gcfamily.errors import GcfError
from gcfamily.methods import get_method
from gcfamily.methods.base import Method
from gcfamily.run import step
from gcfamily.run.distributed import DistEnv
from gcfamily.run.trainer import Trainer

LN = math.log


def make(name: str, **settings) -> Method:
    cls = get_method(name)
    cfg = Config(method=name, **settings)
    cls.validate(cfg)
    return cls(cfg)


# ----------------------------------------------------------------------------- the weights by hand


def _rows(diffs: list[list[float]], valid: list[bool] | None = None) -> tuple[Batch, torch.Tensor]:
    """Rows of one prompt token and len(diffs[i]) completion tokens, log pi_old - log pi_sampler = diffs; the current
    log-probs (pi_old with one pass) and the batch (advantage 1, kept)."""
    B, L = len(diffs), 1 + max(len(d) for d in diffs)
    mask = torch.zeros(B, L, dtype=torch.long)
    d = torch.zeros(B, L)
    for i, row in enumerate(diffs):
        mask[i, 1 : 1 + len(row)] = 1
        d[i, 1 : 1 + len(row)] = torch.tensor(row)
    logps = torch.full((B, L), -1.0) * mask  # [B, L]
    batch = Batch(
        input_ids=torch.zeros(B, L, dtype=torch.long),
        attention_mask=torch.ones(B, L, dtype=torch.long),
        loss_mask=mask,
        sample_logps=torch.where(mask.bool(), logps - d, math.nan),  # a NaN on padding must change nothing
        valid=torch.tensor(valid if valid is not None else [True] * B),
        advantages=torch.ones(B),
        kept=torch.ones(B, dtype=torch.bool),
    )
    return batch, logps


DIFFS = [[LN(4.0), LN(0.5), 0.0], [LN(0.25), LN(2.0)]]
# token ratios: row 0 (4, 0.5, 1), row 1 (0.25, 2); sequence ratios: row 0 4 * 0.5 * 1 = 2, row 1 0.25 * 2 = 0.5
BY_HAND = {
    # tis_max 3, tis_min 0.4: 4 -> 3, 0.25 -> 0.4, the rest as they are
    ("token_truncate", 0.4): [[0, 3.0, 0.5, 1.0], [0, 0.4, 2.0, 0]],
    # no tis_min: nothing is raised from below
    ("token_truncate", None): [[0, 3.0, 0.5, 1.0], [0, 0.25, 2.0, 0]],
    # outside [0.4, 3] -> 0: 4 and 0.25
    ("token_mask", 0.4): [[0, 0.0, 0.5, 1.0], [0, 0.0, 2.0, 0]],
    # one ratio per row: 2 (inside), 0.5 (inside [0.4, 3]); with tis_min 0.6, 0.5 is raised to 0.6 or masked
    ("sequence_truncate", 0.6): [[0, 2.0, 2.0, 2.0], [0, 0.6, 0.6, 0]],
    ("sequence_mask", 0.6): [[0, 2.0, 2.0, 2.0], [0, 0.0, 0.0, 0]],
    ("sequence_mask", None): [[0, 2.0, 2.0, 2.0], [0, 0.5, 0.5, 0]],
}


@pytest.mark.parametrize("mode, lo", list(BY_HAND), ids=[f"{m}-{lo}" for m, lo in BY_HAND])
def test_trl_weights_by_hand(mode: str, lo: float | None) -> None:
    m = make("grpo", group_size=2, tis=mode, tis_max=3.0, tis_min=lo, beta=0.0)
    batch, logps = _rows(DIFFS)
    w = m.sampler_correction(batch, logps) * batch.loss_mask
    assert torch.allclose(w, torch.tensor(BY_HAND[(mode, lo)]), atol=1e-6), w
    assert not w.requires_grad


def test_off_is_one_and_the_rules_multiply_their_term() -> None:
    batch, logps = _rows(DIFFS)
    assert (make("grpo", group_size=2).sampler_correction(batch, logps) == 1).all()
    # GRPO, one pass (r = 1), beta = 0: GC = A * w; RFT: GC = 1[kept] * w
    w = torch.tensor(BY_HAND[("token_truncate", 0.4)])
    for name in ("grpo", "rft"):
        m = make(name, group_size=2, tis="token_truncate", tis_min=0.4, **({"beta": 0.0} if name == "grpo" else {}))
        assert torch.allclose(m.coefficient(batch, logps), w, atol=1e-6), name


def test_the_kl_term_is_not_weighed_as_in_trl() -> None:
    """TRL multiplies its per-token loss by the ratio before adding beta * KL: the KL's GC is the same with tis on."""
    batch, logps = _rows(DIFFS)
    batch.ref_logps = logps + 0.3 * batch.loss_mask  # rho = pi_ref/pi = e^0.3 on every completion token
    batch.advantages = torch.zeros(2)  # A = 0: GC is the KL's alone, beta * (rho - 1)
    off = make("grpo", group_size=2, beta=0.1).coefficient(batch, logps)
    on = make("grpo", group_size=2, beta=0.1, tis="token_mask", tis_min=0.4).coefficient(batch, logps)
    want = 0.1 * (math.exp(0.3) - 1) * batch.loss_mask
    assert torch.allclose(off, want, atol=1e-6) and torch.allclose(on, want, atol=1e-6)


def test_gspo_takes_the_rows_mean_weight_in_its_coefficient() -> None:
    # GSPO's one clipped term per row sits on each token with that token's weight: d/dlogp_t of sum_u w_u c_u s A is
    # mean(c) * s * A. Row 0's weights (3, 0.5, 1) have mean 1.5; row 1's (0.4, 2) mean 1.2. One pass: s = 1, A = 1.
    m = make("gspo", group_size=2, tis="token_truncate", tis_min=0.4)
    batch, logps = _rows(DIFFS)
    want = torch.tensor([[0, 1.5, 1.5, 1.5], [0, 1.2, 1.2, 0]])
    assert torch.allclose(m.coefficient(batch, logps), want, atol=1e-6)


# ----------------------------------------------------------------------------- refusals, one sentence each


@pytest.mark.parametrize(
    "name, settings, said",
    [
        ("grpo", {"tis": "token"}, "tis must be one of off, token_truncate, token_mask, sequence_truncate"),
        ("rft", {"tis": "token_mask", "tis_max": 0.0}, "tis_max must be > 0"),
        ("ppo", {"tis": "token_mask", "tis_min": 3.0}, "tis_min must be below tis_max=3.0"),
        ("rft-offline", {"tis": "token_truncate"}, "pool drawn once from the initial policy"),
        ("online-dpo", {"tis": "sequence_mask"}, "online-dpo refuses tis=sequence_mask"),
        ("online-dpo", {"tis_max": 2.0}, "online-dpo refuses tis_max=2.0"),  # a bound of a correction it never applies
    ],
)
def test_bad_settings_are_one_sentence(name: str, settings: dict, said: str) -> None:
    with pytest.raises(GcfError, match=None) as e:
        make(name, group_size=2, **settings)
    assert said in str(e.value) and str(e.value).count(". ") == 0, str(e.value)


def test_a_batch_without_sampler_log_probs_is_refused_not_skipped() -> None:
    batch, logps = _rows(DIFFS)
    batch.sample_logps = None
    m = make("grpo", group_size=2, tis="token_truncate")
    with pytest.raises(GcfError, match="this batch has no sampler log-probs"):
        m.coefficient(batch, logps)
    assert (make("grpo", group_size=2).coefficient(batch, logps) != 0).any()  # off: nothing to correct, no refusal


# ----------------------------------------------------------------------------- the figures and their reduction


def test_mismatch_figures_by_hand() -> None:
    # row 1 is invalid: its tokens count in no figure. Row 0: |diffs| = (ln 4, ln 2, 0), weights masked outside [0.4, 3]
    batch, logps = _rows(DIFFS, valid=[True, False])
    m = make("grpo", group_size=2, tis="token_mask", tis_min=0.4, beta=0.0)
    got = m.metrics(batch, logps, torch.zeros_like(logps))
    assert got["rollout/logp_diff_mean"] == pytest.approx((LN(4) + LN(2)) / 3)
    assert got["rollout/logp_diff_max"] == pytest.approx(LN(4))
    assert got["tis/ratio_mean"] == pytest.approx((0 + 0.5 + 1) / 3)
    assert (got["tis/ratio_min"], got["tis/ratio_max"]) == pytest.approx((0.0, 1.0))
    assert got["tis/masked_frac"] == pytest.approx(1 / 3)
    off = make("grpo", group_size=2, beta=0.0).metrics(batch, logps, torch.zeros_like(logps))
    assert "rollout/logp_diff_max" in off and not any(k.startswith("tis/") for k in off)


def test_with_pi_old_from_prepare_the_figures_are_the_whole_steps_once() -> None:
    """Several optimizer steps per batch (mu, num_minibatches): the trainer averages over them, which no max survives,
    so prepare reports the figures once, measured against the old_logps it computed, and the micro-batches none."""
    batch, logps = _rows(DIFFS)
    batch.old_logps = logps + 0.1 * batch.loss_mask  # pi_old, which the diffs were not measured against
    m = make("grpo", group_size=2, mu=2, tis="token_mask", tis_min=0.4, beta=0.0)
    per_micro_batch = m.metrics(batch, logps, torch.zeros_like(logps))
    assert not [k for k in per_micro_batch if k.startswith(("rollout/", "tis/"))], per_micro_batch
    got = m.prepared_mismatch(batch)
    assert got["rollout/logp_diff_max"] == pytest.approx(LN(4) + 0.1)  # against old_logps, not the forward's
    assert m.prepared_mismatch(batch.replaced(old_logps=None)) == {}  # one pass: the micro-batches report them


class _Figures(Method):
    """A method whose micro-batch figures are given: {"x/ratio_max", "x/ratio_min", "x/mean"} per call."""

    name = "figures"

    def __init__(self, figures: list[dict[str, float]]) -> None:
        self.figures = iter(figures)

    def metrics(self, batch: Batch, logps: torch.Tensor, coef: torch.Tensor) -> dict[str, float]:
        return next(self.figures)


def _micro(tokens: int) -> step.MicroBatchResult:
    mb = Batch(
        input_ids=torch.zeros(1, tokens, dtype=torch.long),
        attention_mask=torch.ones(1, tokens, dtype=torch.long),
        loss_mask=torch.ones(1, tokens, dtype=torch.long),
    )
    z = torch.zeros(1, tokens)
    return step.MicroBatchResult(mb, z, z, z, torch.zeros(()), {})


def test_a_steps_max_is_the_max_of_its_micro_batches_not_their_mean() -> None:
    # micro-batches of 1 and 3 loss tokens: the mean is token-weighted, (1 * 1 + 3 * 2) / 4 = 1.75; the max 5, the min 0.5
    figures = [
        {"x/ratio_max": 5.0, "x/ratio_min": 0.5, "x/mean": 1.0},
        {"x/ratio_max": 1.0, "x/ratio_min": 0.9, "x/mean": 2.0},
    ]
    got, tokens = step.metrics([_micro(1), _micro(3)], _Figures(figures))
    assert tokens == 4
    assert got["x/mean"] == pytest.approx(1.75)
    assert got["x/ratio_max"] == 5.0 and got["x/ratio_min"] == 0.5  # averaged, they would be 2.0 and 0.8
    # a micro-batch with no token to measure leaves its max out; a NaN max is not hidden by a later finite one
    got, _ = step.metrics([_micro(2), _micro(2)], _Figures([{"x/mean": 0.0}, {"x/ratio_max": 2.0, "x/mean": 1.0}]))
    assert got == pytest.approx(
        {"x/ratio_max": 2.0, "x/mean": 0.5, **{k: got[k] for k in got if k not in ("x/ratio_max", "x/mean")}}
    )
    got, _ = step.metrics([_micro(2), _micro(2)], _Figures([{"x/ratio_max": math.nan}, {"x/ratio_max": 2.0}]))
    assert math.isnan(got["x/ratio_max"])


def test_ranks_combine_a_max_by_max_and_a_min_by_min(monkeypatch: pytest.MonkeyPatch) -> None:
    rows = [
        {"x/ratio_max": 4.0, "x/ratio_min": 0.5, "x/mean": 1.0},
        {"x/ratio_max": 2.0, "x/ratio_min": 0.2, "x/mean": 3.0},
    ]

    def gather(out: list, obj: dict) -> None:
        out[:] = rows

    monkeypatch.setattr("gcfamily.run.distributed.dist.all_gather_object", gather)
    got = DistEnv(0, 2, 0, torch.device("cpu")).reduce_metrics(rows[0])
    assert got == {"x/ratio_max": 4.0, "x/ratio_min": 0.2, "x/mean": 2.0}


# ----------------------------------------------------------------------------- end to end


@pytest.mark.parametrize(
    "name, settings",
    [
        ("grpo", {"tis": "token_truncate", "tis_min": 0.5}),  # one pass: the micro-batches' figures, combined
        ("ppo", {"tis": "token_mask", "tis_min": 0.5, "mu": 2, "num_minibatches": 2}),  # from prepare, once a step
    ],
)
def test_two_steps_with_tis_log_the_figures(tmp_path, name: str, settings: dict) -> None:
    cfg = Config(
        method=name,
        model="tiny",
        task="arithmetic",
        output_dir=str(tmp_path / "run"),
        max_steps=2,
        batch_size=2,
        group_size=4,
        max_new_tokens=8,
        micro_batch_size=3,
        progress=False,
        **settings,
    )
    Trainer(cfg).run()
    rows = [r for r in metrics_rows(tmp_path / "run") if "loss" in r]
    assert [r["step"] for r in rows] == [1, 2]
    masking = settings["tis"].endswith("mask")
    for r in rows:
        keys = ["rollout/logp_diff_mean", "rollout/logp_diff_max", "tis/ratio_mean", "tis/ratio_min", "tis/ratio_max"]
        assert all(isinstance(r.get(k), float) for k in keys), r
        # the native sampler is the policy itself: its log-probs are the trainer's to float rounding
        assert 0 <= r["rollout/logp_diff_mean"] <= r["rollout/logp_diff_max"] < 1e-3
        assert 0.5 <= r["tis/ratio_min"] <= r["tis/ratio_mean"] <= r["tis/ratio_max"] <= 3.0
        assert (r.get("tis/masked_frac") == 0.0) if masking else ("tis/masked_frac" not in r)
