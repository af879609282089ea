"""`gcf check` with the sampler correction on (settings tis, tis_max, tis_min): the textbook weighs each token's term by
TRL's truncated or masked ratio pi_old/pi_sampler, restated in gcfamily/check/textbook.py (`_sampler_weight`), on
batches whose sampler log-probs put ratios past tis_max, below tis_min and inside, per token and per row
(gcfamily/check/sampler.py); each mode passes for grpo, rft and ppo with its branches shown, and a correction that
forgets its truncation, computes a sequence mode per token, or weighs tokens with tis off fails."""

from __future__ import annotations

import pytest
import torch

from gcfamily import check
from gcfamily.methods import get_method, tis
from gcfamily.methods.onpolicy import OnPolicy

BOUNDS = ["--set", "tis_min=0.5", "--set", "tis_max=2"]


def _given(out: str) -> str:
    """The report's lines of the case --set added."""
    return out[out.index("case given") :]


def _branches(mode: str) -> list[str]:
    level = "sequences" if mode.startswith("sequence") else "tokens"
    how = "masked" if mode.endswith("mask") else "truncated"
    return [
        f"{level} with the sampler ratio above tis_max ({how})",
        f"{level} with the sampler ratio below tis_min ({how})",
        f"{level} with the sampler ratio inside [tis_min, tis_max], != 1",
    ]


@pytest.mark.parametrize("mode", ["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"])
def test_grpo_passes_each_mode_and_shows_its_branches(gcf, mode: str) -> None:
    code, out, err = gcf("check", "grpo", "--set", f"tis={mode}", *BOUNDS, "--set", "mu=2", "--seeds", "1")
    assert code == 0, out + err
    given = _given(out)
    assert given.startswith(f"case given {{'tis': '{mode}', 'tis_min': 0.5, 'tis_max': 2.0, 'mu': 2}}: ok"), given
    for branch in _branches(mode) + ["tokens clipped high", "KL past the clamp"]:
        assert branch in given, branch


@pytest.mark.parametrize(
    "name, args, mode",
    [
        ("rft", ["--set", "tis=token_mask", *BOUNDS], "token_mask"),
        ("ppo", ["--set", "tis=sequence_truncate", *BOUNDS, "--set", "mu=2"], "sequence_truncate"),
    ],
)
def test_rft_and_ppo_pass_with_the_correction(gcf, name: str, args: list[str], mode: str) -> None:
    code, out, err = gcf("check", name, *args, "--seeds", "1")
    assert code == 0, out + err
    assert all(b in _given(out) for b in _branches(mode)), _given(out)


def test_without_tis_min_nothing_below_is_required(gcf) -> None:
    code, out, _ = gcf("check", "grpo", "--set", "tis=token_truncate", "--seeds", "1")
    assert code == 0, out
    given = _given(out)
    assert "above tis_max (truncated)" in given and "below tis_min" not in given


PLANT = '''
import torch
from gcfamily.methods import tis
from gcfamily.methods.grpo import GRPO


class NoTruncation(GRPO):
    """GRPO whose sampler correction forgets to truncate: the raw ratio pi_old/pi_sampler."""

    name = "no-truncation"

    def sampler_correction(self, batch, old_logps):
        if self.settings.tis == "off":
            return torch.ones_like(old_logps)
        return tis.sampler_ratio(self.settings.tis, old_logps, batch.sample_logps, batch.loss_mask).detach()
'''


def test_a_correction_that_forgets_the_truncation_fails(gcf, tmp_path) -> None:
    path = tmp_path / "no_truncation.py"
    path.write_text(PLANT)
    code, out, _ = gcf("check", f"{path}:NoTruncation", "--set", "tis=token_truncate", "--seeds", "1")
    assert code == 1, out
    assert "case defaults (its defaults): ok" in out  # tis off: nothing to truncate
    assert "case sampler correction token_truncate, clip and KL" in out
    given = _given(out)
    assert given.startswith("case given {'tis': 'token_truncate'}: FAILED"), given
    assert (
        "FAILED (a) engine vs textbook" in given
    )  # its coefficient and objective share the mistake: the textbook sees it


def _case(name: str, label: str) -> tuple[type, dict]:
    cls = get_method(name)
    found = dict(check.cases(cls))
    assert label in found, list(found)
    return cls, found[label]


def _caught(name: str, label: str, monkeypatch: pytest.MonkeyPatch, target: object, attr: str, plant: object) -> None:
    """The case passes on the real code and fails with the plant in place."""
    cls, settings = _case(name, label)
    assert check.run_case(cls, label, settings, (0,)).ok
    monkeypatch.setattr(target, attr, plant)
    out = check.run_case(cls, label, settings, (0,))
    text, ok = check.report(name, cls, [out])
    assert not ok and any("textbook" in f for f in out.failures), text


def test_a_weight_that_is_not_truncated_in_the_builtin_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    real = tis.weight
    plant = lambda mode, rho, lo, hi: rho if mode.endswith("truncate") else real(mode, rho, lo, hi)  # noqa: E731
    _caught("grpo", "sampler correction token_truncate, clip and KL", monkeypatch, tis, "weight", plant)


@pytest.mark.parametrize(
    "name, label", [("gspo", "sampler correction sequence_mask"), ("ppo", "sampler correction sequence_truncate")]
)
def test_a_sequence_mode_computed_per_token_is_caught(name: str, label: str, monkeypatch: pytest.MonkeyPatch) -> None:
    real = tis.sampler_ratio
    plant = lambda mode, old, sample, mask: real("token_" + mode.split("_")[1], old, sample, mask)  # noqa: E731
    _caught(name, label, monkeypatch, tis, "sampler_ratio", plant)


def test_a_weight_applied_with_tis_off_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    def plant(self, batch, old_logps):  # token_truncate at the default bounds, whatever the setting says
        rho = tis.sampler_ratio("token_truncate", old_logps, batch.sample_logps, batch.loss_mask)
        return tis.weight("token_truncate", rho, None, 3.0).detach()

    _caught("rft", "defaults", monkeypatch, OnPolicy, "sampler_correction", plant)


@pytest.mark.parametrize(
    "name, said", [("online-dpo", "online-dpo refuses tis=token_mask"), ("rft-offline", "pool drawn once")]
)
def test_methods_that_refuse_the_correction_say_so_in_one_line(gcf, name: str, said: str) -> None:
    code, out, err = gcf("check", name, "--set", "tis=token_mask")
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1 and said in err, err
    assert not [label for label, _ in check.cases(get_method(name)) if "sampler" in label]  # none of its cases sets it


def test_every_on_policy_batch_of_the_check_carries_sampler_log_probs() -> None:
    for name in ("grpo", "grpo-ps", "ppo", "rft", "online-dpo"):
        cls = get_method(name)
        world = check.world.World(check.world.N, torch.Generator().manual_seed(0))
        built = check.family_of(cls).build(cls, {}, world, torch.Generator().manual_seed(0), None, 0)
        assert built.batch.sample_logps is not None, name
