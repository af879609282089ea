"""A reward worker can never block the trainer (issue 49, item 2): a reward that writes into the descriptors it inherits
(its own pipe to the trainer among them) used to hang the run past reward_timeout and through SIGTERM, because the
trainer's `Connection.recv` waited for the 2 GB a forged length header promised. Now the trainer's end is read a piece
at a time (rewards/wire.py): garbage fails the call's samples, a half-sent reply meets the deadline, a stop is answered.
"""

from __future__ import annotations

import os
import signal
import struct
import subprocess
import sys
import time

import pytest

from gcfamily.rewards import Rewards, wire

HANG_S = 120  # a bound on a hang, never a speed threshold

SCRIBBLE = """import os, time


def scribble(completions, **kwargs):
    # every descriptor the worker holds past stdio (the issue's 3-19, and above: a busy parent's pipe may get a higher
    # number), its pipe to the trainer among them
    for fd in sorted(int(x) for x in os.listdir("/proc/self/fd") if int(x) >= 3):
        try:
            os.write(fd, {head!r})
        except OSError:
            pass
    {then}
    return [1.0] * len(completions)
"""


def _reward(tmp_path, head: bytes, then: str = "pass") -> str:
    (tmp_path / "scribble.py").write_text(SCRIBBLE.format(head=head, then=then))
    return f"{tmp_path / 'scribble.py'}:scribble"


def _score(rewards: Rewards, **kwargs):
    t0 = time.monotonic()
    scores = rewards.score(["p", "q"], ["a", "b"], **kwargs)
    assert time.monotonic() - t0 < HANG_S
    return scores


def test_a_forged_length_header_fails_the_call_and_the_next_call_gets_a_fresh_worker(tmp_path):
    rewards = Rewards.from_specs([_reward(tmp_path, b"\x7f\xff\xff\xffjunk")], timeout=HANG_S)
    try:
        scores = _score(rewards)
        assert scores.valid.tolist() == [False, False]
        assert all("wrote into the reward worker's pipe" in e for e in scores.errors), scores.errors
        _score(rewards)
        assert rewards.worker.starts == 2  # the scribbling worker was killed, a new one took the next call
    finally:
        rewards.close()


@pytest.mark.parametrize(
    "head",
    [
        struct.pack("!i", 9) + b"not a pickle",  # a whole message that is no pickle
        struct.pack("!i", 3) + b"\x80\x04K",  # a truncated pickle
        struct.pack("!i", -7),  # a negative length
    ],
)
def test_garbage_in_the_pipe_fails_the_samples(tmp_path, head):
    rewards = Rewards.from_specs([_reward(tmp_path, head)], timeout=HANG_S)
    try:
        assert _score(rewards).valid.tolist() == [False, False]
    finally:
        rewards.close()


def test_a_half_sent_reply_meets_reward_timeout(tmp_path):
    """A header for 16 bytes and 2 of them, then the reward sleeps: no reply ever completes, reward_timeout ends it."""
    rewards = Rewards.from_specs([_reward(tmp_path, struct.pack("!i", 16) + b"ab", "time.sleep(600)")], timeout=1)
    try:
        scores = _score(rewards)
        assert scores.valid.tolist() == [False, False]
        assert all("did not return within reward_timeout=1 s" in e for e in scores.errors), scores.errors
    finally:
        rewards.close()


def test_a_stop_is_answered_while_the_pipe_holds_a_forged_header(tmp_path):
    """A header for 1 MB that never comes, and no reward_timeout at all: only the stop flag (the trainer's SIGTERM) can end the wait, and it does."""
    rewards = Rewards.from_specs([_reward(tmp_path, struct.pack("!i", 1 << 20), "time.sleep(600)")], timeout=0)
    asked: list[float] = []

    def should_stop() -> bool:
        asked.append(time.monotonic())
        return len(asked) > 3

    try:
        scores = _score(rewards, should_stop=should_stop)
        assert all("abandoned because the run is stopping" in e for e in scores.errors), scores.errors
    finally:
        rewards.close()


def test_a_reply_of_classes_is_refused_by_the_trainers_unpickler():
    """Only plain values come back: a pickle that names a class (here os.system) is garbled, never built."""
    import pickle

    read, write = os.pipe()
    try:
        end = wire.Wire(read)
        data = pickle.dumps(("ok", [os.getcwd]))
        os.write(write, struct.pack("!i", len(data)) + data)
        with pytest.raises(wire.Garbled):
            end.receive(HANG_S)
    finally:
        os.close(read)
        os.close(write)


@pytest.mark.skipif(sys.platform != "linux", reason="signals and /proc")
def test_the_trainer_answers_sigterm_whatever_the_reward_writes(tmp_path):
    """The issue's replay: a GRPO run whose reward forges a header and then sleeps ignored SIGTERM (only SIGKILL ended
    it). Now SIGTERM stops it at a checkpoint with 128 + 15."""
    marker = tmp_path / "scoring"
    spec = _reward(tmp_path, struct.pack("!i", 1 << 20), f"open({str(marker)!r}, 'w').close()\n    time.sleep(600)")
    proc = subprocess.Popen(
        [sys.executable, "-m", "gcfamily", "run", "--method", "grpo", "--model", "tiny", "--reward", spec]
        + ["--max-steps", "3", "--output-dir", str(tmp_path / "o"), "--set", "reward_timeout=0"]
        + ["--set", "progress=false", "--set", "batch_size=1", "--set", "group_size=2", "--set", "max_new_tokens=2"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    try:
        end = time.monotonic() + HANG_S
        while not marker.exists() and proc.poll() is None and time.monotonic() < end:
            time.sleep(0.1)
        assert marker.exists(), proc.communicate(timeout=HANG_S)
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=HANG_S)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 128 + signal.SIGTERM, (proc.returncode, out, err)
    assert "Traceback" not in out + err
