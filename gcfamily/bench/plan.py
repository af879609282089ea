"""What `gcf bench` runs: the suites (default and quick), each method's recipe and settings, budgets, the user's data, and
which runs share the evaluation before training. gcfamily/bench/suite.py launches the plans.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

from gcfamily.errors import GcfError

DEFAULT_METHODS = ("sft", "rft", "grpo", "ppo", "dpo")
# SmolLM2-135M-Instruct starts at 0.296 (148/500 held-out, greedy)
TASK_PRESETS: dict[str, tuple[str, dict[str, Any]]] = {
    "sorting-short": (
        "sorting",
        {"min_len": 2, "max_len": 3},
    ),
}
"""Task names with options, for a second task where the base model starts between 10% and 60%. SmolLM2-135M-Instruct, greedy,
16 new tokens (`gcf eval --samples 500 --max-new-tokens 16`): arithmetic (mixed levels) 0.400 on its 205 distinct held-out prompts,
sorting of 2-3 numbers 0.296 (148/500); with `--samples 100`, countdown 0.00 and sorting of 3-6 numbers 0.06."""
BUDGET_KINDS = ("steps", "tokens", "time", "flops")
STEP_CAP = 10000

# Settings every run of a suite shares, then each method's own recipe (lr, batch shape, beta).
# The on-policy methods sample 4 prompts x 8 completions of at most 16 tokens (answers are short).
_ONPOLICY = {"batch_size": 4, "group_size": 8, "max_new_tokens": 16, "temperature": 0.7, "micro_batch_size": 32}
SUITES: dict[str, dict[str, Any]] = {
    "default": {
        "model": "smollm2-135m",
        "budget": "time:210",  # the same training seconds for each method: 5 x (210 s + evaluations) stays within 30 min
        # held-out accuracy on up to 500 distinct test prompts (arithmetic has 205: its one-digit levels hold 19 each) before, once
        # in the middle and after: 19 s and 53 s an evaluation at 2 threads on arithmetic and sorting-short
        "common": {"eval_samples": 500, "max_new_tokens": 16, "max_length": 256, "eval_every_s": 105},
        "methods": {
            "sft": {"batch_size": 8, "micro_batch_size": 8, "lr": 2e-5},
            "rft": {**_ONPOLICY, "lr": 1e-5},
            "grpo": {**_ONPOLICY, "lr": 3e-6, "beta": 0.04},
            "ppo": {**_ONPOLICY, "lr": 3e-6, "beta": 0.04, "critic_lr": 1e-5},
            "dpo": {"batch_size": 8, "micro_batch_size": 16, "lr": 1e-6, "beta": 0.1},
        },
    },
    "quick": {
        "model": "tiny",
        "budget": "steps:60",
        "common": {"eval_samples": 32, "max_new_tokens": 8, "max_length": 128, "eval_every": 20},
        "methods": {
            "sft": {"batch_size": 8, "micro_batch_size": 8, "lr": 3e-3},
            "rft": {**_ONPOLICY, "max_new_tokens": 8, "lr": 3e-3},
            "grpo": {**_ONPOLICY, "max_new_tokens": 8, "lr": 1e-3, "beta": 0.04},
            "ppo": {**_ONPOLICY, "max_new_tokens": 8, "lr": 1e-3, "beta": 0.04, "critic_lr": 1e-3},
            "dpo": {"batch_size": 8, "micro_batch_size": 16, "lr": 1e-3, "beta": 0.1},
        },
    },
}


# ----------------------------------------------------------------------------------
# settings


def parse_budget(budget: str) -> dict[str, Any]:
    """`steps:N`, `tokens:N` or `time:SECONDS` -> the trainer settings that stop on it."""
    kind, _, value = budget.partition(":")
    try:
        amount = float(value)
    except ValueError:
        amount = -1.0
    if kind not in BUDGET_KINDS or amount <= 0:
        raise GcfError(
            f"--budget {budget!r} must look like steps:N, tokens:N, time:SECONDS or flops:N with a positive number."
        )
    if kind == "steps":
        return {"max_steps": int(amount)}
    if kind == "tokens":
        return {"max_tokens": int(amount), "max_steps": STEP_CAP}
    if kind == "flops":
        return {"max_flops": amount, "max_steps": STEP_CAP}
    return {"max_time": amount, "max_steps": STEP_CAP}


def method_name(spec: str) -> str:
    """The name of a method spec in the table and its folder (gcfamily.methods.method_label; errors are one sentence)."""
    from gcfamily.methods import method_label

    return method_label(spec)


def default_methods() -> list[str]:
    """The default suite; a method not (yet) in the table but shipped as a module runs by module:Class."""
    from gcfamily.methods import METHODS

    return [m if m in METHODS else f"gcfamily.methods.{m}:{m.upper()}" for m in DEFAULT_METHODS]


def recipe(suite: dict[str, Any], spec: str, name: str) -> dict[str, Any]:
    """A method's recipe in the suite: its own, else its family's (an on-policy method takes GRPO's batch shape, lr and beta;
    a preference method DPO's; a demonstration method SFT's), so that every method of the zoo runs on the same budget."""
    if name in suite["methods"]:
        return dict(suite["methods"][name])
    from gcfamily.methods import get_method

    kind = get_method(spec).data_kind
    family = {"prompts": "grpo", "pairs": "dpo", "labelled": "dpo", "demonstrations": "sft"}.get(kind)
    own = dict(suite["methods"].get(family, {})) if family else {}
    from gcfamily.methods import setting_names

    known = setting_names(spec)
    # beta is GRPO's KL weight or DPO's temperature: only where the method has it
    return {k: v for k, v in own.items() if k in known}


DATA_KINDS = {
    "demonstrations": "demonstrations",
    "prompts": "own samples",
    "pairs": "offline pairs",
    "labelled": "labelled completions",
}


def data_label(spec: str) -> str:
    """What a method trained on, for the table: demonstrations, own samples (on-policy), offline pairs, labelled completions."""
    from gcfamily.methods import get_method

    cls = get_method(spec)
    return DATA_KINDS.get(cls.data_kind, cls.data_kind or "-")


def run_settings(
    suite: dict[str, Any],
    spec: str,
    name: str,
    model: str,
    task: Optional[str],
    budget: dict[str, Any],
    sets: dict[str, str],
    out: Path,
    data: Optional[dict[str, Any]] = None,
) -> dict[str, Any]:
    """Settings of one method's run: common, the method's recipe, the budget, the user's data (dataset, eval_dataset,
    reward: then no task), then --set (KEY or METHOD.KEY).

    A plain KEY reaches every method that has that setting (a shared one, or one of its own: `beta` is GRPO's
    KL weight and DPO's temperature, and SFT has none); `check_sets` refuses a key no method of the suite has."""
    from gcfamily.config import validate
    from gcfamily.methods import resolve, setting_names

    task, options = TASK_PRESETS.get(task, (task, {}))
    s: dict[str, Any] = {
        "method": spec,
        "model": model,
        "task": task,
        "seed": 0,
        "eval_at_ends": True,
        "progress": False,
        "save_every": 0,
        "keep_last": 1,
        "output_dir": str(out / name),
        "overwrite": True,
    }
    if options:
        s["task_options"] = dict(options)
    s.update(suite["common"])
    s.update(recipe(suite, spec, name))
    s.update(budget)
    s.update(data or {})
    own = setting_names(spec)
    for key, value in sets.items():
        target, _, field = key.rpartition(".")
        if not target and key.replace("-", "_") in own:
            s[key] = value
        elif target == name:
            s[field] = value

    validate(resolve(None, s))  # unknown keys and bad values fail here, before any run starts
    return s


def seeded(settings: dict[str, Any], k: int, folder: Path) -> dict[str, Any]:
    """The settings of the k-th seed's run, in `folder`: seeds base..base+N-1, while the task (its problems, split and held-out
    prompts) stays at the base seed for every method and seed."""
    base = int(settings.get("seed", 0))
    settings.update(seed=base + k, task_seed=settings.get("task_seed", base), output_dir=str(folder))
    return settings


def dataset_suite(methods: list[str], data: dict[str, Any], settings_of: Any, echo: Any) -> list[str]:
    """The methods that can train on the user's dataset (its TRL format is one of the method's kinds of rows); the rest are
    said and left out. One sentence when the data cannot make a suite: no reward, no held-out rows, no method left."""
    from gcfamily.data.formats import FORMATS, KINDS, detect
    from gcfamily.data.sources import load_rows
    from gcfamily.methods import get_method, resolve

    if not data.get("reward"):
        raise GcfError(
            "--dataset needs --reward: it scores the on-policy methods' samples and every method's held-out answers."
        )
    if not data.get("eval_dataset"):
        raise GcfError(
            "--dataset needs --eval-dataset: held-out rows (a file, a save_to_disk folder or a hub id; --set eval_split=NAME "
            "picks its split) that --reward scores before and after training."
        )
    cfg = resolve(None, settings_of(methods[0]))  # columns, split and subset as the runs will read them
    rows = load_rows(cfg.dataset, cfg.dataset_split, cfg.dataset_config, cfg.columns)
    if not rows:
        raise GcfError(f"--dataset {cfg.dataset} has no rows in split {cfg.dataset_split}.")
    fmt = detect(rows[0])
    usable = []
    for spec in methods:
        kind = get_method(spec).data_kind
        if fmt in KINDS.get(kind, ()):
            usable.append(spec)
        else:
            takes = " or ".join(FORMATS[f] for f in KINDS.get(kind, ()))
            echo(
                f"[bench] {method_name(spec)}: left out: it trains on {takes or kind} rows, and the dataset's are {FORMATS[fmt]}"
            )
    if not usable:
        raise GcfError(
            f"No method of the suite can train on {FORMATS[fmt]} rows; choose methods that take them with --methods."
        )
    return usable


def check_sets(sets: dict[str, str], methods: list[str]) -> None:
    """A plain --set KEY that no method of the suite has is one sentence (METHOD.KEY is checked by that method)."""
    from gcfamily.methods import setting_names

    known = set().union(*(setting_names(m) for m in methods))
    for key in sets:
        if "." not in key and key.replace("-", "_") not in known:
            raise GcfError(
                f"Unknown setting '{key}': no method of this suite ({', '.join(methods)}) has it; see `gcf settings --method M`."
            )


# Settings that cannot change the policy before the first step, nor how it is evaluated (greedy, on the held-out prompts):
# runs that differ only in these share one evaluation before training. Any other difference evaluates again.
START_FREE = frozenset(
    {
        "method",
        "lr",
        "beta",
        "critic_lr",
        "batch_size",
        "micro_batch_size",
        "group_size",
        "temperature",
        "top_p",
        "top_k",
        "output_dir",
        "max_steps",
        "max_time",
        "max_tokens",
        "max_flops",
        "eval_every",
        "eval_every_s",
        "save_every",
        "keep_last",
        "progress",
        "overwrite",
        "log_every",
        "report_to",
    }
)


def start_key(settings: dict[str, Any]) -> str:
    """What the evaluation before the first step depends on. The seed only initialises the tiny random model; a pretrained
    model loads the same weights whatever the seed, and the methods of the zoo train the policy as loaded."""
    free = START_FREE | ({"seed"} if settings.get("model") != "tiny" else set())
    return json.dumps({k: v for k, v in settings.items() if k not in free}, sort_keys=True, default=str)


def share_start_evaluations(plans: dict[str, dict[str, Any]]) -> None:
    """Each plan whose start_key an earlier plan has takes its evaluation before training from that run (start_eval_from)."""
    first: dict[str, str] = {}
    for plan in plans.values():
        key = start_key(plan["settings"])
        if key in first:
            plan["start_eval_from"] = first[key]
        else:
            first[key] = plan["settings"]["output_dir"]
