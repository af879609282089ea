"""A resume: the settings it may change freely, the settings its checkpoint was written under compared with those
given, the logs past its step dropped, and the checkpoints of the branch it leaves set apart (named in the run's
record first, so that a kill mid-move is finished by the next start).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

from gcfamily.errors import GcfError
from gcfamily.run.folder.ownership import shown_names, write_record
from gcfamily.run.folder.writes import write_atomic

RESUMABLE = {
    "output_dir",
    "overwrite",
    "progress",
    "log_every",
    "report_to",
    "save_every",
    "keep_last",
    "eval_every",
    "eval_every_s",
    "eval_samples",
    "eval_at_ends",
    "log_completions_every",
    "reward_timeout",
    "device",
    "max_time",
    "max_tokens",
    "explicit",
    "allow_changed_settings",
    "dist_timeout",
    "trust_remote_code",
    "save_dtype",
    "merge_lora",
    "eval_dataset",
    "eval_split",
}
"""Settings a resume may change freely: where and how often to log, evaluate, save, and when to stop."""


def compare_settings(saved: dict[str, Any], now: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
    """{setting: (the run's, requested)} for settings that change the trajectory (max_steps only where the schedule depends on it)."""
    free = set(RESUMABLE)
    if now.get("lr_schedule") == "constant" and saved.get("lr_schedule") == "constant":
        free.add("max_steps")
    keys = (set(saved) | set(now)) - free - {"changes"}
    return {k: (saved.get(k), now.get(k)) for k in sorted(keys) if saved.get(k) != now.get(k)}


def settings_of(path: Path) -> dict[str, Any] | None:
    """The settings checkpoint `path` was written under: its own run_config.json, or for a checkpoint written before
    checkpoints recorded them, the run_config.json of its run folder (path is RUN/checkpoints/step-N); None if neither."""
    places = [path / "run_config.json"]
    if path.parent.name == "checkpoints":
        places.append(path.parent.parent / "run_config.json")
    for f in places:
        if f.is_file():
            try:
                saved = json.loads(f.read_text())
            except (OSError, ValueError, RecursionError) as e:
                raise GcfError(
                    f"{f} cannot be read ({e}); the settings of checkpoint {path} are unknown: restore the file, or "
                    "resume another checkpoint."
                ) from e
            return saved if isinstance(saved, dict) else None
    return None


def check_resume(
    path: Path, saved: dict[str, Any] | None, now: dict[str, Any], allow: bool, step: int | None
) -> dict[str, Any] | None:
    """Refuse a resume of checkpoint `path` whose settings differ from `saved` (those it was written under), unless
    allowed; the change record when allowed. A checkpoint with no record of its settings cannot be compared: refused
    unless allowed, and then every setting is taken as given."""
    run = path.parent.parent if path.parent.name == "checkpoints" else path
    if saved is None:
        if not allow:
            raise GcfError(
                f"--resume {path}: the checkpoint records no settings and {run} has no run_config.json, so a change of "
                "settings cannot be seen; pass --set allow_changed_settings=true to continue with the settings given now."
            )
        return {"step": step, "changed": {"settings": ["not recorded", "as given"]}}
    diffs = compare_settings(saved, now)
    if not diffs:
        return None
    shown = "; ".join(f"{k}: {a!r} -> {b!r}" for k, (a, b) in list(diffs.items())[:6]) + (
        "; ..." if len(diffs) > 6 else ""
    )
    if not allow:
        raise GcfError(
            f"--resume would continue run {run} with other settings ({shown}); run the same settings, "
            "or pass --set allow_changed_settings=true to change them on purpose (recorded in run_config.json)."
        )
    return {"step": step, "changed": {k: [a, b] for k, (a, b) in diffs.items()}}


def truncate_logs(out_dir: Path, step: int) -> None:
    """Drop metric and completion rows logged after `step` (a resume from step logs them again)."""
    for name in ("metrics.jsonl", "completions.jsonl", "eval_details.jsonl"):
        path = out_dir / name
        if not path.is_file():
            continue
        keep = []
        for line in path.read_bytes().splitlines():
            try:
                if int(json.loads(line).get("step", 0)) <= step:
                    keep.append(line.decode())
            except (ValueError, AttributeError, TypeError, RecursionError, OverflowError):
                continue  # a line cut by a kill mid-write, or not a row gcfamily wrote
        write_atomic(path, "".join(x + "\n" for x in keep), run_dir=out_dir)


def supersede(out_dir: Path, record: dict[str, Any], step: int) -> None:
    """A resume from `step` commits: the folder's checkpoints past it (an older branch) move to
    checkpoints/replaced-at-step-{step}/, named in the record first so that finish_pending completes a killed move."""
    root = out_dir / "checkpoints"
    names = sorted(p.name for p in root.glob("step-*") if p.name[5:].isdigit() and int(p.name[5:]) > step)
    if not names:
        return
    dest, n = f"replaced-at-step-{step}", 1
    while (root / dest).exists():
        n += 1
        dest = f"replaced-at-step-{step}-{n}"
    record["pending"] = {"dest": dest, "names": names}
    write_record(out_dir, record)
    finish_pending(out_dir, record)
    print(
        f"note: the checkpoints of {out_dir} past step {step} ({shown_names(names)}) belong to the branch this resume "
        f"leaves; they are kept in {root / dest}.",
        file=sys.stderr,
    )


def finish_pending(out_dir: Path, record: dict[str, Any]) -> None:
    """Complete a move of superseded checkpoints that the record names (supersede; or a start killed during it)."""
    pending = record.get("pending")
    if not isinstance(pending, dict):
        return
    root, dest = out_dir / "checkpoints", str(pending["dest"])  # both validated by read_record: inside the folder
    try:
        (root / dest).mkdir(parents=True, exist_ok=True)
        for name in pending.get("names") or []:
            if (root / name).exists():
                os.replace(root / name, root / dest / name)
    except OSError as e:
        raise GcfError(
            f"The checkpoints past the resumed step of {out_dir} cannot be set apart in {root / dest} "
            f"({e.strerror or e}); move them yourself, or resume into another --output-dir."
        ) from e
    record["pending"] = None
    write_record(out_dir, record)
