"""Children die with their parent (issue 49, item 3): SIGKILL of a running `gcf bench` left its child training with
parent 1, holding the run folder's lock. The child now asks the kernel to kill it when the bench dies
(PR_SET_PDEATHSIG, as launched ranks do: gcfamily/run/launch.py), and ends at once if the bench died first."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

HANG_S = 300  # a bound on a hang, never a speed threshold
ROOT = Path(__file__).resolve().parents[1]


def _descendants(pid: int) -> set[int]:
    """Every live process below pid, from /proc (children of children included)."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if fields[0] != "Z":
                parents[int(entry.name)] = int(fields[1])
    found, todo = set(), [pid]
    while todo:
        p = todo.pop()
        kids = {c for c, parent in parents.items() if parent == p}
        todo += list(kids - found)
        found |= kids
    return found


def _alive(pid: int) -> bool:
    try:
        return (Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]) != "Z"
    except OSError:
        return False


@pytest.mark.skipif(sys.platform != "linux", reason="reads /proc; PR_SET_PDEATHSIG is Linux's")
def test_kill_9_of_a_running_bench_leaves_no_process_of_it(tmp_path):
    out = tmp_path / "bench"
    proc = subprocess.Popen(
        [sys.executable, "-m", "gcfamily", "bench", "--quick", "--methods", "sft", "--budget", "steps:100000"]
        + ["--out", str(out)],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    children: set[int] = set()
    try:
        metrics = out / "sft" / "metrics.jsonl"
        end = time.monotonic() + HANG_S
        while not (metrics.exists() and metrics.read_text().strip()) and time.monotonic() < end:
            assert proc.poll() is None, "the bench ended before its child trained"
            time.sleep(0.2)
        children = _descendants(proc.pid)
        assert children, "the bench's child was not found while it trained"  # the case under test occurred
        proc.send_signal(signal.SIGKILL)
        proc.wait(HANG_S)
        end = time.monotonic() + HANG_S
        while any(_alive(p) for p in children) and time.monotonic() < end:
            time.sleep(0.1)
        assert not [p for p in children if _alive(p)], "a child of the killed bench lives on"
    finally:
        for p in [p for p in children if _alive(p)] + ([proc.pid] if proc.poll() is None else []):
            os.kill(p, signal.SIGKILL)  # only what this test started
