"""Where bf16 loses the log-probs: the error of bf16 compute against float32 per token, and which component carries it.

    .venv/bin/python benchmarks/bf16_components.py                        # SmolLM2-135M-Instruct (offline) and families
    .venv/bin/python benchmarks/bf16_components.py --model runs/sft6 --families none   # a trained checkpoint

Text: the arithmetic task's first 48 held-out rows, each a chat-templated prompt and its reference answer plus EOS; the
log-probs are those of the answer's tokens only (what SFT trains on and what a ratio or KL of a completion reads),
through the engine's own path (the backbone, then the chunked output layer and log-softmax). Reference: the same
model in float32. Variants: the trainer's mixed path, float32 weights under torch.autocast(bfloat16)
(`dtype=bfloat16`), with each combination of components kept in float32 by the package's own `float32_components`
(gcfamily/core/float32_parts.py: attention, mlp, head; embeddings and norms autocast never lowers); all three kept
must give exactly float32's log-probs; and pure bf16 weights (`master_dtype=bfloat16`).

Printed per variant: mean and max |logp_bf16 - logp_fp32| over the answer tokens, the held-out NLL per token, and on
the real model the median seconds of one forward and backward over the 48 rows (float32 measured right before it).
The families are the tiny random builds of tests/test_family_sampling.py (random weights, gcfamily's character-level
tokenizer on the same text): their errors say how each architecture's bf16 behaves, not what a
trained model of that family loses.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT)]

from gcfamily.core import engine, float32_parts  # noqa: E402

FAMILIES = "llama,qwen2,mistral,gemma,gemma2,phi3,gpt2,olmo2,granite,qwen3"
KEPT = ((), ("head",), ("mlp",), ("attention",), ("mlp", "head"), ("attention", "head"), ("attention", "mlp"))
ALL = ("attention", "mlp", "head")


def answer_logps(model, rows, mode: str) -> torch.Tensor:
    """Log-probs (float64, 1-D) of every answer token of every row through the engine's own path
    (engine.token_logprobs: the backbone, then the chunked head): float32 ("fp32"), the model as it is under bf16
    autocast ("autocast": its kept components, if any, in float32), or pure bf16 weights ("pure")."""
    m = copy.deepcopy(model).to(torch.bfloat16) if mode == "pure" else model
    out = []
    for prompt, answer in rows:
        ids = torch.tensor([prompt + answer])
        ones = torch.ones_like(ids)
        loss = torch.zeros_like(ids)
        loss[:, len(prompt) :] = 1
        ctx = torch.autocast("cpu", dtype=torch.bfloat16) if mode == "autocast" else contextlib.nullcontext()
        with torch.no_grad(), ctx:
            lp = engine.token_logprobs(m, ids, ones, loss, 1.0, 4096).logps
        out.append(lp[0, len(prompt) :].double())
    return torch.cat(out)


def step_seconds(model, rows, repeats: int) -> tuple[float, float]:
    """Median seconds of one forward and backward of the engine's mean log-likelihood over all rows (one padded batch)
    in float32 and under bf16 autocast (with whatever `model` keeps in float32), the two alternating `repeats` times."""
    L = max(len(p) + len(a) for p, a in rows)
    ids = torch.zeros(len(rows), L, dtype=torch.long)
    am, lm = torch.zeros_like(ids), torch.zeros_like(ids)
    for i, (p, a) in enumerate(rows):
        ids[i, : len(p) + len(a)] = torch.tensor(p + a)
        am[i, : len(p) + len(a)] = 1
        lm[i, len(p) : len(p) + len(a)] = 1
    times: dict[bool, list[float]] = {False: [], True: []}
    for _ in range(repeats):
        for mixed in (False, True):
            ctx = torch.autocast("cpu", dtype=torch.bfloat16) if mixed else contextlib.nullcontext()
            t = time.perf_counter()
            with ctx:
                lp = engine.token_logprobs(model, ids, am, lm, 1.0, 4096).logps
                loss = -(lp * lm).sum() / lm.sum()
            loss.backward()
            times[mixed].append(time.perf_counter() - t)
            model.zero_grad(set_to_none=True)
    return statistics.median(times[False]), statistics.median(times[True])


def table(model, rows, label: str, timing: int = 0) -> list[str]:
    """One line per variant: |dlogp| mean and max against float32, NLL, and (timing > 0) the median forward and
    backward seconds over `timing` repeats, each variant alternating with float32."""
    ref = answer_logps(model, rows, "fp32")
    lines = [f"{label}: float32 NLL per answer token {-ref.mean():.4f} over {len(ref)} tokens"]
    print(lines[-1], flush=True)
    variants = [("pure", ()), *[("autocast", k) for k in KEPT], ("autocast", ALL)]
    for mode, keep in variants:
        m = copy.deepcopy(model)
        float32_parts.keep_float32(m, keep)
        lp = answer_logps(m, rows, mode)
        d = (lp - ref).abs()
        what = (
            "pure bf16 weights"
            if mode == "pure"
            else "bf16 autocast, " + (f"{'+'.join(keep)} in float32" if keep else "all in bf16")
        )
        line = f"  {what:44s} |dlogp| mean {d.mean():.2e} max {d.max():.2e}   NLL {-lp.mean():.4f} ({-lp.mean() + ref.mean():+.4f})"
        if timing and mode == "autocast":
            fp32, mixed = step_seconds(m.train(), rows, timing)
            line += f"   fwd+bwd {mixed:.2f} s (float32 {fp32:.2f} s, x{fp32 / mixed:.2f})"
        lines.append(line)
        print(line, flush=True)
    return lines


def smollm2_rows(tok, n: int) -> list[tuple[list[int], list[int]]]:
    from gcfamily.tasks import get_task

    rows = get_task("arithmetic").rows("test", n)
    out = []
    for r in rows:
        prompt = list(
            tok.apply_chat_template([{"role": "user", "content": r["prompt"]}], add_generation_prompt=True)["input_ids"]
        )
        answer = tok(str(r["answer"]), add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        out.append((prompt, answer))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=48)
    ap.add_argument("--families", default=FAMILIES, help="comma-separated model types, or none")
    ap.add_argument("--no-smollm2", action="store_true")
    ap.add_argument("--model", default="smollm2-135m", help="the real model: an alias or a run's model folder")
    ap.add_argument(
        "--timing", type=int, default=5, help="forward+backward repeats per variant on the real model (0: none)"
    )
    a = ap.parse_args()
    torch.manual_seed(0)
    if not a.no_smollm2:
        from gcfamily.models import load_model

        model, tok = load_model(a.model)
        rows = smollm2_rows(tok, a.rows)
        name = "SmolLM2-135M-Instruct (offline)" if a.model == "smollm2-135m" else a.model
        table(model.eval(), rows, f"{name}, {a.rows} held-out arithmetic answers", a.timing)
    if a.families != "none":
        from test_family_sampling import tiny

        from gcfamily.models import load_model as _  # noqa: F401 - the package's families setup
        from gcfamily.models import tiny_tokenizer

        ctok = tiny_tokenizer()  # character-level, 103 ids: inside every tiny family's vocabulary
        from gcfamily.tasks import get_task

        texts = get_task("arithmetic").rows("test", a.rows)
        rows = [
            (ctok(f"Q: {r['prompt']}\nA: ")["input_ids"], ctok(str(r["answer"]), add_special_tokens=False)["input_ids"])
            for r in texts
        ]
        for fam in a.families.split(","):
            try:
                model = tiny(fam).eval()
            except Exception as e:  # noqa: BLE001 - a family that cannot be built here is listed with the reason
                print(f"{fam}: not built ({str(e).splitlines()[0][:120]})")
                continue
            table(model, rows, f"{fam} (tiny random)")


if __name__ == "__main__":
    main()
