"""The reward worker: user reward functions run in a child process, so that they cannot take the run down.

One small process per run (per `Rewards`), a fresh Python interpreter that imports the user's
reward modules and answers calls over a pipe (calling.serve). Fresh, not forked: the trainer
holds threads and maybe a CUDA context, which a forked child must not touch; the worker imports
no torch of its own, so it starts in about 0.1 s, and a call costs one pickle round trip (measured
when this landed, on a shared 2-core CPU: 0.2 ms more than in-process for 8 samples, 0.4 ms for 64;
a tiny-model GRPO step takes about 60 ms).

What a user reward can no longer do to the run:

- raise SystemExit or KeyboardInterrupt: the worker catches them; the samples fail and are counted;
- call os._exit or crash: the pipe closes; the call's samples fail, the worker is started again
  for the next call;
- hang: after `timeout` seconds (reward_timeout; 0 = none) the worker is killed; the call's
  samples fail and a new worker takes the next call;
- hold the run while it is asked to stop: the wait polls `should_stop` (the trainer's SIGTERM /
  Ctrl-C flag) every POLL_S; a call that has not answered by then is abandoned (its samples fail,
  counted) and the step ends at the trainer's checkpoint. A reward quicker than POLL_S still scores
  the last step; a slower one does not, so that a stop never waits on a reward.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import weakref
from collections.abc import Callable, Sequence
from multiprocessing import Pipe
from multiprocessing.connection import Connection
from typing import Any, Optional

from gcfamily.errors import GcfError
from gcfamily.rewards import calling

POLL_S = 0.1  # how often a waiting call looks at the clock and the stop flag
_BOOT = (
    "import importlib.util, json, sys\n"
    "fd, parent, path, here = int(sys.argv[1]), int(sys.argv[2]), json.loads(sys.argv[3]), sys.argv[4]\n"
    "sys.path[:] = path\n"  # the trainer's import path: module:function resolves the same way in both
    "spec = importlib.util.spec_from_file_location('gcf_reward_worker', here)\n"
    "m = importlib.util.module_from_spec(spec)\n"
    "sys.modules[spec.name] = m\n"
    "spec.loader.exec_module(m)\n"
    "m.serve(fd, parent)\n"
)


def _shutdown(proc: subprocess.Popen, conn: Connection) -> None:
    """Close the pipe (an idle worker then exits by itself) and make sure the process is gone."""
    conn.close()
    try:
        proc.wait(timeout=2)
    except subprocess.TimeoutExpired:  # busy in a reward: it gets no say
        proc.kill()
        proc.wait()


class RewardWorker:
    """A child process that loads `specs` (module:function, file.py:function) and calls them on request."""

    def __init__(self, specs: Sequence[str], timeout: float = 0.0) -> None:
        self.specs = list(specs)
        self.timeout = timeout
        self.proc: Optional[subprocess.Popen] = None
        self.conn: Optional[Connection] = None
        self._finalizer: Any = None
        self.starts = 0  # how many processes this worker has run (1 + restarts after a crash or timeout)
        self.start()

    # -- the process -----------------------------------------------------------------
    def start(self) -> None:
        """Start the process and load the rewards; a reward that fails to load is the user's one-sentence error."""
        mine, theirs = Pipe()
        fd = theirs.fileno()
        args = [sys.executable, "-c", _BOOT, str(fd), str(os.getpid()), json.dumps(sys.path), calling.__file__]
        self.proc = subprocess.Popen(args, pass_fds=(fd,), stdin=subprocess.DEVNULL, cwd=os.getcwd())
        theirs.close()
        self.conn = mine
        self.starts += 1
        self._finalizer = weakref.finalize(self, _shutdown, self.proc, self.conn)
        mine.send(("load", self.specs))
        reply = self._receive(deadline=None, should_stop=None)
        if reply[0] == "gcf_error":
            self.close()
            raise GcfError(reply[1])
        if reply[0] != "ready":  # the process ended while importing the rewards
            self.close()
            raise GcfError(
                f"the reward worker process ended while importing {', '.join(self.specs)} ({reply[1]}); fix the reward module."
            )

    def close(self) -> None:
        """End the process (killed if a reward is still running)."""
        if self._finalizer is not None:
            self._finalizer()
        self.proc = self.conn = self._finalizer = None

    def _kill(self) -> None:
        if self.proc is not None:
            self.proc.kill()
        self.close()

    # -- calls -----------------------------------------------------------------------
    def _receive(self, deadline: Optional[float], should_stop: Optional[Callable[[], bool]]) -> tuple:
        """The next reply, or ("lost", why) when the process ended, the deadline passed or a stop was asked for."""
        assert self.conn is not None and self.proc is not None
        while True:
            if self.conn.poll(POLL_S):
                try:
                    return self.conn.recv()
                except (EOFError, OSError):  # os._exit, a crash or a kill: the pipe closed
                    code = self.proc.wait()
                    return (
                        "lost",
                        f"ended the reward worker process with exit code {code} (os._exit, a crash or a kill)",
                    )
            if deadline is not None and time.monotonic() > deadline:
                return ("lost", f"did not return within reward_timeout={self.timeout:g} s")
            if should_stop is not None and should_stop():
                return ("lost", "was abandoned because the run is stopping")

    def call(
        self,
        spec: str,
        name: str,
        prompts: list[Any],
        completions: list[Any],
        completion_ids: Optional[list[list[int]]],
        columns: dict[str, Sequence[Any]],
        should_stop: Optional[Callable[[], bool]] = None,
    ) -> calling.Values:
        """calling.call_values in the worker: raw values and per-sample errors. A call that is lost fails all its samples."""
        if self.proc is None:  # the last call killed or lost it
            self.start()
        assert self.conn is not None
        self.conn.send(("call", spec, name, prompts, completions, completion_ids, columns))
        deadline = time.monotonic() + self.timeout if self.timeout > 0 else None
        reply = self._receive(deadline, should_stop)
        if reply[0] == "ok":
            return reply[1], reply[2]
        if reply[0] == "gcf_error":
            raise GcfError(reply[1])
        self._kill()  # hung, stopping or already dead: the next call gets a fresh process
        n = len(completions)
        return [None] * n, {i: reply[1] for i in range(n)}
