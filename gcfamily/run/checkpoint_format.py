"""The checkpoint format: how a resumable checkpoint folder is written, checked, found and read, atomically (a
temporary folder, a COMPLETE marker, a rename). What a run puts into one is gcfamily/run/saving.py's.

A checkpoint folder `step-N/` holds the model (safetensors), and in `state.pt` the optimizer,
scheduler, every RNG state, the step and the method's own state; `run_config.json` the settings
it was written under, which a resume compares with, into whatever folder it continues. `--resume` picks the newest
folder that has the marker, so a process killed mid-write never leaves a half checkpoint
that would be picked up. `manifest.json` records the size and sha256 of every file; `--resume`
checks it and falls back to the newest intact checkpoint when the newest is damaged (a file
truncated, missing or changed, or a manifest or state file that cannot be read), saying so.

A write either completes or leaves nothing: any failure (a full disk at the weights, the state, the manifest, the
marker or the rename) removes the temporary folder and ends in one sentence naming the last intact checkpoint; a
checkpoint of the same step already in place is swapped out by renames and put back if the swap fails.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from gcfamily.errors import GcfError
from gcfamily.run.folder.writes import os_error

MARKER = "COMPLETE"
MANIFEST = "manifest.json"
STATE_KEYS = ("step", "optimizer", "scheduler", "rng", "method")
"""What a run's state.pt holds at least (Saving.training_state)."""
SETTINGS = "run_config.json"  # the run's settings when the checkpoint was written (gcfamily/run/saving.py)


def rng_state(generator: torch.Generator | None = None) -> dict[str, Any]:
    """Every RNG the run draws from: python, numpy, torch (CPU and CUDA) and the sampler."""
    np_state = np.random.get_state()
    state = {
        "python": json.dumps(random.getstate()),
        "numpy": json.dumps([np_state[0], np_state[1].tolist(), *np_state[2:]]),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
    }
    if generator is not None:
        state["sampler"] = generator.get_state()
    return state


def set_rng_state(state: dict[str, Any], generator: torch.Generator | None = None) -> None:
    """Restore what rng_state returned."""
    py = json.loads(state["python"])
    random.setstate((py[0], tuple(py[1]), py[2]))
    npv = json.loads(state["numpy"])
    np.random.set_state((npv[0], np.array(npv[1], dtype=np.uint32), *npv[2:]))
    torch.set_rng_state(state["torch"])
    if state.get("cuda") and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    if generator is not None and "sampler" in state:
        generator.set_state(state["sampler"])


def _flat_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    # safetensors refuses shared storage (tied embeddings): keep the first name of each tensor
    seen: dict[int, str] = {}
    out = {}
    for k, v in model.state_dict().items():
        key = v.data_ptr()
        if key in seen and v.numel() > 0:
            continue
        seen[key] = k
        out[k] = v.detach().contiguous().cpu()
    return out


def save(
    root: Path,
    step: int,
    model: torch.nn.Module,
    state: dict[str, Any],
    keep_last: int = 2,
    keys: set[str] | None = None,
    extras: Callable[[Path], None] | None = None,
) -> Path:
    """Write checkpoint `root/step-{step}` atomically and prune to the newest keep_last.

    `keys` limits the weights written to those names (LoRA: the adapters; the frozen base is --model's).
    `extras(folder)` writes more files before the marker (config.json and the tokenizer, so that
    from_pretrained loads a full-weight checkpoint)."""
    weights = _flat_state(model)
    if keys is not None:
        weights = {k: v for k, v in weights.items() if k in keys}
    for k, v in weights.items():
        if v.is_floating_point() and not torch.isfinite(v).all():
            raise GcfError(
                f"Refusing to write a checkpoint with non-finite weights ({k}); the last good checkpoint is kept."
            )
    final = root / f"step-{step}"
    tmp = root / f".tmp-step-{step}-{os.getpid()}"
    prev = root / f".tmp-old-step-{step}-{os.getpid()}"
    try:  # every write, up to the rename: a full disk or a lost permission at any of them leaves the earlier checkpoints as they were
        root.mkdir(parents=True, exist_ok=True)
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir()
        save_file(weights, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        torch.save(state, tmp / "state.pt")
        if extras is not None:
            extras(tmp)
        _test_pause(step)
        (tmp / MANIFEST).write_text(json.dumps(_manifest(tmp), indent=1))
        (tmp / MARKER).write_text(str(step))
        _fsync_dir(tmp)
        if final.exists():  # the same step again (a resume from before it): swapped by renames, put back on failure
            os.replace(final, prev)
        try:
            os.replace(tmp, final)
        except BaseException:
            if prev.exists() and not final.exists():
                os.replace(prev, final)
            raise
    except BaseException as e:  # a full disk surfaces as OSError, RuntimeError (torch) or the Rust writers' own types
        shutil.rmtree(tmp, ignore_errors=True)
        cause = os_error(e) if isinstance(e, Exception) else None
        if cause is None:
            raise  # not a failed write (an interrupt, a mistake): the temporary folder is gone, the error shows as it is
        last = complete_checkpoints(root)
        kept = (
            f"the checkpoint of step {last[-1].name[5:]} is intact: free some disk space (or lower keep_last) and continue with --resume"
            if last
            else "no checkpoint of this run was saved, so its steps are lost: free some disk space and run it again"
        )
        raise GcfError(
            f"Could not write the checkpoint of step {step} under {root} ({_cause(e, cause)}); {kept}."
        ) from e
    shutil.rmtree(prev, ignore_errors=True)
    try:
        _fsync_dir(root)
    except OSError:  # the checkpoint is whole and named: a failed sync of the folder weakens only its durability
        pass
    for old in complete_checkpoints(root)[:-keep_last]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def _cause(e: BaseException, cause: OSError) -> str:
    text = str(e).strip().splitlines()[-1][:200] if str(e).strip() else ""
    return text or cause.strerror or type(e).__name__


def _test_pause(step: int) -> None:
    # test hook: hold the write open between the files and the marker so a test can SIGKILL it there;
    # "SECONDS" pauses every checkpoint's write, "SECONDS@N" only step N's (the others land at once, whatever the load)
    pause = os.environ.get("GCF_TEST_CHECKPOINT_PAUSE")
    if pause:
        import time

        seconds, _, only = pause.partition("@")
        if not only or int(only) == step:
            time.sleep(float(seconds))


def _fsync_dir(path: Path) -> None:
    for f in path.iterdir() if path.is_dir() else []:
        if f.is_file():
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def complete_checkpoints(root: Path) -> list[Path]:
    """Checkpoint folders that finished writing, oldest first."""
    if not root.is_dir():
        return []
    found = [p for p in root.glob("step-*") if (p / MARKER).is_file() and p.name[5:].isdigit()]
    return sorted(found, key=lambda p: int(p.name[5:]))


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def _manifest(folder: Path) -> dict[str, dict[str, Any]]:
    return {f.name: {"size": f.stat().st_size, "sha256": _sha256(f)} for f in sorted(folder.iterdir()) if f.is_file()}


def damage(path: Path) -> str | None:
    """Why a checkpoint folder cannot be trusted (a file missing, truncated, changed or unreadable, a manifest that is
    not one), or None when it is intact."""
    for name in ("model.safetensors", "state.pt"):
        if not (path / name).is_file():
            return f"{name} is missing"
    if not (path / MANIFEST).is_file():
        return None  # written before manifests existed: loading will tell
    try:
        files = json.loads((path / MANIFEST).read_text())
    except (OSError, ValueError, RecursionError) as e:
        return f"{MANIFEST} is unreadable ({getattr(e, 'strerror', None) or str(e)[:80] or type(e).__name__})"
    if not isinstance(files, dict) or not files:
        return f"{MANIFEST} holds {json.dumps(files)[:40]}, not the size and sha256 of each file"
    for name, want in files.items():
        if (
            not isinstance(want, dict)
            or not isinstance(want.get("size"), int)
            or not isinstance(want.get("sha256"), str)
        ):
            return f"{MANIFEST} records no size and sha256 for {name}"
        f = path / name
        try:
            if not f.is_file():
                return f"{name} is missing"
            if f.stat().st_size != want["size"]:
                return f"{name} has {f.stat().st_size} bytes, not the {want['size']} written"
            if _sha256(f) != want["sha256"]:
                return f"{name} changed since it was written"
        except OSError as e:
            return f"{name} cannot be read ({e.strerror or e})"
    return None


def find(resume: str, run_dir: Path) -> Path:
    """The checkpoint `--resume` means: the newest intact one in the run folder (saying which damaged ones it passed), or a given folder."""
    latest = resume in ("", "latest", "auto", "true", "True")
    p = run_dir if latest else Path(resume)
    if not latest and (p / MARKER).is_file():
        why = damage(p)
        if why:
            raise GcfError(
                f"Checkpoint {p} is damaged ({why}); resume from another checkpoint or from the run folder (the newest intact one is taken)."
            )
        return p
    found = complete_checkpoints(p / "checkpoints") or complete_checkpoints(p)
    if not found:
        if latest:
            raise GcfError(
                f"No complete checkpoint in {run_dir / 'checkpoints'} to resume from; start without --resume."
            )
        raise GcfError(
            f"--resume {resume} is not a checkpoint (no folder with a {MARKER} marker); pass a run folder or one of its checkpoints/step-N."
        )
    for path in reversed(found):
        why = damage(path)
        if why is None:
            return path
        print(f"warning: checkpoint {path} is damaged ({why}); trying the one before it.", file=sys.stderr)
    raise GcfError(f"Every checkpoint in {p / 'checkpoints'} is damaged; the run cannot be resumed: start it again.")


def load(path: Path, model: torch.nn.Module, keys: set[str] | None = None) -> dict[str, Any]:
    """Load weights into model and return the saved training state; `keys`: the checkpoint holds exactly those (LoRA)."""
    try:
        weights = load_file(str(path / "model.safetensors"))
    except Exception as e:  # safetensors raises its own error types for a truncated or foreign file
        raise GcfError(
            f"Checkpoint {path} has an unreadable model.safetensors ({str(e).splitlines()[0][:160]}); resume from an earlier checkpoint."
        ) from e
    try:
        missing, unexpected = model.load_state_dict(weights, strict=False)
    except RuntimeError as e:  # shapes that differ: a checkpoint of another architecture or size
        first = str(e).strip().splitlines()
        raise GcfError(
            f"Checkpoint {path} does not fit this model ({(first[1] if len(first) > 1 else first[0]).strip()[:240]}); "
            "resume with the --model and settings the run started with."
        ) from e
    if keys is not None:
        missing = [k for k in keys if k not in weights]
    own = model.state_dict()  # a name of the checkpoint the model lacks (a LoRA-wrapped model's) ties nothing
    tied = {
        k for k in missing if k in own and any(w in own and own[k].data_ptr() == own[w].data_ptr() for w in weights)
    }
    if unexpected or set(missing) - tied:
        raise GcfError(
            f"Checkpoint {path} does not match the model (missing {sorted(set(missing) - tied)[:3]}, unexpected "
            f"{unexpected[:3]}); resume with the --model and lora_r the run started with."
        )
    try:
        state = torch.load(path / "state.pt", weights_only=True, map_location="cpu")
    except Exception as e:  # truncated zip, foreign pickle (weights_only refuses it without running it), no permission
        first = str(e).splitlines()[0][:160] if str(e) else type(e).__name__
        raise GcfError(
            f"Checkpoint {path} has an unreadable state.pt ({first}); resume from an earlier checkpoint."
        ) from e
    missing = [k for k in STATE_KEYS if not isinstance(state, dict) or k not in state]
    if missing:
        what = f"no {', '.join(missing[:3])}" if isinstance(state, dict) else f"a {type(state).__name__}"
        raise GcfError(
            f"Checkpoint {path} has a state.pt that holds {what}, not a run's training state; resume from an earlier checkpoint."
        )
    return state
