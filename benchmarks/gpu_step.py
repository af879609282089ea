"""One prepared GPU check: the rollout's decode and a bf16 GRPO step, eager and compiled, on two model shapes.

For a SmolLM2-135M-shaped and a Qwen2.5-0.5B-shaped model (random weights from their published
configs: timings depend on shapes, not on weight values), it prints and writes as JSON:

- decode at batch 64 (8 prompts x 8 samples, --new-tokens new tokens, every row forced to the full
  length): ms per decode step, generated tokens/s, prefill seconds; eager (`rollout_compile: off`)
  and compiled (`on`: fixed-shape step, CUDA graphs), the compiled one after its first, compiling call;
- a GRPO step (8 x 8, the same new tokens, beta 0.04) through the real trainer, bf16 compute over
  float32 master weights (on CUDA): seconds per step, its generation share, training tokens/s, the
  training FLOP rate as a share of the chip's bf16 matmul rate measured in the same run, and peak memory.
- the same GRPO step with LoRA adapters (`--lora`, rank 16 on CUDA; for `--lora-models`, the Qwen2.5-0.5B shape by
  default): s/step, training tokens/s and peak memory against full fine-tuning's, the reference being the adapters off.

It runs from the working tree with nothing installed (`PYTHONPATH=.`), importing only torch,
transformers and the project (no `datasets`, no `gguf`): the tokenizer is the built-in character-level
one, which is all random weights need. Completions are forced to full length by giving the sampler no
EOS id (a random model would otherwise stop some rows early by chance).

    PYTHONPATH=. python3 benchmarks/gpu_step.py --json $OUT/gpu_step.json           # CUDA, both models
    PYTHONPATH=. python3 benchmarks/gpu_step.py --device cpu --model tiny            # the CPU smoke run (CI-like, < 2 min)
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SHAPES = {  # published configs (config.json of HuggingFaceTB/SmolLM2-135M-Instruct and Qwen/Qwen2.5-0.5B-Instruct)
    "smollm2-135m-shaped": (
        "llama",
        dict(
            vocab_size=49152,
            hidden_size=576,
            intermediate_size=1536,
            num_hidden_layers=30,
            num_attention_heads=9,
            num_key_value_heads=3,
            rope_theta=100000.0,
            rms_norm_eps=1e-5,
            max_position_embeddings=8192,
            tie_word_embeddings=True,
        ),
    ),
    "qwen2.5-0.5b-shaped": (
        "qwen2",
        dict(
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
        ),
    ),
    "tiny": (
        "llama",
        dict(
            vocab_size=128,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=2048,
            tie_word_embeddings=False,
        ),
    ),
}
PROMPTS = [
    "What is 12 + 7?",
    "What is 9 * 8?",
    "Compute 45 - 17.",
    "What is 144 / 12?",
    "What is 3 + 4 * 2?",
    "Compute 15 * 15.",
    "What is 100 - 37?",
    "What is 7 * 6 + 1?",
]


def build(name: str):
    """A random model of the named shape (float32, sdpa) and the character-level tokenizer."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    from gcfamily.models import tiny_tokenizer

    tok = tiny_tokenizer()
    family, shape = SHAPES[name]
    ids = dict(pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id)
    config = (LlamaConfig if family == "llama" else Qwen2Config)(**shape, **ids, attn_implementation="sdpa")
    torch.manual_seed(0)
    model = (LlamaForCausalLM if family == "llama" else Qwen2ForCausalLM)(config)
    return model, tok


def matmul_rate(device: str, dtype: torch.dtype) -> float:
    """Measured dense matmul FLOP/s of this device in dtype (8192^3 on CUDA, 1024^3 on the CPU)."""
    n, reps = (8192, 10) if device == "cuda" else (1024, 5)
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    for _ in range(3):
        a @ b
    sync(device)
    t = time.perf_counter()
    for _ in range(reps):
        a @ b
    sync(device)
    return 2 * n**3 * reps / (time.perf_counter() - t)


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def decode_figures(trainer, new_tokens: int, mode: str, reps: int) -> dict:
    """Rollout of 8 prompts x 8 samples at full length through the trainer's own policy and autocast."""
    from gcfamily.rollout import SamplingSettings, generate

    model, tok, device = trainer.unwrapped_policy(), trainer.formatter.tokenizer, trainer.device.type
    prompt_ids = [tok(p)["input_ids"] for p in PROMPTS]

    def once(c: int) -> float:
        sync(device)
        t = time.perf_counter()
        with torch.no_grad(), trainer.autocast():
            ro = generate(
                model,
                tok,
                prompt_ids,
                8,
                SamplingSettings(max_new_tokens=c, compile=mode),
                torch.Generator().manual_seed(0),
                [],
            )
        sync(device)
        assert int(ro.completion_lengths.min()) == c  # forced to the full length
        return time.perf_counter() - t

    t0 = time.perf_counter()
    once(new_tokens)  # first call: allocation, kernel choice, and for `on` the compilation and graph captures
    first = time.perf_counter() - t0
    prefill = min(once(1) for _ in range(reps))
    total = min(once(new_tokens) for _ in range(reps))
    return {
        "mode": mode,
        "first_call_s": first,
        "prefill_s": prefill,
        "rollout_s": total,
        "decode_ms_per_token": 1000 * (total - prefill) / max(new_tokens - 1, 1),
        "generated_tokens_per_s": 64 * new_tokens / total,
    }


def grpo_figures(
    name: str,
    device: str,
    new_tokens: int,
    steps: int,
    mode: str,
    reps: int,
    rate: float,
    lora_r: int = 0,
    backend: str = "native",
) -> dict:
    import gcfamily.rollout.native as rollout
    import gcfamily.rollout.vllm_engine as vllm_engine
    from gcfamily.config import Config
    from gcfamily.run.logger import read_metrics
    from gcfamily.run.trainer import Trainer

    out = Path(tempfile.mkdtemp(prefix=f"gpu-step-{name}-{mode}-"))
    cfg = Config(
        method="grpo",
        model=name,
        task="arithmetic",
        max_steps=steps,
        output_dir=str(out),
        progress=False,
        device=device,
        dtype="bfloat16" if device == "cuda" else "float32",
        lr=1e-6,
        save_every=0,
        batch_size=8,
        group_size=8,
        max_new_tokens=new_tokens,
        micro_batch_size=64,
        beta=0.04,
        rollout_compile=mode,
        rollout=backend,
        report_to="none",
        **(dict(lora_r=lora_r, lora_alpha=2.0 * lora_r) if lora_r else {}),
    )
    if device == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    eos = rollout._eos_ids, vllm_engine._eos_ids
    rollout._eos_ids = vllm_engine._eos_ids = lambda *a: []  # full-length completions (the engine's EOS ids too)
    t0 = time.perf_counter()
    try:
        trainer = Trainer(cfg, model=build(name))
    finally:
        rollout._eos_ids, vllm_engine._eos_ids = eos
    built_s = time.perf_counter() - t0  # with rollout=vllm: the engine's start-up
    decode = decode_figures(trainer, new_tokens, mode, reps) if backend == "native" else {}
    tokens: list[int] = []
    forwards: list[int] = []
    prepare = trainer.method.prepare

    def counting_prepare(batch):  # every non-pad token the step trains on, and the no-grad passes over them
        b, stats = prepare(batch)
        tokens.append(int(b.attention_mask.sum()))
        forwards.append(int(b.ref_logps is not None) + int(b.old_logps is not None))
        return b, stats

    trainer.method.prepare = counting_prepare
    rollout._eos_ids = lambda *a: []  # full-length completions in the training step too
    try:
        trainer.run()
    finally:
        rollout._eos_ids = eos[0]
    rows = [r for r in read_metrics(out) if "time/step_s" in r][1:]  # the first step pays for warm-up
    tok, fw = tokens[1:], forwards[1:]
    params = sum(p.numel() for p in trainer.unwrapped_policy().parameters())
    trained = sum(p.numel() for p in trainer.unwrapped_policy().parameters() if p.requires_grad)
    step_s = sum(r["time/step_s"] for r in rows) / len(rows)
    gen_s = sum(r["time/data_s"] for r in rows) / len(rows)
    train_s = step_s - gen_s
    # per trained token: forward 2N and the backward's input gradients 2N over every weight, weight gradients 2N over the
    # trained ones only (all of them in full fine-tuning: 6N; LoRA's frozen base takes none), and 2N per extra no-grad forward
    flops = sum(((4 + 2 * f) * params + 2 * trained) * t for f, t in zip(fw, tok)) / len(tok)
    return {
        "model": name,
        "params": params,
        "trained_params": trained,
        "mode": mode,
        "rollout": backend,
        "built_s": built_s,
        "lora_r": lora_r,
        **{f"decode_{k}": v for k, v in decode.items() if k != "mode"},
        "step_s": step_s,
        "generation_s": gen_s,
        "train_s": train_s,
        "train_tokens_per_step": sum(tok) / len(tok),
        "train_tokens_per_s": sum(tok) / len(tok) / max(train_s, 1e-9),
        "train_share_of_matmul": flops / max(train_s, 1e-9) / rate,
        "peak_memory_gb": torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else None,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cuda", "cpu"])
    ap.add_argument(
        "--model",
        default=None,
        help=f"comma-separated, of {', '.join(SHAPES)}; default the two shapes on CUDA, tiny on the CPU",
    )
    ap.add_argument(
        "--new-tokens", type=int, default=None, help="new tokens per completion (default 256 on CUDA, 64 on the CPU)"
    )
    ap.add_argument("--steps", type=int, default=3, help="GRPO steps per model and mode (the first is not counted)")
    ap.add_argument("--reps", type=int, default=2, help="timed rollouts per mode (the fastest is kept)")
    ap.add_argument("--modes", default="off,on", help="rollout_compile values to compare")
    ap.add_argument(
        "--lora",
        type=int,
        default=None,
        help="also a GRPO run with LoRA adapters of this rank (default 16 on CUDA, off on the CPU)",
    )
    ap.add_argument(
        "--lora-models", default="qwen2.5-0.5b-shaped", help="the models (of --model) the LoRA run is made for"
    )
    ap.add_argument(
        "--vllm",
        default="auto",
        choices=["auto", "on", "off"],
        help="also a GRPO step with rollout=vllm (auto: if vLLM imports)",
    )
    ap.add_argument("--json", default=None, help="also write every figure here")
    a = ap.parse_args()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    names = (a.model or ("smollm2-135m-shaped,qwen2.5-0.5b-shaped" if a.device == "cuda" else "tiny")).split(",")
    new_tokens = a.new_tokens or (256 if a.device == "cuda" else 64)
    dtype = torch.bfloat16 if a.device == "cuda" else torch.float32
    rate = matmul_rate(a.device, dtype)
    where = torch.cuda.get_device_name() if a.device == "cuda" else f"cpu ({torch.get_num_threads()} threads)"
    print(
        f"{where}, torch {torch.__version__}; {str(dtype)[6:]} matmul rate measured: {rate / 1e12:.2f} TFLOP/s; "
        f"GRPO 8 x 8, {new_tokens} new tokens (forced), beta 0.04",
        flush=True,
    )
    results = []
    for name in names:
        for mode in a.modes.split(","):
            t = time.perf_counter()
            r = grpo_figures(name, a.device, new_tokens, a.steps, mode, a.reps, rate)
            r["wall_s"] = time.perf_counter() - t
            results.append(r)
            mem = f", peak {r['peak_memory_gb']:.2f} GB" if r["peak_memory_gb"] is not None else ""
            print(
                f"{name} rollout_compile={mode}: decode {r['decode_decode_ms_per_token']:.2f} ms/token at batch 64, "
                f"{r['decode_generated_tokens_per_s']:.0f} generated tok/s (first call {r['decode_first_call_s']:.1f} s); "
                f"GRPO step {r['step_s']:.3f} s (generation {r['generation_s']:.3f}), training {r['train_tokens_per_s']:.0f} tok/s "
                f"= {100 * r['train_share_of_matmul']:.1f}% of matmul{mem} [{r['wall_s']:.0f} s]",
                flush=True,
            )
        by = {r["mode"]: r for r in results if r["model"] == name and not r["lora_r"] and r["rollout"] == "native"}
        lora_r = a.lora if a.lora is not None else (16 if a.device == "cuda" else 0)
        if lora_r and name in a.lora_models.split(","):  # the same step with adapters: full fine-tuning against LoRA
            mode = a.modes.split(",")[-1]
            t = time.perf_counter()
            r = grpo_figures(name, a.device, new_tokens, a.steps, mode, a.reps, rate, lora_r)
            r["wall_s"] = time.perf_counter() - t
            results.append(r)
            full = by[mode]
            mem = (
                (
                    f", peak {r['peak_memory_gb']:.2f} GB against {full['peak_memory_gb']:.2f} GB "
                    f"({r['peak_memory_gb'] / full['peak_memory_gb']:.2f})"
                )
                if r["peak_memory_gb"] is not None
                else ""
            )
            print(
                f"{name} LoRA r={lora_r} (rollout_compile={mode}): GRPO step {r['step_s']:.3f} s against {full['step_s']:.3f} s full "
                f"(generation {r['generation_s']:.3f}), training {r['train_tokens_per_s']:.0f} tok/s{mem} [{r['wall_s']:.0f} s]",
                flush=True,
            )
        if a.vllm == "on" or (a.vllm == "auto" and importlib.util.find_spec("vllm") is not None):
            mode = a.modes.split(",")[0]
            t = time.perf_counter()
            try:
                r = grpo_figures(name, a.device, new_tokens, a.steps, mode, a.reps, rate, backend="vllm")
            except Exception as e:  # noqa: BLE001 - a GPU check reports what failed and goes on with the rest
                print(f"{name} rollout=vllm failed: {e}", flush=True)
            else:
                r["wall_s"] = time.perf_counter() - t
                results.append(r)
                mem = f", peak {r['peak_memory_gb']:.2f} GB" if r["peak_memory_gb"] is not None else ""
                native = by.get(mode)
                print(
                    f"{name} rollout=vllm: engine start-up {r['built_s']:.1f} s; GRPO step {r['step_s']:.3f} s "
                    f"(generation {r['generation_s']:.3f})"
                    + (
                        f" against {native['step_s']:.3f} s native (generation {native['generation_s']:.3f})"
                        if native
                        else ""
                    )
                    + f"{mem} [{r['wall_s']:.0f} s]",
                    flush=True,
                )
        if "off" in by and "on" in by:
            print(
                f"{name}: compiled / eager: step {by['off']['step_s'] / by['on']['step_s']:.2f}x faster, decode "
                f"{by['off']['decode_decode_ms_per_token'] / by['on']['decode_decode_ms_per_token']:.2f}x faster",
                flush=True,
            )
    if a.json:
        Path(a.json).write_text(
            json.dumps(
                {
                    "device": where,
                    "torch": torch.__version__,
                    "matmul_flops": rate,
                    "new_tokens": new_tokens,
                    "results": results,
                },
                indent=1,
            )
        )


if __name__ == "__main__":
    main()
