"""Against the peer: the same SFT, DPO and GRPO steps through TRL's trainers and through gcfamily.

    .venv/bin/python benchmarks/vs_trl.py                                  # smollm2-135m, float32, CPU
    .venv/bin/python benchmarks/vs_trl.py --cases grpo,grpo-beta0 --steps 3 --reps 2
    .venv/bin/python benchmarks/vs_trl.py --model tiny --steps 3 --reps 1  # a smoke run of the script

Needs TRL (`pip install -e ".[trl]"`; on a CPU machine pin torch with it so pip keeps the CPU
build: `pip install trl "torch==2.13.0"`); without it the script says so and exits 0.

Each run is its own subprocess, and the frameworks alternate (gcfamily, TRL, gcfamily, TRL, ...)
so drift in machine load hits both. A run takes `--steps` optimizer steps; the first is a warm-up
and is dropped, and the figure is the median s/step over the other steps of all of that
framework's runs. Peak memory is the child's peak resident set size (ru_maxrss) at the end of its
last step, before anything is saved; the child's whole-life ru_maxrss (wait4) is printed too.

Settings are matched one to one (see CASES): the same model folder (identical weights), the same
arithmetic rows in the same order (TRL's shuffling is off and its dataset is gcfamily's step
order), batch, group size, completion length, beta, temperature 1 without top-k/top-p, float32,
AdamW, lr, gradient clipping at 1, no gradient accumulation in TRL, no gradient checkpointing, no
evaluation, no saving and no logging in TRL (logging_steps past the run, report_to none).
gcfamily runs with its own defaults for what does not change the gradient: micro-batches of 8 rows
(Z is counted over the whole step first, so 8 micro-batches give the one-batch gradient) and shared
prompts run once per group (share_prefix). `--gcf-set micro_batch_size=64 --gcf-set share_prefix=false`
runs it as one 64-row pass over every full row instead, as TRL does.
GRPO: one generation per step (steps_per_generation 1, num_iterations 1, so neither computes
pi_old), loss_type "grpo" (= gcfamily's "sequence" normalisation), group-std scaling; the reward
is the task's own numeric reward in both. DPO: TRL precomputes the reference log-probs before
training (precompute_ref_log_probs), as gcfamily does in setup, so neither step runs the
reference; `--dpo-ref per-step` gives TRL's default instead.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CASES = {
    "sft": {"method": "sft", "batch_size": 8, "lr": 2e-5},
    "dpo": {"method": "dpo", "batch_size": 8, "beta": 0.1, "lr": 1e-6},
    "grpo": {"method": "grpo", "batch_size": 8, "group_size": 8, "max_new_tokens": 64, "beta": 0.04, "lr": 1e-6},
    "grpo-beta0": {"method": "grpo", "batch_size": 8, "group_size": 8, "max_new_tokens": 64, "beta": 0.0, "lr": 1e-6},
}
SEED = 0
# TRL 1.16's GRPO loss as gcfamily settings (docs/trl-mapping.md, checked by benchmarks/trl_parity.py): the group std
# plus 1e-4, and the KL as the importance-weighted k3, unclamped; the rest of the case is matched one to one
MATCH_TRL = {"grpo": {"std_eps": 1e-4, "kl_estimator": "k3-importance-weighted", "kl_clamp": None}}


def rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def model_folder(name: str, work: Path) -> str:
    """A checkpoint folder both frameworks load: smollm2's converted cache, or the tiny model saved once."""
    from gcfamily.models import load_model, resolve_source

    if name != "tiny":
        return resolve_source(name)
    folder = work / "tiny-model"
    if not (folder / "config.json").is_file():
        model, tok = load_model("tiny", seed=SEED)
        model.save_pretrained(folder)
        tok.save_pretrained(folder)
    return str(folder)


def step_rows(n: int, steps: int, batch: int) -> list[int]:
    """Indices of the rows gcfamily's steps 0..steps-1 read, in order."""
    from gcfamily.data.batches import epoch_indices

    return [i for s in range(steps) for i in epoch_indices(n, SEED, s, batch)]


# ----------------------------------------------------------------------------------
# the two children


def run_gcfamily(case: dict, model: str, steps: int, out: Path, extra: dict) -> dict:
    from gcfamily.methods import resolve
    from gcfamily.run.logger import read_metrics
    from gcfamily.run.trainer import Trainer

    cfg = resolve(
        None,
        dict(
            method=case["method"],
            model=model,
            task="arithmetic",
            seed=SEED,
            device="cpu",
            dtype="float32",
            max_steps=steps,
            batch_size=case["batch_size"],
            lr=case["lr"],
            group_size=case.get("group_size", 8),
            max_new_tokens=case.get("max_new_tokens", 64),
            **({"beta": case["beta"]} if "beta" in case else {}),
            **MATCH_TRL.get(case["method"], {}),
            temperature=1.0,
            top_p=1.0,
            top_k=0,
            grad_clip=1.0,
            max_length=1024,
            eval_at_ends=False,
            progress=False,
            save_every=0,
            keep_last=1,
            output_dir=str(out),
            overwrite=True,
        )
        | extra,
    )  # all given: no method default replaces them
    trainer = Trainer(cfg)
    trainer.run()
    rows = [r for r in read_metrics(out) if "time/step_s" in r]
    res = {"step_s": [r["time/step_s"] for r in rows], "peak_rss_mb": rows[-1]["peak_memory_mb"]}
    if case["method"] == "grpo":  # sampling and scoring, the trainer's data time
        res.update(
            generation_s=[r["time/data_s"] for r in rows],
            generated_tokens=[r.get("tokens/generated", 0.0) for r in rows],
        )
    return res


def run_trl(case: dict, model: str, steps: int, out: Path, dpo_ref: str) -> dict:
    import torch
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback

    from gcfamily.tasks import get_task

    class Timer(TrainerCallback):
        """Seconds from the start of each optimizer step to its end (generation included for GRPO)."""

        def __init__(self) -> None:
            self.times: list[float] = []
            self.rss = 0.0

        def on_step_begin(self, args, state, control, **kw):  # noqa: ANN001
            self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):  # noqa: ANN001
            self.times.append(time.perf_counter() - self.t0)
            self.rss = rss_mb()

    task = get_task("arithmetic", seed=SEED)
    tok = AutoTokenizer.from_pretrained(model)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    common = dict(
        model_init_kwargs={"dtype": torch.float32},
        output_dir=str(out),
        max_steps=steps,
        per_device_train_batch_size=case["batch_size"],
        gradient_accumulation_steps=1,
        learning_rate=case["lr"],
        lr_scheduler_type="constant",
        weight_decay=0.0,
        max_grad_norm=1.0,
        optim="adamw_torch",
        bf16=False,
        fp16=False,
        use_cpu=True,
        gradient_checkpointing=False,
        logging_steps=10**6,
        report_to="none",
        save_strategy="no",
        eval_strategy="no",
        seed=SEED,
        data_seed=SEED,
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    timer = Timer()
    m = case["method"]

    def user(p: str) -> list[dict]:
        return [{"role": "user", "content": p}]

    if m == "sft":
        from trl import SFTConfig, SFTTrainer

        rows = task.rows("train")
        data = [
            {"prompt": user(rows[i]["prompt"]), "completion": [{"role": "assistant", "content": rows[i]["completion"]}]}
            for i in step_rows(len(rows), steps, case["batch_size"])
        ]
        args = SFTConfig(**common, max_length=1024, shuffle_dataset=False, packing=False)
        trainer = SFTTrainer(
            model=model, args=args, train_dataset=Dataset.from_list(data), processing_class=tok, callbacks=[timer]
        )
    elif m == "dpo":
        from trl import DPOConfig, DPOTrainer

        from gcfamily.data.preferences import preference_rows

        pairs = preference_rows(task, None, SEED)
        data = [
            {
                "prompt": user(pairs[i]["prompt"]),
                "chosen": [{"role": "assistant", "content": pairs[i]["chosen"]}],
                "rejected": [{"role": "assistant", "content": pairs[i]["rejected"]}],
            }
            for i in step_rows(len(pairs), steps, case["batch_size"])
        ]
        args = DPOConfig(**common, beta=case["beta"], max_length=1024, precompute_ref_log_probs=dpo_ref == "precompute")
        trainer = DPOTrainer(
            model=model, args=args, train_dataset=Dataset.from_list(data), processing_class=tok, callbacks=[timer]
        )
    else:
        from trl import GRPOConfig, GRPOTrainer

        rows = task.rows("train")
        data = [
            {"prompt": user(rows[i]["prompt"]), "answer": rows[i]["answer"]}
            for i in step_rows(len(rows), steps, case["batch_size"])
        ]
        G = case["group_size"]

        def reward(prompts, completions, answer, **kw):  # noqa: ANN001
            texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
            return task.reward([p[-1]["content"] if isinstance(p, list) else p for p in prompts], texts, answer=answer)

        generated: list[float] = []
        common["per_device_train_batch_size"] = case["batch_size"] * G  # TRL counts completions per device
        args = GRPOConfig(
            **common,
            num_generations=G,
            max_completion_length=case["max_new_tokens"],
            beta=case["beta"],
            temperature=1.0,
            top_p=1.0,
            top_k=0,
            num_iterations=1,
            steps_per_generation=1,
            loss_type="grpo",
            scale_rewards="group",
            epsilon=0.2,
            shuffle_dataset=False,
            log_completions=False,
        )
        trainer = GRPOTrainer(
            model=model,
            reward_funcs=[reward],
            args=args,
            train_dataset=Dataset.from_list(data),
            processing_class=tok,
            callbacks=[timer],
        )
        inner = trainer._generate_and_score_completions

        def counting(inputs):  # noqa: ANN001
            t0 = time.perf_counter()
            o = inner(inputs)
            generated.append(float(o["completion_mask"].sum()))
            timer_gen.append(time.perf_counter() - t0)
            return o

        timer_gen: list[float] = []
        trainer._generate_and_score_completions = counting
    trainer.train()
    res = {"step_s": timer.times, "peak_rss_mb": timer.rss}
    if m == "grpo":
        res.update(generation_s=timer_gen, generated_tokens=generated)
    return res


# ----------------------------------------------------------------------------------
# the parent


def launch(
    framework: str, case_name: str, model: str, steps: int, work: Path, dpo_ref: str, gcf_set: list[str]
) -> dict:
    out = work / f"{framework}-{case_name}-{time.time_ns()}"
    res_path = out.with_suffix(".json")
    cmd = [
        sys.executable,
        __file__,
        "--child",
        framework,
        "--cases",
        case_name,
        "--model-dir",
        model,
        "--steps",
        str(steps),
        "--result",
        str(res_path),
        "--dpo-ref",
        dpo_ref,
    ] + [x for kv in gcf_set for x in ("--gcf-set", kv)]
    log = out.with_suffix(".log")
    with log.open("w") as f:
        proc = subprocess.Popen(
            cmd, stdout=f, stderr=subprocess.STDOUT, env={**os.environ, "TOKENIZERS_PARALLELISM": "false"}
        )
        _, status, usage = os.wait4(proc.pid, 0)
    if os.waitstatus_to_exitcode(status) != 0 or not res_path.is_file():
        tail = log.read_text().strip().splitlines()[-15:]
        raise SystemExit(f"{framework} {case_name} failed (log {log}):\n" + "\n".join(tail))
    res = json.loads(res_path.read_text())
    res["lifetime_rss_mb"] = usage.ru_maxrss / 1024
    shutil.rmtree(out, ignore_errors=True)  # a run's saved model and checkpoint (GBs); the log stays
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m", help="smollm2-135m, tiny, or a checkpoint folder")
    ap.add_argument("--cases", default="sft,dpo,grpo,grpo-beta0", help=f"comma-separated, from {', '.join(CASES)}")
    ap.add_argument("--steps", type=int, default=4, help="optimizer steps per run (the first is dropped)")
    ap.add_argument("--reps", type=int, default=2, help="runs per framework and case, alternating")
    ap.add_argument("--dpo-ref", default="precompute", choices=["precompute", "per-step"])
    ap.add_argument(
        "--gcf-set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="change a gcfamily setting, e.g. micro_batch_size=64 (same gradient, more memory)",
    )
    ap.add_argument("--frameworks", default="gcfamily,trl", help="which to run (one alone: its own figures, no ratio)")
    ap.add_argument("--json", default=None, help="also write every figure here")
    ap.add_argument("--child", choices=["gcfamily", "trl"], help=argparse.SUPPRESS)
    ap.add_argument("--model-dir", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    a = ap.parse_args()

    if a.child:
        case = CASES[a.cases]
        out = Path(a.result).with_suffix("")
        from gcfamily.config import parse_sets

        res = (
            run_gcfamily(case, a.model_dir, a.steps, out, parse_sets(tuple(a.gcf_set)))
            if a.child == "gcfamily"
            else run_trl(case, a.model_dir, a.steps, out, a.dpo_ref)
        )
        Path(a.result).write_text(json.dumps(res))
        return

    order = [f for f in ("gcfamily", "trl") if f in a.frameworks.split(",")]
    try:
        import trl

        trl_version = trl.__version__
    except ImportError:
        trl_version = "not installed"
        if "trl" in order:
            print(
                'TRL is not installed, so there is nothing to compare against: pip install -e ".[trl]" '
                '(on a CPU machine: pip install trl "torch==2.13.0"), then run this again.'
            )
            return
    import torch

    cases = [c.strip() for c in a.cases.split(",") if c.strip()]
    unknown = [c for c in cases if c not in CASES]
    if unknown:
        raise SystemExit(f"unknown case(s) {unknown}; choose from {', '.join(CASES)}")
    work = Path(tempfile.mkdtemp(prefix="vs-trl-"))
    model = model_folder(a.model, work)
    print(
        f"TRL {trl_version}, torch {torch.__version__} ({torch.get_num_threads()} threads), model {a.model}, float32 CPU, "
        f"{a.steps} steps per run (first dropped), {a.reps} runs per framework, load average {os.getloadavg()[0]:.2f}"
        + (f"; gcfamily settings changed: {' '.join(a.gcf_set)}" if a.gcf_set else ""),
        flush=True,
    )
    report = {}
    for name in cases:
        runs: dict[str, list[dict]] = {f: [] for f in order}
        for rep in range(a.reps):
            for fw in order if rep % 2 == 0 else order[::-1]:
                r = launch(fw, name, model, a.steps, work, a.dpo_ref, a.gcf_set)
                runs[fw].append(r)
                gen = (
                    f", generation {statistics.median(r['generation_s'][1:] or r['generation_s']):.2f} s for "
                    f"{statistics.median(r['generated_tokens'][1:] or r['generated_tokens']):.0f} tokens"
                    if any(r.get("generated_tokens", []))
                    else ""
                )
                print(
                    f"  {name} rep {rep} {fw:8s}: steps {' '.join(f'{s:.2f}' for s in r['step_s'])} s{gen}; "
                    f"peak {r['peak_rss_mb']:.0f} MB (lifetime {r['lifetime_rss_mb']:.0f} MB); load {os.getloadavg()[0]:.2f}",
                    flush=True,
                )
        summary = {}
        for fw, rs in runs.items():
            times = [t for r in rs for t in (r["step_s"][1:] or r["step_s"])]
            gen_s = [t for r in rs for t in (r.get("generation_s", [])[1:] or r.get("generation_s", []))]
            gen_tok = [t for r in rs for t in (r.get("generated_tokens", [])[1:] or r.get("generated_tokens", []))]
            summary[fw] = {
                "step_s": statistics.median(times),
                "peak_rss_mb": max(r["peak_rss_mb"] for r in rs),
                "lifetime_rss_mb": max(r["lifetime_rss_mb"] for r in rs),
                "generation_s": statistics.median(gen_s) if gen_s else None,
                "generation_tokens_per_s": sum(gen_tok) / sum(gen_s) if gen_s else None,
                "runs": rs,
            }
        report[name] = summary
        if len(order) < 2:
            for fw, v in summary.items():
                gen = f"; generation {v['generation_tokens_per_s']:.0f} tok/s" if v["generation_tokens_per_s"] else ""
                print(f"{name}: {fw} {v['step_s']:.2f} s/step, peak {v['peak_rss_mb']:.0f} MB{gen}", flush=True)
            continue
        g, t = summary["gcfamily"], summary["trl"]
        summary["ratio_step_s"] = g["step_s"] / t["step_s"]
        summary["ratio_peak_rss"] = g["peak_rss_mb"] / t["peak_rss_mb"]
        gen = ""
        if g["generation_tokens_per_s"]:
            gen = f"; generation {g['generation_tokens_per_s']:.0f} vs {t['generation_tokens_per_s']:.0f} tok/s"
        print(
            f"{name}: gcfamily {g['step_s']:.2f} s/step, peak {g['peak_rss_mb']:.0f} MB | TRL {t['step_s']:.2f} s/step, peak "
            f"{t['peak_rss_mb']:.0f} MB | ratio {summary['ratio_step_s']:.2f}x time, {summary['ratio_peak_rss']:.2f}x memory{gen}",
            flush=True,
        )
    if a.json:
        Path(a.json).write_text(
            json.dumps(
                {
                    "model": a.model,
                    "gcf_set": a.gcf_set,
                    "trl": trl_version,
                    "torch": torch.__version__,
                    "cases": report,
                },
                indent=1,
            )
        )


if __name__ == "__main__":
    main()
