"""Every user-facing input is refused with one clear sentence, a non-zero exit and no traceback."""

import json

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from gcfamily.data.encoding import Formatter, encode
from gcfamily.data.formats import as_kind
from gcfamily.data.sources import load_rows
from gcfamily.errors import GcfError
from gcfamily.models import tiny_tokenizer


def _one_clear_line(code, out, err):
    assert code != 0, out
    assert err.startswith("error: ") and len(err.strip().splitlines()) == 1, err
    assert "Traceback" not in out + err


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--method", "grpo", "--set", "group_size=1"], "group_size"),
        (["--method", "grpo", "--set", "beta=-0.1"], "beta must be >= 0"),
        (["--method", "grpo", "--set", "epsilon=0"], "epsilon must be in (0, 1)"),
        (["--method", "grpo", "--set", "epsilon=1.5"], "epsilon must be in (0, 1)"),
        (["--method", "sft", "--set", "beta=0.1"], "Unknown setting 'beta' for method sft"),
        (["--method", "grpo", "--set", "epsilon_high=abc"], "epsilon_high='abc' has the wrong type"),
        (["--method", "grpo", "--set", "dataset=123"], "Dataset 123"),
        (["--method", "dpo", "--set", "lr=-1"], "lr (learning rate) must be > 0"),
        (["--method", "grpo", "--reward", "no_such_module_xyz:fn"], "no_such_module_xyz"),
        (["--method", "grpo", "--reward", "gcfamily.rewards:no_such_fn"], "no_such_fn"),
        (["--method", "sft", "--resume", "/nonexistent/ckpt"], "is not a checkpoint"),
    ],
)
def test_bad_settings_and_references(gcf, tmp_path, args, needle):
    code, out, err = gcf(
        "run",
        "--model",
        "tiny",
        *args,
        "--max-steps",
        "1",
        "--output-dir",
        str(tmp_path / "o"),
        "--set",
        "progress=false",
        "--set",
        "max_new_tokens=4",
        "--set",
        "batch_size=2",
    )
    _one_clear_line(code, out, err)
    assert needle in err, err


def test_resume_in_a_run_without_checkpoints(gcf, tmp_path):
    code, out, err = gcf(
        "run",
        "--model",
        "tiny",
        "--method",
        "sft",
        "--resume",
        "--max-steps",
        "1",
        "--output-dir",
        str(tmp_path / "fresh"),
    )
    _one_clear_line(code, out, err)
    assert "No complete checkpoint" in err


def test_empty_dataset(gcf, tmp_path):
    data = tmp_path / "empty.jsonl"
    data.write_text("")
    code, out, err = gcf(
        "run",
        "--model",
        "tiny",
        "--method",
        "sft",
        "--dataset",
        str(data),
        "--max-steps",
        "1",
        "--output-dir",
        str(tmp_path / "o"),
    )
    _one_clear_line(code, out, err)
    assert "empty" in err or "could not be read" in err


def test_empty_field_names_the_row(gcf, tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text(
        json.dumps({"prompt": "a", "completion": "b"}) + "\n" + json.dumps({"prompt": " ", "completion": "b"}) + "\n"
    )
    code, out, err = gcf(
        "run",
        "--model",
        "tiny",
        "--method",
        "sft",
        "--dataset",
        str(data),
        "--max-steps",
        "1",
        "--output-dir",
        str(tmp_path / "o"),
    )
    _one_clear_line(code, out, err)
    assert "Row 1" in err and "'prompt'" in err


def test_prompt_longer_than_context_errors_when_asked(gcf, tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text(
        json.dumps({"prompt": "x" * 300, "completion": "b"})
        + "\n"
        + json.dumps({"prompt": "ok", "completion": "b"})
        + "\n"
    )
    base = [
        "run",
        "--model",
        "tiny",
        "--method",
        "sft",
        "--dataset",
        str(data),
        "--max-steps",
        "1",
        "--set",
        "max_length=64",
        "--set",
        "progress=false",
    ]
    code, out, err = gcf(*base, "--output-dir", str(tmp_path / "o1"), "--set", "long_prompts=error")
    _one_clear_line(code, out, err)
    assert "Row 0" in err and "max_length" in err
    code, out, err = gcf(*base, "--output-dir", str(tmp_path / "o2"))  # the default skips and counts it
    assert code == 0, err
    row = json.loads((tmp_path / "o2" / "metrics.jsonl").read_text().splitlines()[0])
    assert row["skipped_long_prompts"] == 1.0


def test_unreadable_config_file(gcf, tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("method: [unclosed\n")
    code, out, err = gcf("run", "--config", str(bad), "--max-steps", "1")
    _one_clear_line(code, out, err)
    assert "not valid YAML" in err


# --- arbitrary rows never crash the loader with anything but the documented GcfError
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=8,
)
rows = st.dictionaries(
    st.sampled_from(["prompt", "completion", "messages", "chosen", "rejected", "answer", "x"]), json_values, max_size=5
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(row=rows)
def test_arbitrary_rows_give_a_row_or_a_clear_error(row):
    tok = tiny_tokenizer()
    for kind in ("demonstrations", "prompts", "pairs", "labelled"):
        try:
            encode(
                kind,
                [{"prompt": "ok", "completion": "ok", "chosen": "a", "rejected": "b"}, row],
                Formatter(tok),
                64,
                method="m",
            )
        except GcfError as e:
            assert "Row 1" in str(e) or "m cannot train" in str(e) or "none of TRL's formats" in str(e), str(
                e
            )  # names the row or the format


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture]
)
@given(lines=st.lists(rows, min_size=0, max_size=4), junk=st.booleans())
@example(lines=[{"prompt": {"\x00": {}}}], junk=False)  # found by hypothesis: datasets failed decoding, not loading
def test_arbitrary_jsonl_files_load_or_fail_clearly(tmp_path_factory, lines, junk):
    path = tmp_path_factory.mktemp("d") / "data.jsonl"
    text = "\n".join(json.dumps(r) for r in lines) + ("\n{not json" if junk else "")
    path.write_text(text)
    try:
        loaded = load_rows(str(path))
    except GcfError:
        return
    try:
        as_kind(loaded, "demonstrations", "sft")
    except GcfError:
        pass
