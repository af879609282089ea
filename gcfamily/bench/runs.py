"""The bench's runs: launching one child process to the end, and telling the bench's own runs (bench_spec.json) from what
it must not replace. gcfamily/bench/suite.py and gcfamily/bench/unified.py launch through these."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Optional

from gcfamily.errors import GcfError, Interrupted, install_stop_handlers


def launch(spec: dict[str, Any], folder: Path, env: dict[str, str]) -> dict[str, Any]:
    """Run one child to the end; returns its exit code, wall time and peak resident memory."""
    folder.mkdir(parents=True, exist_ok=True)
    spec_path = folder / "bench_spec.json"
    spec_path.write_text(json.dumps(spec, indent=2))
    t0 = time.perf_counter()
    received: list[int] = []
    with (folder / "bench.log").open("w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "gcfamily.bench.child", str(spec_path), str(os.getpid())],  # it dies with us
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
        )

        def forward(signum: int, _frame: Any) -> None:  # the child stops at a checkpoint; we wait for it
            received.append(signum)
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signum)

        restore = install_stop_handlers(forward)
        try:
            _, status, usage = os.wait4(proc.pid, 0)  # retried after each handler (PEP 475)
        finally:
            restore()
        proc.returncode = os.waitstatus_to_exitcode(status)
    if received:
        name = signal.Signals(received[0]).name
        raise Interrupted(
            f"Stopped by {name} while {folder.name} was running (its log: {folder / 'bench.log'}); "
            "the runs that finished are kept, and the same command runs the rest.",
            128 + received[0],
        )
    return {"returncode": proc.returncode, "wall_s": time.perf_counter() - t0, "max_rss_mb": usage.ru_maxrss / 1024}


def _setting_part(s: dict[str, Any]) -> dict[str, Any]:
    """A plan less where its run was written (output_dir, however the path was spelled: relative or absolute) and which
    run's start evaluation it copied: the run in a folder is the one asked about, and a copied start evaluation equals
    the computed one."""
    return {
        **{k: v for k, v in s.items() if k != "start_eval_from"},
        "settings": {k: v for k, v in s.get("settings", {}).items() if k != "output_dir"},
    }


def _bench_spec(folder: Path) -> Optional[dict[str, Any]]:
    """The plan the bench launched in `folder` (its bench_spec.json), {} when unreadable, None when the bench never did."""
    try:
        spec = json.loads((folder / "bench_spec.json").read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        return {}
    return spec if isinstance(spec, dict) else {}


def finished_run(folder: Path, spec: dict[str, Any]) -> Optional[dict[str, Any]]:
    """The launch record of a run in `folder` that finished with exactly this spec (_setting_part), else None."""
    old = _bench_spec(folder)
    try:
        proc = json.loads((folder / "bench_proc.json").read_text())
    except (OSError, ValueError):
        return None
    same = bool(old) and _setting_part(old) == _setting_part(json.loads(json.dumps(spec)))
    return proc if same and proc.get("returncode") == 0 and (folder / "bench_child.json").is_file() else None


def check_run_folder(folder: Path, spec: dict[str, Any], replace: bool = False) -> None:
    """Refuse, in one sentence, a folder where the run of `spec` would replace what the bench did not write there: a run
    of the user's, a model, or a bench run of other settings (the child runs with overwrite, which removes a run's and a
    model's files: gcfamily/run/folder/ownership.py RUN_FILES). The bench's own run of these settings, finished or not, passes;
    so does any folder with `replace` (--replace-runs)."""
    from gcfamily.run.folder.ownership import RUN_FILES, holds_run

    if folder.exists() and not folder.is_dir():
        raise GcfError(
            f"{folder} is a file, where the bench would write the run of {folder.name}; move it, or choose another --output-dir."
        )
    if replace or not folder.is_dir():
        return
    files = sorted(
        p.name
        for p in folder.iterdir()
        if p.name in RUN_FILES or (p.name.startswith("model-") and p.name.endswith(".safetensors"))
    )
    if not files:
        return  # nothing there that the run would remove
    fix = "pass --replace-runs to replace it, or choose another --output-dir"
    old = _bench_spec(folder)
    if old is None:
        what = "a run the bench did not start" if holds_run(folder) else "a model or files the bench did not write"
        raise GcfError(f"{folder} holds {what} ({', '.join(files[:4])}{', ...' if len(files) > 4 else ''}); {fix}.")
    if not old:
        raise GcfError(
            f"{folder} holds a run whose bench_spec.json cannot be read, so the bench cannot tell it for its own; {fix}."
        )

    def flat(s: dict[str, Any]) -> dict[str, Any]:
        part = _setting_part(s)
        return {**{k: v for k, v in part.items() if k != "settings"}, **part["settings"]}

    was, now = flat(old), flat(json.loads(json.dumps(spec)))
    changed = [
        f"{k}: {was.get(k)!r} -> {now.get(k)!r}" for k in sorted(set(was) | set(now)) if was.get(k) != now.get(k)
    ]
    if changed:
        raise GcfError(
            f"{folder} holds a bench run of other settings ({'; '.join(changed[:3])}{'; ...' if len(changed) > 3 else ''}); {fix}."
        )


def _load() -> str:
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:  # pragma: no cover
        return "?"
