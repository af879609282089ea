"""Every numeric shared setting, fed values out of its range or not finite: one `error:` line naming it, exit 2.

The ranges below are written here from the settings' meaning (the issue's list), not read from
config.py, so a range dropped or loosened there fails these tests. Settings fail before any model
loads, so each case runs in-process in milliseconds.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import yaml
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gcfamily.cli import main
from gcfamily.config import INTERNAL, Config, validate
from gcfamily.errors import GcfError
from gcfamily.methods import resolve

INF = math.inf
# name -> (kind, low, high, low open, high open): the values a setting may take, both ends included unless open.
RANGES = {
    "seed": ("int", 0, 2**63 - 1, False, False),
    "task_seed": ("int", 0, 2**63 - 1, False, False),  # or None: the run's seed
    "max_steps": ("int", 0, INF, False, False),
    "max_tokens": ("int", 0, INF, False, False),
    "max_flops": ("float", 0, INF, False, True),
    "validation_rows": ("int", 0, INF, False, False),
    "batch_size": ("int", 1, 2**20, False, False),
    "micro_batch_size": ("int", 1, INF, False, False),
    "chunk_size": ("int", 1, INF, False, False),
    "max_length": ("int", 2, 2**20, False, False),
    "warmup_steps": ("int", 0, INF, False, False),
    "max_bad_steps": ("int", 1, INF, False, False),
    "group_size": ("int", 1, 2**16, False, False),
    "max_new_tokens": ("int", 1, 2**20, False, False),
    "top_k": ("int", 0, INF, False, False),
    "log_every": ("int", 1, INF, False, False),
    "eval_every": ("int", 0, INF, False, False),
    "eval_samples": ("int", 1, INF, False, False),
    "save_every": ("int", 0, INF, False, False),
    "keep_last": ("int", 1, INF, False, False),
    "log_completions_every": ("int", 0, INF, False, False),
    "lora_r": ("int", 0, INF, False, False),
    "max_turns": ("int", 1, INF, False, False),
    "max_episode_tokens": ("int", 1, 2**20, False, False),  # or None: max_new_tokens * max_turns
    "max_time": ("float", 0, INF, False, True),
    "epochs": ("float", 0, INF, False, True),
    "norm_constant": ("float", 0, INF, True, True),
    "lr": ("float", 0, INF, True, True),
    "weight_decay": ("float", 0, INF, False, True),
    "min_lr_ratio": ("float", 0, 1, False, False),
    "grad_clip": ("float", 0, INF, False, True),
    "temperature": ("float", 0, INF, True, True),
    "top_p": ("float", 0, 1, True, False),
    "reward_timeout": ("float", 0, INF, False, True),
    "env_timeout": ("float", 0, INF, False, True),
    "eval_every_s": ("float", 0, INF, False, True),
    "lora_alpha": ("float", 0, INF, True, True),
    "lora_dropout": ("float", 0, 1, False, True),
    "dist_timeout": ("float", 0, INF, True, True),
    "vllm_gpu_memory": ("float", 0, 1, True, False),
    "vllm_cpu_kv_gb": ("float", 0, INF, True, True),
    "rollout_check_tol": ("float", 0, INF, True, True),  # or None: by dtype
    "logprob_error_bound": ("float", 0, INF, True, True),
}


def _one_error_line(res) -> str:
    err = res.stderr.strip()
    assert res.exit_code == 2, (res.exit_code, res.output, repr(res.exception))
    assert err.startswith("error: ") and len(err.splitlines()) == 1, err
    assert "Traceback" not in res.output
    return err


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """`gcf run --method sft --model tiny ARGS` in-process; its output folder is never written when the settings fail first."""
    out = str(tmp_path_factory.mktemp("ranges") / "out")

    def call(*args: str):
        return CliRunner().invoke(
            main, ["run", "--method", "sft", "--model", "tiny", "--max-steps", "1", "--output-dir", out, *args]
        )

    return call


NUMERIC = sorted(
    f.name
    for f in dataclasses.fields(Config)
    if f.name not in INTERNAL and str(f.type).removeprefix("Optional[").removesuffix("]") in ("int", "float")
)


def test_every_numeric_shared_setting_has_a_range_here():
    assert len(NUMERIC) >= 30 and set(NUMERIC) <= set(RANGES), set(NUMERIC) - set(RANGES)


def _outside(kind: str, lo: float, hi: float, lo_open: bool, hi_open: bool) -> st.SearchStrategy:
    """Values the setting must refuse: below, above, an open end itself, and (for floats) NaN and the infinities."""
    bad: list[st.SearchStrategy] = []
    if kind == "int":
        bad.append(st.integers(max_value=int(lo) - 1, min_value=-(2**70)))
        if hi != INF:
            bad.append(st.integers(min_value=int(hi) + 1, max_value=2**70))
        return st.one_of(bad)
    # an included end is filtered out by value too: hypothesis may offer -0.0 just below 0.0, and -0.0 == 0.0 is allowed
    below = st.floats(max_value=lo, exclude_max=not lo_open, allow_nan=False, allow_infinity=False)
    bad += [st.sampled_from([math.nan, INF, -INF]), below.filter(lambda x: lo_open or x != lo)]
    if hi != INF:
        above = st.floats(min_value=hi, exclude_min=not hi_open, allow_nan=False, allow_infinity=False)
        bad.append(above.filter(lambda x: hi_open or x != hi))
    return st.one_of(bad)


def _inside(kind: str, lo: float, hi: float, lo_open: bool, hi_open: bool) -> st.SearchStrategy:
    if kind == "int":
        return st.integers(min_value=int(lo), max_value=int(min(hi, lo + 1000)))
    top = min(hi, 1e6)
    return st.floats(
        min_value=lo,
        max_value=top,
        exclude_min=lo_open,
        exclude_max=hi_open and top == hi,
        allow_nan=False,
        allow_infinity=False,
    )


def _text(value) -> str:
    """How a user types the value after --set (YAML reads nan, inf and -inf as text; the setting's float() takes them)."""
    return repr(value) if isinstance(value, float) and math.isfinite(value) else str(value)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), name=st.sampled_from(NUMERIC))
def test_out_of_range_values_are_one_error_line(run, data, name):
    value = data.draw(_outside(*RANGES[name]), label=name)
    err = _one_error_line(run("--set", f"{name}={_text(value)}"))
    assert name in err, err


@settings(max_examples=150, deadline=None)
@given(data=st.data(), name=st.sampled_from(NUMERIC))
def test_in_range_values_pass(data, name):
    value = data.draw(_inside(*RANGES[name]), label=name)
    others = (
        {"batch_size": 1, "group_size": 1, "max_new_tokens": 1}
        if name in ("batch_size", "group_size", "max_new_tokens")
        else {}
    )
    validate(resolve(None, {"model": "tiny", **others, name: _text(value)}))  # no GcfError


@pytest.mark.parametrize("value", [".nan", ".inf", "-.inf"])
@pytest.mark.parametrize("name", [k for k in NUMERIC if RANGES[k][0] == "float"])
def test_non_finite_from_a_recipe(run, tmp_path, name, value):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"{name}: {value}\n")
    assert not math.isfinite(yaml.safe_load(recipe.read_text())[name])  # the recipe really holds a float NaN / inf
    err = _one_error_line(run("--config", str(recipe)))
    assert name in err, err


@pytest.mark.parametrize(
    "sets, needle",
    [
        (["min_lr_ratio=-5"], "min_lr_ratio must be in [0, 1]"),
        (["weight_decay=-1"], "weight_decay must be >= 0"),
        (["warmup_steps=-5"], "warmup_steps must be >= 0"),
        (["max_bad_steps=0"], "max_bad_steps must be >= 1"),
        (["lr=inf"], "lr (learning rate) must be > 0 and finite"),
        (["lr=nan"], "lr (learning rate) must be > 0 and finite"),
        (["log_every=0"], "log_every must be >= 1"),
        (["eval_samples=0"], "eval_samples must be >= 1"),
        (["keep_last=0"], "keep_last must be >= 1"),
        (["max_time=inf"], "max_time must be >= 0 and finite"),
        (["max_tokens=-1"], "max_tokens must be >= 0"),
        (["temperature=nan"], "temperature must be > 0 and finite"),
        (["top_p=nan"], "top_p must be in (0, 1]"),
        (["dist_timeout=0"], "dist_timeout must be > 0"),
        (["reward_timeout=inf"], "reward_timeout must be >= 0 seconds and finite"),
        (["norm_constant=nan"], "norm_constant must be > 0 and finite"),
        (["lora_alpha=0"], "lora_alpha must be > 0"),
        (["lora_dropout=1"], "lora_dropout must be in [0, 1)"),
        (["chunk_size=0"], "chunk_size must be >= 1"),
        (["micro_batch_size=0"], "micro_batch_size must be >= 1"),
        (["group_size=1000000000"], "group_size must be in [1, 65536]"),
        (["max_new_tokens=1000000000"], "max_new_tokens must be in [1, 1048576]"),
        (["batch_size=1000000000"], "batch_size must be in [1, 1048576]"),
        (["max_length=1000000000"], "max_length must be in [2, 1048576]"),
        (["seed=-1"], "seed must be in [0, 2**63)"),
        (["adam_betas=[0.9]"], "adam_betas must be two numbers in [0, 1)"),
        (["adam_betas=[0.9, 1.0]"], "adam_betas must be two numbers in [0, 1)"),
        (["adam_betas=[0.9, .nan]"], "adam_betas must be two numbers in [0, 1)"),
        (["adam_betas=[a, b]"], "adam_betas must be two numbers in [0, 1)"),
        (["adam_betas=[true, 0.9]"], "adam_betas must be two numbers in [0, 1)"),
        (["adam_betas=0.9"], "adam_betas=0.9 has the wrong type"),
        # each within its own cap, together past what a machine could allocate
        (["batch_size=2048", "group_size=1024"], "batch_size * group_size = 2097152 rows"),
        (
            ["batch_size=1024", "group_size=512", "max_new_tokens=8192"],
            "batch_size * group_size * max_new_tokens = 4294967296 tokens",
        ),
        (["stop_strings=['']"], "stop_strings must be a list of non-empty strings"),
        (["stop_strings=[1]"], "stop_strings must be a list of non-empty strings"),
    ],
)
def test_named_cases(run, sets, needle):
    err = _one_error_line(run(*(x for s in sets for x in ("--set", s))))
    assert needle in err, err


def test_the_caps_leave_large_real_runs_alone():
    # 512 prompts x 16 samples x 32k tokens (a large GRPO step) and the longest contexts in use are allowed
    validate(
        resolve(
            None, {"model": "tiny", "batch_size": 512, "group_size": 16, "max_new_tokens": 32768, "max_length": 131072}
        )
    )
    with pytest.raises(GcfError, match="rows sampled per step"):
        validate(resolve(None, {"model": "tiny", "batch_size": 2**11, "group_size": 2**10}))
