"""The rollout backend (gcfamily/rollout/backend.py): the one interface every sampling path of a run calls."""

import re
from pathlib import Path

import pytest
import torch

import gcfamily.rollout.backend as backend_mod
from gcfamily.config import Config
from gcfamily.errors import GcfError
from gcfamily.models import tiny_model, tiny_tokenizer
from gcfamily.rollout import BACKENDS, NativeBackend, RolloutBackend, SamplingSettings, build_backend, generate
from gcfamily.run.trainer import Trainer

ROOT = Path(__file__).resolve().parents[1]


def test_the_native_backend_is_the_native_sampler_behind_the_interface():
    tok = tiny_tokenizer()
    model = tiny_model(len(tok)).eval()
    b = build_backend("native", model, tok)
    assert isinstance(b, RolloutBackend) and isinstance(b, NativeBackend) and set(BACKENDS) == {"native", "vllm"}
    prompts = [tok("1+1=")["input_ids"], tok("abc")["input_ids"]]
    s = SamplingSettings(temperature=1.0, max_new_tokens=6)
    got = b.generate(prompts, 3, s, torch.Generator().manual_seed(4))
    want = generate(model, tok, prompts, 3, s, torch.Generator().manual_seed(4))
    assert torch.equal(got.input_ids, want.input_ids) and torch.equal(got.sample_logps, want.sample_logps)
    b.weights_changed()  # nothing to push: it samples the live weights
    b.close()
    with pytest.raises(GcfError, match="closed"):
        b.generate(prompts, 1, s)
    with pytest.raises(GcfError, match="Unknown rollout backend 'sglang'; choose one of native, vllm"):
        build_backend("sglang", model, tok)


def test_why_each_completion_ended():
    tok = tiny_tokenizer()
    model = tiny_model(len(tok)).eval()
    prompts = [tok("what is 2+2?")["input_ids"]] * 2
    ro = build_backend("native", model, tok).generate(
        prompts, 8, SamplingSettings(temperature=1.0, max_new_tokens=12), torch.Generator().manual_seed(0)
    )
    eos = tok.eos_token_id
    for n, why in enumerate(ro.ended_by):  # an independent reading of the rows: the last sampled token, the length
        last = int(ro.input_ids[n][ro.completion_mask[n].bool()][-1])
        assert why == ("eos" if last == eos else "length")
        assert why != "length" or int(ro.completion_lengths[n]) == 12
    assert len(ro.ended_by) == 16 and set(ro.ended_by) <= {"eos", "length"}
    text = next(c for c, why in zip(ro.completions, ro.ended_by) if len(c) >= 6)
    stop = text[2:4]  # a stop string that this completion contains: the same draw ends it there
    cut = build_backend("native", model, tok).generate(
        prompts,
        8,
        SamplingSettings(temperature=1.0, max_new_tokens=12, stop_strings=(stop,)),
        torch.Generator().manual_seed(0),
    )
    k = ro.completions.index(text)
    assert cut.ended_by[k] == "stop" and cut.completions[k] == text[: text.index(stop) + len(stop)]  # stop kept


def test_a_run_tells_its_backend_when_the_weights_change_and_closes_it(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(NativeBackend, "weights_changed", lambda self: calls.append("weights"))
    monkeypatch.setattr(NativeBackend, "close", lambda self: calls.append("close"))
    cfg = Config(
        method="grpo",
        model="tiny",
        task="arithmetic",
        max_steps=3,
        batch_size=2,
        group_size=4,
        max_new_tokens=6,
        eval_at_ends=False,
        progress=False,
        report_to="none",
        output_dir=str(tmp_path / "run"),
    )
    tr = Trainer(cfg)
    generated = []
    real = tr.rollout.generate
    monkeypatch.setattr(tr.rollout, "generate", lambda *a, **k: generated.append(1) or real(*a, **k))
    tr.run()
    assert calls == ["weights"] * tr.trained_steps + ["close"] and tr.trained_steps == 3
    assert len(generated) == 3  # every step's samples came through the run's backend


def test_no_sampling_path_calls_the_native_sampler_but_its_backend():
    """Methods, pools, evaluation and the bench sample through the interface; only backend.py calls native.generate."""
    bare = re.compile(r"(?<![\w.])generate\(|native\.generate\(")
    hits = [
        f"{p.relative_to(ROOT)}:{i}"
        for p in sorted((ROOT / "gcfamily").rglob("*.py"))
        if p.name not in ("native.py",) and p != Path(backend_mod.__file__)
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if bare.search(line) and not line.lstrip().startswith(("def ", "#", '"', "print("))
    ]
    assert hits == []
