"""RunLogger: metrics.jsonl always, TensorBoard and W&B (offline) when asked, and logged completions."""

from __future__ import annotations

import json
import struct
import sys
from pathlib import Path

import pytest

from gcfamily.errors import GcfError
from gcfamily.run.logger import RunLogger, read_metrics

CHAT = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "2+2?"}]
ROWS = [
    {"prompt": "say hi", "completion": "hi | there", "reward": 1.0},
    {"prompt": CHAT, "completion": "4", "reward": None, "task": "math"},
]


def tb_events(out: Path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(out / "tensorboard"), size_guidance={"tensors": 0, "scalars": 0})
    acc.Reload()
    return acc


def test_report_to_none_writes_metrics_only(tmp_path):
    out = tmp_path / "run"  # not made beforehand: the logger makes it
    log = RunLogger(out, report_to="none")
    log.log(1, {"loss": 0.5, "bad": float("nan")})
    log.log(2, {"loss": 0.25})
    log.close()
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == [1, 2]
    assert rows[0]["loss"] == 0.5 and rows[0]["bad"] is None
    assert not (out / "tensorboard").exists() and not (out / "wandb").exists()


def test_tensorboard_false_wins_over_report_to(tmp_path):
    log = RunLogger(tmp_path, tensorboard=False, report_to=["tensorboard"])
    log.log(1, {"loss": 1.0})
    log.close()
    assert not (tmp_path / "tensorboard").exists()
    assert read_metrics(tmp_path)[0]["loss"] == 1.0


def test_tensorboard_scalars(tmp_path):
    log = RunLogger(tmp_path)  # the default: report_to="tensorboard"
    for step in (1, 2, 3):
        log.log(step, {"loss": 1.0 / step, "flag": True, "bad": float("inf")})
    log.close()
    acc = tb_events(tmp_path)
    # bools and non-finite numbers are not scalars to plot
    assert acc.Tags()["scalars"] == ["loss"]
    assert [(e.step, round(e.value, 4)) for e in acc.Scalars("loss")] == [(1, 1.0), (2, 0.5), (3, 0.3333)]


def test_completions_jsonl_and_tensorboard_text(tmp_path):
    log = RunLogger(tmp_path)
    log.completions(7, ROWS)
    log.completions(8, [{"prompt": "p", "completion": "c", "reward": float("nan")}])
    log.close()
    lines = [json.loads(x) for x in (tmp_path / "completions.jsonl").read_text().splitlines()]
    assert lines[0] == {"step": 7, "prompt": "say hi", "completion": "hi | there", "reward": 1.0}
    # the JSONL keeps a chat prompt as given, and extra keys
    assert lines[1] == {"step": 7, "prompt": CHAT, "completion": "4", "reward": None, "task": "math"}
    assert lines[2]["step"] == 8 and lines[2]["reward"] is None
    acc = tb_events(tmp_path)
    assert "completions/text_summary" in acc.Tags()["tensors"]
    events = acc.Tensors("completions/text_summary")
    assert [e.step for e in events] == [7, 8]
    text = events[0].tensor_proto.string_val[0].decode()
    assert text.splitlines()[0] == "| prompt | completion | reward |"
    # a pipe in a cell is escaped, and a chat prompt is one "role: content" line per message
    assert "| say hi | hi \\| there | 1 |" in text
    assert "| system: be brief<br>user: 2+2? | 4 |  |" in text


def test_disabled_rank_writes_nothing(tmp_path):
    log = RunLogger(tmp_path / "run", enabled=False)
    log.log(1, {"loss": 1.0})
    log.completions(1, ROWS)
    log.close()
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("report_to", ["banana", ["tensorboard", "banana"]])
def test_unknown_tracker_is_one_sentence(tmp_path, report_to):
    # refused on every rank, so that no rank is left waiting for the one that stopped
    for enabled in (True, False):
        sentence = "report_to='banana' is not a tracker; use 'tensorboard', 'wandb' or 'none'"
        with pytest.raises(GcfError, match=sentence):
            RunLogger(tmp_path, enabled=enabled, report_to=report_to)


def test_wandb_missing_is_one_sentence(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` now raises ImportError
    # every rank refuses, not rank 0 alone
    for report_to, enabled in (("wandb", True), (["tensorboard", "wandb"], True), ("wandb", False)):
        with pytest.raises(GcfError) as e:
            RunLogger(tmp_path, enabled=enabled, report_to=report_to)
        assert str(e.value) == (
            "report_to=wandb needs the wandb package: pip install 'gcfamily[wandb]' (or pip install wandb)."
        )
    assert not (tmp_path / "tensorboard").exists()


def test_wandb_init_failure_is_one_sentence(tmp_path, monkeypatch):
    wandb = pytest.importorskip("wandb")

    def no_key(**kwargs):  # what wandb.init raises online without a key, faked so that nothing is sent
        raise wandb.errors.UsageError("No API key configured. Use `wandb login` to log in.")

    monkeypatch.setattr(wandb, "init", no_key)
    with pytest.raises(GcfError, match=r"could not start a W&B run \(No API key configured.*WANDB_MODE=offline"):
        RunLogger(tmp_path, report_to=["tensorboard", "wandb"])
    assert not (tmp_path / "tensorboard").exists()


def wandb_history(run_dir: Path) -> tuple[dict, dict[int, dict]]:
    """(run record fields, {step: history row}) read back from an offline run's .wandb file.

    The file is a 7-byte ":W&B" header, then the LevelDB log format (32 KiB blocks of records, each a
    7-byte header: crc32c, little-endian length, kind; kind 1 is a whole record, 2/3/4 first/middle/last
    pieces) holding wandb's protobuf Records; read here without wandb's own reader, which is in Go.
    """
    from wandb.proto import wandb_internal_pb2 as pb

    (path,) = run_dir.glob("*.wandb")
    data = path.read_bytes()
    assert data[:4] == b":W&B"
    block, pos, piece, run, history = 32768, 7, b"", {}, {}
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _crc, n, kind = struct.unpack("<IHB", data[pos : pos + 7])
        piece, pos = piece + data[pos + 7 : pos + 7 + n], pos + 7 + n
        if kind in (1, 4):
            r = pb.Record()
            r.ParseFromString(piece)
            piece = b""
            if r.WhichOneof("record_type") == "run":
                config = {u.key: json.loads(u.value_json) for u in r.run.config.update}
                run = {"name": r.run.display_name, "project": r.run.project, "config": config}
            elif r.WhichOneof("record_type") == "history":
                items = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item}
                history[r.history.step.num] = items
    return run, history


def test_wandb_offline_two_runs(tmp_path, monkeypatch):
    wandb = pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_PROJECT", "gcf-test")
    for var in ("WANDB_DIR", "WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(var, str(tmp_path / var.lower()))
    # two loggers alive at once in one process: each must own its run
    a = RunLogger(tmp_path / "a", report_to=["tensorboard", "wandb"], config={"lr": 1e-5})
    b = RunLogger(tmp_path / "b", report_to="wandb", run_name="second")
    assert a.wandb is not b.wandb
    for step in (1, 2, 3):
        a.log(step, {"loss": 1.0 / step, "bad": float("nan")})
        b.log(step, {"loss": 2.0 * step})
    a.completions(3, ROWS)
    a.close()
    b.close()
    a.close()  # twice is harmless
    # finish() can return before wandb's service has written the .wandb file (seen: 7 bytes, the header);
    # teardown waits for the service, as the atexit hook does at the end of a real run
    wandb.teardown()

    (run_a,) = (tmp_path / "a" / "wandb").glob("offline-run-*")
    (run_b,) = (tmp_path / "b" / "wandb").glob("offline-run-*")
    info, hist = wandb_history(run_a)
    assert info == {"name": "a", "project": "gcf-test", "config": {"_wandb": {}, "lr": 1e-5}}
    assert {s: h["loss"] for s, h in hist.items()} == {1: 1.0, 2: 0.5, 3: pytest.approx(1 / 3)}
    assert not any("bad" in h for h in hist.values())
    # the completions Table is logged at its step, beside that step's metrics
    assert hist[3]["completions/_type"] == "table-file" and hist[3]["completions/nrows"] == 2
    table = json.loads((run_a / "files" / hist[3]["completions/path"]).read_text())
    assert table == {
        "columns": ["prompt", "completion", "reward", "task"],
        "data": [["say hi", "hi | there", 1.0, None], ["system: be brief\nuser: 2+2?", "4", None, "math"]],
    }
    info, hist = wandb_history(run_b)
    assert info["name"] == "second" and {s: h["loss"] for s, h in hist.items()} == {1: 2.0, 2: 4.0, 3: 6.0}
    # metrics.jsonl and TensorBoard are written alongside
    assert [r["step"] for r in read_metrics(tmp_path / "a")] == [1, 2, 3]
    assert (tmp_path / "a" / "tensorboard").is_dir() and not (tmp_path / "b" / "tensorboard").exists()
