"""mask_truncated (TRL's mask_truncated_completions) on the GRPO family: a completion that hit max_new_tokens without
EOS trains no token while its reward stays in its group's statistics. `gcf check` restates it (two truncated samples
in the check's groups); TRL parity is benchmarks/trl_parity.py's (grpo, dapo, dr_grpo rows)."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner

from gcfamily import check
from gcfamily.cli import main
from gcfamily.methods import get_method
from gcfamily.methods.grpo import GRPO

LABEL = "truncated samples masked, clip and KL"


def _run(name: str, label: str = LABEL) -> check.Outcome:
    cls = get_method(name)
    return check.run_case(cls, label, dict(check.cases(cls))[label])


@pytest.mark.parametrize("name", ["grpo", "dapo", "gspo", "grpo-ps"])
def test_gcf_check_passes_and_reaches_the_masked_samples(name: str) -> None:
    out = _run(name)
    assert out.ok, check.report(name, get_method(name), [out])[0]
    assert out.branches["truncated samples masked, their rewards kept"] >= 2


def _drops_their_rewards(self, batch):  # type: ignore[no-untyped-def]
    """The planted bug: truncated samples made invalid, so their rewards leave the group's mean and std too."""
    if batch.truncated is not None:
        batch.valid = batch.valid & ~batch.truncated
    return real_prepare(self, batch.replaced(truncated=None))


def _ignores_the_setting(self, batch):  # type: ignore[no-untyped-def]
    return real_prepare(self, batch.replaced(truncated=None))


real_prepare = GRPO.prepare


@pytest.mark.parametrize("plant", [_drops_their_rewards, _ignores_the_setting], ids=["rewards dropped", "no-op"])
def test_a_wrong_mask_fails_gcf_check(plant, monkeypatch: pytest.MonkeyPatch) -> None:
    assert _run("grpo").ok
    monkeypatch.setattr(GRPO, "prepare", plant)
    out = _run("grpo")
    text, ok = check.report("grpo", get_method("grpo"), [out])
    assert not ok and "FAILED (a) engine vs textbook" in text, text


def test_a_run_whose_completions_are_cut_trains_none_of_their_tokens(tmp_path) -> None:
    """max_new_tokens=3 cuts almost every completion of the tiny model: the log counts them and their tokens give no
    gradient (grad_norm 0 when every completion of the step is cut)."""
    out = tmp_path / "run"
    args = ["run", "--method", "grpo", "--model", "tiny", "--max-steps", "2", "--output-dir", str(out)]
    sets = ["max_new_tokens=3", "mask_truncated=true", "progress=false"]
    res = CliRunner().invoke(main, [*args, *(x for kv in sets for x in ("--set", kv))])
    assert res.exit_code == 0, res.output
    logged = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    rows = 64  # batch_size 8 x group_size 8, the defaults
    for r in logged:
        assert 0 < r["grpo/masked_truncated"] <= rows
        if r["grpo/masked_truncated"] == rows:
            assert r["grad_norm"] == 0.0
    assert torch.tensor([r["completion/truncated_frac"] for r in logged]).min() > 0.5
