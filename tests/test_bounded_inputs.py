"""No input hangs or crashes a run (issue 49, item 2): a chat template's work is bounded in time, and rows nested past
any real data are refused before a reader recurses into them (a JSON line 100,000 lists deep was a SIGSEGV).

Each hostile case ends in one `error:` sentence and exit 2; the only clocks are generous hang bounds.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

import pytest

from gcfamily.core.deadline import Overtime, within
from gcfamily.errors import GcfError

HANG_S = 120  # a bound on a hang, never a speed threshold
QUICK = ["--max-steps", "1", "--set", "progress=false", "--set", "batch_size=2"]
NESTED_LOOPS = "{% for i in range(99999) %}{% for j in range(99999) %}{% endfor %}{% endfor %}{{ messages[0].content }}"


def _one_sentence(code: int, out: str, err: str) -> str:
    assert code == 2, (code, out, err)
    assert err.startswith("error: ") and len(err.strip().splitlines()) == 1, err
    assert "Traceback" not in out + err
    return err


def _rows(tmp_path, name: str = "rows.jsonl"):
    path = tmp_path / name
    path.write_text("".join(json.dumps({"prompt": f"{i}+1=", "completion": str(i + 1)}) + "\n" for i in range(4)))
    return path


# --------------------------------------------------------------------------- the deadline


def _spin(seconds: float) -> int:
    """Count loop turns inside a `within(seconds)` block until Overtime (or the hang bound) ends it."""
    turns, end = 0, time.monotonic() + HANG_S
    with pytest.raises(Overtime), within(seconds):
        while time.monotonic() < end:
            turns += 1
    assert time.monotonic() < end, "the deadline never fired"
    return turns


def test_a_deadline_stops_pure_python_work_in_the_main_thread_and_in_others():
    assert _spin(0.2) > 0
    got: list[object] = []
    worker = threading.Thread(target=lambda: got.append(_spin(0.2)))
    worker.start()
    worker.join(HANG_S)
    assert not worker.is_alive() and got and isinstance(got[0], int), got


def test_a_block_that_ends_in_time_leaves_nothing_pending():
    for _ in range(200):  # many short blocks under a short deadline: none may leak Overtime into the code after it
        with within(0.05):
            sum(range(100))
    time.sleep(0.2)
    x = 0
    for i in range(200_000):  # bytecodes where a stray asynchronous exception would land
        x += i
    assert x == sum(range(200_000))


# --------------------------------------------------------------------------- chat templates


def test_nested_loops_in_a_chat_template_end_in_one_sentence(gcf, tmp_path, monkeypatch):
    from gcfamily.data import encoding

    monkeypatch.setattr(encoding, "RENDER_S", 0.5)  # the bound, not the speed, is under test
    err = _one_sentence(
        *gcf(
            "run",
            "--method",
            "sft",
            "--model",
            "tiny",
            "--dataset",
            str(_rows(tmp_path)),
            "--set",
            f"chat_template={NESTED_LOOPS}",
            "--set",
            "chat_format=chat",
            "--output-dir",
            str(tmp_path / "o"),
            *QUICK,
        )
    )
    assert "chat template did not finish rendering" in err and "chat_template" in err, err
    assert not (tmp_path / "o").exists()


def test_a_model_folders_own_template_that_never_ends_is_one_sentence(tmp_path, monkeypatch):
    """The template a downloaded folder ships (chat_template.jinja), not one the user gave: the fix names the setting."""
    from gcfamily.data import encoding
    from gcfamily.models import tiny_tokenizer

    monkeypatch.setattr(encoding, "RENDER_S", 0.5)
    tok = tiny_tokenizer()
    tok.chat_template = NESTED_LOOPS
    fmt = encoding.Formatter(tok, "chat")
    with pytest.raises(GcfError, match="did not finish rendering.*pass a chat_template"):
        fmt.prompt_ids("1+1=")
    tok.chat_template = "{{ messages[0].content }}"  # the same Formatter renders a quick template afterwards
    assert fmt.prompt_ids("1+1=") == list(tok("1+1=", add_special_tokens=False)["input_ids"])


# --------------------------------------------------------------------------- rows nested past real data


def _deep_line(depth: int) -> str:
    return json.dumps({"prompt": "1+1=", "completion": "2"})[:-1] + ', "x": ' + "[" * depth + "]" * depth + "}\n"


def test_json_depth_counts_brackets_outside_strings_only(tmp_path):
    from gcfamily.data.sources import json_depth

    path = tmp_path / "t.jsonl"
    # depth by hand: { [ [ { [ is 5; the brackets and the escaped quote inside the string do not count
    path.write_text(json.dumps({"a": '[[[["\\"[[[{{', "b": [[{"c": [1]}]]}) + "\n" + json.dumps({"x": []}) + "\n")
    assert json_depth(path) == 5


@pytest.mark.parametrize("layout", ["file", "folder"])
def test_a_row_100000_lists_deep_is_one_sentence_in_a_real_process(tmp_path, layout):
    """The JSON reader crashed with SIGSEGV (exit -11, no message); now the file is refused before it is read."""
    folder = tmp_path / "data"
    folder.mkdir()
    path = folder / "rows.jsonl"
    path.write_text(_deep_line(100_000))
    res = subprocess.run(
        [sys.executable, "-m", "gcfamily", "run", "--method", "sft", "--model", "tiny"]
        + ["--dataset", str(path if layout == "file" else folder), "--output-dir", str(tmp_path / "o"), *QUICK],
        capture_output=True,
        text=True,
        timeout=HANG_S,
        env={**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"},
    )
    err = _one_sentence(res.returncode, res.stdout, res.stderr)
    assert "nests values more than 100 deep" in err and "rows.jsonl" in err, err
    assert not (tmp_path / "o").exists()


def test_a_row_just_inside_the_bound_is_read(tmp_path):
    from gcfamily.data.sources import load_rows

    path = tmp_path / "rows.jsonl"
    path.write_text(json.dumps({"prompt": "1+1=", "completion": "2", "x": [[[1]]]}) + "\n")
    assert load_rows(str(path))[0]["x"] == [[[1]]]


def test_deep_rows_from_python_are_one_sentence():
    from gcfamily.data.sources import load_rows

    deep: list = []
    for _ in range(100_000):
        deep = [deep]
    looped: list = []
    looped.append(looped)  # a list that holds itself is endlessly deep
    for value in (deep, looped):
        with pytest.raises(GcfError, match=r"Row 1 of dataset .* nests values more than 100 deep"):
            load_rows([{"prompt": "a", "completion": "b"}, {"prompt": "a", "completion": "b", "x": value}])


# --------------------------------------------------------------------------- counts bounded by the machine


@pytest.mark.parametrize("k", ["1000000", "99999999999999999999"])
def test_maj_k_past_the_machine_is_one_sentence(gcf, k, monkeypatch):
    """--maj-k 1000000 tried to allocate 94 GB, 99999999999999999999 overflowed a C int: a traceback. Refused after the
    model loads (its sizes give the cache) and before any generation."""
    from gcfamily.run import heldout

    generated: list[int] = []
    monkeypatch.setattr(heldout, "heldout_accuracy", lambda *a, **kw: generated.append(1) or 0.0)
    err = _one_sentence(*gcf("eval", "--model", "tiny", "--samples", "16", "--maj-k", k))
    assert f"--maj-k {k} samples" in err and "GiB" in err and "lower it" in err, err
    assert generated == []


def test_a_maj_k_the_machine_holds_is_not_refused():
    from gcfamily.models import tiny_model
    from gcfamily.run.heldout import check_fits

    check_fits(tiny_model(103), 16 * 8, 32, "--maj-k 8")  # 128 rows of 33 positions: a few MB


@pytest.mark.parametrize("value", ["1e8", "-1", "0"])
def test_samples_that_are_not_a_count_are_one_sentence(gcf, value):
    err = _one_sentence(*gcf("eval", "--model", "tiny", "--samples", value))
    assert "--samples" in err, err


@pytest.mark.parametrize("suite", [[], ["--suite", "unified"]])
def test_bench_out_a_file_is_one_sentence(gcf, tmp_path, suite):
    (tmp_path / "taken").write_text("a file of the user's\n")
    for out in (tmp_path / "taken", tmp_path / "taken" / "below"):
        err = _one_sentence(*gcf("bench", "--quick", *suite, "--out", str(out)))
        assert "taken is a file" in err, err
    assert (tmp_path / "taken").read_text() == "a file of the user's\n"
