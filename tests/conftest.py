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
