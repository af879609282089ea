"""One prepared GPU check: bf16 steps of GRPO, SFT and DPO through the real trainer.

Prints, per method, seconds per step (split into generation/scoring, prepare, and the
training passes), training tokens/s (every non-pad token forwarded and backpropagated),
generation tokens/s, peak GPU memory, and the training FLOP rate as a fraction of the chip's
own bf16 matmul rate measured in the same run (6 x parameters x tokens, plus 2 x parameters x
tokens for each no-grad reference/old forward).

Usage (on a CUDA machine, from the repository root):
    PYTHONPATH=. python3 benchmarks/gpu_step.py --model DIR [--steps 4] [--methods grpo,sft,dpo]
    PYTHONPATH=. python3 benchmarks/gpu_step.py --model qwen2.5-0.5b-shaped --methods grpo,grpo-lora   # full vs LoRA r=16
`qwen2.5-0.5b-shaped` is a random Qwen2ForCausalLM from Qwen2.5-0.5B's published config
(benchmarks/memory.py writes it once under the cache folder).
DIR is a Hugging Face checkpoint folder (or an alias); `--random-init DIR` first writes a
randomly initialised copy of the architecture in DIR's config.json (for machines that
cannot load the real weights; timings depend on shapes, not on weight values, except that a
random model never stops early, so every completion runs to max_new_tokens).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch


def matmul_rate(dtype: torch.dtype, n: int = 8192, reps: int = 10) -> float:
    """Measured dense matmul FLOP/s of this device for dtype."""
    a = torch.randn(n, n, device="cuda", dtype=dtype)
    b = torch.randn(n, n, device="cuda", dtype=dtype)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(reps):
        a @ b
    torch.cuda.synchronize()
    return 2 * n**3 * reps / (time.perf_counter() - t)


def random_init(folder: Path) -> None:
    """Write random weights for the architecture in folder/config.json (bf16 safetensors)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(folder)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg).to(torch.bfloat16)
    model.save_pretrained(folder, safe_serialization=True)


def run_method(method: str, model: str, steps: int, extra: dict, device: str = "cuda") -> dict:
    from gcfamily.config import Config
    from gcfamily.logger import read_metrics
    from gcfamily.trainer import Trainer

    out = Path(tempfile.mkdtemp(prefix=f"gpu-{method}-"))
    base = dict(method=method, model=model, task="arithmetic", max_steps=steps, output_dir=str(out), progress=False,
                device=device, dtype="bfloat16" if device == "cuda" else "float32", lr=1e-6, save_every=0)
    base.update(extra)
    cfg = Config(**base)
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    trainer = Trainer(cfg)
    tokens: list[int] = []
    forwards: list[int] = []
    prepare = trainer.method.prepare

    def counting_prepare(batch):  # count every non-pad token the step trains on, and the no-grad passes
        b = prepare(batch)
        tokens.append(int(b["attention_mask"].sum()))
        forwards.append(int("ref_logps" in b) + int("old_logps" in b))
        return b

    trainer.method.prepare = counting_prepare
    trainer.run()
    rows = [r for r in read_metrics(out) if "time/step_s" in r]
    params = sum(p.numel() for p in trainer.unwrapped_policy().parameters())
    skip = 1 if len(rows) > 1 else 0  # the first step pays for allocator growth and kernel choice
    rows, tok, fw = rows[skip:], tokens[skip:], forwards[skip:]
    step_s = sum(r["time/step_s"] for r in rows) / len(rows)
    gen_s = sum(r["time/data_s"] for r in rows) / len(rows)
    prep_s = sum(r["time/prepare_s"] for r in rows) / len(rows)
    train_s = step_s - gen_s - prep_s
    tok_per_step = sum(tok) / len(tok)
    flops = sum((6 + 2 * f) * params * t for f, t in zip(fw, tok)) / len(tok)
    gen_tokens = sum(r.get("completion/length_mean", 0.0) for r in rows) / len(rows) * extra.get("batch_size", 8) * extra.get("group_size", 1)
    return {
        "method": method, "params": params, "step_s": step_s, "generation_s": gen_s, "prepare_s": prep_s, "train_s": train_s,
        "train_tokens_per_step": tok_per_step, "train_tokens_per_s": tok_per_step / max(train_s + prep_s, 1e-9),
        "train_flops_per_s": flops / max(train_s + prep_s, 1e-9),
        "generation_tokens_per_s": gen_tokens / gen_s if gen_s > 0 and gen_tokens else None,
        "peak_memory_gb": torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else float("nan"),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--random-init", action="store_true")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--methods", default="grpo,sft,dpo")
    ap.add_argument("--json", default=None, help="also write the figures here")
    ap.add_argument("--cpu-smoke", action="store_true", help="run the same script on the CPU (a dry run, no rates)")
    a = ap.parse_args()
    if a.random_init:
        random_init(Path(a.model))
    model = a.model
    if model == "qwen2.5-0.5b-shaped":
        from memory import model_source  # benchmarks/ is on sys.path when this file runs as a script

        model = model_source(model)
    device = "cpu" if a.cpu_smoke else "cuda"
    print(f"device: {torch.cuda.get_device_name() if device == 'cuda' else 'cpu'}, torch {torch.__version__}")
    rate = matmul_rate(torch.bfloat16) if device == "cuda" else 1e12
    print(f"bf16 matmul rate (8192^3, measured): {rate / 1e12:.0f} TFLOP/s")
    settings = {
        "grpo": dict(batch_size=8, group_size=8, max_new_tokens=64, micro_batch_size=64, beta=0.04),
        "grpo-lora": dict(batch_size=8, group_size=8, max_new_tokens=64, micro_batch_size=64, beta=0.04, lora_r=16, lora_alpha=32.0),
        "grpo-beta0": dict(batch_size=8, group_size=8, max_new_tokens=64, micro_batch_size=64, beta=0.0),
        "sft": dict(batch_size=64, micro_batch_size=64),
        "dpo": dict(batch_size=32, micro_batch_size=64, beta=0.1),
    }
    results = []
    for m in a.methods.split(","):
        extra = settings.get(m, {})
        r = run_method(m.replace("-beta0", "").replace("-lora", ""), model, a.steps, extra, device)
        r["method"] = m
        r["fraction_of_bf16_matmul"] = r["train_flops_per_s"] / rate
        results.append(r)
        gen = f", generation {r['generation_tokens_per_s']:.0f} tok/s" if r["generation_tokens_per_s"] else ""
        print(f"{m}: {r['step_s']:.3f} s/step (generation {r['generation_s']:.3f}, prepare {r['prepare_s']:.3f}, train {r['train_s']:.3f}); "
              f"{r['train_tokens_per_s']:.0f} train tok/s = {100 * r['fraction_of_bf16_matmul']:.1f}% of bf16 matmul{gen}; "
              f"peak {r['peak_memory_gb']:.2f} GB", flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps({"bf16_matmul_flops": rate, "results": results}, indent=2))


if __name__ == "__main__":
    main()
