"""The open method registry: `--method` takes a name, module:Class, path/to/file.py:Class or an installed
entry point in every command, and examples/gspo.py is a worked rule from a file of one's own."""

from __future__ import annotations

import json
import math
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import metrics_rows

from gcfamily.config import Config
from gcfamily.core import engine
from gcfamily.core.batch import Batch
from gcfamily.errors import GcfError
from gcfamily.methods import get_method, installed_methods, method_label
from gcfamily.methods.base import Method
from gcfamily.methods.grpo import GRPO

REPO = Path(__file__).resolve().parents[1]
GSPO_SPEC = "examples/gspo.py:GSPO"  # relative to the repository root, as in the README
FAST = {"batch_size": 2, "group_size": 4, "max_new_tokens": 8, "micro_batch_size": 8, "progress": False}


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


RULE = "from gcfamily.methods.grpo import GRPO\n\n\nclass Rule(GRPO):\n    name = {name!r}\n"


# ----------------------------------------------------------------------------- every kind of spec


def test_every_spec_kind_resolves(monkeypatch, tmp_path):
    monkeypatch.chdir(REPO)
    assert get_method("grpo") is GRPO
    assert get_method("gcfamily.methods.grpo:GRPO") is GRPO
    gspo = get_method(GSPO_SPEC)
    assert issubclass(gspo, GRPO) and gspo.name == "gspo" and gspo.__module__ in sys.modules
    assert get_method(f"{REPO}/examples/gspo.py:GSPO") is gspo  # relative and absolute: one module, one class
    assert method_label(GSPO_SPEC) == "gspo" and method_label("grpo") == "grpo"
    # two files both called rules.py: two modules, two classes
    a = get_method(f"{write(tmp_path / 'a' / 'rules.py', RULE.format(name='rule-a'))}:Rule")
    b = get_method(f"{write(tmp_path / 'b' / 'rules.py', RULE.format(name='rule-b'))}:Rule")
    assert (a.name, b.name) == ("rule-a", "rule-b") and a.__module__ != b.__module__


def test_a_file_rule_pickles_and_has_the_same_module_name_in_a_new_process(monkeypatch):
    """A torchrun worker is the same command line in the same folder: it must import the file under the same
    name, so that the class (and anything holding it) unpickles there."""
    monkeypatch.chdir(REPO)
    gspo = get_method(GSPO_SPEC)
    assert pickle.loads(pickle.dumps(gspo)) is gspo
    code = (
        "import pickle, sys; from gcfamily.methods import get_method; cls = get_method(sys.argv[1]); "
        "print(pickle.loads(bytes.fromhex(sys.argv[2])) is cls, cls.__module__)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, GSPO_SPEC, pickle.dumps(gspo).hex()],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["True", gspo.__module__]


def test_installed_packages_register_methods_by_entry_point(gcf, monkeypatch, tmp_path):
    """A dist-info folder with an entry_points.txt on sys.path is what `pip install` leaves; no install needed."""
    site = tmp_path / "site"
    write(site / "gcf_plugin_rules.py", RULE.format(name="plugin-rule"))
    write(site / "gcf_plugin-0.1.dist-info" / "METADATA", "Metadata-Version: 2.1\nName: gcf-plugin\nVersion: 0.1\n")
    write(
        site / "gcf_plugin-0.1.dist-info" / "entry_points.txt",
        "[gcfamily.methods]\nplugin-rule = gcf_plugin_rules:Rule\n",
    )
    monkeypatch.syspath_prepend(str(site))
    assert installed_methods()["plugin-rule"] == ("gcf_plugin_rules:Rule", "gcf-plugin")
    cls = get_method("plugin-rule")
    assert issubclass(cls, GRPO) and cls.name == "plugin-rule" and method_label("plugin-rule") == "plugin-rule"
    code, out, err = gcf("methods")
    assert code == 0, err
    assert any(line.startswith("plugin-rule ") and "(from gcf-plugin)" in line for line in out.splitlines()), out
    with pytest.raises(GcfError, match="plugin-rule"):  # an unknown name lists the installed ones too
        get_method("nope")
    # a broken entry point: the listing shows the others, then one error line names it
    write(
        site / "gcf_plugin-0.1.dist-info" / "entry_points.txt",
        "[gcfamily.methods]\nplugin-rule = gcf_plugin_rules:Rule\nbroken-rule = gcf_plugin_rules:Missing\n",
    )
    code, out, err = gcf("methods")
    assert code == 2 and "plugin-rule" in out and "grpo" in out
    assert err.strip().splitlines() == [err.strip()] and err.startswith("error: Method 'broken-rule' (entry point "), (
        err
    )
    assert "has no attribute 'Missing'" in err


# ----------------------------------------------------------------------------- failures: one line, exit 2

BAD_FILES = {
    "raises.py": "raise RuntimeError('boom')\n",
    "syntax.py": "class Rule(:\n",
    "plain.py": "class NotAMethod:\n    pass\n",
}
FAILURES = [  # (spec, what stderr must say)
    ("nope", "Unknown method 'nope'"),
    ("examples/no_such_file.py:GSPO", "the file examples/no_such_file.py does not exist"),
    ("no_such_module_xyz:Rule", "no module named 'no_such_module_xyz'"),
    ("{tmp}/raises.py:Rule", "failed to import (RuntimeError at line 1: boom)"),
    ("{tmp}/syntax.py:Rule", "failed to import (SyntaxError at line 1"),
    ("examples/gspo.py:Nope", "examples/gspo.py has no attribute 'Nope'"),
    ("{tmp}/plain.py:NotAMethod", "is the class NotAMethod, not a subclass of gcfamily.methods.base.Method"),
    ("gcfamily.methods.grpo:torch", "is a module, not a subclass of gcfamily.methods.base.Method"),
]
COMMANDS = {  # every command that takes a method, with the rest of a valid command line
    "run": lambda spec, out: ["run", "--method", spec, "--model", "tiny", "--max-steps", "1", "--output-dir", out],
    "methods": lambda spec, out: ["methods", "--method", spec],
    "settings": lambda spec, out: ["settings", "--method", spec],
    "bench": lambda spec, out: ["bench", "--quick", "--methods", spec, "--budget", "steps:1", "--out", out],
    "theory": lambda spec, out: ["theory", "--method", spec, "--variant", "grpo", "--out", out],
}


@pytest.mark.parametrize("command", list(COMMANDS))
@pytest.mark.parametrize("spec, needle", FAILURES, ids=[f[0].split("/")[-1] for f in FAILURES])
def test_every_failure_is_one_error_line_in_every_command(gcf, monkeypatch, tmp_path, command, spec, needle):
    monkeypatch.chdir(REPO)
    for name, text in BAD_FILES.items():
        write(tmp_path / name, text)
    spec = spec.format(tmp=tmp_path)
    code, out, err = gcf(*COMMANDS[command](spec, str(tmp_path / "out")))
    assert code == 2, (out, err)
    assert err.startswith("error: ") and needle in err, err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in out + err
    assert not (tmp_path / "out").exists()  # nothing ran


def test_theory_needs_a_variant_for_a_method_of_ones_own(gcf, monkeypatch, tmp_path):
    monkeypatch.chdir(REPO)
    code, _, err = gcf("theory", "--method", GSPO_SPEC, "--out", str(tmp_path))
    assert code == 2 and "pass --variant NAME" in err
    code, _, err = gcf("theory", "--method", "gcfamily.methods.sft:SFT", "--variant", "grpo", "--out", str(tmp_path))
    assert code == 2 and "not one, so pass a GRPO subclass" in err


# ----------------------------------------------------------------------------- GSPO from examples/


def gspo_objective(logps, old, ref, mask, adv, beta, eps_low, eps_high):
    """GSPO's J written from the paper: the mean over sequences of the clipped sequence-ratio surrogate, minus
    beta times each sequence's mean k3 (GRPO's KL term)."""
    n = mask.sum(-1)  # [B] |o_i|
    s = torch.exp(((logps - old) * mask).sum(-1) / n)  # [B]
    surrogate = torch.minimum(s * adv, s.clamp(1 - eps_low, 1 + eps_high) * adv)  # [B]
    d = ref - logps  # log rho
    k3 = ((torch.exp(d) - d - 1) * mask).sum(-1) / n  # [B]
    return (surrogate - beta * k3).mean()


def test_gspo_gradient_equals_autograd_of_its_textbook_objective(monkeypatch):
    """mu > 1, so old_logps != logps and s_i != 1; sequences clipped on both sides and unclipped ones."""
    monkeypatch.chdir(REPO)
    cls = get_method(GSPO_SPEC)
    cfg = Config(method=GSPO_SPEC, group_size=4, mu=2, beta=0.1, epsilon=0.2)
    cls.validate(cfg)
    m = cls(cfg)
    B, L = 8, 10
    g = torch.Generator().manual_seed(0)
    pos = torch.arange(L)[None]
    start, end = torch.randint(1, 3, (B, 1), generator=g), torch.randint(5, L + 1, (B, 1), generator=g)
    mask = ((pos >= start) & (pos < end)).float()  # [B, L]: prompt tokens and padding are off
    logps = -3 * torch.rand(B, L, generator=g)  # [B, L]; prompt tokens have log-probs too, outside the loss mask
    log_s = torch.tensor([0.5, -0.5, 0.1, -0.1, 0.3, -0.4, 0.05, 0.2])  # target log s_i
    noise = 0.3 * torch.randn(B, L, generator=g)  # token ratios differ within a sequence ...
    noise = noise - (noise * mask).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True)  # ... with mean 0 over o_i
    old = logps - log_s[:, None] + noise  # [B, L]
    ref = logps + 0.5 * torch.randn(B, L, generator=g)  # [B, L]
    adv = torch.tensor([1.0, -1.0, 1.0, -1.0, -1.0, 1.0, 0.5, 0.0])
    batch = Batch(
        input_ids=torch.zeros(B, L, dtype=torch.long),
        attention_mask=torch.ones(B, L, dtype=torch.long),
        loss_mask=mask.long(),
        valid=torch.ones(B, dtype=torch.bool),
        advantages=adv,
        old_logps=old,
        ref_logps=ref,
    )
    # the branches: s_i = e^0.5 with A > 0 and e^-0.5 with A < 0 are clipped; the others are not, and s_i != 1
    s = torch.exp(((logps - old) * mask).sum(-1) / mask.sum(-1))
    clipped = ((adv > 0) & (s > 1.2)) | ((adv < 0) & (s < 0.8))
    assert clipped.tolist() == [True, True] + [False] * 6 and ((s - 1).abs() > 0.04).all()

    Z = engine.normaliser([batch], m.norm)
    assert m.norm == "sequence" and Z == B  # the textbook 1/G mean over the sequences
    lp = logps.clone().requires_grad_(True)
    engine.weighted_loss(m.coefficient(batch, lp.detach()), lp, batch, m.norm, Z).backward()  # the engine
    lp_ref = logps.clone().requires_grad_(True)
    (-gspo_objective(lp_ref, old, ref, mask, adv, 0.1, 0.2, 0.2)).backward()  # autograd of the paper's J
    diff = (lp.grad - lp_ref.grad).abs().max().item()
    assert diff < 1e-7, diff
    lp_obj = logps.clone().requires_grad_(True)
    (-m.objective(batch, lp_obj, Z)).backward()  # GSPO's own statement of J (what the exactness suite reads)
    assert (lp_obj.grad - lp_ref.grad).abs().max().item() < 1e-7
    # by hand, on token t of o_i: dJ/dlogp_t = (s_i A_i [0 when clipped] + beta (rho_t - 1)) / |o_i| / B
    for i, surrogate in ((0, 0.0), (2, float(s[2] * adv[2]))):  # o_0 clipped (s = e^0.5 > 1.2, A > 0), o_2 not
        t = int(start[i])
        want = (surrogate + 0.1 * math.expm1(float(ref[i, t] - logps[i, t]))) / float(mask[i].sum()) / B
        assert abs(-float(lp.grad[i, t]) - want) < 1e-7, (i, -float(lp.grad[i, t]), want)


def test_gspo_from_its_file_trains_two_steps(gcf, monkeypatch, tmp_path):
    monkeypatch.chdir(REPO)
    out = tmp_path / "run"
    sets = {**FAST, "mu": 2}  # a second pass: pi_old != pi, so s_i != 1 and the clip can bind
    code, _, err = gcf(
        "run",
        "--method",
        GSPO_SPEC,
        "--model",
        "tiny",
        "--task",
        "arithmetic",
        "--max-steps",
        "2",
        "--output-dir",
        str(out),
        *[f"--set={k}={v}" for k, v in sets.items()],
    )
    assert code == 0, err
    rows = metrics_rows(out)
    assert [r["step"] for r in rows] == [1, 2] and all(math.isfinite(r["loss"]) for r in rows)
    assert "grpo/seq_clip_frac" in rows[0] and "grpo/kl" in rows[0]  # clip fractions counted over sequences
    assert json.loads((out / "run_config.json").read_text())["method"] == GSPO_SPEC


def test_a_run_without_output_dir_is_named_after_the_rule(monkeypatch):
    from gcfamily.api import default_output_dir as _default_output_dir

    monkeypatch.chdir(REPO)
    monkeypatch.setenv("WORLD_SIZE", "1")
    cfg = Config(method=GSPO_SPEC, model="tiny")
    assert _default_output_dir(cfg, None).output_dir.startswith("runs/gspo-tiny-")


def test_settings_lists_a_file_rules_own_settings(gcf, monkeypatch):
    monkeypatch.chdir(REPO)
    code, out, err = gcf("settings", "--method", GSPO_SPEC)
    assert code == 0, err
    shared, _, own = out.partition(f"# {GSPO_SPEC}'s own settings")
    assert "max_steps = " in shared and "epsilon = 0.2" in own and "std = 'sample'" in own
    code, out, _ = gcf("settings")
    assert code == 0 and "max_steps = " in out and "epsilon = " not in out and "method_options" not in out


def test_methods_lists_a_rule_from_a_file(gcf, monkeypatch):
    monkeypatch.chdir(REPO)
    code, out, err = gcf("methods", "--method", GSPO_SPEC)
    assert code == 0, err
    assert out.startswith(GSPO_SPEC) and "s_i * A_i * 1[s_i not clipped]" in out
    assert issubclass(get_method(GSPO_SPEC), Method) and os.path.exists(REPO / "examples" / "gspo.py")
