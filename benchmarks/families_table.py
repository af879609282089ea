"""The family table: for each transformers family of tests/test_families.py (random tiny float32 models, rows past every
sliding window), the largest difference between the engine's log-probs and parameter gradients and the model's own
forward on each unpadded row; and the one sentence each refused family gets.

    .venv/bin/python benchmarks/families_table.py        # about a minute on two cores

The models, batches and the oracle are the test's (`tests/test_families.py`), so the table is what CI checks, as figures.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gcfamily.core import engine, packing  # noqa: E402
from gcfamily.errors import GcfError  # noqa: E402
from test_families import FAMILIES, REFUSED, build, distinct_batch, grpo_batch, oracle_logps  # noqa: E402


def _grads(model) -> dict[str, torch.Tensor]:
    out = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    return out


def main() -> None:
    torch.set_num_threads(2)
    print(
        "| family | sliding window | path | max abs diff, log-probs | max abs diff, gradients |\n|---|---|---|---|---|"
    )
    for name, (_, _, fields, kinds) in FAMILIES.items():
        model = build(name)
        g = torch.Generator().manual_seed(1)
        d_lp = d_g = 0.0
        packed = []
        for batch in (grpo_batch(g), distinct_batch(g)):
            w = torch.randn(batch["input_ids"].shape, generator=g) * batch["loss_mask"]
            want = oracle_logps(model, batch)
            (want * w).sum().backward()
            want_grads = _grads(model)
            real = packing.pack_rows
            packing.pack_rows = lambda *a, **k: packed.append(real(*a, **k)) or packed[-1]
            try:
                got = engine.token_logprobs(
                    model, batch["input_ids"], batch["attention_mask"], batch["loss_mask"], 1.0, 16, True
                ).logps
            finally:
                packing.pack_rows = real
            (got * w).sum().backward()
            grads = _grads(model)
            d_lp = max(d_lp, float((got.detach() - want.detach()).abs().max()))
            d_g = max(d_g, max(float((grads[n] - want_grads[n]).abs().max()) for n in grads))
        window = fields.get("sliding_window") if kinds or kinds is None else None
        path = "packed" if packed and all(p is not None for p in packed) else "plain padded pass"
        print(f"| {name} | {window or '-'} | {path} | {d_lp:.1e} | {d_g:.1e} |", flush=True)
    print("\n| refused family | the sentence |\n|---|---|")
    for name in REFUSED:
        try:
            build(name)
            print(f"| {name} | NOT REFUSED |")
        except GcfError as e:
            print(f"| {name} | {e} |")


if __name__ == "__main__":
    main()
