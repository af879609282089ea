"""Engine throughput: one optimizer step of SFT, GRPO and DPO against this machine's own matmul rate,
and rollout generation against plain `transformers` generate, all measured in the same run.

    .venv/bin/python benchmarks/throughput.py                       # smollm2-135m, CPU float32
    .venv/bin/python benchmarks/throughput.py --model tiny --reps 2 --no-generation   # a smoke run
    .venv/bin/python benchmarks/throughput.py --profile             # also: where a step's time goes

Training step. The batch of step 0 is drawn once (for GRPO that samples the 8 x 8 completions,
which is not timed here: generation has its own figure below); each timed rep then runs the
method's `prepare` (GRPO: the reference forward) and the trainer's `train_step` (forward,
coefficient, backward, clip, AdamW step) on it. Settings are the TRL comparison's
(benchmarks/vs_trl.py CASES): SFT 8 rows, DPO 8 pairs, GRPO 8 prompts x 8 completions of up to 64
tokens, beta 0.04. The figure is the median of --reps reps after one warm-up rep.

gcfamily runs at its defaults for what does not change the gradient (micro-batches of 8 rows,
packed), as in the TRL comparison.

- train tok/s: every real (non-pad) token of the batch trained on, per second of the step.
- fraction of matmul (the issue's formula): 6 x parameters x real tokens per second over the
  float32 matmul FLOP/s measured here (torch.mm of 2048 x 2048 matrices, median of 5). Packing
  runs a shared prompt once per group, so this counts work the engine never does and can pass
  100%: it is the effective rate, not the machine's utilisation.
- fraction, FLOPs done: what the step actually multiplies. The engine runs the packed tokens
  (`engine.pack_rows`) and applies the output layer only to loss tokens, so: 6 x (parameters -
  embedding) x packed tokens + 6 x V x H x loss tokens, plus 2 x that forward for GRPO's
  reference pass (attention's own T^2 terms are left out: small at these lengths).

Generation: benchmarks/generation.py run as a subprocess (8 prompts x 8 samples = batch 64, 64
new tokens, temperature 1, no top-k/top-p; the two paths alternate), and its figures parsed.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from vs_trl import CASES  # noqa: E402  (the settings of the TRL comparison)


def matmul_rate(n: int = 2048, reps: int = 5) -> float:
    """Measured float32 dense matmul FLOP/s of this CPU at torch's thread count."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    for _ in range(2):
        a @ b
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        a @ b
        times.append(time.perf_counter() - t)
    return 2 * n**3 / statistics.median(times)


def step_figures(name: str, model: str, reps: int, profile: bool) -> dict:
    """Time `reps` training steps of one method on the batch of step 0; FLOP counts of what they do."""
    from gcfamily.core.engine import effective_mask, pack_rows
    from gcfamily.data.batches import split_batch
    from gcfamily.methods import resolve
    from gcfamily.run.trainer import Trainer

    case = CASES[name]
    cfg = resolve(
        None,
        dict(
            method=case["method"],
            model=model,
            task="arithmetic",
            seed=0,
            device="cpu",
            dtype="float32",
            max_steps=reps + 2,
            batch_size=case["batch_size"],
            lr=case["lr"],
            beta=case.get("beta", 0.04),
            group_size=case.get("group_size", 8),
            max_new_tokens=case.get("max_new_tokens", 64),
            temperature=1.0,
            max_length=1024,
            progress=False,
            output_dir=tempfile.mkdtemp(prefix=f"throughput-{name}-"),
        ),
    )
    tr = Trainer(cfg)
    t = time.perf_counter()
    batch, _ = tr.method.data(0)
    data_s = time.perf_counter() - t

    def one_step() -> tuple[float, float]:
        t0 = time.perf_counter()
        b, _ = tr.method.prepare(batch.copy())
        t1 = time.perf_counter()
        tr.train_step(b)
        return t1 - t0, time.perf_counter() - t1

    one_step()  # warm-up: allocator growth, first-call costs
    prep, train = zip(*[one_step() for _ in range(reps)])
    step_s = statistics.median(p + q for p, q in zip(prep, train))
    prepared, _ = tr.method.prepare(batch.copy())
    tokens = int(batch.attention_mask.sum())
    loss_tokens = int(effective_mask(prepared).sum())
    packed = 0  # tokens the model actually runs: packed micro-batches, a shared prompt once per group
    for mb in split_batch(batch, cfg.micro_batch_size, tr.method.rows_per_example):
        p = pack_rows(mb.input_ids, mb.attention_mask, mb.loss_mask, cfg.share_prefix)
        packed += mb.input_ids.numel() if p is None else p.input_ids.numel()
    policy = tr.unwrapped_policy()
    params = sum(p.numel() for p in policy.parameters())
    head = policy.get_output_embeddings().weight
    emb = policy.get_input_embeddings().weight
    V, H = head.shape
    backbone = params - emb.numel() - (head.numel() if head.data_ptr() != emb.data_ptr() else 0)
    fwd = 2 * (
        backbone * packed + V * H * loss_tokens
    )  # one forward pass as run: packed tokens, output layer on loss tokens only
    ref_passes = sum(
        k in prepared and k not in batch for k in ("ref_logps", "old_logps")
    )  # no-grad forwards in prepare
    out = {
        "method": name,
        "params": params,
        "tokens": tokens,
        "packed_tokens": packed,
        "loss_tokens": loss_tokens,
        "rows": int(batch.input_ids.shape[0]),
        "seq_len": int(batch.input_ids.shape[1]),
        "step_s": step_s,
        "prepare_s": statistics.median(prep),
        "train_s": statistics.median(train),
        "data_s": data_s,
        "train_tokens_per_s": tokens / step_s,
        "flops_6pt": 6 * params * tokens,
        "flops_done": 3 * fwd + ref_passes * fwd,
        "ref_passes": ref_passes,
    }
    if profile:
        out["profile"] = profile_step(tr, batch)
    return out


def profile_step(tr, batch: dict, top: int = 18) -> str:  # noqa: ANN001
    """torch.profiler table of one training step (prepare + train_step), by total CPU time."""
    from torch.profiler import ProfilerActivity, profile, record_function

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        with record_function("prepare"):
            b, _ = tr.method.prepare(batch.copy())
        with record_function("train_step"):
            tr.train_step(b)
    return prof.key_averages().table(sort_by="cpu_time_total", row_limit=top, max_name_column_width=60)


def generation_figures(model: str, reps: int) -> dict:
    """benchmarks/generation.py at batch 64 (8 prompts x 8 samples), 64 new tokens; its output parsed."""
    cmd = [
        sys.executable,
        str(Path(__file__).parent / "generation.py"),
        "--model",
        "tiny" if model == "tiny" else "smollm2",
        "--prompts",
        "8",
        "--samples",
        "8",
        "--max-new-tokens",
        "64",
        "--reps",
        str(reps),
        "--device",
        "cpu",
    ]
    text = subprocess.run(
        cmd, capture_output=True, text=True, check=True, env={**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    ).stdout
    print(text, end="")
    rate = {m.group(1): float(m.group(2)) for m in re.finditer(r"^(gcfamily|hf)\s+([\d.]+) tok/s", text, re.M)}
    return {
        "gcfamily_tokens_per_s": rate.get("gcfamily"),
        "hf_tokens_per_s": rate.get("hf"),
        "speedup": rate["gcfamily"] / rate["hf"] if rate.get("hf") else None,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m", help="smollm2-135m or tiny")
    ap.add_argument("--methods", default="sft,grpo,dpo", help=f"from {', '.join(CASES)}")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--no-generation", action="store_true", help="skip the generation comparison")
    ap.add_argument("--profile", action="store_true", help="print a torch.profiler table of one step per method")
    ap.add_argument("--json", default=None, help="also write every figure here")
    a = ap.parse_args()

    rate = matmul_rate()
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f}"
    )
    print(f"float32 matmul rate (2048^3, measured): {rate / 1e9:.1f} GFLOP/s", flush=True)
    results = []
    for name in [m.strip() for m in a.methods.split(",") if m.strip()]:
        r = step_figures(name, a.model, a.reps, a.profile)
        r["fraction_6pt"] = r["flops_6pt"] / r["step_s"] / rate
        r["fraction_done"] = r["flops_done"] / r["step_s"] / rate
        results.append(r)
        print(
            f"{name}: {r['step_s']:.3f} s/step (prepare {r['prepare_s']:.3f}, train {r['train_s']:.3f}) for {r['rows']} rows x "
            f"{r['seq_len']} = {r['tokens']} tokens ({r['loss_tokens']} in the loss; {r['packed_tokens']} run, packed): {r['train_tokens_per_s']:.0f} train tok/s = "
            f"{100 * r['fraction_6pt']:.1f}% of matmul by 6PT, {100 * r['fraction_done']:.1f}% by FLOPs done"
            + (f"; sampling the batch took {r['data_s']:.1f} s" if r["data_s"] > 0.5 else ""),
            flush=True,
        )
        if a.profile:
            print(r["profile"], flush=True)
    gen = None
    if not a.no_generation:
        gen = generation_figures(a.model, a.reps)
        print(
            f"generation at batch 64: rollout {gen['gcfamily_tokens_per_s']:.0f} tok/s vs transformers generate "
            f"{gen['hf_tokens_per_s']:.0f} tok/s = {gen['speedup']:.2f}x"
        )
    print(f"load average at the end {os.getloadavg()[0]:.2f}")
    if a.json:
        Path(a.json).write_text(json.dumps({"matmul_flops": rate, "steps": results, "generation": gen}, indent=1))


if __name__ == "__main__":
    main()
