"""The `threads` setting: the choice from the cores and how busy they are (worked by hand), the /proc/stat reading, the
refusal of a bad value, a run that applies and records its count, and a resume that keeps the count its run recorded."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import metrics_rows

from gcfamily.config import Config
from gcfamily.core import threads
from gcfamily.core.threads import choose_threads, counted_busy, resumed_threads, stat_ticks
from gcfamily.errors import Interrupted
from gcfamily.run.trainer import Trainer

# --------------------------------------------------------------------------- the choice, by hand


def test_one_busy_core_of_two_leaves_one_thread():
    assert choose_threads(2, 1.0, None, 2) == (1, "2 cores, 1 busy: 1 thread; set threads=2 to override")


def test_a_quiet_machine_keeps_every_core():
    count, reason = choose_threads(8, 0.0, None, 8)
    assert count == 8 and reason.startswith("8 cores, 0 busy: 8 threads;")


@pytest.mark.parametrize("busy", [2.0, 3.0, 5.5, 64.0])
def test_busy_at_or_past_the_cores_leaves_one_thread(busy):
    count, reason = choose_threads(2, busy, None, 2)
    assert count == 1 and "1 thread;" in reason


@pytest.mark.parametrize(
    "busy, counted, count",
    [
        (0.5, 0, 8),  # half a core in use: free
        (0.79, 0, 8),
        (0.95, 1, 7),  # a spinning process reads a little under one core over a short window: busy
        (1.5, 1, 7),  # rounded down
        (2.6, 2, 6),
        (2.85, 3, 5),
    ],
)
def test_fractional_busy_rounds_down_counting_a_nearly_full_core(busy, counted, count):
    assert counted_busy(busy) == counted
    got, reason = choose_threads(8, busy, None, 8)
    assert got == count and f"8 cores, {counted} busy" in reason and f"{busy:.2f} measured" in reason


def test_a_given_count_is_kept_whatever_the_machine():
    assert choose_threads(2, 1.9, 6, 2) == (6, "threads=6 as given: 6 threads")
    assert choose_threads(64, None, 1, 1)[0] == 1


def test_an_unknown_busy_figure_keeps_torchs_count_and_says_so():
    count, reason = choose_threads(4, None, None, 3)
    assert count == 3 and "cannot be read" in reason and "torch's own 3 threads" in reason


def test_auto_never_goes_above_torchs_count_before_the_run():
    count, reason = choose_threads(8, 0.0, None, 4)  # OMP_NUM_THREADS=4, or the program's torch.set_num_threads(4)
    assert count == 4 and "torch at 4 before the run" in reason
    count, reason = choose_threads(8, 0.0, None, 1)
    assert count == 1 and "set to 1 thread before the run" in reason


def test_processes_on_one_machine_share_the_free_cores():
    count, reason = choose_threads(8, 1.0, None, 8, local_world_size=2)  # 7 free cores, 2 processes: 3 each
    assert count == 3 and "2 processes" in reason and "3 threads each" in reason and "threads=4" in reason
    assert choose_threads(2, 2.0, None, 2, local_world_size=4)[0] == 1


def test_a_resume_keeps_the_recorded_count_unless_given():
    count, reason = resumed_threads(2, 1, "2 cores, 1 busy: 1 thread; ...", explicit=False)
    assert count == 2 and "the run recorded" in reason and "auto would choose 1 now" in reason
    count, reason = resumed_threads(2, 1, "threads=1 as given: 1 thread", explicit=True)
    assert count == 1 and "no longer bitwise equal" in reason
    count, reason = resumed_threads(2, 2, "threads=2 as given: 2 threads", explicit=True)
    assert count == 2 and "bitwise" not in reason
    count, reason = resumed_threads(None, 3, "8 cores, 5 busy: 3 threads", explicit=False)
    assert count == 3 and "records no thread count" in reason


# --------------------------------------------------------------------------- /proc/stat

STAT = """cpu  110 0 50 1790 50 0 0 0 0 0
cpu0 100 0 50 800 50 0 0 0 0 0
cpu1 10 0 0 990 0 0 0 0 0 0
intr 12345 0 0
ctxt 999
"""


def test_stat_ticks_sums_the_cpus_asked_for():
    # cpu0: busy = 100 user + 50 system = 150 of 1000 (idle 800 and iowait 50 are idle); cpu1: 10 of 1000
    assert stat_ticks(STAT, {0}) == (150, 1000, 1)
    assert stat_ticks(STAT, {1}) == (10, 1000, 1)
    assert stat_ticks(STAT, None) == (160, 2000, 2)  # the "cpu " total line is not counted twice
    assert stat_ticks(STAT, {7}) is None
    assert stat_ticks("", None) is None


def test_busy_cores_is_the_share_of_busy_ticks_times_the_cpus(monkeypatch):
    readings = iter([(100, 1000, 2), (160, 1100, 2)])  # 60 of 100 ticks busy on 2 CPUs: 1.2 cores
    monkeypatch.setattr(threads, "_cpu_times", lambda cpus: next(readings))
    assert threads.busy_cores(0.01) == pytest.approx(1.2, abs=0.1)  # less this process's own use, near 0 asleep
    monkeypatch.setattr(threads, "_cpu_times", lambda cpus: None)
    assert threads.busy_cores(0.01) is None


def test_busy_cores_reads_this_machine_where_it_can():
    busy = threads.busy_cores(0.05)
    if busy is None:
        pytest.skip("no /proc/stat here")
    assert 0.0 <= busy <= threads.usable_cores() + 0.5


# --------------------------------------------------------------------------- the setting and the run


@pytest.mark.parametrize("value", ["0", "-2", "many", "1.5", "[1, 2]"])
def test_a_bad_threads_value_is_one_sentence(gcf, tmp_path, value):
    code, _, err = gcf(
        "run",
        "--method",
        "sft",
        "--model",
        "tiny",
        "--max-steps",
        "1",
        "--output-dir",
        str(tmp_path / "o"),
        "--set",
        f"threads={value}",
    )
    assert code == 2 and err.startswith("error: Invalid setting: threads must be auto or a whole number >= 1")
    assert len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "o").exists()


@pytest.fixture
def two_threads():
    """torch at 2 threads for the test (the suite runs at 1: auto never goes above it), put back after."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def _cfg(out: Path, **kw) -> Config:
    base = dict(
        method="sft",
        model="tiny",
        task="arithmetic",
        max_steps=4,
        lr=1e-3,
        batch_size=4,
        micro_batch_size=2,
        output_dir=str(out),
        progress=False,
        report_to="none",
        lr_schedule="cosine",
        warmup_steps=1,
    )
    return Config(**{**base, **kw})


def _spy_threads(trainer: Trainer, stop_at: int | None = None) -> list[int]:
    """torch's thread count at each step of the run; a SIGTERM at step `stop_at` (a checkpoint, then Interrupted)."""
    seen: list[int] = []
    orig = trainer.method.after_step

    def after(step: int):
        seen.append(torch.get_num_threads())
        if step == stop_at:
            trainer.stop_signal = "SIGTERM"
        return orig(step)

    trainer.method.after_step = after
    return seen


def test_a_run_with_threads_1_runs_and_records_1(tmp_path, two_threads):
    t = Trainer(_cfg(tmp_path, threads=1, max_steps=2))
    seen = _spy_threads(t)
    t.run()
    assert seen == [1, 1]
    assert torch.get_num_threads() == 2  # the program's own count again once the run ended
    rows = metrics_rows(tmp_path)
    assert rows[0]["threads"] == 1 and "threads" not in rows[1]
    assert json.loads((tmp_path / "run_config.json").read_text())["threads"] == 1
    state = torch.load(next((tmp_path / "checkpoints").glob("step-*")) / "state.pt", weights_only=True)
    assert state["threads"] == 1


def test_auto_applies_its_choice_and_logs_the_busy_cores(tmp_path, two_threads, monkeypatch):
    monkeypatch.setattr(threads, "usable_cores", lambda: 2)
    monkeypatch.setattr(threads, "busy_cores", lambda: 1.0)
    t = Trainer(_cfg(tmp_path, max_steps=1))
    seen = _spy_threads(t)
    t.run()
    assert seen == [1] and t.threads.reason == "2 cores, 1 busy: 1 thread; set threads=2 to override"
    row = metrics_rows(tmp_path)[0]
    assert row["threads"] == 1 and row["threads/busy_cores"] == 1.0


def test_a_resume_keeps_the_recorded_count_and_stays_bitwise(tmp_path, two_threads, monkeypatch, capsys):
    monkeypatch.setattr(threads, "usable_cores", lambda: 2)
    whole = Trainer(_cfg(tmp_path / "whole", threads=1))  # the oracle: one thread throughout, given
    whole.run()
    monkeypatch.setattr(threads, "busy_cores", lambda: 1.0)  # busy as the run starts: auto takes 1 thread
    cut = Trainer(_cfg(tmp_path / "cut"))
    assert cut.threads.count == 1
    seen = _spy_threads(cut, stop_at=2)
    with pytest.raises(Interrupted):
        cut.run()
    assert seen == [1, 1]
    monkeypatch.setattr(threads, "busy_cores", lambda: 0.0)  # quiet now: auto alone would take 2
    assert threads.decide(None).count == 2
    resumed = Trainer(_cfg(tmp_path / "cut"), resume="latest")
    assert resumed.threads.count == 1 and "the run recorded" in resumed.threads.reason
    assert "auto would choose 2 now" in resumed.threads.reason
    seen = _spy_threads(resumed)
    resumed.run()
    assert seen == [1, 1]
    rows = metrics_rows(tmp_path / "cut")
    assert [r["step"] for r in rows] == [1, 2, 3, 4] and rows[2]["threads"] == 1  # the resumed start's first row
    a, b = whole.unwrapped_policy().state_dict(), resumed.unwrapped_policy().state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a), "the resumed run differs from the uninterrupted one"
    assert "bitwise" not in capsys.readouterr().err  # progress=false: nothing printed where nothing changed


def test_a_resume_given_another_count_takes_it_and_says_bitwise_equality_ends(tmp_path, two_threads, capsys):
    cut = Trainer(_cfg(tmp_path, threads=1))
    _spy_threads(cut, stop_at=2)
    with pytest.raises(Interrupted):
        cut.run()
    resumed = Trainer(_cfg(tmp_path, threads=2, explicit=["threads"]), resume="latest")  # not refused as a change
    seen = _spy_threads(resumed)
    resumed.run()
    assert seen == [2, 2] and resumed.threads.count == 2
    err = capsys.readouterr().err
    assert (
        "threads: threads=2 as given: 2 threads, where the run recorded 1: the continuation is no longer bitwise" in err
    )


def test_the_progress_bar_comes_with_the_reason(gcf, tmp_path):
    args = ["run", "--method", "sft", "--model", "tiny", "--max-steps", "1", "--set", "report_to=none"]
    code, _, err = gcf(*args, "--output-dir", str(tmp_path / "a"))
    assert code == 0 and err.splitlines()[0].startswith("threads: torch was set to 1 thread before the run"), err
    code, _, err = gcf(*args, "--output-dir", str(tmp_path / "b"), "--set", "progress=false")
    assert code == 0 and "threads:" not in err, err


# --------------------------------------------------------------------------- bounds and hostile machines (issue 49)


@pytest.mark.parametrize(
    "text",
    [
        "cpu0 100 0 50\n",  # three fields: no idle column
        "cpu0 a b c d e\n",  # not numbers
        "cpu0 100 0 50 -800 50\n",  # a negative tick
        "cpu0\n",
        "cpu0 1e3 0 0 9 0\n",
    ],
)
def test_a_short_or_garbled_per_cpu_line_is_not_counted(text):
    assert stat_ticks(text, None) is None  # was an IndexError or a ValueError
    assert stat_ticks(text + "cpu1 10 0 0 990 0 0 0 0\n", None) == (10, 1000, 1)  # the good line still counts


def _group(tmp_path: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    return tmp_path


def test_a_cgroup_v2_quota_counts_as_fewer_cores(tmp_path):
    from gcfamily.core.cgroup import cgroup_quota

    root = _group(tmp_path, {"job/cpu.max": "150000 100000\n", "cpu.max": "max 100000\n"})
    assert cgroup_quota(root, "0::/job\n") == 1.5  # 150 ms every 100 ms; the root's "max" is no limit
    assert cgroup_quota(root, "0::/\n") is None
    root = _group(tmp_path / "nested", {"a/cpu.max": "100000 100000", "a/b/cpu.max": "max 100000"})
    assert cgroup_quota(root, "0::/a/b") == 1.0  # a parent's quota binds its children
    for garbled in ("", "max", "x y", "100000 0", "-5 100000"):
        assert cgroup_quota(_group(tmp_path / "g", {"cpu.max": garbled}), "0::/") is None


def test_a_cgroup_v1_quota_counts_as_fewer_cores(tmp_path):
    from gcfamily.core.cgroup import cgroup_quota

    root = _group(
        tmp_path, {"cpu,cpuacct/job/cpu.cfs_quota_us": "50000\n", "cpu,cpuacct/job/cpu.cfs_period_us": "100000\n"}
    )
    assert cgroup_quota(root, "4:memory:/job\n3:cpu,cpuacct:/job\n") == 0.5
    unlimited = _group(tmp_path / "u", {"cpu/cpu.cfs_quota_us": "-1", "cpu/cpu.cfs_period_us": "100000"})
    assert cgroup_quota(unlimited, "3:cpu:/\n") is None


def test_usable_cores_takes_the_quota(monkeypatch):
    monkeypatch.setattr(threads, "cgroup_quota", lambda: 1.5)
    monkeypatch.setattr(threads.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    assert threads.usable_cores() == 2  # ceil(1.5): the second thread has half a core
    monkeypatch.setattr(threads, "cgroup_quota", lambda: 0.2)
    assert threads.usable_cores() == 1
    monkeypatch.setattr(threads, "cgroup_quota", lambda: None)
    assert threads.usable_cores() == 4


def test_one_usable_core_is_said_without_blaming_omp_num_threads():
    count, reason = choose_threads(1, 0.0, None, 1)  # taskset -c 0: torch's own default is 1 thread
    assert count == 1 and "1 core usable here" in reason and "OMP_NUM_THREADS" not in reason, reason
    count, reason = choose_threads(4, 0.0, None, 1)  # 4 cores, torch held at 1 by the program
    assert "torch.set_num_threads" in reason and "OMP_NUM_THREADS" not in reason, reason
    count, reason = choose_threads(4, 0.0, None, 1, omp="1")
    assert "OMP_NUM_THREADS=1" in reason, reason


@pytest.mark.skipif(not hasattr(__import__("os"), "sched_setaffinity"), reason="needs CPU affinity")
def test_taskset_to_one_core_in_a_real_process():
    """The issue's replay: affinity limited to one core, OMP_NUM_THREADS not set; the message blamed it."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    code = "import os; os.sched_setaffinity(0, {min(os.sched_getaffinity(0))}); from gcfamily.core import threads; print(threads.decide(None).reason)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "1 core usable here" in out.stdout and "OMP_NUM_THREADS" not in out.stdout, out.stdout


@pytest.mark.parametrize("value", ["100000", "2147483648", "99999999999999999999"])
def test_more_threads_than_usable_cores_is_one_sentence(gcf, tmp_path, value, monkeypatch):
    """threads=100000 started 100,000 threads (the machine's other processes failed to fork; then SIGSEGV), and
    2147483648 overflowed torch's int: a traceback. Refused before torch is asked."""
    asked: list[int] = []
    monkeypatch.setattr(torch, "set_num_threads", asked.append)
    code, _, err = gcf(
        "run", "--method", "sft", "--model", "tiny", "--max-steps", "1", "--output-dir", str(tmp_path / "o"),
        "--set", f"threads={value}",
    )  # fmt: skip
    assert code == 2 and err.startswith(f"error: threads={value} is more than the ") and "threads=auto" in err, err
    assert len(err.strip().splitlines()) == 1 and int(value) not in asked, asked


@pytest.mark.parametrize("recorded", [100000, 0, -3, "2", True, 2.0])
def test_a_recorded_count_past_the_cores_or_not_a_count_is_not_taken(recorded):
    count, reason = resumed_threads(recorded, 2, "2 cores, 0 busy: 2 threads", explicit=False, cores=2)
    assert count == 2 and f"records threads={recorded!r}" in reason and "not bitwise equal" in reason, reason
