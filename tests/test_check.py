"""`gcf check SPEC`: the exactness checks of gcfamily/check/ on a name, a module:Class or a file's class.

Exit 0 when every case passes, 1 when a check fails (the FAILED lines say which), 2 with one `error:` line for
a spec that names no Method, bad settings, or a class of a data family the check cannot build a batch for.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from gcfamily.check import cases as check_cases
from gcfamily.methods import get_method

GRPO_CASES = len(check_cases(get_method("grpo")))

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "gspo.py"

# GSPO's coefficient with the clip removed: s_i * A_i on every token, times the row's mean sampler weight (tis; 1 when
# off), plus GRPO's KL part (its coefficient at A = 0)
NO_CLIP_COEFFICIENT = """
    def coefficient(self, batch, logps):
        s, g = self.importance_ratio(batch, logps)
        kl_part = super().coefficient(batch.replaced(advantages=torch.zeros_like(batch.advantages)), logps)
        c, m = self.sampler_correction(batch, self._old(batch, logps)), batch.loss_mask
        c = (c * m).sum(-1, keepdim=True) / m.sum(-1, keepdim=True).clamp(min=1)
        return kl_part + g * self.token_advantages(batch) * m * c
"""


def _gspo_copy(tmp_path: Path, objective_clipped: bool = True) -> str:
    text = EXAMPLE.read_text() + NO_CLIP_COEFFICIENT
    if not objective_clipped:
        assert "s.clamp(1 - lo, 1 + hi) * adv" in text
        text = text.replace("s.clamp(1 - lo, 1 + hi) * adv", "s * adv")
        assert "if self.settings.dual_clip is not None:" in text  # and without dual-clip's bound, as the coefficient
        text = text.replace("if self.settings.dual_clip is not None:", "if False:")
    path = tmp_path / "gspo_no_clip.py"
    path.write_text(text)
    return f"{path}:GSPO"


def test_builtin_method_passes_and_shows_diffs_and_branches(gcf) -> None:
    code, out, err = gcf("check", "grpo")
    assert code == 0, out + err
    for line in (
        "family: on-policy groups",
        "case defaults (its defaults): ok",
        "case clip and KL",
        "(a) engine vs textbook",
        "(a) engine vs own objective",
        "(b) d loss/d logits vs textbook",
        "tokens clipped low",
        "tokens clipped high",
        "KL past the clamp",
        "equal-reward groups",
        "failed rewards",
        "micro-batches",
        "tokens with the sampler ratio above tis_max (truncated)",
        "sequences with the sampler ratio below tis_min (masked)",
        "tokens past dual-clip's bound (A < 0, r > c)",
        "case multi-turn episodes, clip and KL, token",
        "environment tokens inside completions",
        "(c) d loss/d logits on the environment's tokens (exactly 0)",
        f"{GRPO_CASES} cases: {GRPO_CASES} passed, 0 failed",
        "case truncated samples masked, clip and KL",
        "case off-policy mask 0, clip and KL",
        "case two rewards standardised apart, then summed",
    ):
        assert line in out, line
    assert "FAILED" not in out


def test_a_file_rule_passes_at_the_sequence_level(gcf) -> None:
    code, out, err = gcf("check", f"{EXAMPLE}:GSPO")
    assert code == 0, out + err
    assert "ratio: sequence" in out and "sequences clipped high" in out and "sequences clipped low" in out


def test_gspo_without_the_clip_in_its_coefficient_fails(gcf, tmp_path) -> None:
    code, out, _ = gcf("check", _gspo_copy(tmp_path))
    assert code == 1
    assert "case defaults (its defaults): ok" in out  # one pass: s_i = 1, nothing to clip
    assert "case clip and KL {'mu': 2, 'beta': 0.04}: FAILED" in out
    assert "textbook: none: GSPO.coefficient and GSPO.objective are its own" in out  # a rule of its own
    assert "FAILED (a) engine vs own objective" in out and "FAILED (a) engine vs textbook" not in out
    assert "0 passed" not in out and out.rstrip().endswith("failed (against the method's own objective only)")


def test_gspo_without_the_clip_anywhere_is_a_consistent_rule_of_its_own(gcf, tmp_path) -> None:
    code, out, _ = gcf("check", _gspo_copy(tmp_path, objective_clipped=False))
    assert code == 0, out  # its coefficient and objective agree, and both are its own: nothing else states its rule
    assert "textbook: none: GSPO.coefficient and GSPO.objective are its own" in out
    assert "(a) engine vs textbook" not in out and "sequences clipped high" in out  # its family's batch all the same


def test_set_adds_a_case_typed_by_the_methods_settings(gcf) -> None:
    code, out, _ = gcf(
        "check", "dapo", "--set", "mu=3", "--set", "norm_constant=2", "--set", "loss_norm=constant", "--seeds", "1"
    )
    assert code == 0, out
    assert "case given {'mu': 3, 'norm_constant': 2.0, 'loss_norm': 'constant'}: ok" in out
    assert "tokens in the band between eps and eps_high" in out


def test_a_method_that_trains_no_policy_passes(gcf) -> None:
    code, out, _ = gcf("check", "reward-model")
    assert code == 0 and "GC (trains no policy)" in out


def test_a_hook_the_textbook_does_not_know_is_named(gcf, tmp_path) -> None:
    path = tmp_path / "own.py"
    path.write_text(
        "import torch\nfrom gcfamily.methods.grpo import GRPO\n\n\nclass Mine(GRPO):\n    name = 'mine'\n\n"
        "    def group_advantages(self, rewards, valid):\n        return torch.where(valid, rewards, 0.0)\n"
    )
    code, out, _ = gcf("check", f"{path}:Mine")
    assert code == 0, out
    assert (
        "textbook: none: Mine.group_advantages is its own" in out and "(against the method's own objective only)" in out
    )


@pytest.mark.parametrize(
    "args, message",
    [
        (["nope"], "Unknown method 'nope'"),
        (["gcfamily.config:Config"], "not a subclass of gcfamily.methods.base.Method"),
        (["grpo", "--set", "mu=abc"], "mu='abc' has the wrong type"),
        (["grpo", "--set", "foo=1"], "Unknown setting 'foo'"),
        (["grpo", "--set", "epsilon=2"], "epsilon must be in (0, 1)"),
        (["grpo", "--set", "group_size=8"], "leave group_size out"),
        (["NOFAMILY"], "belongs to no data family the check can build a batch for"),
    ],
)
def test_bad_input_is_one_error_line_and_exit_2(gcf, tmp_path, args: list[str], message: str) -> None:
    if args == ["NOFAMILY"]:
        path = tmp_path / "bare.py"
        path.write_text(
            "import torch\nfrom gcfamily.methods.base import Method\n\n\nclass Bare(Method):\n    name = 'bare'\n\n"
            "    def coefficient(self, batch, logps):\n        return torch.ones_like(logps)\n"
        )
        args = [f"{path}:Bare"]
    code, out, err = gcf("check", *args)
    assert code == 2 and out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], err
