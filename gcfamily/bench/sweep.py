"""`gcf bench --sweep KEY=V1,V2,...`: each method's setting chosen on a validation split, the held-out result reported at the choice.

Every sweep run keeps `validation_rows` (= eval_samples) rows at the end of the task's train split out of training
and evaluates on them (eval/val_accuracy); it never reads the test split. Per method the value with the highest
final validation accuracy (the mean over seeds with --seeds) wins (ties: the first value given). Only then are the
chosen value's final models evaluated on the held-out test prompts, once each, beside the base model's held-out
accuracy (the same for every method). The runs' KL and pass@k are measured on their validation rows too.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Optional

from gcfamily.bench.report import fmt
from gcfamily.errors import GcfError


def parse_sweep(text: str) -> tuple[str, list[str]]:
    """'lr=1e-6,3e-6,1e-5' -> ('lr', ['1e-6', '3e-6', '1e-5']); one setting, at least two values."""
    key, _, values = text.partition("=")
    vals = [v.strip() for v in values.split(",") if v.strip()]
    if not key.strip() or len(vals) < 2:
        raise GcfError(
            f"--sweep {text!r} must look like KEY=V1,V2[,...] with at least two values, e.g. lr=1e-6,3e-6,1e-5."
        )
    return key.strip(), vals


def plan_sweep(
    swept: tuple[str, list[str]],
    methods: list[str],
    names: dict[str, str],
    seeds: int,
    settings_of: Callable[[str, dict[str, str]], dict[str, Any]],
    sets: dict[str, str],
    out: Path,
) -> dict[str, dict[str, Any]]:
    """One run per method, value and seed (OUT/METHOD/KEY=V[/seed-K]); a method without the setting runs once per seed."""
    from gcfamily.bench.plan import seeded
    from gcfamily.methods import setting_names

    key, values = swept
    plans = {}
    for spec in methods:
        for v in values if key.replace("-", "_") in setting_names(spec) else [None]:
            for k in range(seeds):
                name = names[spec] + ("" if v is None else f"/{key}={v}") + (f"/seed-{k}" if seeds > 1 else "")
                settings = seeded(settings_of(spec, dict(sets) if v is None else {**sets, key: v}), k, out / name)
                # the choice never reads the test split
                settings["validation_rows"] = int(settings.get("eval_samples", 64))
                plans[name] = {"method_spec": spec, "settings": settings}
    return plans


def write_sweep(
    swept: tuple[str, list[str]],
    per_method: dict[str, list[dict[str, Any]]],
    plans: dict[str, dict[str, Any]],
    seeds: int,
    header: dict[str, Any],
    out: Path,
) -> None:
    """Choose each method's value on validation (mean over seeds), then read the test split for the chosen runs only; bench.md."""
    key, values = swept
    settings = {p["settings"]["output_dir"]: p["settings"] for p in plans.values()}
    base_acc = heldout_of(None, next(iter(settings.values())))
    for runs in per_method.values():
        for r in runs:
            # a failed run's last is not final
            r["val_accuracy"] = final_validation(Path(r["folder"])) if r.get("returncode") == 0 else None
        # one group of seeds per value, in the order given
        groups = [runs[i : i + seeds] for i in range(0, len(runs), seeds)]
        means = [_mean_of([r["val_accuracy"] for r in g]) for g in groups]
        i = choose([str(j) for j in range(len(groups))], means)
        for j, g in enumerate(groups):
            for r in g:
                r["val_mean"], r["chosen"] = means[j], j == i
                if j == i:  # only now, and only for the chosen runs, is the test split read
                    r["heldout_after"] = heldout_of(Path(r["folder"]), settings[r["folder"]])
    (out / "bench.md").write_text(sweep_table(key, values, per_method, base_acc, header, seeds))


def _mean_of(xs: list[Optional[float]]) -> Optional[float]:
    """The mean of the seeds' figures; None unless every seed has one."""
    return None if not xs or any(x is None for x in xs) else sum(xs) / len(xs)  # type: ignore[arg-type]


def final_validation(folder: Path) -> Optional[float]:
    """The last eval/val_accuracy a run logged after training (None if it has none)."""
    from gcfamily.run.logger import read_metrics

    if not (folder / "metrics.jsonl").is_file():
        return None
    rows = [r for r in read_metrics(folder) if r.get("eval/val_accuracy") is not None and r["step"] > 0]
    return rows[-1]["eval/val_accuracy"] if rows else None


def choose(values: list[str], scores: list[Optional[float]]) -> Optional[int]:
    """Index of the best validation score (the first of equal ones); None when no run has one."""
    best = None
    for i, s in enumerate(scores):
        if s is not None and (best is None or s > scores[best]):
            best = i
    return best


def heldout_of(folder: Optional[Path], settings: dict[str, Any]) -> float:
    """Held-out test accuracy of a model folder (None: the suite's base model), as the trainer measures it (greedy, eval_samples)."""
    import torch

    from gcfamily.core import onednn
    from gcfamily.data.encoding import Formatter
    from gcfamily.methods import resolve
    from gcfamily.models import load_model
    from gcfamily.run.heldout import heldout_accuracy
    from gcfamily.tasks import get_task

    cfg = resolve(None, settings)  # typed, as the run read them
    task = get_task(cfg.task, seed=cfg.seed if cfg.task_seed is None else cfg.task_seed, **cfg.task_options)
    model, tok = load_model(str(folder) if folder is not None else cfg.model, torch.float32, "cpu")
    fmt_ = Formatter(tok, cfg.chat_format, cfg.system_prompt, cfg.assistant_only_loss, cfg.chat_template)
    with onednn.packing(cfg.rollout_pack_weights):  # the run's setting
        return heldout_accuracy(model, tok, task, cfg.eval_samples, cfg.max_new_tokens, formatter=fmt_)


def sweep_table(
    key: str,
    values: list[str],
    per_method: dict[str, list[dict[str, Any]]],
    base_acc: float,
    header: dict[str, Any],
    seeds: int = 1,
) -> str:
    """bench.md of a sweep: validation accuracy per value (mean over seeds), the choice, and the held-out accuracy at it."""
    from gcfamily.core.stats import mean_interval

    seeded = seeds > 1
    lines = [
        f"# gcf bench --sweep {key}"
        + (f" --seeds {seeds}" if seeded else "")
        + f": {header['model']} on {header['task']}, budget {header['budget']}",
        "",
        f"{header['machine']}; {header['date']}; total {header['total_s']:.0f} s of runs.",
        "",
        "| method | "
        + " | ".join(f"{key}={v}: validation acc" + (" (mean)" if seeded else "") for v in values)
        + f" | chosen {key} | held-out acc before | after, at the chosen"
        + (" (mean [95% CI over seeds])" if seeded else "")
        + " |",
        "|---" * (len(values) + 4) + "|",
    ]
    for m, runs in per_method.items():
        groups = [runs[i : i + seeds] for i in range(0, len(runs), seeds)]
        scores = [g[0].get("val_mean") for g in groups]
        chosen_runs = [r for r in runs if r.get("chosen")]
        afters = [r.get("heldout_after") for r in chosen_runs]
        if seeded:  # every chosen seed's figure, or none: one seed's value is not a mean over seeds
            mu, lo, hi = mean_interval(afters) if afters and all(a is not None for a in afters) else (None, None, None)
            after = "-" if mu is None else f"{mu:.3f} [{lo:.3f}, {hi:.3f}]"
        else:
            after = fmt(afters[0] if afters else None, ".3f")
        if len(groups) != len(values):  # the method has no such setting: one run per seed
            cells, chosen = [fmt(scores[0], ".3f")] + ["same run"] * (len(values) - 1), f"({key} is not its setting)"
        else:
            i = next((j for j, g in enumerate(groups) if g[0].get("chosen")), None)
            cells, chosen = [fmt(x, ".3f") for x in scores], values[i] if i is not None else "-"
        lines.append("| " + " | ".join([m, *cells, chosen, fmt(base_acc, ".3f"), after]) + " |")
    lines += [
        "",
        "Validation: the last eval_samples rows of the task's train split, kept out of training (validation_rows); the choice "
        "reads only these"
        + (", averaged over the seeds" if seeded else "")
        + ". Held-out: the test split, read once for each "
        "final model of the chosen value, and once for the base model.",
    ]
    return "\n".join(lines) + "\n"
