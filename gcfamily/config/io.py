"""Settings in and out: a YAML recipe and `--set` values typed into a Config, a method's own settings typed by its class,
the resolved settings as the JSON saved with every run, and the docstrings `gcf settings` prints."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import reprlib
from dataclasses import fields
from pathlib import Path
from typing import Any, Optional

import yaml

from gcfamily.config.shared import FIELD_NAMES, FIELDS, INTERNAL, Config, MethodSettings
from gcfamily.errors import GcfError

MAX_YAML_CHARS = 1_000_000
"""A recipe or `--set` value longer than this is not a recipe (the largest shipped one is a few hundred characters)."""
MAX_YAML_DEPTH = 64
"""Nesting a recipe or `--set` value may have: settings nest two or three levels; 5000 would overflow the parser."""
MAX_YAML_ITEMS = 100_000
"""Values a recipe or `--set` value may hold once its aliases are expanded (as saving the settings expands them)."""


class _BoundedLoader(yaml.SafeLoader):
    """yaml.SafeLoader that refuses, before anything is built, nesting past MAX_YAML_DEPTH (PyYAML composes recursively:
    a 5000-deep list overflows Python's stack) and a document whose aliases expand past MAX_YAML_ITEMS values or refer
    to themselves: nested anchors ("billion laughs") load as shared objects, then expand 10**9-fold once saved."""

    depth = 0

    def compose_node(self, parent: Any, index: Any) -> Any:
        self.depth += 1
        try:
            if self.depth > MAX_YAML_DEPTH:
                raise _TooBig(f"nests deeper than {MAX_YAML_DEPTH} levels")
            return super().compose_node(parent, index)
        finally:
            self.depth -= 1


class _TooBig(Exception):
    """A YAML document past a bound; `parse_yaml` turns it into the caller's sentence."""


def _node_children(node: Any) -> list[Any]:
    """A YAML node's children (a sequence's items, a mapping's keys and values), or a Python container's."""
    if isinstance(node, (yaml.SequenceNode, yaml.MappingNode)):
        node = node.value
    if isinstance(node, dict):
        return [n for pair in node.items() for n in pair]
    if isinstance(node, (list, tuple, set, frozenset)):
        return [n for item in node for n in (item if isinstance(item, tuple) and len(item) == 2 else (item,))]
    return []


def _check_expansion(root: Any) -> None:
    """Refuse a YAML node graph or Python value that refers to itself, nests past MAX_YAML_DEPTH or expands past
    MAX_YAML_ITEMS values (iterative: no recursion to overflow; each shared part is counted once per use)."""
    size: dict[int, int] = {}  # id(node) -> values under it, aliases expanded
    on_path: set[int] = set()
    stack: list[tuple[Any, bool, int]] = [(root, False, 1)]
    while stack:
        node, leaving, depth = stack.pop()
        key = id(node)
        if leaving:
            on_path.discard(key)
            size[key] = 1 + sum(size[id(c)] for c in _node_children(node))
            if size[key] > MAX_YAML_ITEMS:
                raise _TooBig(f"expands to more than {MAX_YAML_ITEMS} values (aliases of anchors nested in each other)")
            continue
        if key in size:
            continue
        if key in on_path:
            raise _TooBig("refers to itself (an alias inside its own anchor, or a list that holds itself)")
        if depth > MAX_YAML_DEPTH:
            raise _TooBig(f"nests deeper than {MAX_YAML_DEPTH} levels")
        on_path.add(key)
        stack.append((node, True, depth))
        stack.extend((c, False, depth + 1) for c in _node_children(node))


def check_bounds(value: Any) -> None:
    """Raise ValueError (saying which bound) for a value that refers to itself, nests or expands past the YAML bounds:
    the same bounds for a value from Python (train()'s keywords) as for one read from YAML."""
    try:
        _check_expansion(value)
    except _TooBig as e:
        raise ValueError(str(e)) from None


def parse_yaml(text: str) -> Any:
    """yaml.safe_load within bounds (size, nesting, aliases expanded); a document past one raises ValueError saying which."""
    if len(text) > MAX_YAML_CHARS:
        raise ValueError(f"is longer than {MAX_YAML_CHARS} characters")
    loader = _BoundedLoader(text)
    try:
        root = loader.get_single_node()
        if root is None:
            return None
        _check_expansion(root)
        return loader.construct_document(root)
    except _TooBig as e:
        raise ValueError(str(e)) from None
    finally:
        loader.dispose()


def field_docs(cls: type = Config) -> dict[str, str]:
    """Field name -> its docstring, read from the source of `cls` and of its dataclass bases."""
    import ast
    import inspect
    import textwrap

    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass) or klass is object:
            continue
        try:
            src = textwrap.dedent(inspect.getsource(klass))
        except (OSError, TypeError):
            continue
        tree = ast.parse(src).body[0]
        last = None
        for node in tree.body:  # type: ignore[attr-defined]
            if isinstance(node, ast.AnnAssign):
                last = node.target.id  # type: ignore[union-attr]
            elif isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and last:
                docs[last] = " ".join(str(node.value.value).split())
                last = None
    return {k: v for k, v in docs.items() if k not in INTERNAL}


def _coerce(f: dataclasses.Field, value: Any, owner: str = "Setting") -> Any:
    """Turn a YAML or command-line value into the field's type; a clear error otherwise."""
    name = f.name
    default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
    typ = (f.type if isinstance(f.type, str) else getattr(f.type, "__name__", None) or str(f.type)).replace(
        "typing.", ""
    )
    optional = default is None or typ.startswith("Optional")
    base = typ.removeprefix("Optional[").removesuffix("]") if optional else typ
    if isinstance(value, str) and base != "str":
        if value.lower() in ("none", "null") and optional:
            return None
        try:
            value = parse_yaml(value)  # numbers, booleans, lists, dicts; never code
        except yaml.YAMLError as e:
            raise GcfError(f"{owner} {name}={_short(value)} is not a valid value.") from e
        except ValueError as e:  # past a bound: a 10**9-item expansion, 5000 levels deep, an alias of itself
            raise GcfError(f"{owner} {name}={_short(value)} {e}; give a plain value.") from None
    if value is None and optional:
        return None
    try:
        check_bounds(value)
    except ValueError as e:  # from Python: a list holding itself, 5000 levels deep, 10**9 items through shared parts
        raise GcfError(f"{owner} {name}={_short(value)} {e}; give a plain value.") from None
    try:
        if base == "bool":
            if isinstance(value, bool):
                return value
        elif base == "int":
            if isinstance(value, float) and value.is_integer():
                value = int(value)
            if isinstance(value, int) and not isinstance(value, bool):
                return value
        elif base == "float":
            if isinstance(value, str):  # YAML reads 1e-3 (no dot) as a string
                value = float(value)
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                try:
                    return float(value)
                except OverflowError:  # an int of 400 digits
                    raise GcfError(
                        f"{owner} {name}={_short(value)} is too large for a number of its kind; give a finite number."
                    ) from None
        elif base == "tuple":
            if isinstance(value, (list, tuple)):
                return tuple(value)
        elif base in ("list", "dict"):
            if isinstance(value, list if base == "list" else dict):
                return value
        elif base == "str":
            if isinstance(value, (str, int, float)) and not isinstance(value, bool):
                return str(value)
        else:
            return value
    except (TypeError, ValueError):
        pass
    raise GcfError(
        f"{owner} {name}={_short(value)} has the wrong type; expected {base}{' or none' if optional else ''}."
    )


def _short(value: Any, limit: int = 80) -> str:
    """A value's repr for a message, cut short (a --set value may be a megabyte); never the repr of a cyclic or huge
    object in full."""
    try:
        short = reprlib.Repr()  # keyword arguments only from Python 3.12
        short.maxstring, short.maxother, short.maxlist, short.maxdict, short.maxlevel = limit, limit, 6, 6, 3
        text = short.repr(value)
    except Exception:  # noqa: BLE001 (an object whose repr raises: its type is enough)
        text = f"<{type(value).__name__}>"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def settings_for(method_cls: Any, cfg: Config) -> Any:
    """The method's Settings instance from cfg.method_options; an unknown key names both kinds of setting."""
    cls = getattr(method_cls, "Settings", MethodSettings)
    own = {f.name: f for f in fields(cls)}
    values = {}
    for k, v in cfg.method_options.items():
        if k not in own:
            known = ", ".join(sorted(own)) or "none"
            raise GcfError(
                f"Unknown setting '{k}' for method {cfg.method}; its own settings are: {known}; "
                f"the shared ones are listed by `gcf settings`."
            )
        values[k] = _coerce(own[k], v)
        # no method setting means anything at nan or inf
        if isinstance(values[k], float) and not math.isfinite(values[k]):
            raise GcfError(f"Setting {k}={values[k]} of method {cfg.method} must be a finite number.")
    return cls(**values)


def own_setting_names(method_cls: Any) -> set[str]:
    """Every key `--set` takes for a method class: the shared settings and its own (by name: gcfamily.methods.setting_names)."""
    own = {f.name for f in fields(getattr(method_cls, "Settings", MethodSettings))}
    return (set(FIELD_NAMES) - set(INTERNAL)) | own


def resolve_settings(cfg: Config, method_cls: Any) -> Config:
    """Attach the method's settings to cfg (a class; by name: gcfamily.methods.resolve); returns cfg."""
    if not isinstance(cfg.settings, getattr(method_cls, "Settings", MethodSettings)):
        object.__setattr__(cfg, "settings", settings_for(method_cls, cfg))
    return cfg


def apply(cfg: Config, values: dict[str, Any], source: str) -> Config:
    """Return a copy of cfg with values applied: shared keys typed now, the rest kept for the method."""
    out = Config(**{f.name: getattr(cfg, f.name) for f in fields(Config)}, method_options=dict(cfg.method_options))
    out.explicit = list(cfg.explicit)  # the method's settings are typed again once the method is known
    for k, v in values.items():
        key = k.replace("-", "_")
        if key in INTERNAL:
            raise GcfError(f"Unknown setting '{k}' in {source}; see `gcf settings` for the list.")
        if key in FIELD_NAMES:
            object.__setattr__(out, key, _coerce(FIELDS[key], v))
        else:
            out.method_options[key] = v
    return out


def load_yaml(path: str) -> dict[str, Any]:
    """Read a recipe; a missing or malformed file is a clear error."""
    p = Path(path)
    if not p.is_file():
        raise GcfError(f"Config file {path} does not exist; pass a YAML recipe such as configs/sft-arithmetic.yaml.")
    try:
        data = parse_yaml(p.read_text(encoding="utf-8")) or {}
    except UnicodeDecodeError as e:
        raise GcfError(
            f"Config file {path} is not text (byte {e.start} is not UTF-8); pass a YAML recipe such as configs/sft-arithmetic.yaml."
        ) from e
    except OSError as e:
        raise GcfError(f"Config file {path} could not be read ({e.strerror or e}).") from e
    except yaml.YAMLError as e:
        raise GcfError(
            f"Config file {path} is not valid YAML ({(str(e).splitlines() or [type(e).__name__])[0]})."
        ) from e
    except ValueError as e:  # past a bound: a 10**9-item expansion, 5000 levels deep, an alias of itself
        raise GcfError(f"Config file {path} {e}; a recipe is a flat mapping of setting: value.") from None
    if not isinstance(data, dict):
        raise GcfError(f"Config file {path} must be a mapping of setting: value.")
    bad = [k for k in data if not isinstance(k, str)]
    if bad:
        raise GcfError(
            f"Config file {path} has the key {bad[0]!r}, which is not a setting name; keys are names such as lr or method."
        )
    return data


def parse_sets(items: tuple[str, ...]) -> dict[str, str]:
    """`--set key=value` pairs to a dict."""
    out = {}
    for item in items:
        if "=" not in item:
            raise GcfError(f"--set {item!r} must look like key=value.")
        k, v = item.split("=", 1)
        out[k.strip()] = v
    return out


def read(config_path: Optional[str], overrides: dict[str, Any]) -> Config:
    """Defaults, then the YAML recipe, then command-line values; the method's own settings stay untyped until its class
    types them (gcfamily.methods.resolve does both)."""
    cfg = Config()
    given: dict[str, Any] = {}
    if config_path:
        given = load_yaml(config_path)
        cfg = apply(cfg, given, config_path)
    cfg = apply(cfg, overrides, "the command line")
    if cfg.trust_remote_code and not any(k.replace("-", "_") == "trust_remote_code" for k in overrides):
        # a recipe is often someone else's file: running a model's own code is asked for where the command is typed
        raise GcfError(
            f"Config file {config_path} sets trust_remote_code: true, which a recipe alone may not do; "
            f"pass --trust-remote-code on the command line if you trust the model's code."
        )
    object.__setattr__(cfg, "explicit", sorted({k.replace("-", "_") for k in [*given, *overrides]}))
    return cfg


def to_dict(cfg: Config) -> dict[str, Any]:
    """JSON-ready dict of the resolved settings, shared and the method's, flat (saved with every run)."""
    out = {f.name: getattr(cfg, f.name) for f in fields(Config) if f.name not in INTERNAL}
    out.update(dataclasses.asdict(cfg.settings) if cfg.settings is not None else cfg.method_options)
    out["explicit"] = list(cfg.explicit)
    return json.loads(json.dumps(out, default=list))


def env_flag(name: str) -> bool:
    """True when an environment variable is set to a truthy value."""
    return os.environ.get(name, "").lower() in ("1", "true", "yes")
