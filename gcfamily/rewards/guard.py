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
  the last step; a slower one does not, so that a stop never waits on a reward;
- hang while importing: the import runs under the same reward_timeout, and one that does not finish
  ends the run in one sentence (before any step, so the run folder is left as it was);
- block the trainer through the pipe: the trainer's end is read and written without blocking (wire.py), so
  a reward that writes into the worker's own pipe (a forged 2 GB length header) fails its call's samples,
  and a reply that never completes meets reward_timeout and the stop flag like a hung reward;
- block on a pipe it inherited: the worker inherits no descriptor but its own pipe to the trainer
  (close_fds); stdin is /dev/null and stdout and stderr go to an unnamed temporary file, which a write
  never fills, so a reward that prints a lot neither blocks nor holds the trainer's own streams open
  (its prints do not reach the terminal; the last line is quoted when the worker ends while importing).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
import weakref
from collections.abc import Callable, Sequence
from multiprocessing import Pipe
from multiprocessing.connection import Connection
from typing import Any, Optional

from gcfamily.errors import GcfError
from gcfamily.rewards import calling, wire

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


def _shutdown(proc: subprocess.Popen, conn: Connection, output: Any) -> None:
    """Close the pipe (an idle worker then exits by itself) and make sure the process is gone."""
    conn.close()
    try:
        proc.wait(timeout=2)
    except subprocess.TimeoutExpired:  # busy in a reward: it gets no say
        proc.kill()
        proc.wait()
    output.close()


def _last_line(output: Any) -> str:
    """The last line the worker printed (its stdout and stderr file), cut short; '' when it printed nothing."""
    try:
        output.seek(max(0, output.seek(0, os.SEEK_END) - 400))
        lines = output.read().decode("utf-8", "replace").strip().splitlines()
    except (OSError, ValueError):
        return ""
    return calling.shorten(lines[-1].strip()) if lines else ""


def _said(reply: tuple) -> bool:
    """Whether a reply is (kind, sentence): an error, a timeout, a stop or a lost worker."""
    return len(reply) == 2 and isinstance(reply[1], str)


def _answers(reply: tuple, n: int) -> bool:
    """Whether an "ok" reply holds n values and a dict of sample index -> why it failed, as calling.serve sends."""
    return (
        len(reply) == 3
        and isinstance(reply[1], list)
        and len(reply[1]) == n
        and isinstance(reply[2], dict)
        and all(isinstance(i, int) and isinstance(why, str) for i, why in reply[2].items())
    )


class RewardWorker:
    """A child process that loads `specs` (module:function, file.py:function) and calls them on request.

    The environment worker (gcfamily/envs/worker.py) is this process with another served file and load message:
    `served` is the file whose serve(fd, parent) the process runs, `what` and `timeout_name` name it in errors."""

    served: str = calling.__file__
    what: str = "reward"
    timeout_name: str = "reward_timeout"

    def __init__(self, specs: Sequence[str], timeout: float = 0.0) -> None:
        self.specs = list(specs)
        self.timeout = timeout
        self.proc: Optional[subprocess.Popen] = None
        self.conn: Optional[Connection] = None
        self.wire: Optional[wire.Wire] = None  # the trainer's end of self.conn, read and written without blocking
        self.output: Any = None  # the unnamed file the process's stdout and stderr go to
        self._finalizer: Any = None
        self.starts = 0  # how many processes this worker has run (1 + restarts after a crash or timeout)
        self.loaded: tuple = ()  # the worker's "ready" reply
        self.start()

    def load_message(self) -> tuple:
        """What the process is asked to load first."""
        return ("load", self.specs)

    # -- the process -----------------------------------------------------------------
    def start(self, should_stop: Optional[Callable[[], bool]] = None) -> bool:
        """Start the process and load the rewards, within reward_timeout; a reward that fails to load, or whose import does
        not finish in time, is the user's one-sentence error. False when a stop was asked for first (nothing loaded)."""
        mine, theirs = Pipe()
        fd = theirs.fileno()
        args = [sys.executable, "-c", _BOOT, str(fd), str(os.getpid()), json.dumps(sys.path), self.served]
        self.output = tempfile.TemporaryFile(prefix=f"gcf-{self.what}-")  # noqa: SIM115 (closed by _shutdown, with the process)
        self.proc = subprocess.Popen(
            args,
            pass_fds=(fd,),
            close_fds=True,  # no descriptor of the trainer's but the pipe: a reward cannot fill or hold one open
            stdin=subprocess.DEVNULL,
            stdout=self.output,
            stderr=self.output,
            cwd=os.getcwd(),
        )
        theirs.close()
        self.conn, self.wire = mine, wire.Wire(mine.fileno())
        self.starts += 1
        self._finalizer = weakref.finalize(self, _shutdown, self.proc, self.conn, self.output)
        deadline = time.monotonic() + self.timeout if self.timeout > 0 else None
        reply = self._send(self.load_message(), deadline, should_stop)
        names = ", ".join(self.specs)
        if reply[0] == "ready":
            self.loaded = reply
            return True
        if reply[0] == "stopping":
            self._kill()
            return False
        if reply[0] == "timeout":
            self._kill()
            raise GcfError(
                f"importing the {self.what} {names} did not finish within {self.timeout_name}={self.timeout:g} s; "
                f"fix what its module does at import (or raise {self.timeout_name})."
            )
        printed = _last_line(self.output) if reply[0] != "gcf_error" else ""
        self.close()
        if reply[0] == "gcf_error":
            raise GcfError(reply[1])
        # the process ended while importing the rewards
        said = f"; its last output: {printed}" if printed else ""
        raise GcfError(
            f"the {self.what} worker process ended while importing {names} ({reply[1]}{said}); fix the {self.what} module."
        )

    def close(self) -> None:
        """End the process (killed if a reward is still running)."""
        if self._finalizer is not None:
            self._finalizer()
        self.proc = self.conn = self.wire = self.output = self._finalizer = None

    def _kill(self) -> None:
        if self.proc is not None:
            self.proc.kill()
        self.close()

    # -- calls -----------------------------------------------------------------------
    def _receive(self, deadline: Optional[float], should_stop: Optional[Callable[[], bool]]) -> tuple:
        """The next reply, or (kind, why) with kind "lost" when the process ended, "timeout" when the deadline passed
        and "stopping" when a stop was asked for."""
        assert self.wire is not None and self.proc is not None
        while True:
            try:
                reply = self.wire.receive(POLL_S)
            except EOFError:  # os._exit, a crash or a kill: the pipe closed (or the reward closed it and runs on)
                try:
                    code: Any = self.proc.wait(timeout=1)
                except subprocess.TimeoutExpired:
                    code = "none yet"
                return (
                    "lost",
                    f"ended the {self.what} worker process with exit code {code} (os._exit, a crash or a kill)",
                )
            except wire.Garbled as e:  # the reward wrote into the worker's pipe
                return ("lost", f"wrote into the {self.what} worker's pipe to the trainer ({e})")
            if isinstance(reply, tuple) and reply and (reply[0] in ("ready", "ok") or _said(reply)):
                return reply
            if reply is not None:
                return ("lost", f"wrote into the {self.what} worker's pipe to the trainer (a message that is no reply)")
            if deadline is not None and time.monotonic() > deadline:
                return ("timeout", f"did not return within {self.timeout_name}={self.timeout:g} s")
            if should_stop is not None and should_stop():
                return ("stopping", "was abandoned because the run is stopping")

    def _send(self, message: tuple, deadline: Optional[float], should_stop: Optional[Callable[[], bool]]) -> tuple:
        """Send a request and wait for its reply (_receive's kinds); a worker that does not read it in time is "timeout"."""
        assert self.wire is not None
        while not self.wire.send(message, POLL_S if deadline is None else max(0.0, deadline - time.monotonic())):
            if deadline is not None and time.monotonic() > deadline:
                return ("timeout", f"did not return within {self.timeout_name}={self.timeout:g} s")
            if should_stop is not None and should_stop():
                return ("stopping", "was abandoned because the run is stopping")
        return self._receive(deadline, should_stop)

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
        n = len(completions)
        if self.proc is None and not self.start(should_stop):  # the last call killed or lost it; a stop came first
            return [None] * n, {i: "was abandoned because the run is stopping" for i in range(n)}
        deadline = time.monotonic() + self.timeout if self.timeout > 0 else None
        reply = self._send(("call", spec, name, prompts, completions, completion_ids, columns), deadline, should_stop)
        if reply[0] == "ok" and _answers(reply, n):
            return reply[1], reply[2]
        if reply[0] == "gcf_error":
            raise GcfError(reply[1])
        self._kill()  # hung, stopping, already dead or garbled: the next call gets a fresh process
        why = (
            reply[1]
            if _said(reply)
            else "sent the trainer a reply of the wrong shape (it wrote into the worker's pipe)"
        )
        return [None] * n, {i: why for i in range(n)}
