"""Runs beside busy processes: torch's default thread count against threads=auto (issue 38).

    .venv/bin/python benchmarks/shared_machine.py             # SmolLM2-135M: 10 SFT steps and rollout tokens/s, quiet and
                                                              # beside 1 and 2 busy processes, 2 repetitions each
    .venv/bin/python benchmarks/shared_machine.py --quick     # the tiny random model, 2 steps: shows the script works

torch's intra-op threads spin at the end of each parallel region waiting for the slowest; when another process holds a
core, they wait for the thread it pre-empted. Each figure is one fresh process (`gcf run`, or this script's rollout child),
run with torch's default count (passed as threads=N, N what torch picks in a fresh process) and with threads=auto,
alternating which goes first, beside 0, 1 and 2 processes that spin (`python3 -c "while 1: pass"`, started and killed
here). SFT is timed by the sum of its steps' time/step_s (model loading is not counted); rollouts as in
benchmarks/generation.py: completion tokens up to the first EOS over the sampling time, after a warm-up rollout. Run it on
an otherwise quiet machine: the busy processes are the ones it starts.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = ["What is 12 + 7?", "What is 9 * 8?", "Compute 45 - 17.", "What is 144 / 12?"]


def clean_env() -> dict[str, str]:
    """The environment of every child: no OMP_NUM_THREADS / MKL_NUM_THREADS, so torch's default is torch's own."""
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    return {**env, "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}


def torch_default() -> int:
    """The thread count torch picks in a fresh process here."""
    code = "import torch; print(torch.get_num_threads())"
    return int(subprocess.run([sys.executable, "-c", code], env=clean_env(), capture_output=True, text=True).stdout)


def sft(args: argparse.Namespace, threads: str, work: Path) -> dict:
    """One `gcf run --method sft`: the steps' seconds and the thread count its first metrics row records."""
    out = work / "sft"
    cmd = [
        *[sys.executable, "-m", "gcfamily", "run", "--method", "sft", "--model", args.model, "--task", "arithmetic"],
        *["--max-steps", str(args.steps), "--output-dir", str(out), "--overwrite"],
        *["--set", "progress=false", "--set", "report_to=none", "--set", f"threads={threads}"],
    ]
    t0 = time.perf_counter()
    r = subprocess.run(cmd, cwd=ROOT, env=clean_env(), capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if r.returncode != 0:
        raise SystemExit(f"gcf run failed ({r.returncode}):\n{r.stderr[-3000:]}")
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x.strip()]
    steps = [x for x in rows if "time/step_s" in x]
    return {"s": sum(x["time/step_s"] for x in steps), "wall_s": wall, "threads": rows[0].get("threads")}


def rollout(args: argparse.Namespace, threads: str) -> dict:
    """Rollout tokens/s in a fresh process (this script's --rollout-child)."""
    cmd = [sys.executable, __file__, "--rollout-child", threads, "--model", args.model]
    cmd += [
        "--samples",
        str(args.samples),
        "--max-new-tokens",
        str(args.max_new_tokens),
        "--reps",
        str(args.reps_rollout),
    ]
    r = subprocess.run(cmd, cwd=ROOT, env=clean_env(), capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"rollout child failed ({r.returncode}):\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def rollout_child(args: argparse.Namespace) -> None:
    """Load the model, take the thread count (a number, or auto as a run chooses it), time rollouts; print one JSON line."""
    import torch

    from gcfamily.core import onednn, threads
    from gcfamily.data.encoding import Formatter
    from gcfamily.models import load_model
    from gcfamily.rollout import SamplingSettings, generate

    choice = threads.decide(None if args.rollout_child == "auto" else int(args.rollout_child))
    threads.apply(choice.count)
    model, tok = load_model(args.model, torch.float32, "cpu")
    model.eval()
    fmt = Formatter(tok)
    prompt_ids = [fmt.prompt_ids(p) for p in PROMPTS]
    s = SamplingSettings(temperature=1.0, max_new_tokens=args.max_new_tokens)
    n = secs = 0.0
    with torch.no_grad(), onednn.packing(True):  # as a run samples (rollout_pack_weights)
        for rep in range(args.reps_rollout + 1):  # the first warms up (allocator, oneDNN kernels), not counted
            gen = torch.Generator().manual_seed(rep)
            t0 = time.perf_counter()
            ro = generate(model, tok, prompt_ids, args.samples, s, gen, [tok.eos_token_id])
            dt = time.perf_counter() - t0
            if rep:
                n, secs = n + int(ro.completion_lengths.sum()), secs + dt
    print(json.dumps({"tok_s": n / secs, "tokens": n, "s": secs, "threads": choice.count, "reason": choice.reason}))


def spinners(k: int) -> list[subprocess.Popen]:
    """k processes that each keep a core busy."""
    exe = shutil.which("python3") or sys.executable
    procs = [subprocess.Popen([exe, "-c", "while 1: pass"]) for _ in range(k)]
    time.sleep(1.0)  # running before anything is measured
    return procs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="tiny model, 2 steps, 1 repetition, beside 0 and 1 processes")
    ap.add_argument("--model", default=None, help="default smollm2-135m (tiny with --quick)")
    ap.add_argument("--steps", type=int, default=None, help="SFT steps per run (default 10; 2 with --quick)")
    ap.add_argument(
        "--busy", default=None, help="comma-separated counts of busy processes (default 0,1,2; 0,1 with --quick)"
    )
    ap.add_argument("--reps", type=int, default=None, help="repetitions of each pair (default 2; 1 with --quick)")
    ap.add_argument(
        "--reps-rollout", type=int, default=None, help="timed rollouts per figure (default 2; 1 with --quick)"
    )
    ap.add_argument("--samples", type=int, default=None, help="completions per prompt, 4 prompts (default 8)")
    ap.add_argument("--max-new-tokens", type=int, default=None, help="default 64 (8 with --quick)")
    ap.add_argument("--rollout-child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    q = args.quick
    args.model = args.model or ("tiny" if q else "smollm2-135m")
    args.steps = args.steps or (2 if q else 10)
    args.reps = args.reps or (1 if q else 2)
    args.reps_rollout = args.reps_rollout or (1 if q else 2)
    args.samples = args.samples or (2 if q else 8)
    args.max_new_tokens = args.max_new_tokens or (8 if q else 64)
    if args.rollout_child is not None:
        rollout_child(args)
        return
    busy_counts = [int(x) for x in (args.busy or ("0,1" if q else "0,1,2")).split(",")]
    default = torch_default()
    configs = {"default": str(default), "auto": "auto"}
    print(
        f"model={args.model} sft_steps={args.steps} reps={args.reps} rollout={len(PROMPTS)}x{args.samples}x"
        f"{args.max_new_tokens} cores={len(os.sched_getaffinity(0))} torch_default={default} threads "
        f"load_average={os.getloadavg()[0]:.2f}",
        flush=True,
    )
    results: dict[tuple[int, str, str], list[float]] = {}
    with tempfile.TemporaryDirectory(prefix="gcf-shared-") as tmp:
        for k in busy_counts:
            procs = spinners(k)
            try:
                for rep in range(args.reps):
                    order = list(configs) if rep % 2 == 0 else list(reversed(configs))
                    for name in order:
                        s = sft(args, configs[name], Path(tmp))
                        print(
                            f"busy={k} rep={rep} {name:7s} sft     {s['s']:7.2f} s for {args.steps} steps "
                            f"({s['s'] / args.steps:.3f} s/step, {s['wall_s']:.1f} s with loading), threads={s['threads']}",
                            flush=True,
                        )
                        results.setdefault((k, name, "sft_s"), []).append(s["s"])
                        r = rollout(args, configs[name])
                        print(
                            f"busy={k} rep={rep} {name:7s} rollout {r['tok_s']:8.1f} tok/s ({r['tokens']} tokens in "
                            f"{r['s']:.2f} s), threads={r['threads']}",
                            flush=True,
                        )
                        results.setdefault((k, name, "tok_s"), []).append(r["tok_s"])
            finally:
                for p in procs:
                    p.kill()
                    p.wait()
    med = {key: statistics.median(v) for key, v in results.items()}
    print("\nmedians; 'slower' is how many times slower than the same configuration on the quiet machine")
    print(f"{'busy':>4}  {'config':7s}  {'sft s':>8}  {'slower':>8}  {'tok/s':>8}  {'slower':>8}")
    for k in busy_counts:
        for name in configs:
            sft_s, tok_s = med[(k, name, "sft_s")], med[(k, name, "tok_s")]
            base = (med.get((busy_counts[0], name, "sft_s")), med.get((busy_counts[0], name, "tok_s")))
            slow = f"{sft_s / base[0]:.2f}x" if busy_counts[0] == 0 else "-"
            fall = f"{base[1] / tok_s:.2f}x" if busy_counts[0] == 0 else "-"
            print(f"{k:>4}  {name:7s}  {sft_s:8.2f}  {slow:>8}  {tok_s:8.1f}  {fall:>8}")
        sft_gain = med[(k, "default", "sft_s")] / med[(k, "auto", "sft_s")]
        tok_gain = med[(k, "auto", "tok_s")] / med[(k, "default", "tok_s")]
        print(f"{k:>4}  auto is {sft_gain:.2f}x as fast as default on SFT steps, {tok_gain:.2f}x on rollouts")


if __name__ == "__main__":
    main()
