"""The package's layers: no import runs up, and no two modules import each other in a circle.

Bottom up (a module imports only from its own layer or below; every import counts, also inside functions and under
TYPE_CHECKING):

    errors                      the one error type
    config                      the shared settings, their coercion and ranges
    core                        tensors and plain arguments: engine, packing, families, precision, optimizer, oneDNN
    data                        rows in, ids and batches out
    rollout, models             sampling; loading models, LoRA
    rewards                     reward functions and their workers
    envs                        environments of multi-turn episodes and their worker
    tasks                       built-in tasks (their rewards are rewards)
    methods                     the Method API, Services, the registry, one module per family
    run                         the loop, the run folder, checkpoints, evaluation, distributed, logging
    commands                    cli, api, bench, check, theory, gcf data (inspect_data), the package face
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "gcfamily"

LAYERS: list[tuple[str, ...]] = [
    ("gcfamily.errors",),
    ("gcfamily.config",),
    ("gcfamily.core",),
    ("gcfamily.data",),
    ("gcfamily.rollout", "gcfamily.models"),
    ("gcfamily.rewards",),
    ("gcfamily.envs",),
    ("gcfamily.tasks",),
    ("gcfamily.methods",),
    ("gcfamily.run",),
    (
        "gcfamily",
        "gcfamily.__main__",
        "gcfamily.cli",
        "gcfamily.api",
        "gcfamily.bench",
        "gcfamily.check",
        "gcfamily.theory",
        "gcfamily.inspect_data",
    ),
]


def layer_of(module: str) -> int:
    """The layer of a module: that of the longest prefix in LAYERS (a package's modules share its layer)."""
    best, layer = -1, None
    for i, names in enumerate(LAYERS):
        for name in names:
            inside = module == name or (name != "gcfamily" and module.startswith(name + "."))  # the face is one module
            if inside and len(name) > best:
                best, layer = len(name), i
    if layer is None:
        raise KeyError(f"{module} is in no layer of tests/test_layers.py; add its package there")
    return layer


def modules(pkg: Path = PKG) -> dict[str, Path]:
    """Dotted name -> file of every module of the package."""
    out = {}
    for p in pkg.rglob("*.py"):
        name = ".".join(p.relative_to(pkg.parent).with_suffix("").parts)
        out[name.removesuffix(".__init__")] = p
    return out


def imports(mods: dict[str, Path]) -> dict[str, set[str]]:
    """module -> the gcfamily modules its text imports (anywhere: top, functions, TYPE_CHECKING blocks)."""
    edges: dict[str, set[str]] = {m: set() for m in mods}
    for m, p in mods.items():
        for node in ast.walk(ast.parse(p.read_text(encoding="utf-8"))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = m.split(".") if p.name == "__init__.py" else m.split(".")[:-1]
                    base = base[: len(base) - node.level + 1]
                    mod = ".".join(base + ([node.module] if node.module else []))
                else:
                    mod = node.module or ""
                targets = [f"{mod}.{a.name}" if f"{mod}.{a.name}" in mods else mod for a in node.names]
            for t in targets:
                while t and t not in mods:
                    t = t.rpartition(".")[0]
                if t and (t == "gcfamily" or t.startswith("gcfamily.")) and t != m:
                    edges[m].add(t)
    return edges


def upward(edges: dict[str, set[str]]) -> list[tuple[str, str]]:
    """(importer, imported) pairs where the imported module sits in a higher layer."""
    return sorted((a, b) for a, deps in edges.items() for b in deps if layer_of(b) > layer_of(a))


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Groups of two or more modules that import each other, directly or around a loop (Tarjan's components)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 10_000))
    try:
        for v in sorted(edges):
            if v not in index:
                visit(v)
    finally:
        sys.setrecursionlimit(limit)
    return out


def test_every_module_has_a_layer() -> None:
    for m in modules():
        layer_of(m)  # a KeyError names the module


def test_no_import_runs_up() -> None:
    bad = upward(imports(modules()))
    assert not bad, "imports from a lower layer to a higher one: " + "; ".join(f"{a} -> {b}" for a, b in bad)


def test_no_import_circle() -> None:
    found = circles(imports(modules()))
    assert not found, "import circles: " + "; ".join(" -> ".join(c) for c in found)


def test_few_top_level_modules() -> None:
    top = sorted(p.name for p in PKG.glob("*.py"))
    assert len(top) <= 8, (
        f"{len(top)} modules at the top of gcfamily/ ({', '.join(top)}); put new ones in a layer's folder"
    )


def test_the_checks_catch_a_planted_upward_import_and_circle(tmp_path: Path) -> None:
    # a copy of two layers where core imports methods (upward) and two methods import each other (a circle)
    pkg = tmp_path / "gcfamily"
    (pkg / "core").mkdir(parents=True)
    (pkg / "methods").mkdir()
    for f in ("__init__.py", "core/__init__.py", "methods/__init__.py"):
        (pkg / f).write_text("")
    (pkg / "core" / "engine.py").write_text("def f():\n    from gcfamily.methods import grpo\n")
    (pkg / "methods" / "grpo.py").write_text("from gcfamily.methods.ppo import x\n")
    (pkg / "methods" / "ppo.py").write_text("from gcfamily.methods import grpo\nx = 1\n")
    edges = imports(modules(pkg))
    assert upward(edges) == [("gcfamily.core.engine", "gcfamily.methods.grpo")]
    assert ["gcfamily.methods.grpo", "gcfamily.methods.ppo"] in circles(edges)


@pytest.mark.parametrize(
    "face",
    [
        "from gcfamily.config import Config",
        "from gcfamily.rollout import generate",
        "from gcfamily.methods.base import Method",
        "from gcfamily.errors import GcfError",
    ],
)
def test_public_names_import_from_their_faces(face: str) -> None:
    exec(face, {})
    import gcfamily

    assert callable(gcfamily.train)


def test_package_faces_only_re_export() -> None:
    """A package's __init__.py documents and re-exports (torchtune's faces): a docstring, imports, `__all__`; the top
    package's re-exports load lazily (PEP 562: its name table and a `__getattr__` that imports)."""
    lazy = {"__version__", "_EXPORTS"}
    impl = []
    for init in sorted(PKG.rglob("__init__.py")):
        for node in ast.parse(init.read_text()).body:
            doc = (
                isinstance(node, ast.Expr)
                and isinstance(node.value, ast.Constant)
                and isinstance(node.value.value, str)
            )
            names = isinstance(node, (ast.Assign, ast.AnnAssign)) and all(
                isinstance(t, ast.Name) and (t.id == "__all__" or (init.parent == PKG and t.id in lazy))
                for t in (node.targets if isinstance(node, ast.Assign) else [node.target])
            )
            getattr_ = init.parent == PKG and isinstance(node, ast.FunctionDef) and node.name == "__getattr__"
            if not (doc or names or getattr_ or isinstance(node, (ast.Import, ast.ImportFrom))):
                impl.append(f"{init.relative_to(ROOT)}:{node.lineno}")
    assert impl == []


def test_no_module_over_the_house_limit() -> None:
    """Files stay small (CONVENTIONS.md, house rule 4): past 400 lines a module is split by responsibility."""
    long = {str(p.relative_to(ROOT)): n for p in PKG.rglob("*.py") if (n := len(p.read_text().splitlines())) > 400}
    assert long == {}


def test_every_name_the_top_package_exports_resolves() -> None:
    import gcfamily

    for name in gcfamily.__all__:  # a module moved under a lazy export would only fail at a user's first use
        assert getattr(gcfamily, name) is not None, name
