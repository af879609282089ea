"""The one door between a method and the run: every implementation of Services has each of its members, with the
Protocol's parameters, and no method reads anything of the run but through it."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest
import torch

from gcfamily.check.world import StubServices, World
from gcfamily.config import Config
from gcfamily.methods.services import LocalServices, Services
from gcfamily.run.services import RunServices
from gcfamily.theory.bandit import BanditProblem
from gcfamily.theory.train import BanditRunner

METHODS_DIR = Path(__file__).resolve().parents[1] / "gcfamily" / "methods"


def _members() -> tuple[set[str], dict[str, inspect.Signature]]:
    attrs = set(Services.__annotations__)
    funcs = {n: inspect.signature(f) for n, f in vars(Services).items() if callable(f) and not n.startswith("_")}
    return attrs, funcs


def _params(sig: inspect.Signature) -> list[str]:
    return [p for p in sig.parameters if p != "self"]


@pytest.mark.parametrize("impl", [RunServices, StubServices, BanditRunner, LocalServices], ids=lambda c: c.__name__)
def test_every_implementation_has_the_protocols_members(impl: type) -> None:
    attrs, funcs = _members()
    assert attrs and funcs  # the Protocol is read, not empty
    for name in attrs:
        assert hasattr(impl, name), f"{impl.__name__} lacks the attribute {name}"
    for name, sig in funcs.items():
        if impl is LocalServices and name in ("policy", "reference", "logprobs", "generate"):
            continue  # the shared base: each implementation writes these
        got = getattr(impl, name, None)
        assert callable(got), f"{impl.__name__} lacks {name}()"
        assert _params(inspect.signature(got)) == _params(sig), (
            f"{impl.__name__}.{name} takes {_params(inspect.signature(got))}, not {_params(sig)}"
        )


def test_the_stand_ins_are_services_at_run_time() -> None:
    world = World(4, torch.Generator().manual_seed(0))
    stub = StubServices(Config(method="grpo"), world, 1.0)
    problem = BanditProblem.binary([0.3, 0.6])
    assert isinstance(stub, Services)
    assert stub.all_sum(torch.tensor([2.0])).item() == 2.0 and stub.world_size == 1 and not stub.stop_requested()
    runner = BanditRunner(Config(method="grpo"), problem.policy(), problem)
    assert isinstance(runner, Services) and runner.policy() is runner.bandit


def test_no_method_reads_the_trainer() -> None:
    # a method's module never names the trainer, never imports the run, never guards against a stand-in with hasattr/getattr
    for path in sorted(METHODS_DIR.glob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr == "trainer":
                pytest.fail(f"{path.name}:{node.lineno} reads .trainer")
            if isinstance(node, ast.Name) and node.id == "trainer":
                pytest.fail(f"{path.name}:{node.lineno} names trainer")
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                mods = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
                assert not any(m.startswith("gcfamily.run") for m in mods), f"{path.name}:{node.lineno} imports the run"
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id in ("hasattr", "getattr")
                and node.args
            ):
                first = node.args[0]
                name = first.attr if isinstance(first, ast.Attribute) else getattr(first, "id", "")
                assert name not in ("services", "trainer", "tr"), (
                    f"{path.name}:{node.lineno} guards the door with {node.func.id}"
                )
