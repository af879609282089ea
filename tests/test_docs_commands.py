"""The docs say what runs: every command marked runnable in README.md and docs/*.md runs as written, every relative
link resolves, and the README stays a few screens long.

The convention for runnable commands (README.md and docs/*.md):

- A fenced block whose info string is `bash runnable` holds shell commands, one a line, with comments, blank lines
  and `\\` continuations; the block runs as one bash script under `set -e -o pipefail`, so the first command that
  fails fails the test. A block whose info string is `python runnable` is a Python script. Any other block (```bash,
  ```python, ```) is shown, never run.
- All runnable blocks of one file run in order in one fresh temporary folder, as a reader following the page would,
  so a later block may use what an earlier one wrote (`gcf eval --model runs/x` after `--output-dir runs/x`).
- That folder holds links to the repository's examples/, configs/, benchmarks/ and docs/: repository-relative paths
  (`examples/data/chat.jsonl`, `configs/...`) read the repository's files, and relative output paths
  (`--output-dir runs/...`, the default `runs/...`) land in the temporary folder. So a runnable command writes under
  a relative path, never into the repository or at an absolute path.
- `gcf` and `python` are the repository's .venv/bin ones (first on PATH); the hub is offline.
- One substitution, the only change made to the text: a real model alias, `--model smollm2-135m` or
  `--model qwen-0.5b` (also `--model=...` and, in Python, `model="..."`), runs as the tiny random model. Marking such a
  block runnable says the command shows the same on the tiny model; where only the real model's output makes the
  point, leave the block unmarked.
- Nothing else is added: a runnable command carries its own small budget (`--max-steps 2`, `--budget steps:2`) and
  should finish within about 20 s on the tiny model. Long jobs stay unmarked: `make run` (the default job on
  SmolLM2-135M) is not run here, nor the default `gcf bench`, nor the recipes of configs/.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README_MAX_LINES = 260
LINKED_FOLDERS = ("examples", "configs", "benchmarks", "docs")
REAL_MODELS = ("smollm2-135m", "qwen-0.5b")

FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})(?P<info>.*)$")
LINK = re.compile(r"!?\[[^\]]*\]\(\s*(?P<target><[^>]*>|[^)\s]+)(?:\s+\"[^\"]*\")?\s*\)")


def shown(doc: Path) -> str:
    """A file's name in messages: relative to the repository where it lies inside it."""
    return str(doc.relative_to(ROOT)) if doc.is_relative_to(ROOT) else str(doc)


def doc_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def fenced_blocks(text: str) -> list[tuple[int, str, str]]:
    """Every fenced block of a markdown text: (line number of its opening fence, info string, body with the fence's
    indentation removed). An unclosed fence runs to the end of the text."""
    blocks, lines, i = [], text.splitlines(), 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, fence, info, start = m["indent"], m["fence"], m["info"].strip(), i
        body, i = [], i + 1
        while i < len(lines):
            close = FENCE.match(lines[i])
            if (
                close
                and close["fence"][0] == fence[0]
                and len(close["fence"]) >= len(fence)
                and not close["info"].strip()
            ):
                break
            body.append(lines[i][len(indent) :] if lines[i].startswith(indent) else lines[i].lstrip())
            i += 1
        blocks.append((start + 1, info, "\n".join(body) + "\n"))
        i += 1
    return blocks


def runnable_blocks(text: str) -> list[tuple[int, str, str]]:
    """The blocks marked runnable: (line, language 'bash' or 'python', body)."""
    out = []
    for line, info, body in fenced_blocks(text):
        words = info.split()
        if len(words) >= 2 and words[1] == "runnable" and words[0] in ("bash", "python"):
            out.append((line, words[0], body))
    return out


def to_tiny(body: str) -> str:
    """The one substitution: a real model alias runs as the tiny model."""
    names = "|".join(re.escape(m) for m in REAL_MODELS)
    body = re.sub(rf"(--model[ =])({names})(?=\s|$)", r"\1tiny", body)
    return re.sub(rf"""(\bmodel\s*=\s*)(["'])({names})\2""", r"\1\2tiny\2", body)


def run_blocks(doc: Path, workdir: Path) -> None:
    """Run a file's runnable blocks in order in workdir; fail naming the block, with the tail of its output."""
    for name in LINKED_FOLDERS:
        (workdir / name).symlink_to(ROOT / name, target_is_directory=True)
    venv_bin = ROOT / ".venv" / "bin"
    bin_dir = venv_bin if venv_bin.is_dir() else Path(sys.executable).parent
    env = {
        **os.environ,
        "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}",
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
    }
    for n, (line, lang, body) in enumerate(runnable_blocks(doc.read_text())):
        script = workdir / f".block-{n}.{'sh' if lang == 'bash' else 'py'}"
        script.write_text(("set -e -o pipefail\n" if lang == "bash" else "") + to_tiny(body))
        cmd = ["bash", str(script)] if lang == "bash" else [str(bin_dir / "python"), str(script)]
        # a guard against a hang, not a speed check: the machine may be shared and slow
        p = subprocess.run(cmd, check=False, cwd=workdir, env=env, capture_output=True, text=True, timeout=1200)
        assert p.returncode == 0, (
            f"{shown(doc)}:{line}: the {lang} runnable block exited {p.returncode}:\n{body}\n"
            f"--- stdout (end)\n{p.stdout[-3000:]}\n--- stderr (end)\n{p.stderr[-3000:]}"
        )


def files_with_runnable_blocks() -> list[Path]:
    return [p for p in doc_files() if runnable_blocks(p.read_text())]


@pytest.mark.parametrize("doc", files_with_runnable_blocks(), ids=lambda p: str(p.relative_to(ROOT)))
def test_runnable_commands_run_as_written(doc: Path, tmp_path: Path):
    run_blocks(doc, tmp_path)


def test_readme_tour_is_marked_runnable():
    # the tour's commands are the ones a newcomer types first: each kind must be among the runnable blocks
    bodies = "".join(body for _, _, body in runnable_blocks((ROOT / "README.md").read_text()))
    for command in ("gcf data ", "gcf run ", "--reward ", "gcf.train(", "gcf bench ", "gcf check ", "gcf eval "):
        assert command in bodies, f"README.md: no runnable block holds `{command.strip()}`"
    assert "make run" not in bodies  # the default job takes minutes on SmolLM2: shown, not run here


def test_readme_is_a_few_screens():
    n = len((ROOT / "README.md").read_text().splitlines())
    assert n <= README_MAX_LINES, f"README.md has {n} lines (at most {README_MAX_LINES}): move detail into docs/"


def github_anchor_slugs(text: str) -> set[str]:
    """The anchors GitHub gives a markdown file's headings (lowercase, punctuation dropped, spaces to hyphens,
    -1, -2 ... for repeats); headings inside fenced blocks are not headings."""
    inside, seen, slugs = None, {}, set()
    for line in text.splitlines():
        m = FENCE.match(line)
        if m and (inside is None or (m["fence"][0] == inside and not m["info"].strip())):
            inside = m["fence"][0] if inside is None else None
            continue
        h = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if inside is None and h:
            slug = re.sub(r"[^\w\- ]", "", h[1].lower()).replace(" ", "-")
            k = seen.get(slug, 0)
            seen[slug] = k + 1
            slugs.add(slug if k == 0 else f"{slug}-{k}")
    return slugs


def relative_links(text: str) -> list[str]:
    """Link and image targets that point into the repository, outside fenced blocks and code spans."""
    kept, inside = [], None
    for line in text.splitlines():
        m = FENCE.match(line)
        if m and (inside is None or (m["fence"][0] == inside and not m["info"].strip())):
            inside = m["fence"][0] if inside is None else None
            continue
        if inside is None:
            kept.append(re.sub(r"`[^`]*`", "", line))
    targets = [m["target"].strip("<>") for m in LINK.finditer("\n".join(kept))]
    return [t for t in targets if not re.match(r"^[a-z][a-z0-9+.-]*:", t, re.IGNORECASE)]


def broken_links(doc: Path) -> list[str]:
    """The relative links of a markdown file that name no file, or a heading its target does not have."""
    broken = []
    for target in relative_links(doc.read_text()):
        path, _, anchor = target.partition("#")
        dest = doc if not path else (doc.parent / path).resolve()
        if not dest.exists():
            broken.append(f"{target} (no such file)")
        elif anchor and dest.suffix == ".md" and anchor.lower() not in github_anchor_slugs(dest.read_text()):
            broken.append(f"{target} (no heading with that anchor)")
    return broken


@pytest.mark.parametrize("doc", doc_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(doc: Path):
    broken = broken_links(doc)
    assert not broken, f"{shown(doc)}: broken links: {', '.join(broken)}"


def test_the_checks_catch_what_they_are_for(tmp_path: Path):
    # the parser, the substitution and the link check on a planted page: each must see what it is for
    page = (
        "# Title\n\nSee [a](missing.md), [b](ok.md#real-heading), [c](ok.md#no-such), `[d](not-a-link.md)`,\n"
        "[e](https://example.com/x.md) and ![f](pic.png).\n\n"
        "```bash runnable\ngcf run --model smollm2-135m \\\n    --max-steps 2\n```\n\n"
        "- item\n\n  ```python runnable\n  train(model='qwen-0.5b')\n  ```\n\n```bash\nnot run\n```\n"
        "```text\n# Not a heading\n[g](inside-a-fence.md)\n```\n"
    )
    blocks = runnable_blocks(page)
    assert [(lang, to_tiny(body)) for _, lang, body in blocks] == [
        ("bash", "gcf run --model tiny \\\n    --max-steps 2\n"),
        ("python", "train(model='tiny')\n"),
    ]
    (tmp_path / "ok.md").write_text("# Real heading\n\n```\n# Not a heading\n```\n")
    (tmp_path / "pic.png").write_bytes(b"")
    (tmp_path / "page.md").write_text(page)
    assert relative_links(page) == ["missing.md", "ok.md#real-heading", "ok.md#no-such", "pic.png"]
    assert broken_links(tmp_path / "page.md") == [
        "missing.md (no such file)",
        "ok.md#no-such (no heading with that anchor)",
    ]
    assert github_anchor_slugs("## `gcf bench`: the default suite\n## A\n## A\n") == {
        "gcf-bench-the-default-suite",
        "a",
        "a-1",
    }


def test_a_failing_block_fails_naming_it(tmp_path: Path):
    # the runner itself: repository files by relative path, the venv's gcf on PATH, outputs in the temporary folder,
    # and a block that fails ends the run with its file and line
    doc = tmp_path / "page.md"
    doc.write_text(
        "```bash runnable\ntest -f examples/data/chat.jsonl\ncommand -v gcf\nmkdir -p runs/x  # a comment\n```\n\n"
        "```bash runnable\ntest -d runs/x\nfalse\necho never\n```\n"
    )
    work = tmp_path / "work"
    work.mkdir()
    with pytest.raises(AssertionError, match=r"page.md:7: the bash runnable block exited 1") as e:
        run_blocks(doc, work)
    assert "never" not in str(e.value).split("--- stdout")[1]
    assert (work / "runs" / "x").is_dir() and not (ROOT / "runs" / "x").exists()


def test_usage_sample_summary_is_what_gcf_run_prints_now(gcf, tmp_path, monkeypatch):
    """docs/usage.md's sample run summary is the current format: the command it names, run here, prints the same lines
    (the seconds aside)."""
    text = (ROOT / "docs" / "usage.md").read_text()
    command = re.search(r"of `(gcf run [^`]+)`", text).group(1)
    sample = re.search(r"```\n(done: .*?)\n```", text, re.S).group(1)
    monkeypatch.chdir(tmp_path)
    code, out, err = gcf(*command.split()[1:], "--set", "progress=false")
    assert code == 0, err

    def seconds_aside(s: str) -> str:
        return re.sub(r"in [0-9.]+ s", "in N s", s.strip())

    assert seconds_aside(out) == seconds_aside(sample)


def test_no_doc_carries_an_absolute_path_of_a_machine():
    """README.md and every file under docs/ (pages, bench records) name paths relative to the repository or a run."""
    machine = re.compile(r"(?<![\w.])/(?:work|tmp|home|Users|root|mnt|scratch)/[\w.-]")
    found = []
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*"))]:
        if path.is_file() and path.suffix in (".md", ".json", ".txt", ".yaml"):
            for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
                if machine.search(line):
                    found.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()[:100]}")
    assert not found, "\n".join(found[:10])
