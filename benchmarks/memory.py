"""Peak memory and s/step of a GRPO step: full fine-tuning against LoRA, on two model shapes.

    .venv/bin/python benchmarks/memory.py                          # smollm2-135m and qwen2.5-0.5b-shaped, CPU float32
    .venv/bin/python benchmarks/memory.py --models tiny --steps 2  # a smoke run

Each (model, mode) runs in its own process, one after another, so that a process's peak resident
memory (ru_maxrss) is that run's alone: GRPO, 8 prompts x 8 completions of up to 64 new tokens,
beta 0.04 (so a reference is needed), temperature 1, lr 1e-6, the arithmetic task's prompts.

- full: every weight trains; the process holds the policy, its gradients, AdamW's two moments
  and a frozen copy of the policy as the reference.
- lora: adapters of rank 16 (alpha 32) on every attention and MLP projection; the reference is
  the policy with its adapters off, so the weights are held once and only the adapters have
  gradients and AdamW state.

Models: `smollm2-135m` (the real SmolLM2-135M-Instruct weights), and `qwen2.5-0.5b-shaped`: a
Qwen2ForCausalLM built from Qwen2.5-0.5B's published config with random weights (for memory and
time the architecture and size matter, not the weights) and the tiny character tokenizer, saved
once under the cache folder. Random weights rarely emit EOS, so its completions run the full 64
tokens; SmolLM2's stop where the model stops (the same samples in both modes at step 1: LoRA starts
as the same function, and the seed is the same).

Printed per run: peak RSS (the process's lifetime maximum: loading included), the median s/step
over the steps after the first, and the trained parameter count; then LoRA's peak over full's.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

STEP = dict(
    method="grpo",
    task="arithmetic",
    batch_size=8,
    group_size=8,
    max_new_tokens=64,
    beta=0.04,
    lr=1e-6,
    temperature=1.0,
    micro_batch_size=8,
    device="cpu",
    dtype="float32",
    progress=False,
    log_every=1,
)
LORA = dict(lora_r=16, lora_alpha=32.0)

# Qwen2.5-0.5B's published config (Qwen/Qwen2.5-0.5B-Instruct, config.json)
QWEN25_05B = dict(
    vocab_size=151936,
    hidden_size=896,
    intermediate_size=4864,
    num_hidden_layers=24,
    num_attention_heads=14,
    num_key_value_heads=2,
    max_position_embeddings=32768,
    rope_theta=1000000.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
    use_sliding_window=False,
    sliding_window=32768,
    max_window_layers=21,
    hidden_act="silu",
)


def model_source(name: str) -> str:
    """What --model takes: an alias, or the folder of the random Qwen2.5-0.5B-shaped model (made once)."""
    if name != "qwen2.5-0.5b-shaped":
        return name
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from gcfamily.models import cache_dir, tiny_tokenizer

    folder = cache_dir() / "qwen2.5-0.5b-shaped"
    if not (folder / "model.safetensors").is_file():
        tok = tiny_tokenizer()
        torch.manual_seed(0)
        model = Qwen2ForCausalLM(
            Qwen2Config(
                **QWEN25_05B,
                pad_token_id=tok.pad_token_id,
                eos_token_id=tok.eos_token_id,
                bos_token_id=tok.bos_token_id,
            )
        )
        model.save_pretrained(folder, safe_serialization=True)
        tok.save_pretrained(folder)
    return str(folder)


def child(model: str, mode: str, steps: int, out: str, checkpointing: bool = False, pack: bool = True) -> None:
    """One run in this process: `steps` GRPO steps; prints one JSON line of figures."""
    import torch

    from gcfamily.config import Config
    from gcfamily.run.trainer import Trainer

    torch.set_num_threads(2)
    cfg = Config(
        model=model_source(model),
        output_dir=out,
        max_steps=steps,
        activation_checkpointing=checkpointing,
        rollout_pack_weights=pack,
        **STEP,
        **(LORA if mode == "lora" else {}),
    )
    tr = Trainer(cfg)
    tr.save_final = lambda: None  # what is measured is training; skip writing the final model
    tr.save_checkpoint = lambda: None
    t0 = time.perf_counter()
    tr.run()
    rows = [json.loads(x) for x in (Path(out) / "metrics.jsonl").read_text().splitlines() if x.strip()]
    times = [r["time/step_s"] for r in rows if "time/step_s" in r]
    print(
        json.dumps(
            {
                "model": model,
                "mode": mode,
                "peak_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                "s_per_step": statistics.median(times[1:] or times),
                "step_s": times,
                "wall_s": time.perf_counter() - t0,
                "trained_params": sum(p.numel() for p in tr.policy.parameters() if p.requires_grad),
                "generated_tokens": [r.get("tokens/generated") for r in rows],
            }
        )
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="smollm2-135m,qwen2.5-0.5b-shaped")
    ap.add_argument("--steps", type=int, default=3, help="GRPO steps per run (the first is left out of s/step)")
    ap.add_argument("--work", default="runs/bench-memory")
    ap.add_argument(
        "--activation-checkpointing",
        action="store_true",
        help="recompute decoder layers in the backward, in both modes",
    )
    ap.add_argument(
        "--no-pack-weights",
        action="store_true",
        help="rollout_pack_weights=false in both modes: sample on the plain weights, no oneDNN packed copy",
    )
    ap.add_argument("--child", nargs=3, metavar=("MODEL", "MODE", "STEPS"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        model, mode, steps = args.child
        child(
            model,
            mode,
            int(steps),
            str(Path(args.work) / f"{model}-{mode}"),
            args.activation_checkpointing,
            not args.no_pack_weights,
        )
        return
    results = []
    for model in args.models.split(","):
        model_source(model)  # make the random model's folder before timing anything
        for mode in ("full", "lora"):
            cmd = [sys.executable, __file__, "--work", args.work, "--child", model, mode, str(args.steps)]
            cmd += ["--activation-checkpointing"] if args.activation_checkpointing else []
            cmd += ["--no-pack-weights"] if args.no_pack_weights else []
            res = subprocess.run(cmd, capture_output=True, text=True)
            if res.returncode != 0:
                sys.exit(f"{model} {mode} failed:\n{res.stderr[-3000:]}")
            row = json.loads(res.stdout.strip().splitlines()[-1])
            results.append(row)
            print(
                f"{model:22s} {mode:5s} peak {row['peak_mb']:8.0f} MB  {row['s_per_step']:7.2f} s/step  "
                f"trained params {row['trained_params']:,}  steps {[round(s, 1) for s in row['step_s']]}",
                flush=True,
            )
    print(
        "\n| model | full peak MB | LoRA r=16 peak MB | LoRA / full | full s/step | LoRA s/step |\n|---|---|---|---|---|---|"
    )
    for model in args.models.split(","):
        full, lo = (next(r for r in results if r["model"] == model and r["mode"] == m) for m in ("full", "lora"))
        print(
            f"| {model} | {full['peak_mb']:,.0f} | {lo['peak_mb']:,.0f} | {lo['peak_mb'] / full['peak_mb']:.2f} | "
            f"{full['s_per_step']:.2f} | {lo['s_per_step']:.2f} |"
        )


if __name__ == "__main__":
    main()
