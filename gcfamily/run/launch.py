"""Starting a run in several processes: `gcf run --nproc N` under torchrun, one line per failure.

`launch` re-runs the command under torch.distributed.run; each process calls `run_process`, which
trains with a `distributed.DistEnv`. A user error on any rank ends in one line (the lowest
failing rank's message) and a non-zero exit, never a traceback per rank.

The processes `launch` starts run this module (`python -m gcfamily.run.launch run ...`), whose first
instruction asks the kernel to kill the process when the launcher dies and then checks that the
launcher is still its parent: a launcher killed while the processes start (importing torch, or
waiting for each other at the rendezvous) takes them with it instead of leaving them connecting to
a store that is gone. This module imports nothing heavy at its top, so that comes first.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import sys
import tempfile
from pathlib import Path
from typing import Any

from gcfamily.errors import GcfError

ERROR_DIR_ENV = "GCF_ERROR_DIR"  # set by `launch`: each failing rank leaves its one-line message there
LAUNCHER_ENV = "GCF_LAUNCHER_PID"  # set by `launch`: the process whose death ends every process it started


def launch(nproc: int, argv: list[str]) -> int:
    """Run `gcf` with `argv` (its --nproc removed) in nproc processes under torchrun; its exit code.

    Same as `torchrun --standalone --nproc_per_node N -m gcfamily ARGV`, but a user error ends in
    one line (the lowest failing rank's message) instead of torchrun's failure report, and a
    SIGTERM / SIGINT to this process stops every rank at a checkpoint and exits 128 + signal.
    """
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    from gcfamily.core.threads import usable_cores

    err_dir = tempfile.mkdtemp(prefix="gcf-errors-")
    saved = dict(os.environ)
    os.environ[ERROR_DIR_ENV] = err_dir
    os.environ[LAUNCHER_ENV] = str(os.getpid())  # torchrun's agent runs here: the processes' parent
    # torchrun would set 1 (and warn): each process's share of this machine's cores instead, the most its threads=auto
    # then takes, fewer when other processes keep cores busy (gcfamily/core/threads.py)
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, usable_cores() // nproc)))
    elastic_log = logging.getLogger("torch.distributed.elastic")
    level = elastic_log.level
    elastic_log.setLevel(logging.CRITICAL)  # its failure report repeats what the ranks already printed
    try:
        args = ["--standalone", "--nproc_per_node", str(nproc), "-m", "gcfamily.run.launch", *strip_nproc(argv)]
        run(parse_args(args))
        return 0
    except ChildFailedError as e:
        message = first_error(Path(err_dir))
        if message is not None:
            code, text = message
            print(f"error: {text}", file=sys.stderr)
            return code
        rank, failure = e.get_first_failure()
        code = failure.exitcode if failure.exitcode > 0 else 128 - failure.exitcode  # -N: killed by signal N
        how = (
            f"was killed by {signal_name(-failure.exitcode)}"
            if failure.exitcode < 0
            else f"exited with code {failure.exitcode}; its output is above"
        )
        print(f"error: process {rank} of {nproc} {how}.", file=sys.stderr)
        return code
    except SignalException as e:  # torchrun passed the signal on and waited for the processes
        message = first_error(Path(err_dir))  # theirs: stopped at step N, checkpoint saved
        name = signal.Signals(e.sigval).name
        code, text = (
            message
            if message is not None
            else (128 + int(e.sigval), f"Stopped by {name}; the processes were stopped too.")
        )
        print(f"error: {text}", file=sys.stderr)
        return code
    finally:
        elastic_log.setLevel(level)
        os.environ.clear()
        os.environ.update(saved)
        shutil.rmtree(err_dir, ignore_errors=True)


def signal_name(number: int) -> str:
    """'SIGKILL' for 9; 'signal N' for a number Python does not name."""
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def strip_nproc(argv: list[str]) -> list[str]:
    """argv without `--nproc N` / `--nproc=N`."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == "--nproc":
            skip = True
        elif not a.startswith("--nproc="):
            out.append(a)
    return out


def first_error(err_dir: Path) -> tuple[int, str] | None:
    """(exit code, message) left by the lowest rank that failed with a user error, if any."""
    files = sorted(err_dir.glob("rank-*"), key=lambda p: int(p.name[5:]))
    if not files:
        return None
    code, _, text = files[0].read_text().partition("\n")
    return int(code), text


def run_process(cfg: Any, resume: str | None) -> None:
    """`gcf run` in one process of torchrun: join the group, train, leave the group.

    A user error on any rank ends in one line (rank 0's, or the lowest failing rank's through the
    `launch` that started us) and a non-zero exit, never a traceback per rank.
    """
    from gcfamily.run.distributed import DistEnv
    from gcfamily.run.trainer import Trainer

    rank, env, code = int(os.environ.get("RANK", "0")), None, 0
    die_with_parent()
    try:
        env = DistEnv.from_env(cfg.device, cfg.dist_timeout)
        assert env is not None, "run_process is for WORLD_SIZE > 1"
        env.check(cfg)
        trainer = Trainer(cfg, resume=resume, dist_env=env)
        out = trainer.run()
        if env.is_main:
            print(
                f"done: {trainer.step} steps on {env.world_size} processes ({cfg.strategy}); model and metrics in {out}"
            )
        env.close(agree=True)  # every rank got here: wait for the others before tearing the connections down
    except GcfError as e:
        code = getattr(e, "exit_code", 2)
        err_dir = os.environ.get(ERROR_DIR_ENV)
        if err_dir:  # started by `launch`, which prints the lowest failing rank's message
            (Path(err_dir) / f"rank-{rank}").write_text(f"{code}\n{e}")
        elif rank == 0:
            print(f"error: {e}", file=sys.stderr)
    except RuntimeError as e:  # another rank died (killed, crashed): its own output says why
        if not peer_lost(e):
            raise
        print(
            f"error: process {rank} lost its connection to another process, which stopped first; that process's output says why.",
            file=sys.stderr,
        )
        code = 1
    finally:
        if env is not None:
            env.close()
    leave(code)


def leave(code: int) -> None:
    """End a rank process without the interpreter's finalization, its work written and its process group left:
    finalizing can abort it (gloo's threads may still hold a collective's tensors, whose release then needs a GIL that is
    going away: "terminate called without an active exception", SIGABRT, seen at the end of two-process runs)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def die_with_parent(expected: int | None = None) -> None:
    """Never outlive the launcher: the kernel sends SIGKILL to this process when its parent (torchrun's agent,
    inside `gcf run --nproc N`) dies, however it dies; a watchdog thread does the same where prctl is missing.

    `expected`: the launcher's pid. The parent may be gone before the line that asks the kernel: then this process is
    already someone else's child and ends at once."""
    parent = os.getppid()
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        if libc.prctl(1, signal.SIGKILL, 0, 0, 0) != 0:  # PR_SET_PDEATHSIG
            raise OSError(ctypes.get_errno(), "prctl")
    except (OSError, AttributeError):
        import threading
        import time

        def watch() -> None:
            while os.getppid() == parent:
                time.sleep(1.0)
            os.kill(os.getpid(), signal.SIGKILL)

        threading.Thread(target=watch, name="gcf-parent-watchdog", daemon=True).start()
    if expected is not None and os.getppid() != expected:  # the launcher died before the kernel was asked
        os._exit(128 + signal.SIGKILL)


def worker_main() -> None:
    """A process started by `launch`: tie its life to the launcher's first, then run `gcf` with its argv."""
    import runpy

    launcher = os.environ.get(LAUNCHER_ENV, "")
    die_with_parent(int(launcher) if launcher.isdigit() else None)
    # then exactly `python -m gcfamily`, run by name: this layer does not import the commands above it
    runpy.run_module("gcfamily", run_name="__main__", alter_sys=True)


PEER_LOST = ("Connection closed by peer", "Connection reset by peer", "Broken pipe")


def peer_lost(e: BaseException) -> bool:
    """Whether `e` is a collective failing because another process of the group is gone."""
    return isinstance(e, RuntimeError) and any(s in str(e) for s in PEER_LOST)


if __name__ == "__main__":  # `python -m gcfamily.run.launch`: a process of `gcf run --nproc N`
    worker_main()
