"""Does bf16 compute learn what float32 learns? The same SFT and GRPO runs on SmolLM2-135M in each dtype, with seeds.

    .venv/bin/python benchmarks/bf16_training.py                      # SFT 20 steps and GRPO 24 steps, seeds 0-2
    .venv/bin/python benchmarks/bf16_training.py --methods sft --seeds 0,1 --sft-steps 6

Each run is `gcf run` of a shipped recipe (configs/sft-arithmetic.yaml, configs/default.yaml) with --set dtype=D and
seed=S (the seed orders the data and draws the samples); the dtypes alternate within each seed, so both see the same
machine. Printed per run: the mean seconds a step (time/step_s), the last logged training loss, the run's own held-out
accuracy at its end (greedy, in its own dtype), and the held-out NLL per answer token of its final model on the 48
answers of benchmarks/bf16_components.py, computed in float32 for every run. Then per method and dtype the mean and
the seed-to-seed SD, and float32 minus bf16 against that spread. Nothing else should run on the machine.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "benchmarks"), str(ROOT)]

from bf16_components import answer_logps, smollm2_rows  # noqa: E402

RECIPES = {"sft": ("configs/sft-arithmetic.yaml", "sft_steps"), "grpo": ("configs/default.yaml", "grpo_steps")}


def run(method: str, dtype: str, seed: int, steps: int, out: Path) -> dict[str, float]:
    """One run; its figures (time a step, last loss, held-out accuracy at the end, float32 NLL of its final model)."""
    recipe = RECIPES[method][0]
    cmd = [str(Path(sys.executable).with_name("gcf")), "run", "--config", recipe, "--output-dir", str(out)]
    for kv in (f"dtype={dtype}", f"seed={seed}", f"max_steps={steps}", "progress=false", "save_every=0"):
        cmd += ["--set", kv]
    subprocess.run(cmd, cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps_rows = [r for r in rows if "time/step_s" in r]
    evals = [r["eval/accuracy"] for r in rows if "eval/accuracy" in r]
    from gcfamily.models import load_model

    model, tok = load_model(str(out))
    nll = -float(answer_logps(model.eval(), smollm2_rows(tok, 48), "fp32").mean())
    return {
        "step_s": statistics.mean(r["time/step_s"] for r in steps_rows[1:] or steps_rows),
        "loss": steps_rows[-1]["loss"],
        "acc0": evals[0] if len(evals) > 1 else float("nan"),
        "acc": evals[-1] if evals else float("nan"),
        "nll": nll,
    }


def summary(label: str, vals: list[float]) -> str:
    sd = statistics.stdev(vals) if len(vals) > 1 else float("nan")
    return f"{label} {statistics.mean(vals):.4f} (SD {sd:.4f})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--methods", default="sft,grpo")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--sft-steps", type=int, default=20)
    ap.add_argument("--grpo-steps", type=int, default=24)
    a = ap.parse_args()
    torch.set_num_threads(2)
    dtypes, seeds = a.dtypes.split(","), [int(s) for s in a.seeds.split(",")]
    tmp = Path(tempfile.mkdtemp(prefix="bf16-training-"))
    try:
        for method in a.methods.split(","):
            steps = getattr(a, RECIPES[method][1])
            got: dict[str, list[dict[str, float]]] = {d: [] for d in dtypes}
            for seed in seeds:
                for d in dtypes if seed % 2 == 0 else dtypes[::-1]:  # alternate which dtype runs first
                    r = run(method, d, seed, steps, tmp / f"{method}-{d}-{seed}")
                    got[d].append(r)
                    print(
                        f"{method} {d:9s} seed {seed}: {r['step_s']:.2f} s a step, last loss {r['loss']:.4f}, held-out "
                        f"accuracy {r['acc0']:.3f} -> {r['acc']:.3f}, float32 NLL of the final model {r['nll']:.4f}",
                        flush=True,
                    )
                    shutil.rmtree(tmp / f"{method}-{d}-{seed}")
            print(f"{method}, {steps} steps, seeds {a.seeds}:")
            for d in dtypes:
                rs = got[d]
                print(
                    f"  {d:9s} "
                    + ", ".join(
                        summary(k, [r[key] for r in rs])
                        for k, key in (("s/step", "step_s"), ("NLL", "nll"), ("accuracy", "acc"), ("last loss", "loss"))
                    )
                )
            if len(dtypes) == 2:
                x, y = (got[d] for d in dtypes)
                for k in ("nll", "acc"):
                    diffs = [p[k] - q[k] for p, q in zip(x, y)]
                    sd = statistics.mean([statistics.variance([r[k] for r in rs]) for rs in (x, y)]) ** 0.5

                    print(
                        f"  {k}: {dtypes[0]} - {dtypes[1]} per seed {', '.join(f'{v:+.4f}' for v in diffs)}; mean "
                        f"{statistics.mean(diffs):+.4f} against a seed-to-seed SD of {sd:.4f} (pooled within each dtype)"
                    )
                speed = statistics.mean(r["step_s"] for r in x) / statistics.mean(r["step_s"] for r in y)
                print(f"  a {dtypes[1]} step takes 1/{speed:.2f} of a {dtypes[0]} step")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
