"""What a run leaves travels: its final folder, copied to another path with the original deleted, loads with
from_pretrained and pipeline; a LoRA adapter records its base by hub id, never a path; the card's own snippet runs
there; a reward model's card names its loader and accuracy; a run given Python objects does not print their reprs."""

from __future__ import annotations

import contextlib
import io
import json
import shutil
from pathlib import Path

import pytest
import torch

from gcfamily.config import Config
from gcfamily.models import lora, tiny_model
from gcfamily.run.summary import summary
from gcfamily.run.trainer import Trainer

pytest.importorskip("peft")

FAST = {"task": "arithmetic", "batch_size": 2, "micro_batch_size": 8, "progress": False, "device": "cpu"}
IDS = torch.tensor([[10, 20, 30, 40, 50, 60]])  # a fixed probe of the tiny vocabulary's printable characters


def _move(folder: Path, tmp_path: Path) -> Path:
    """The folder copied to another path and the original deleted: nothing can still read the old path."""
    moved = tmp_path / "elsewhere" / "model"
    shutil.copytree(folder, moved)
    shutil.rmtree(folder)
    return moved


def _blocks(readme: Path) -> list[str]:
    """The card's python blocks, in order."""
    return [b.split("\n```", 1)[0] for b in readme.read_text().split("```python\n")[1:]]


def _exec(code: str, cwd: Path, monkeypatch) -> tuple[dict, str]:
    """Run a card's block as a reader would, from inside the folder; its names and what it printed."""
    monkeypatch.chdir(cwd)
    names: dict = {}
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, "README.md", "exec"), names)  # noqa: S102 -- the card's own snippet, as a reader runs it
    return names, out.getvalue()


def _logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=IDS).logits


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    """A LoRA SFT run on the tiny model (a base with no hub id) with a checkpoint; its logits before the folder moves."""
    out = tmp_path_factory.mktemp("lora") / "run"
    tr = Trainer(
        Config(
            method="sft",
            model="tiny",
            output_dir=str(out),
            max_steps=2,
            lr=1e-2,
            lora_r=4,
            lora_alpha=8.0,
            save_every=2,
            **FAST,
        )
    )
    tr.run()
    policy = tr.unwrapped_policy()
    assert any(p.abs().sum() > 0 for n, p in policy.named_parameters() if "lora_B" in n)  # the adapters trained
    ckpt = tmp_path_factory.mktemp("ckpt") / "step-2"  # kept apart: a test below moves the run folder away
    shutil.copytree(out / "checkpoints" / "step-2", ckpt)
    tr.checkpoint_copy = ckpt
    return out, _logits(policy), tr


def test_lora_final_folder_of_a_base_with_no_hub_id_loads_anywhere(lora_run, tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM, pipeline

    out, trained, _ = lora_run
    moved = _move(out, tmp_path)
    # the folder holds the merged model: from_pretrained needs no base and gives the trained policy's logits
    assert not (moved / "adapter_config.json").exists() and (moved / "adapter" / "adapter_config.json").is_file()
    model = AutoModelForCausalLM.from_pretrained(moved)
    assert torch.allclose(_logits(model), trained, atol=1e-5)
    generate = pipeline("text-generation", model=str(moved))
    text = generate("What is 2 + 3?", max_new_tokens=4, do_sample=False)[0]["generated_text"]
    assert text.startswith("What is 2 + 3?") and len(text) > len("What is 2 + 3?")
    # the adapter names no base path (tiny has no hub id), and no file a loader reads names the old folder
    recorded = json.loads((moved / "adapter" / "adapter_config.json").read_text())["base_model_name_or_path"]
    assert recorded is None
    for name in ("config.json", "tokenizer_config.json", "adapter/adapter_config.json", "README.md"):
        assert str(out) not in (moved / name).read_text(), name
    assert not (moved / "adapter" / "README.md").exists()  # peft's blank card is not left behind

    # the card's first snippet runs from inside the moved folder and generates; the second puts the adapter on
    # the base gcfamily builds, which is the merged model again (an oracle independent of the merge)
    first, second = _blocks(moved / "README.md")
    names, printed = _exec(first, moved, monkeypatch)
    assert printed.startswith("What is 2 + 3?")
    assert torch.allclose(_logits(names["model"]), trained, atol=1e-5)
    names, _ = _exec(second, moved, monkeypatch)
    assert type(names["model"]).__name__ == "PeftModelForCausalLM"
    assert torch.allclose(_logits(names["model"]), trained, atol=1e-5)


def test_lora_checkpoint_adapter_loads_on_its_base_anywhere(lora_run, tmp_path):
    """What a LoRA checkpoint holds besides its resume state (save_adapter): adapter files that PeftModel loads, from
    the run's own checkpoints/step-2 moved elsewhere."""
    from peft import PeftModel

    from gcfamily.models import load_model

    _, trained, tr = lora_run
    moved = _move(tr.checkpoint_copy, tmp_path)
    assert (moved / "state.pt").is_file() and (moved / "adapter_model.safetensors").is_file()
    assert json.loads((moved / "adapter_config.json").read_text())["base_model_name_or_path"] is None
    base, _ = load_model("tiny", seed=tr.cfg.seed)
    assert not torch.allclose(_logits(base), trained, atol=1e-3)  # the base alone is not the trained policy
    assert torch.allclose(_logits(PeftModel.from_pretrained(base, moved)), trained, atol=1e-5)


@pytest.mark.parametrize(
    "model,recorded,layout",
    [
        ("smollm2-135m", "HuggingFaceTB/SmolLM2-135M-Instruct", "merged"),  # the GGUF's weights are not the hub's
        ("qwen-0.5b", "Qwen/Qwen2.5-0.5B-Instruct", "adapter"),
        ("org/some-model", "org/some-model", "adapter"),
        ("tiny", None, "merged"),
    ],
)
def test_adapters_record_the_hub_id_never_a_path(tmp_path, model, recorded, layout):
    """wrap and save_final on a tiny model under each --model name (no SmolLM2 or hub weights are loaded)."""
    from gcfamily.models import tiny_tokenizer

    base = tiny_model(128)
    base.name_or_path = str(tmp_path / "cache" / "smollm2-135m")  # as a converted checkpoint loads: peft records it
    peft_model = lora.wrap(base, Config(method="sft", model=model, lora_r=4, lora_alpha=8.0))
    lora.save_final(peft_model, tiny_tokenizer(), tmp_path / "out", merge=False, save_dtype="master")
    adapter = tmp_path / "out" / ("adapter" if layout == "merged" else "") / "adapter_config.json"
    assert json.loads(adapter.read_text())["base_model_name_or_path"] == recorded
    assert (tmp_path / "out" / "config.json").is_file() == (layout == "merged")


def test_an_adapter_wrapped_elsewhere_records_no_path(tmp_path):
    """A peft model made outside wrap records its base's name_or_path, here a folder: save_adapter drops it."""
    from peft import LoraConfig, get_peft_model

    from gcfamily.models import tiny_tokenizer

    base = tiny_model(128)
    base.name_or_path = str(tmp_path / "my-base")
    peft_model = get_peft_model(base, LoraConfig(r=2, target_modules=["q_proj"], task_type="CAUSAL_LM"))
    assert peft_model.peft_config["default"].base_model_name_or_path == str(tmp_path / "my-base")  # peft's record
    lora.save_adapter(peft_model, tiny_tokenizer(), tmp_path / "a")
    assert json.loads((tmp_path / "a" / "adapter_config.json").read_text())["base_model_name_or_path"] is None


def test_the_card_of_an_alias_gives_its_hub_id(tmp_path):
    from gcfamily.run.card import write_model_card

    (tmp_path / "adapter").mkdir()
    (tmp_path / "adapter" / "adapter_config.json").write_text("{}")
    cfg = {"method": "sft", "model": "smollm2-135m", "seed": 0, "explicit": []}
    text = write_model_card(tmp_path, cfg, [], "smollm2-135m", {"name": "sft"}).read_text()
    assert 'from_pretrained("smollm2-135m")' not in text
    assert "base_model: HuggingFaceTB/SmolLM2-135M-Instruct" in text and 'load_model("smollm2-135m", seed=0)' in text


def test_reward_model_card_names_its_loader_and_accuracy(tmp_path, monkeypatch, capsys):
    from transformers import AutoModelForSequenceClassification

    out = tmp_path / "rm"
    tr = Trainer(Config(method="reward-model", model="tiny", output_dir=str(out), max_steps=2, eval_samples=8, **FAST))
    tr.run()
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    acc = rows[-1]["rm/heldout_accuracy"]
    moved = _move(out, tmp_path)
    text = (moved / "README.md").read_text()
    assert "AutoModelForSequenceClassification.from_pretrained" in text and "AutoModelForCausalLM" not in text
    assert f"| rm/heldout_accuracy (held-out) | {acc:.4g} | 2 |" in text
    lines = summary(rows, 2, 1.0, moved, True).splitlines()
    assert f"  rm/heldout_accuracy {acc:.4g} (held-out, step 2)" in lines
    assert lines[-1] == f"  model: {moved} (AutoModelForSequenceClassification.from_pretrained)"
    # the card's snippet runs from inside the moved folder and prints the score the saved model gives
    (block,) = _blocks(moved / "README.md")
    names, printed = _exec(block, moved, monkeypatch)
    assert isinstance(names["model"], torch.nn.Module) and names["model"].config.num_labels == 1
    expected = AutoModelForSequenceClassification.from_pretrained(moved)
    ids = names["tokenizer"]("What is 2 + 3? 5", return_tensors="pt")
    assert float(printed) == pytest.approx(expected(**ids).logits[0, 0].item(), abs=1e-6)


def test_python_api_card_names_the_objects_it_cannot_reproduce(tmp_path):
    from datasets import Dataset

    import gcfamily

    ds = Dataset.from_list([{"prompt": f"What is {i} + {i}?", "answer": str(2 * i)} for i in range(16)])
    out = gcfamily.train(
        method="grpo",
        model="tiny",
        dataset=ds,
        reward=[lambda completions, **kw: [float(len(c) % 3) for c in completions], "numeric"],
        output_dir=str(tmp_path / "py"),
        max_steps=1,
        batch_size=2,
        group_size=2,
        max_new_tokens=4,
        progress=False,
        device="cpu",
    )
    text = (out / "README.md").read_text()
    assert "<lambda>" not in text and "<Dataset" not in text
    reproduce = text.split("## Reproduce", 1)[1]
    assert "gcf run" not in reproduce and "cannot be reproduced from the command line" in reproduce
    assert "the dataset, Dataset of 16 rows" in reproduce and "the reward, a lambda" in reproduce
    assert "| `max_new_tokens` | `4` |" in text  # the plain settings are still given
