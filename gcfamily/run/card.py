"""What a finished run says about itself: a model card (README.md) and a console summary.

Both read only what the run already wrote (the flat settings of `config.to_dict`, the rows of
metrics.jsonl) and never raise on odd metrics: a missing figure is left out, a None or NaN one
is shown as "n/a". The card's front matter is made by yaml.safe_dump, so it always parses.
"""

from __future__ import annotations

import json
import math
import os
import re
import shlex
import tempfile
from pathlib import Path
from typing import Any, Optional

import yaml

# the settings a reader wants even when the defaults were kept
CORE_SETTINGS = ("lr", "batch_size", "max_steps", "seed", "dtype")
# stated elsewhere in the card (title, text, load snippet), so not repeated in its tables or --set flags
STATED_ELSEWHERE = ("method", "model", "output_dir")
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def write_model_card(
    out_dir: Path,
    config: dict,
    metrics: list[dict],
    base_model: str,
    method_info: dict,
    steps: Optional[int] = None,
) -> Path:
    """Write out_dir/README.md, a short Hugging Face model card of the run, atomically; returns its path.

    `config` is the run's flat settings (`config.to_dict`), `metrics` the rows of metrics.jsonl (none when
    the run logged nothing) and `method_info` the method's "name", "data_source" and "gc_formula" (and
    optionally "on_policy"; without it a data source that samples from the policy counts as on-policy).
    `steps`, the steps the run took, when known: 0 says the model is the base model as loaded.
    """
    out_dir = Path(out_dir)
    name = str(method_info.get("name") or config.get("method") or "unknown")
    has_adapter = (out_dir / "adapter_config.json").is_file()
    front: dict[str, Any] = {"library_name": "transformers"}
    if _hub_id(base_model):
        front["base_model"] = base_model
    front["tags"] = ["gcfamily", name]

    lines = ["---", yaml.safe_dump(front, sort_keys=False).rstrip(), "---", "", f"# {out_dir.name or name}", ""]
    source, formula = (str(method_info.get(k) or "n/a").rstrip(". ") for k in ("data_source", "gc_formula"))
    about = (
        f"This model was trained with gcfamily's `{name}` from `{base_model}`"
        f"{' as a LoRA adapter' if has_adapter else ''}. "
        f"Its training data: {source}. Its per-token gradient coefficient: {formula}."
    )
    if steps == 0:
        about = (
            f"This is `{base_model}` as it was loaded: the run of gcfamily's `{name}` took no training step "
            f"(max_steps={config.get('max_steps')}). Had it trained, its data would have been: {source}; "
            f"its per-token gradient coefficient: {formula}."
        )
    lines += [about, ""]
    lines += [f"- **Data:** {_data(config)}"]
    if _on_policy(method_info):
        lines += [f"- **Reward:** {_rewards(config)}"]
    lines += ["", "## Settings", "", *_table(("Setting", "Value"), _settings(config))]
    figures = _final_metrics(metrics)
    if figures:
        lines += ["", "## Final metrics", "", *_table(("Metric", "Value", "Step"), figures)]
    lines += ["", "## How to load", "", *_load_snippet(out_dir, base_model, has_adapter)]
    # one flag a line, so a reader sees the settings; bash joins the lines back
    command = " \\\n  ".join(_reproduce_parts(config, base_model))
    lines += ["", "## Reproduce", "", "```bash", command, "```", ""]

    path = out_dir / "README.md"
    _write_atomic(path, "\n".join(lines))
    return path


def summary(metrics: list[dict], steps: int, seconds: float, out_dir: Path, final_saved: bool) -> str:
    """A few lines for the end of `gcf run`: steps and time, held-out and reward change, last loss, the model."""
    rows = _rows(metrics)
    lines = [f"done: {steps} step{'' if steps == 1 else 's'} in {_duration(seconds)}"]
    for key in _eval_keys(rows):
        seen = _seen(rows, key)
        if len(seen) >= 2 and seen[0][0] != seen[-1][0]:
            (s0, v0), (s1, v1) = seen[0], seen[-1]
            when = "before -> after" if s0 == 0 else f"step {fmt(s0)} -> {fmt(s1)}"
            lines.append(f"  {key} {fmt(v0)} -> {fmt(v1)} (held-out, {when})")
    seen = _seen(rows, "reward/mean")
    if len(seen) >= 2:
        lines.append(f"  reward/mean {fmt(seen[0][1])} -> {fmt(seen[-1][1])} (first -> last step)")
    elif seen:
        lines.append(f"  reward/mean {fmt(seen[0][1])} (step {seen[0][0]})")
    seen = _seen(rows, "loss")
    if seen:
        lines.append(f"  loss {fmt(seen[-1][1])} (last step)")
    if final_saved:
        how = "AutoModelForCausalLM.from_pretrained"
        if (Path(out_dir) / "adapter_config.json").is_file():
            how += "; a LoRA adapter, needs peft"
        if steps == 0:
            how += "; no training step was taken: the base model as loaded"
        lines.append(f"  model: {out_dir} ({how})")
    else:
        lines.append("  no final model was written")
    return "\n".join(lines)


def reproduce_command(config: dict, base_model: str) -> str:
    """`gcf run --method M --model BASE --set k=v ...` for the settings the run was given explicitly."""
    return " ".join(_reproduce_parts(config, base_model))


def _reproduce_parts(config: dict, base_model: str) -> list[str]:
    """The command's head, then one `--set k=v` per explicit setting, each quoted for the shell."""
    model = base_model or config.get("model") or ""
    parts = [f"gcf run --method {shlex.quote(str(config.get('method', 'sft')))} --model {shlex.quote(str(model))}"]
    for key in _explicit(config):
        if key not in STATED_ELSEWHERE and key in config:
            parts.append(f"--set {shlex.quote(f'{key}={_value(config[key])}')}")
    return parts


def fmt(value: Any) -> str:
    """A metric for people: floats to 4 significant digits; None, NaN and infinities as n/a."""
    if value is None or isinstance(value, bool):
        return "n/a" if value is None else str(value)
    if isinstance(value, (int, float)):
        try:
            return f"{value:.4g}" if math.isfinite(value) else "n/a"
        except (OverflowError, ValueError, TypeError):
            return "n/a"
    return str(value)


# -- the card's parts ------------------------------------------------------------------


def _hub_id(model: str) -> bool:
    """org/name that is not a folder on this machine (a local folder is no hub id)."""
    return isinstance(model, str) and bool(HUB_ID.match(model)) and not Path(model).exists()


def _on_policy(method_info: dict) -> bool:
    if "on_policy" in method_info:
        return bool(method_info["on_policy"])
    source = str(method_info.get("data_source", "")).lower()
    # "the current / initial policy's samples" (rft, rft-offline) as well as "the policy's own samples"
    return any(k in source for k in ("own samples", "on-policy", "policy's samples"))


def _data(config: dict) -> str:
    if config.get("dataset"):
        extra = [f"config `{config['dataset_config']}`"] if config.get("dataset_config") else []
        extra += [f"split `{config['dataset_split']}`"] if config.get("dataset_split") else []
        return f"`{config['dataset']}`" + (f" ({', '.join(extra)})" if extra else "")
    if config.get("task"):
        options = config.get("task_options")
        return f"the built-in task `{config['task']}`" + (f" with options `{_value(options)}`" if options else "")
    return "n/a"


def _rewards(config: dict) -> str:
    reward = config.get("reward")
    names = reward if isinstance(reward, list) else [reward] if reward else []
    weights = config.get("reward_weights") or []
    if names and len(weights) == len(names):
        text = " + ".join(f"{_value(w)} * `{n}`" for n, w in zip(names, weights))
    elif names:
        text = " + ".join(f"`{n}`" for n in names)
    else:
        text = f"the task's reward (`{config['task']}`)" if config.get("task") else "the default reward"
    if config.get("reward_model"):
        text += f"; the reward model at `{config['reward_model']}`"
    return text


def _explicit(config: dict) -> list[str]:
    explicit = config.get("explicit") or []
    return [str(k) for k in explicit] if isinstance(explicit, (list, tuple)) else []


def _settings(config: dict) -> list[tuple[str, ...]]:
    keys = [k for k in _explicit(config) if k not in STATED_ELSEWHERE]
    keys += [k for k in CORE_SETTINGS if k not in keys]
    lora_r = config.get("lora_r")
    if "lora_r" not in keys and isinstance(lora_r, (int, float)) and lora_r > 0:
        keys.append("lora_r")
    return [(f"`{k}`", f"`{_value(config[k])}`") for k in keys if k in config]


def _final_metrics(metrics: list[dict]) -> list[tuple[str, ...]]:
    """Held-out figures first and last seen, then the last loss, reward/mean and KL figures, then steps done."""
    rows = _rows(metrics)
    out: list[tuple[str, ...]] = []
    for key in _eval_keys(rows):
        seen = _seen(rows, key)
        (s0, v0), (s1, v1) = seen[0], seen[-1]
        if s0 == s1:
            out.append((f"{key} (held-out)", fmt(v1), fmt(s1)))
        else:
            out.append((f"{key} (held-out)", f"{fmt(v0)} → {fmt(v1)}", f"{fmt(s0)} → {fmt(s1)}"))
    kl_keys = sorted({k for r in rows for k in r if isinstance(k, str) and "kl" in k and not k.startswith("eval/")})
    for key in ["loss", "reward/mean", *kl_keys]:
        seen = _seen(rows, key)
        if seen:
            out.append((key, fmt(seen[-1][1]), fmt(seen[-1][0])))
    steps = [s for s in (r.get("step") for r in rows) if isinstance(s, int) and not isinstance(s, bool)]
    if steps:
        out.append(("steps done", str(max(steps)), ""))
    return out


def _load_snippet(out_dir: Path, base_model: str, has_adapter: bool) -> list[str]:
    lines = [
        "```python",
        "from transformers import AutoModelForCausalLM, AutoTokenizer",
        "",
        f"model = AutoModelForCausalLM.from_pretrained({json.dumps(str(out_dir))})",
        f"tokenizer = AutoTokenizer.from_pretrained({json.dumps(str(out_dir))})",
    ]
    if has_adapter:
        lines += [
            "",
            "# or, explicitly, the LoRA adapter on its base model (needs peft)",
            "from peft import PeftModel",
            "",
            f"base = AutoModelForCausalLM.from_pretrained({json.dumps(str(base_model))})",
            f"model = PeftModel.from_pretrained(base, {json.dumps(str(out_dir))})",
        ]
    return lines + ["```"]


def _table(header: tuple[str, ...], rows: list[tuple[str, ...]]) -> list[str]:
    def cells(row: tuple[str, ...]) -> str:
        return "| " + " | ".join(c.replace("|", "\\|").replace("\n", " ") for c in row) + " |"

    return [cells(header), "|" + "|".join("---" for _ in header) + "|", *(cells(r) for r in rows)]


def _write_atomic(path: Path, text: str) -> None:
    """Write to a temporary file in the same folder, then rename over `path`: a reader never sees half a card."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


# -- small helpers ------------------------------------------------------------------------


def _value(value: Any) -> str:
    """A setting as given: strings as they are, everything else as compact JSON (true, null, [1,0.5], {"a":1})."""
    if isinstance(value, str):
        return value
    try:
        return json.dumps(value, separators=(",", ":"))
    except (TypeError, ValueError):
        return str(value)


def _rows(metrics: Any) -> list[dict]:
    try:
        return [r for r in metrics if isinstance(r, dict)]
    except TypeError:
        return []


def _eval_keys(rows: list[dict]) -> list[str]:
    return sorted({k for r in rows for k in r if isinstance(k, str) and k.startswith("eval/")})


def _seen(rows: list[dict], key: str) -> list[tuple[Any, Any]]:
    """(step, value) of every row that holds `key`, in file order."""
    return [(r.get("step"), r[key]) for r in rows if key in r]


def _duration(seconds: float) -> str:
    try:
        s = float(seconds)
    except (TypeError, ValueError):
        return "n/a"
    if not math.isfinite(s):
        return "n/a"
    return f"{s:.1f} s" if s < 120 else f"{s:.0f} s ({s / 60:.1f} min)"
