"""Shared test helpers: run the CLI in-process and read what it wrote."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

# tiny models gain nothing from a second thread, and on a shared 2-core machine two
# threads contending with another process run many times slower than one
torch.set_num_threads(1)

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault(
    "OMP_NUM_THREADS", "1"
)  # the CLI runs the tests start in other processes: one thread, as here, so bitwise comparisons hold whatever the load


@pytest.fixture
def gcf():
    """Call `gcf ARGS...` in-process; returns (exit code, stdout, stderr)."""
    from click.testing import CliRunner

    from gcfamily.cli import main

    def call(*args: str):
        r = CliRunner().invoke(main, list(args), catch_exceptions=True)
        if r.exception is not None and not isinstance(r.exception, SystemExit):
            raise r.exception
        return r.exit_code, r.stdout, r.stderr

    return call


def metrics_rows(out_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (Path(out_dir) / "metrics.jsonl").read_text().splitlines() if x.strip()]


def assert_engine_grad_matches_objective(trainer, batch, micro: int = 3) -> None:
    """On the trainer's real policy: micro-batched engine gradient == autograd of -objective on the whole batch."""
    from gcfamily.core import engine
    from gcfamily.data.batches import split_batch

    m = trainer.method
    mbs = split_batch(batch, micro)
    Z = engine.normaliser(mbs, m.norm)
    params = [p for p in trainer.policy.parameters() if p.requires_grad]
    trainer.policy.zero_grad()
    for mb in mbs:
        lp = engine.token_logprobs(trainer.policy, mb.input_ids, mb.attention_mask, mb.loss_mask).logps
        engine.weighted_loss(m.coefficient(mb, lp.detach()), lp, mb, m.norm, Z).backward()
    got = [p.grad.clone() for p in params]
    trainer.policy.zero_grad()
    lp = engine.token_logprobs(trainer.policy, batch.input_ids, batch.attention_mask, batch.loss_mask).logps
    (-m.objective(batch, lp, Z)).backward()
    for a, b in zip(got, (p.grad for p in params)):
        assert torch.allclose(a, b, atol=1e-6, rtol=1e-4)
    trainer.policy.zero_grad()
