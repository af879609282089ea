"""The run folder as a transaction: one owner at a time, never two runs mixed, resume means the same run, and a start
that fails leaves the folder as it was.

- The lock (`.gcf.lock`, gcfamily/run/lock.py) is taken before anything is written: one owner at a time.
- The run's record (`.gcf-run.json`) lists the top-level names the run owns: every gcfamily run name (RUN_FILES,
  model-*.safetensors shards, .tmp-* leftovers) that nothing held when a start claimed it, written before the run
  writes anything. A name claimed stays the run's (a file the user puts there later counts as the run's). --overwrite
  removes exactly the owned entries (and the record), nothing else; a folder with no record is a run only when it holds
  a run_config.json that gcfamily wrote (a dict naming a `method`), written before records existed: its owned entries
  are the gcfamily run names present. A folder whose entries bear gcfamily's names but were not written by a run (a
  user's own `checkpoints/` or `vocab.json`) is refused, with or without --overwrite, and so is the current directory
  (an explicit --output-dir, please). A folder of other files and no run is refused without --overwrite; with it the
  run writes beside them and removes none (`gcf bench` writes its spec and log into a run's folder before the run
  starts with --overwrite). User files beside a run's are never removed.
- A folder that holds another run is refused unless --overwrite or --resume. --overwrite sets the owned entries aside
  in `.gcf-replaced/` while the start runs its checks, and removes them only once every check has passed; a set-aside
  run that a killed start left is put back by the next start. A --model inside an entry of the run (its checkpoints)
  is refused before anything moves; so is the folder that is the --model itself.
- The record also lists the run's segments: where each start began (step, and the checkpoint it resumed). A resume
  from step b supersedes the folder's checkpoints past b (an older branch): at commit they move to
  `checkpoints/replaced-at-step-b/` (named in the record first, so a kill mid-move is finished by the next start), so
  `--resume` (latest) continues the newest segment and never an older branch. A resume of a checkpoint from outside
  the folder's checkpoints/ into a folder that holds a run is refused (two runs would mix).
- A resume compares the requested settings with those the checkpoint was written under (recorded in the checkpoint;
  for an older checkpoint, its run folder's run_config.json), wherever the run continues: a setting that changes the
  trajectory may differ only with allow_changed_settings=true, which records the change; metrics and completions
  logged after the resumed step are dropped (they are about to be logged again), and half-written checkpoint folders
  are removed.
- Before training the folder must be writable and hold room for a checkpoint.
- Until the start commits (RunFolder.commit) nothing already in the folder is changed or removed, only set aside (the
  record excepted: its old bytes are kept and written back); a start that fails removes what it wrote (`snapshot`,
  `remove_new`) and puts back what it set aside, so the folder is byte for byte as it was, and a folder it made is
  removed.
"""

from __future__ import annotations

import errno
import fnmatch
import json
import os
import shutil
import sys
from pathlib import Path
from typing import Any

from gcfamily.errors import GcfError
from gcfamily.run.lock import LOCK
from gcfamily.run.writes import WriteFailed, write_atomic

ASIDE = ".gcf-replaced"
"""Where --overwrite keeps the previous run's files until the start commits."""
RECORD = ".gcf-run.json"
"""The run's record: the names it owns, its segments."""
RUN_FILES = (
    "run_config.json",
    "metrics.jsonl",
    "completions.jsonl",
    "eval_details.jsonl",
    "tensorboard",
    "wandb",
    "checkpoints",
    "README.md",
    "curves.png",
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "model.safetensors.index.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "added_tokens.json",
    "adapter_config.json",
    "adapter_model.safetensors",
    "adapter",
    "reward_model.json",
    "value_head.safetensors",
    "pools",
)
"""What a gcfamily run writes (with model-*.safetensors shards and .tmp-* leftovers): the names a start claims."""
CLAIMS = (*RUN_FILES, "model-*.safetensors", ".tmp-*")

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


# --------------------------------------------------------------------------- what a folder holds, and whose it is


def _internal(name: str) -> bool:
    """gcfamily's own bookkeeping beside a run (the lock and its temporary links, the record, the set-aside run, a
    write probe): never a user's file, never a run's output."""
    return name.startswith(".gcf")


def read_record(out_dir: Path) -> dict[str, Any] | None:
    """The run's record (module docstring), or None when the folder has none; one sentence when it cannot be read."""
    path = out_dir / RECORD
    if not path.is_file():
        return None
    try:
        record = json.loads(path.read_text())
        ok = isinstance(record, dict) and isinstance(record.get("owns"), list)
        ok = ok and all(isinstance(n, str) for n in record["owns"]) and isinstance(record.get("segments", []), list)
    except (OSError, ValueError, RecursionError) as e:
        record, ok = None, False
        why = str(e)[:80] or type(e).__name__
    else:
        why = "not a record of owned names and segments"
    if not ok:
        raise GcfError(
            f"The run record {path} cannot be read ({why}), so what the run in {out_dir} owns is unknown; restore it, "
            f"or choose another --output-dir."
        )
    return record


def _legacy_run(out_dir: Path) -> bool:
    """A run written before records existed: its run_config.json is one gcfamily wrote (a dict naming a method)."""
    try:
        saved = json.loads((out_dir / "run_config.json").read_text())
    except (OSError, ValueError, RecursionError):
        return False
    return isinstance(saved, dict) and "method" in saved


def owned_names(out_dir: Path, record: dict[str, Any] | None) -> list[str]:
    """The names (and patterns) the folder's run owns: its record's, or a run of before records, the gcfamily run names
    present; none for a folder that holds no run."""
    if record is not None:
        return list(record["owns"])
    if _legacy_run(out_dir):
        return list(CLAIMS)
    return []


def _matches(name: str, owns: list[str]) -> bool:
    return any(fnmatch.fnmatchcase(name, pattern) for pattern in owns)


def owned_entries(out_dir: Path, record: dict[str, Any] | None = None) -> list[str]:
    """The folder's top-level entries that its run owns (what --overwrite removes), sorted."""
    if not out_dir.is_dir():
        return []
    if record is None:
        record = read_record(out_dir)
    owns = owned_names(out_dir, record)
    return sorted(p.name for p in out_dir.iterdir() if not _internal(p.name) and _matches(p.name, owns))


def holds_run(out_dir: Path) -> bool:
    """A run's files are in the folder, or set aside by an --overwrite start that never committed."""
    return bool(owned_entries(out_dir)) or (out_dir / ASIDE).is_dir()


def is_run_file(name: str) -> bool:
    """A gcfamily run name (RUN_FILES, model-*.safetensors shards, .tmp-* leftovers)."""
    return _matches(name, list(CLAIMS))


def same_folder(a: str | Path, b: str | Path) -> bool:
    try:
        return Path(a).expanduser().resolve() == Path(b).expanduser().resolve()
    except OSError:
        return False


def check_target(out_dir: Path, model: str, resume: str | None = None, overwrite: bool = False) -> None:
    """Refuse, before the lock, a folder no run may write: the current directory, the --model itself, a file; and a run
    set aside by an --overwrite start (killed, or still running its checks) unless --overwrite or --resume: it counts
    as the run it is."""
    if not str(out_dir).strip() or same_folder(out_dir, os.getcwd()):
        raise GcfError(
            f"--output-dir {str(out_dir)!r} is the current directory, where a run would write among your own files; "
            "give the run a folder of its own (e.g. --output-dir runs/my-run)."
        )
    if Path(model).expanduser().is_dir() and same_folder(out_dir, model):
        raise GcfError(
            f"Output folder {out_dir} is the model being trained (--model {model}); writing there would replace the weights it starts from: "
            "choose another --output-dir."
        )
    if out_dir.exists() and not out_dir.is_dir():
        raise GcfError(f"Output folder {out_dir} is a file; choose a folder for --output-dir.")
    if (out_dir / ASIDE).is_dir() and resume is None and not overwrite:
        raise GcfError(
            f"Output folder {out_dir} holds another run; pass --overwrite to replace it, --resume to continue it, or another --output-dir."
        )


def _inside(path: Path, folder: Path) -> str | None:
    """The top-level entry of `folder` that holds `path`, or None when path is not inside folder."""
    try:
        rel = path.expanduser().resolve().relative_to(folder.resolve())
    except (OSError, ValueError):
        return None
    return rel.parts[0] if rel.parts else None


def check_contents(
    out_dir: Path, model: str, resume: str | None, overwrite: bool, record: dict[str, Any] | None
) -> None:
    """Refuse, holding the lock and before anything moves, a folder that would lose or mix work (module docstring)."""
    owns = owned_names(out_dir, record)
    entries = [p.name for p in sorted(out_dir.iterdir()) if not _internal(p.name)]
    live = [n for n in entries if _matches(n, owns)]
    foreign = [n for n in entries if not _matches(n, owns)]
    clash = [n for n in foreign if is_run_file(n)]
    if clash:
        raise GcfError(
            f"Output folder {out_dir} holds {_shown(clash)}, which bear the names of a gcfamily run's files but no run of "
            "this folder wrote them; a run would write over them: move them, or choose another --output-dir."
        )
    top = _inside(Path(model), out_dir) if Path(model).expanduser().exists() else None
    if top is not None and (_matches(top, owns) or is_run_file(top)):
        raise GcfError(
            f"--model {model} lies inside {out_dir / top}, which the run in {out_dir} owns and may replace or remove; "
            "copy the model elsewhere first, or choose another --output-dir."
        )
    latest = resume in ("", "latest", "auto", "true", "True")
    if resume is not None and not latest and live:
        path = Path(resume)
        mine = (out_dir / "checkpoints").resolve()
        if not (same_folder(path, out_dir) or (path.parent.resolve() == mine and path.name.startswith("step-"))):
            raise GcfError(
                f"--resume {resume} is not a checkpoint of the run in {out_dir} (its checkpoints/step-N), and resuming it "
                "there would mix two runs; resume it into another --output-dir."
            )
    if resume is not None:
        return
    if live and not overwrite:
        raise GcfError(
            f"Output folder {out_dir} holds another run; pass --overwrite to replace it, --resume to continue it, or another --output-dir."
        )
    if foreign and record is None and not live and not overwrite:
        what = "a model" if "config.json" in foreign else "files"
        raise GcfError(
            f"Output folder {out_dir} holds {what} ({_shown(foreign)}) but no gcfamily run; pass --overwrite to write "
            "the run beside them (it removes only what a run wrote, none of these), or another --output-dir."
        )


def _shown(names: list[str]) -> str:
    return ", ".join(names[:4]) + (", ..." if len(names) > 4 else "")


def claim(out_dir: Path, record: dict[str, Any] | None, keep: bool) -> dict[str, Any]:
    """The record this start writes before anything else: the names the run owns now (`keep`: those it owned; after
    check_contents, every gcfamily run name is free or owned) and, `keep`, its segments so far."""
    owns = set(owned_names(out_dir, record)) if keep else set()
    return {
        "owns": sorted(owns | set(CLAIMS)),
        "segments": list((record or {}).get("segments") or []) if keep else [],
        "pending": (record or {}).get("pending") if keep else None,
    }


def write_record(out_dir: Path, record: dict[str, Any]) -> None:
    write_atomic(out_dir / RECORD, json.dumps(record, indent=1), run_dir=out_dir)


def set_aside(out_dir: Path, names: list[str] | None = None) -> list[str]:
    """--overwrite, before the checks: move the entries the folder's run owns (`names`, by default owned_entries) and
    its record into ASIDE; the names moved. A rename in the same folder: nothing is copied or lost."""
    aside = out_dir / ASIDE
    names = owned_entries(out_dir) if names is None else names
    moved = names + ([RECORD] if (out_dir / RECORD).is_file() else [])
    if moved:
        aside.mkdir()
        for name in moved:
            os.replace(out_dir / name, aside / name)
    return names


def put_back(out_dir: Path) -> list[str]:
    """Undo set_aside: each set-aside entry back in its place (over whatever a failed start wrote there); the names."""
    aside = out_dir / ASIDE
    if not aside.is_dir():
        return []
    names = sorted(p.name for p in aside.iterdir())
    for name in names:
        _remove(out_dir / name)
        os.replace(aside / name, out_dir / name)
    aside.rmdir()
    return [n for n in names if n != RECORD]


def drop_aside(out_dir: Path) -> None:
    """The start committed: the set-aside run goes for good."""
    shutil.rmtree(out_dir / ASIDE, ignore_errors=True)


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
        f"note: the checkpoints of {out_dir} past step {step} ({_shown(names)}) belong to the branch this resume "
        f"leaves; they are kept in {root / dest}.",
        file=sys.stderr,
    )


def finish_pending(out_dir: Path, record: dict[str, Any]) -> None:
    """Complete a move of superseded checkpoints that the record names (supersede; or a start killed during it)."""
    pending = record.get("pending")
    if not isinstance(pending, dict):
        return
    root = out_dir / "checkpoints"
    (root / str(pending["dest"])).mkdir(parents=True, exist_ok=True)
    for name in pending.get("names") or []:
        if (root / name).exists():
            os.replace(root / name, root / str(pending["dest"]) / name)
    record["pending"] = None
    write_record(out_dir, record)


def size_of(path: Path) -> int:
    """Bytes of the files under `path` (what removing it frees)."""
    if not path.exists():
        return 0
    files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file() and not p.is_symlink()]
    return sum(p.stat().st_size for p in files)


def _paths(out_dir: Path) -> list[Path]:
    """The folder's entries, and everything inside those that a run writes (its checkpoints, logs, pools): a start
    writes nowhere else, and a folder of the user's is not walked."""
    out = []
    for p in sorted(out_dir.iterdir()):
        out.append(p)
        if is_run_file(p.name) and p.is_dir() and not p.is_symlink():
            out += sorted(p.rglob("*"))
    return out


def snapshot(out_dir: Path) -> set[str]:
    """The paths a start could add to (`_paths`, relative), taken before it writes anything."""
    return {str(p.relative_to(out_dir)) for p in _paths(out_dir)}


def remove_new(out_dir: Path, before: set[str]) -> None:
    """A failed start: remove every path it added (not in `before`), except the lock and ASIDE, which put_back empties."""
    for p in _paths(out_dir):  # a folder before what is in it
        rel = p.relative_to(out_dir)
        if rel.parts[0].startswith((ASIDE, LOCK)) or str(rel) in before or not (p.exists() or p.is_symlink()):
            continue  # (a path inside a new folder went with it)
        _remove(p)


def _remove(p: Path) -> None:
    if p.is_dir() and not p.is_symlink():
        shutil.rmtree(p)
    elif p.exists() or p.is_symlink():
        p.unlink()


def check_writable(out_dir: Path, need_bytes: int, reclaim: int = 0) -> None:
    """The folder takes a file, and its disk has room for one checkpoint (need_bytes, estimated by the caller; `reclaim`
    bytes are freed before the first checkpoint: a run that --overwrite set aside)."""
    probe = out_dir / f".gcf-write-test-{os.getpid()}"
    try:
        probe.write_bytes(b"ok")
        probe.unlink()
    except OSError as e:
        try:
            probe.unlink()
        except OSError:
            pass
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            raise WriteFailed(probe, e, run_dir=out_dir, what=f"into {out_dir}") from None
        raise GcfError(
            f"Output folder {out_dir} is not writable ({e.strerror or e}); choose another --output-dir or fix its permissions."
        ) from e
    free = shutil.disk_usage(out_dir).free + reclaim
    if free < need_bytes:
        raise GcfError(
            f"The disk of {out_dir} has {free / 2**20:,.0f} MB free, less than one checkpoint needs (about {need_bytes / 2**20:,.0f} MB); "
            "free some space or choose another --output-dir."
        )


def clean_partial_checkpoints(out_dir: Path) -> None:
    """Remove checkpoint folders that a killed or failed write left half-done (.tmp-step-*); a whole one it had swapped
    out (.tmp-old-step-N-*) goes back to step-N when that is missing."""
    root = out_dir / "checkpoints"
    if root.is_dir():
        for p in root.glob(".tmp-old-step-*"):  # a checkpoint swapped out for a rewrite of its step, killed midway
            final = root / ("step-" + p.name.split("-")[3])
            if (p / "COMPLETE").is_file() and not final.exists():
                os.replace(p, final)
        for p in root.glob(".tmp-*"):
            shutil.rmtree(p, ignore_errors=True)


# --------------------------------------------------------------------------- resume


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


def say(note: str | None) -> None:
    if note:
        print(note, file=sys.stderr)
