"""Settings: typed defaults, then a YAML recipe, then command-line overrides (in that order).

Two kinds, set the same way (`key: value` in YAML, `--set key=value`):

- shared settings, the fields of `Config`: what to run, the step, the optimizer, sampling, logging;
- a method's own settings, a small dataclass on the method class (`GRPO.Settings`: the clip range,
  the KL weight and estimator, ...), which a subclass extends without touching this file.

A key is looked up in the shared settings, then in the method's; an unknown key is one sentence
naming both. Each field's docstring is what `gcf settings --method M` prints.
"""

from __future__ import annotations

from gcfamily.config.budget import planned_steps
from gcfamily.config.io import (
    _coerce,
    apply,
    env_flag,
    field_docs,
    load_yaml,
    own_setting_names,
    parse_sets,
    read,
    resolve_settings,
    settings_for,
    to_dict,
)
from gcfamily.config.shared import FIELD_NAMES, FIELDS, INTERNAL, Config, MethodSettings, validate

__all__ = [
    "planned_steps",
    "FIELDS",
    "FIELD_NAMES",
    "INTERNAL",
    "Config",
    "MethodSettings",
    "_coerce",
    "apply",
    "env_flag",
    "field_docs",
    "load_yaml",
    "own_setting_names",
    "parse_sets",
    "read",
    "resolve_settings",
    "settings_for",
    "to_dict",
    "validate",
]
