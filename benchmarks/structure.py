"""The package's shape, measured: modules, top-level modules, import circles, upward imports (against the layer table
in tests/test_layers.py), calls between files in one GRPO step on the tiny model, the length of the loop, the largest
file and function, files past the house's 400 lines and package faces that implement.

    python benchmarks/structure.py

Calls between files are counted with sys.setprofile: every Python call whose caller and callee are functions of two
different files of gcfamily, during one `Trainer.run` of one GRPO step (setup and saving excluded: the step only).
"""

from __future__ import annotations

import collections
import inspect
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "gcfamily"
sys.path.insert(0, str(ROOT))


def _module(*names: str):  # noqa: ANN202
    """The first of these modules that imports (the layout before and after the layers change)."""
    import importlib

    for n in names:
        try:
            return importlib.import_module(n)
        except ImportError:
            continue
    raise ImportError(names)


def calls_in_one_grpo_step() -> tuple[int, int]:
    """(calls between files, files taking part) during the second of two GRPO steps on the tiny model: from the
    start of its data() to the metrics row it logs."""
    from gcfamily import api

    counts: collections.Counter = collections.Counter()
    files: set[str] = set()
    pkg = str(PKG)

    def prof(frame, event, arg):  # noqa: ANN001, ARG001
        if event != "call":
            return
        callee = frame.f_code.co_filename
        caller = frame.f_back.f_code.co_filename if frame.f_back else ""
        if callee.startswith(pkg) and caller.startswith(pkg) and callee != caller:
            counts[(caller, callee)] += 1
            files.update((caller, callee))

    onpolicy = _module("gcfamily.methods.onpolicy")
    logger = _module("gcfamily.run.logger")
    real_data, real_log = onpolicy.OnPolicy.data, logger.RunLogger.log

    def data(self, step, *a, **k):  # noqa: ANN001, ANN002, ANN003
        if step == 1:
            sys.setprofile(prof)
        return real_data(self, step, *a, **k)

    def log(self, step, metrics):  # noqa: ANN001
        if step == 2:
            sys.setprofile(None)
        return real_log(self, step, metrics)

    onpolicy.OnPolicy.data, logger.RunLogger.log = data, log
    try:
        with tempfile.TemporaryDirectory() as d:
            api.train(
                method="grpo",
                model="tiny",
                task="arithmetic",
                max_steps=2,
                batch_size=2,
                group_size=4,
                max_new_tokens=8,
                micro_batch_size=4,
                progress=False,
                report_to="none",
                output_dir=f"{d}/run",
                log_completions_every=0,
            )
    finally:
        sys.setprofile(None)
        onpolicy.OnPolicy.data, logger.RunLogger.log = real_data, real_log
    return sum(counts.values()), len(files)


def sizes() -> tuple[list[tuple[int, str]], tuple[int, str], list[str]]:
    """(files by length, longest first; the longest function or method and where; package faces that implement)."""
    import ast

    files, longest, faces = [], (0, ""), []
    for p in sorted(PKG.rglob("*.py")):
        text = p.read_text()
        rel = str(p.relative_to(ROOT))
        files.append((len(text.splitlines()), rel))
        tree = ast.parse(text)
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                longest = max(longest, (n, f"{rel}:{node.name}"))
        if p.name == "__init__.py" and p.parent != PKG:
            doc = (ast.Expr, ast.Import, ast.ImportFrom)
            names = (ast.Assign, ast.AnnAssign)
            if any(not isinstance(n, doc + names) for n in tree.body):
                faces.append(f"{rel} ({len(text.splitlines())} lines)")
    return sorted(files, reverse=True), longest, faces


def main() -> None:
    sys.path.insert(0, str(ROOT / "tests"))
    from test_layers import circles, imports, layer_of, modules  # the layer table and the walk live beside their test

    mods = modules()
    edges = imports(mods)
    top = sorted(p.name for p in PKG.glob("*.py"))
    up = [(a, b) for a, deps in edges.items() for b in deps if layer_of(b) > layer_of(a)]
    print(f"top-level modules: {len(top)} ({', '.join(top)})")
    print(f"folders: {', '.join(sorted(p.name for p in PKG.iterdir() if p.is_dir() and p.name != '__pycache__'))}")
    cs = circles(edges)
    print(f"import circles: {len(cs)}" + "".join(f"\n  {len(c)} modules: {' '.join(c)}" for c in cs))
    print(f"upward imports: {len(up)}" + "".join(f"\n  {a} -> {b}" for a, b in sorted(up)))
    n, f = calls_in_one_grpo_step()
    print(f"calls between files in one GRPO step: {n} across {f} files")
    src = inspect.getsource(_module("gcfamily.run.trainer").Trainer.run)
    print(f"Trainer.run: {len(src.splitlines())} lines")
    files, (fn_len, fn), faces = sizes()
    over = [f"{r} ({n})" for n, r in files if n > 400]
    print(
        f"modules: {len(files)}; largest file: {files[0][1]} ({files[0][0]} lines); largest function: {fn} ({fn_len} lines)"
    )
    print(f"files over 400 lines: {len(over)}" + "".join(f"\n  {x}" for x in over))
    print(f"package faces that implement: {len(faces)}" + "".join(f"\n  {x}" for x in faces))


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
