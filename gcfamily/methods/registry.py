"""The method table and the one resolver of a `--method` spec.

A spec is one of

    grpo                     a name in METHODS below (the built-in methods)
    my-rule                  a name an installed package registers in the entry-point group
                             "gcfamily.methods" (my-rule = "my_package.rules:MyRule")
    my_package.rules:MyRule  an importable module and a Method subclass in it
    path/to/rules.py:MyRule  a Python file and a Method subclass in it

Every command resolves it with `get_method`, and every way it can fail is one GcfError sentence.
A file is imported under a module name made from its resolved path, `_gcf_file_<stem>_<hash>`,
and registered in sys.modules: two files both called rules.py do not collide, the class pickles,
and a torchrun worker (started with the same command line, in the same folder) gets the same name.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import importlib.util
import re
import sys
import traceback
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any, Optional

from gcfamily.config import Config, own_setting_names, read, resolve_settings
from gcfamily.errors import GcfError

if TYPE_CHECKING:
    from gcfamily.methods.base import Method

# name -> "module:Class"; a new built-in method adds one line here
METHODS: dict[str, str] = {
    "sft": "gcfamily.methods.sft:SFT",
    "dpo": "gcfamily.methods.dpo:DPO",
    "ipo": "gcfamily.methods.dpo:IPO",
    "cdpo": "gcfamily.methods.dpo:ConservativeDPO",
    "simpo": "gcfamily.methods.dpo:SimPO",
    "hinge": "gcfamily.methods.pair_losses:Hinge",
    "robust-dpo": "gcfamily.methods.pair_losses:RobustDPO",
    "exo-pair": "gcfamily.methods.pair_losses:EXOPair",
    "discopop": "gcfamily.methods.pair_losses:DiscoPOP",
    "nca-pair": "gcfamily.methods.pair_losses:NCAPair",
    "bco-pair": "gcfamily.methods.pair_losses:BCOPair",
    "sppo-hard": "gcfamily.methods.pair_losses:SPPOHard",
    "apo-zero": "gcfamily.methods.pair_losses:APOZero",
    "apo-down": "gcfamily.methods.pair_losses:APODown",
    "sigmoid-norm": "gcfamily.methods.pair_losses:SigmoidNorm",
    "ipo-norm": "gcfamily.methods.pair_losses:IPONorm",
    "rft": "gcfamily.methods.rft:RFT",
    "rft-offline": "gcfamily.methods.rft:OfflineRFT",
    "grpo": "gcfamily.methods.grpo:GRPO",
    "grpo-ps": "gcfamily.methods.grpo_ps:GRPOProcess",
    "rloo": "gcfamily.methods.grpo_variants:RLOO",
    "grpo-passk": "gcfamily.methods.group_estimators:GRPOPassK",
    "opo": "gcfamily.methods.group_estimators:OPO",
    "reinforce-pp": "gcfamily.methods.group_estimators:ReinforcePP",
    "reinforce-pp-baseline": "gcfamily.methods.group_estimators:ReinforcePPBaseline",
    "dr-grpo": "gcfamily.methods.grpo_variants:DrGRPO",
    "dapo": "gcfamily.methods.grpo_variants:DAPO",
    "ppo": "gcfamily.methods.ppo:PPO",
    "gspo": "gcfamily.methods.gspo:GSPO",
    "cispo": "gcfamily.methods.cispo:CISPO",
    "gpg": "gcfamily.methods.gpg:GPG",
    "gmpo": "gcfamily.methods.gmpo:GMPO",
    "sapo": "gcfamily.methods.sapo:SAPO",
    "vespo": "gcfamily.methods.vespo:VESPO",
    "reinforce-baseline": "gcfamily.methods.reinforce:ReinforceBaseline",
    "online-dpo": "gcfamily.methods.online_dpo:OnlineDPO",
    "kto": "gcfamily.methods.kto:KTO",
    "orpo": "gcfamily.methods.orpo:ORPO",
    "reward-model": "gcfamily.methods.reward_model:RewardModelTraining",
    "grpo-shift": "gcfamily.methods.theory_variants:GRPOShift",
    "grpo-direct-kl": "gcfamily.methods.theory_variants:GRPODirectKL",
    "grpo-shift-direct-kl": "gcfamily.methods.theory_variants:GRPOShiftDirectKL",
}
ENTRY_POINT_GROUP = "gcfamily.methods"
SPEC_FORMS = "a name from `gcf methods`, module:Class or path/to/file.py:Class"


def get_method(spec: str) -> type["Method"]:
    """The Method subclass that `spec` names (see the module docstring for the four forms)."""
    if spec in METHODS:  # ours: an error in importing it is a bug, and keeps its traceback
        module, cls = METHODS[spec].split(":")
        return getattr(importlib.import_module(module), cls)
    installed = installed_methods()
    if spec in installed:
        target, dist = installed[spec]
        return _load(target, f"'{spec}' (entry point {target} of the package {dist})")
    if ":" in spec:
        return _load(spec, f"'{spec}'")
    names = ", ".join([*METHODS, *(n for n in installed if n not in METHODS)])
    raise GcfError(f"Unknown method '{spec}'; choose one of: {names}; or pass module:Class or path/to/file.py:Class.")


def installed_methods() -> dict[str, tuple[str, str]]:
    """name -> ("module:Class", distribution) for every entry point in the group gcfamily.methods.

    A built-in name wins over an entry point of the same name.
    """
    from importlib.metadata import entry_points

    found: dict[str, tuple[str, str]] = {}
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        found.setdefault(ep.name, (ep.value, ep.dist.name if ep.dist is not None else "unknown"))
    return found


def all_methods() -> dict[str, type["Method"]]:
    """Every built-in and installed method class, by name (an installed one that fails raises GcfError)."""
    return {name: get_method(name) for name in [*METHODS, *installed_methods()]}


def method_label(spec: str) -> str:
    """A short name for folders and tables: the registered name, else the class's `name` (or its class name)."""
    if spec in METHODS or spec in installed_methods():
        return spec
    cls = get_method(spec)
    return cls.name or cls.__name__.lower()


def setting_names(method: Any) -> set[str]:
    """Every key `--set` takes for a method (a spec or a class): the shared settings and its own."""
    return own_setting_names(get_method(method) if isinstance(method, str) else method)


def resolve(config_path: Optional[str], overrides: dict[str, Any]) -> Config:
    """Defaults, then the YAML recipe, then command-line values; the method's own settings typed by its class."""
    cfg = read(config_path, overrides)
    return resolve_settings(cfg, get_method(cfg.method))


# ----------------------------------------------------------------------------- loading


def _load(target: str, what: str) -> type["Method"]:
    """Import `module:Class` or `file.py:Class` and check that it is a Method subclass."""
    from gcfamily.methods.base import Method

    where, _, attr = target.rpartition(":")  # rpartition: a Windows path has a colon of its own
    if not where or not attr:
        raise GcfError(f"Method {what} must be {SPEC_FORMS}.")
    module = _import_file(where, what) if _is_path(where) else _import_module(where, what)
    try:
        obj = functools.reduce(getattr, attr.split("."), module)
    except AttributeError:
        raise GcfError(
            f"Method {what}: {where} has no attribute '{attr}'; check the class name after the colon."
        ) from None
    if not (isinstance(obj, type) and issubclass(obj, Method)):
        found = f"the class {obj.__name__}" if isinstance(obj, type) else f"a {type(obj).__name__}"
        raise GcfError(
            f"Method {what} is {found}, not a subclass of gcfamily.methods.base.Method; subclass it "
            "(or a built-in method such as gcfamily.methods.grpo.GRPO)."
        )
    return obj


def _is_path(where: str) -> bool:
    return where.endswith(".py") or "/" in where or "\\" in where


def _import_module(name: str, what: str) -> ModuleType:
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as e:
        if e.name is not None and (name == e.name or name.startswith(e.name + ".")):
            raise GcfError(
                f"Method {what}: no module named '{name}' can be imported; install it, or pass its file "
                f"as path/to/{name.rsplit('.', 1)[-1]}.py:Class."
            ) from None
        raise GcfError(
            f"Method {what}: module '{name}' failed to import (ModuleNotFoundError: {_first_line(e)}); fix that import."
        ) from None
    except Exception as e:  # anything the user's module raises while it is imported
        raise GcfError(
            f"Method {what}: module '{name}' failed to import ({type(e).__name__}: {_first_line(e)}); fix the error in it."
        ) from None


def _import_file(path: str, what: str) -> ModuleType:
    """Import a .py file once under a name unique to its resolved path, registered in sys.modules."""
    p = Path(path).expanduser().resolve()
    if not p.is_file():
        raise GcfError(
            f"Method {what}: the file {path} does not exist; pass path/to/file.py:Class, relative to "
            f"{Path.cwd()} or absolute."
        )
    name = f"_gcf_file_{re.sub(r'[^0-9A-Za-z_]', '_', p.stem)}_{hashlib.sha1(str(p).encode()).hexdigest()[:10]}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, p)
    if spec is None or spec.loader is None:
        raise GcfError(f"Method {what}: {path} cannot be imported as Python; pass a .py file.")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # before running it: dataclasses and pickle look the module up by name
    try:
        spec.loader.exec_module(module)
    except Exception as e:  # anything the user's file raises while it is imported
        del sys.modules[name]
        lines = [f.lineno for f in traceback.extract_tb(e.__traceback__) if f.filename == str(p)]
        lineno = e.lineno if isinstance(e, SyntaxError) else (lines[-1] if lines else None)
        at = f" at line {lineno}" if lineno else ""
        raise GcfError(
            f"Method {what}: the file {path} failed to import ({type(e).__name__}{at}: {_first_line(e)}); "
            "fix the error in it."
        ) from None
    return module


def _first_line(e: BaseException) -> str:
    """The exception's message on one line (the CLI prints one line per error)."""
    lines = str(e).strip().splitlines()
    return lines[0] if lines else type(e).__name__
