"""Where the peak resident memory of a GRPO step comes from: RSS per phase, full fine-tuning and LoRA.

    .venv/bin/python benchmarks/memory_phases.py                       # smollm2-135m, both modes, memory.py's step
    .venv/bin/python benchmarks/memory_phases.py --modes lora --max-new-tokens 16   # a quicker look

Each mode runs in its own process (the settings of benchmarks/memory.py: GRPO, 8 prompts x 8
samples, 64 new tokens, beta 0.04, CPU float32, one step). The phases are marked by wrapping the
functions that make them (model load, LoRA wrap, reference, rollout with its oneDNN packing,
reward, the pi_ref log-probs, the training forwards and backwards, clipping, the optimizer step).
Per phase the table gives the RSS when it starts, the highest RSS inside it and the RSS when it
ends. The peak is exact, not sampled: at every phase boundary the kernel's high-water mark
(VmHWM) is read and reset (`echo 5 > /proc/self/clear_refs`), so a short spike between two reads
is still counted. Where that reset is not allowed, a thread sampling VmRSS every 10 ms stands in.
Beside the RSS, the bytes torch holds in parameters, gradients and AdamW state at the end of a
phase ("tensors"), so the rest (allocator caches, activations, packed weights, libraries) shows.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from memory import LORA, STEP, model_source  # noqa: E402  the same step as benchmarks/memory.py


def _status() -> tuple[float, float]:
    """(VmRSS, VmHWM) of this process in MB."""
    text = Path("/proc/self/status").read_text()
    return tuple(int(re.search(rf"{k}:\s+(\d+)", text).group(1)) / 1024 for k in ("VmRSS", "VmHWM"))  # type: ignore[return-value]


class Phases:
    """Nested phases; every boundary folds the high-water mark since the last one into all open phases."""

    def __init__(self) -> None:
        self.rows: list[dict] = []  # in order of start
        self.open: list[dict] = []
        try:
            Path("/proc/self/clear_refs").write_text("5")
            self.resettable = True
        except OSError:
            self.resettable = False
        self.sampled_max = 0.0
        self.lock = threading.Lock()
        if not self.resettable:
            threading.Thread(target=self._sample, daemon=True).start()

    def _sample(self) -> None:
        while True:
            rss = _status()[0]
            with self.lock:
                self.sampled_max = max(self.sampled_max, rss)
                for row in self.open:
                    row["peak"] = max(row["peak"], rss)
            time.sleep(0.01)

    def _boundary(self) -> float:
        rss, hwm = _status()
        if self.resettable:
            Path("/proc/self/clear_refs").write_text("5")
        with self.lock:
            for row in self.open:
                row["peak"] = max(row["peak"], hwm if self.resettable else rss)
        return rss

    @contextlib.contextmanager
    def __call__(self, name: str, tensors=None):
        rss = self._boundary()
        row = {
            "phase": "  " * len(self.open) + name,
            "start": rss,
            "peak": rss,
            "end": rss,
            "t0": time.perf_counter(),
            "tensors": None,
        }
        self.rows.append(row)
        self.open.append(row)
        try:
            yield
        finally:
            row["end"] = self._boundary()
            row["s"] = time.perf_counter() - row["t0"]
            row["tensors"] = tensors() if tensors else None
            self.open.pop()

    def wrap(self, owner, attr: str, name: str, tensors=None) -> None:
        """Replace owner.attr by a function that runs inside phase `name`."""
        fn = getattr(owner, attr)

        @functools.wraps(fn)
        def wrapped(*a, **k):
            with self(name, tensors):
                return fn(*a, **k)

        setattr(owner, attr, wrapped)

    def table(self) -> str:
        out = [
            "| phase | RSS at start MB | peak within MB | RSS at end MB | torch tensors at end MB | s |",
            "|---|---|---|---|---|---|",
        ]
        for r in self.rows:
            t = "" if r["tensors"] is None else r["tensors"]
            out.append(
                f"| {r['phase']} | {r['start']:,.0f} | {r['peak']:,.0f} | {r['end']:,.0f} | {t} | {r.get('s', 0):.1f} |"
            )
        return "\n".join(out)


def child(model: str, mode: str, out: str, max_new_tokens: int) -> None:
    """One GRPO step of `mode` with its phases marked; prints the table and a JSON line."""
    P = Phases()
    with P("imports"):
        import torch

        from gcfamily.config import Config
        from gcfamily.core import engine
        from gcfamily.methods import onpolicy
        from gcfamily.models import lora
        from gcfamily.rollout import native as rollout
        from gcfamily.run import build as build_mod
        from gcfamily.run import trainer as trainer_mod
        from gcfamily.run.trainer import Trainer
    torch.set_num_threads(2)
    state: dict = {}

    def tensors() -> str:
        tr = state.get("tr")
        if tr is None or not hasattr(tr, "optimizer"):
            return ""
        ps = list(tr.policy.parameters())
        mb = lambda ts: sum(t.numel() * t.element_size() for t in ts) / 2**20  # noqa: E731
        opt = [v for s in tr.optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
        ref = getattr(tr.method, "ref", None)
        ref_mb = mb(ref.parameters()) if isinstance(ref, torch.nn.Module) else 0.0
        return f"weights {mb(ps):.0f}, grads {mb(p.grad for p in ps if p.grad is not None):.0f}, adam {mb(opt):.0f}, ref {ref_mb:.0f}"

    P.wrap(build_mod, "load_model", "model load (from_pretrained)")
    P.wrap(lora, "wrap", "LoRA wrap")
    P.wrap(trainer_mod.Trainer, "reference", "reference setup")
    P.wrap(onpolicy, "generate", "rollout", tensors)
    rollout.packed_linears = _enter_only(
        P, rollout.packed_linears
    )  # a context manager: its entry packs, its body decodes
    P.wrap(rollout, "_assemble", "assemble rollout")
    orig_as_rewards = onpolicy.as_rewards

    def as_rewards(fn):
        r = orig_as_rewards(fn)
        P.wrap(r, "score", "reward")
        return r

    onpolicy.as_rewards = as_rewards
    P.wrap(trainer_mod.Trainer, "logprobs", "log-probs without grad (pi_old / pi_ref)", tensors)
    P.wrap(trainer_mod.Trainer, "optimizer_step", "optimizer_step (train)", tensors)
    P.wrap(engine, "token_logprobs", "forward (micro-batch)")
    orig_backward = torch.Tensor.backward
    torch.Tensor.backward = lambda self, *a, **k: _in(P, "backward (micro-batch)", orig_backward, self, *a, **k)
    P.wrap(torch.nn.utils, "clip_grad_norm_", "clip grad norm")

    cfg = Config(
        model=model_source(model),
        output_dir=out,
        overwrite=True,
        max_steps=1,
        **{**STEP, "max_new_tokens": max_new_tokens},
        **(LORA if mode == "lora" else {}),
    )
    with P("Trainer(cfg): load, wrap, task, reference, optimizer", tensors):
        tr = Trainer(cfg)
    state["tr"] = tr
    P.wrap(tr.optimizer, "step", "AdamW step", tensors)
    P.wrap(tr.method, "data", "data: rollout + reward", tensors)
    P.wrap(tr.method, "prepare", "prepare: advantages, pi_ref", tensors)
    tr.save_final = lambda: None
    tr.save_checkpoint = lambda: None
    with P("one GRPO step (run)", tensors):
        tr.run()
    whole = max(r["peak"] for r in P.rows)
    print(f"\n## {model} {mode}: peak {whole:,.0f} MB (VmHWM reset per phase: {P.resettable})\n")
    print(P.table())
    print(
        json.dumps(
            {
                "model": model,
                "mode": mode,
                "peak_mb": whole,
                "rows": [{k: v for k, v in r.items() if k != "t0"} for r in P.rows],
            }
        )
    )


def _in(P: Phases, name: str, fn, *a, **k):
    with P(name):
        return fn(*a, **k)


def _enter_only(P: Phases, cm_fn):
    """A context-manager function whose entry (the packing) is its own phase; the body runs after it."""

    @contextlib.contextmanager
    def wrapped(*a, **k):
        cm = cm_fn(*a, **k)
        with P("oneDNN packing"):
            value = cm.__enter__()
        try:
            with P("decode (packed)"):
                yield value
        except BaseException:
            if not cm.__exit__(*sys.exc_info()):
                raise
        else:
            cm.__exit__(None, None, None)

    return wrapped


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--modes", default="full,lora")
    ap.add_argument(
        "--max-new-tokens",
        type=int,
        default=STEP["max_new_tokens"],
        help="below 64 only to explore: the headline figure is at 64",
    )
    ap.add_argument("--work", default="runs/bench-memory-phases")
    ap.add_argument("--child", nargs=2, metavar=("MODEL", "MODE"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(
            args.child[0], args.child[1], str(Path(args.work) / f"{args.child[0]}-{args.child[1]}"), args.max_new_tokens
        )
        return
    model_source(args.model)
    for mode in args.modes.split(","):
        cmd = [
            sys.executable,
            __file__,
            "--work",
            args.work,
            "--max-new-tokens",
            str(args.max_new_tokens),
            "--child",
            args.model,
            mode,
        ]
        res = subprocess.run(cmd, capture_output=True, text=True)
        if res.returncode != 0:
            sys.exit(f"{args.model} {mode} failed:\n{res.stderr[-3000:]}")
        print("\n".join(res.stdout.strip().splitlines()[:-1]), flush=True)


if __name__ == "__main__":
    main()
