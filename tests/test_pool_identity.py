"""A pool of samples is untrusted input (issue 49, item 1): it carries what it was drawn for (its prompts' digest and its
lines' digest, in its first line and in the run's checkpoints), so an edited, cut, foreign or empty pool is refused in
one sentence on --resume and with pool=PATH, and a full disk while it is written leaves no temporary file."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest
from test_pools import FAST, odd_length  # the pool tests' run settings and reward

import gcfamily
from gcfamily.errors import GcfError


def rows_of(path: Path) -> tuple[dict, list[dict]]:
    head, *lines = path.read_text().splitlines()
    return json.loads(head), [json.loads(x) for x in lines]


def write(path: Path, head: dict, rows: list[dict], rehash: bool) -> None:
    """The pool file with these rows; `rehash`: as an attacker who also rewrites the first line's digest and count."""
    lines = "".join(json.dumps(r) + "\n" for r in rows)
    if rehash:
        head = {**head, "samples": hashlib.sha256(lines.encode()).hexdigest(), "count": len(rows)}
    path.write_text(json.dumps(head) + "\n" + lines)


def flip(rows):
    return [{**r, "rewards": 1.0 - r["rewards"]} for r in rows]


EDITS = {
    "rewards-flipped": (lambda rows: flip(rows), False, "edited or cut"),
    "half-cut": (lambda rows: rows[: len(rows) // 2], False, "edited or cut"),
    "index-negative": (lambda rows: [{**rows[0], "prompt_index": -1}, *rows[1:]], True, "malformed sample on line 2"),
    "index-true": (lambda rows: [{**rows[0], "prompt_index": True}, *rows[1:]], True, "malformed sample on line 2"),
    "reward-nan": (lambda rows: [{**rows[0], "rewards": float("nan")}, *rows[1:]], True, "malformed sample"),
    "token-past-vocab": (lambda rows: [{**rows[0], "completion_ids": [10**9]}, *rows[1:]], True, "malformed sample"),
    "no-samples": (lambda rows: [], True, "holds no samples"),
    # the first line rewritten to match: only the checkpoint's record of the pool tells
    "flipped-and-rehashed": (lambda rows: flip(rows), True, "not the one the resumed checkpoint was trained on"),
    "last-cut-and-rehashed": (lambda rows: rows[:-1], True, "not the one the resumed checkpoint"),
}


def one_sentence(e: pytest.ExceptionInfo, needle: str) -> None:
    text = str(e.value)
    assert "\n" not in text and needle in text, text


@pytest.fixture(scope="module")
def rft_run(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("rft") / "r"
    gcfamily.train(method="rft-offline", reward=odd_length, output_dir=str(out), max_steps=2, save_every=1, **FAST)
    return out


def digests(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest() for p in folder.rglob("*.*")}


@pytest.mark.parametrize("edit", list(EDITS))
def test_resume_refuses_an_edited_pool_in_one_sentence(rft_run, tmp_path, edit):
    out = tmp_path / "r"
    shutil.copytree(rft_run, out)
    change, rehash, needle = EDITS[edit]
    pool = out / "pools" / "rft-offline.jsonl"
    head, rows = rows_of(pool)
    assert len({r["prompt_index"] for r in rows}) == 6 and any(r["rewards"] >= 0.5 for r in rows)
    write(pool, head, change(rows), rehash)
    before = digests(out)
    with pytest.raises(GcfError) as e:  # the old code resumed on it and trained something else without a word
        gcfamily.train(
            method="rft-offline", reward=odd_length, output_dir=str(out), resume="latest", max_steps=3, **FAST
        )
    one_sentence(e, needle)
    assert digests(out) == before  # refused before the start committed: nothing of the run changed


@pytest.mark.parametrize("text", ["", "\n"])
def test_an_empty_pool_file_is_one_sentence(rft_run, tmp_path, text):
    given = tmp_path / "empty.jsonl"
    given.write_text(text)  # once a ZeroDivisionError
    with pytest.raises(GcfError) as e:
        gcfamily.train(method="rft-offline", reward=odd_length, output_dir=str(tmp_path / "n"), pool=str(given), **FAST)
    one_sentence(e, "cannot be read")


def test_a_pool_of_another_task_is_refused_with_pool_path(rft_run, tmp_path):
    given = rft_run / "pools" / "rft-offline.jsonl"
    with pytest.raises(GcfError) as e:  # the old code paired its completions with this task's prompts by index
        gcfamily.train(
            method="rft-offline",
            reward=odd_length,
            output_dir=str(tmp_path / "n"),
            pool=str(given),
            max_steps=1,
            **{**FAST, "task": "countdown"},
        )
    one_sentence(e, "was drawn for other prompts")
    # the same pool on the task it was drawn for is taken, exactly
    out = gcfamily.train(
        method="rft-offline", reward=odd_length, output_dir=str(tmp_path / "s"), pool=str(given), max_steps=1, **FAST
    )
    assert (out / "pools" / "rft-offline.jsonl").read_bytes() == given.read_bytes()


def test_a_full_disk_while_the_pool_is_written_is_one_sentence_and_leaves_no_temporary_file(tmp_path, monkeypatch):
    real_write, real_fsync = os.write, os.fsync
    failed = []

    def pooled(fd: int) -> bool:
        return ".tmp-rft-offline" in os.readlink(f"/proc/self/fd/{fd}")

    def write(fd: int, data) -> int:  # noqa: ANN001
        if pooled(fd):
            real_write(fd, bytes(data)[: len(data) // 2])  # half the bytes land, then the disk is full
            failed.append(fd)
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(fd, data)

    def fsync(fd: int) -> None:  # a buffered writer's bytes meet the full disk here
        if pooled(fd):
            failed.append(fd)
            raise OSError(errno.ENOSPC, "No space left on device")
        real_fsync(fd)

    monkeypatch.setattr(os, "write", write)
    monkeypatch.setattr(os, "fsync", fsync)
    out = tmp_path / "r"
    with pytest.raises(GcfError) as e:  # once a traceback that left pools/.tmp-rft-offline.jsonl
        gcfamily.train(method="rft-offline", reward=odd_length, output_dir=str(out), max_steps=1, **FAST)
    assert failed
    one_sentence(e, "the disk is full")
    assert list((out / "pools").iterdir()) == []


@pytest.mark.parametrize("rehash", [False, True])
def test_dpo_resume_refuses_an_edited_pool(tmp_path, rehash):
    out = gcfamily.train(
        method="dpo",
        reward=odd_length,
        output_dir=str(tmp_path / "d"),
        max_steps=2,
        save_every=1,
        pairs="own-samples",
        **FAST,
    )
    pool = out / "pools" / "dpo-pairs.jsonl"
    head, rows = rows_of(pool)
    write(pool, head, flip(rows), rehash)  # chosen and rejected swapped in every pair
    before = digests(out)
    with pytest.raises(GcfError) as e:
        gcfamily.train(
            method="dpo",
            reward=odd_length,
            output_dir=str(out),
            resume="latest",
            max_steps=3,
            pairs="own-samples",
            **FAST,
        )
    one_sentence(e, "not the one the resumed checkpoint" if rehash else "edited or cut")
    assert digests(out) == before
