"""Pools of the initial policy's samples: offline RFT trains on one pool drawn once (never resampled, reused exactly by
--resume and by pool=PATH), DPO pairs its own samples, and the data sources read apart in `gcf methods`."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch

import gcfamily
from gcfamily.errors import GcfError
from gcfamily.methods import get_method
from gcfamily.methods.pools import COLUMNS, Pool, pairs_of
from gcfamily.methods.rft import OfflineRFT
from gcfamily.run.services import RunServices

FAST = dict(
    model="tiny",
    task="arithmetic",
    batch_size=2,
    group_size=4,
    max_new_tokens=6,
    progress=False,
    report_to="none",
    pool_prompts=6,
    log_completions_every=0,
)


def odd_length(prompts, completions, **kw):  # noqa: ANN001, ANN201
    """A reward the random tiny model meets about half the time."""
    return [float(len(c) % 2) for c in completions]


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _read(path: Path) -> Pool:
    """The samples of a pool file, read apart from Pool.load: the lines after its header."""
    rows = [json.loads(x) for x in path.read_text().splitlines()[1:]]
    return Pool(**{c: [r[c] for r in rows] for c in COLUMNS})


def _count_generate(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    calls: list[int] = []
    real = RunServices.generate

    def counted(self, prompt_ids, group_size, sampling):  # noqa: ANN001, ANN202
        calls.append(len(prompt_ids))
        return real(self, prompt_ids, group_size, sampling)

    monkeypatch.setattr(RunServices, "generate", counted)
    return calls


def test_offline_rft_draws_its_pool_once_and_never_resamples(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _count_generate(monkeypatch)
    out = gcfamily.train(method="rft-offline", reward=odd_length, output_dir=str(tmp_path / "a"), max_steps=4, **FAST)
    pool = _read(out / "pools" / "rft-offline.jsonl")
    assert len(pool) == 6 * 4 and len(set(pool.prompt_index)) == 6
    assert sum(calls) == 6  # every pooled prompt sampled once (in chunks of batch_size), nothing during the 4 steps
    assert 0 < sum(pool.valid[k] and pool.rewards[k] >= 0.5 for k in range(len(pool))) < len(pool)


def test_offline_rft_resumes_on_its_pool_and_reuses_another_runs_pool_exactly(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    whole = gcfamily.train(
        method="rft-offline", reward=odd_length, output_dir=str(tmp_path / "w"), max_steps=3, save_every=1, **FAST
    )
    pool_file = whole / "pools" / "rft-offline.jsonl"
    before = _digest(pool_file)
    calls = _count_generate(monkeypatch)
    # another run trained on that pool: no sampling at all, the same weights as the run that drew it
    again = gcfamily.train(
        method="rft-offline",
        reward=odd_length,
        output_dir=str(tmp_path / "r"),
        max_steps=3,
        pool=str(pool_file),
        **FAST,
    )
    assert calls == [] and _digest(again / "pools" / "rft-offline.jsonl") == before
    a = {
        k: v
        for k, v in torch.load(next((whole / "checkpoints").iterdir()) / "state.pt", weights_only=False).items()
        if k == "step"
    }
    assert a["step"] == 3
    from safetensors.torch import load_file

    wa, wb = load_file(str(whole / "model.safetensors")), load_file(str(again / "model.safetensors"))
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    # a resumed run whose pool file is gone refuses to redraw it from a trained policy
    pool_file.unlink()
    with pytest.raises(GcfError, match="cannot redraw"):
        gcfamily.train(
            method="rft-offline",
            reward=odd_length,
            resume=str(whole / "checkpoints" / "step-2"),
            max_steps=3,
            save_every=1,
            **FAST,
        )


def test_dpo_pairs_its_own_samples(tmp_path: Path) -> None:
    out = gcfamily.train(
        method="dpo", reward=odd_length, output_dir=str(tmp_path / "d"), max_steps=2, pairs="own-samples", **FAST
    )
    pool = _read(out / "pools" / "dpo-pairs.jsonl")
    pairs, unpaired = pairs_of(pool, 0.5)
    assert pairs and len(pairs) + unpaired == len(set(pool.prompt_index))
    for p, w, lo in pairs:  # the first kept and the first rejected sample of the prompt, in the order drawn
        ks = [k for k in range(len(pool)) if pool.prompt_index[k] == p and pool.valid[k]]
        assert w == next(k for k in ks if pool.rewards[k] >= 0.5) and lo == next(k for k in ks if pool.rewards[k] < 0.5)
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["dpo/pool_pairs"] == len(pairs) and rows[-1]["dpo/pool_unpaired_prompts"] == unpaired


def test_pairs_of_by_hand() -> None:
    pool = Pool(
        prompt_index=[0, 0, 0, 1, 1, 2, 2],
        completion_ids=[[1]] * 7,
        completions=["a"] * 7,
        rewards=[0.0, 1.0, 1.0, 1.0, 1.0, 9.0, 0.0],
        valid=[True, True, True, True, True, False, True],
    )
    # prompt 0: kept 1 (first >= 0.5), rejected 0; prompt 1: no rejected; prompt 2: its 9.0 failed, so no kept
    assert pairs_of(pool, 0.5) == ([(0, 1, 0)], 2)


def test_the_data_sources_read_apart() -> None:
    online, offline = get_method("rft").data_source, get_method("rft-offline").data_source
    assert "current policy" in online and "every step" in online
    assert "initial policy" in offline and "once" in offline
    assert OfflineRFT.coefficient is get_method("rft").coefficient  # the same rule: only the data differ


def test_a_malformed_pool_file_is_one_sentence(tmp_path: Path) -> None:
    bad = tmp_path / "pool.jsonl"
    bad.write_text('{"prompt_index": 0}\n')
    with pytest.raises(GcfError, match="cannot be read"):
        Pool.load(bad, [[1, 2]])


@pytest.mark.parametrize("progress", [True, False])
def test_drawing_a_pool_says_how_far_it_is(tmp_path: Path, capsys: pytest.CaptureFixture, progress: bool) -> None:
    """A pool's draw can take minutes: a line per call of the sampler, quiet with progress=false (issue 50)."""
    cfg = {**FAST, "progress": progress}
    gcfamily.train(method="rft-offline", reward=odd_length, max_steps=1, output_dir=str(tmp_path / "run"), **cfg)
    lines = [x for x in capsys.readouterr().err.splitlines() if x.startswith("pool: ")]
    if not progress:
        assert lines == []
        return
    # 6 prompts drawn batch_size = 2 at a time: three lines, the last at 6/6
    assert [x.split(" prompts")[0] for x in lines] == ["pool: 2/6", "pool: 4/6", "pool: 6/6"], lines
    assert all("G=4 each" in x for x in lines)
