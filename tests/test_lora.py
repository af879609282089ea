"""LoRA: adapters train, the reference is the base with adapters off (no copy), checkpoints hold the adapters."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import assert_engine_grad_matches_objective
from safetensors.torch import load_file

from gcfamily.config import Config
from gcfamily.core import engine
from gcfamily.models import tiny_model
from gcfamily.models.lora import AdapterOffReference
from gcfamily.run.trainer import Trainer

pytest.importorskip("peft")

ROOT = Path(__file__).resolve().parents[1]
FAST = {
    "model": "tiny",
    "task": "arithmetic",
    "batch_size": 2,
    "group_size": 4,
    "max_new_tokens": 8,
    "micro_batch_size": 8,
    "progress": False,
    "device": "cpu",
    "lora_r": 4,
    "lora_alpha": 8.0,
}


def _length_reward(prompts, completions, **columns):
    """Varies within a group on a random tiny model (the task's own reward is 0 for every sample there)."""
    return [float(len(c) % 3) for c in completions]


def _trainer(tmp_path, method, resume=None, **kw):
    tr = Trainer(Config(method=method, output_dir=str(tmp_path / method), **{**FAST, **kw}), resume=resume)
    if hasattr(tr.method, "reward_fn"):
        tr.method.reward_fn = _length_reward
    return tr


def _perturb_adapters(model, seed=0):
    """B = 0 at init makes every A gradient 0 and pi == pi_ref; random B exercises both."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)


def _adapters(model):
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize(
    "method,kw",
    [
        ("sft", {}),
        ("rft", {"reward_threshold": 0.0}),
        ("grpo", {"mu": 2, "beta": 0.1}),
        ("dpo", {}),
        ("ppo", {"mu": 2, "beta": 0.1}),
        ("dr-grpo", {}),
        ("rloo", {}),
    ],
)
def test_adapter_gradient_equals_autograd_of_the_objective(tmp_path, method, kw):
    tr = _trainer(tmp_path, method, **kw)
    _perturb_adapters(tr.policy)
    trainable = [n for n, p in tr.policy.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)  # the base is frozen
    batch, _ = tr.method.prepare(tr.method.data(0)[0])
    if (
        batch.ref_logps is not None
    ):  # the reference (adapters off) differs from the perturbed policy: the KL term is live
        lp = tr.services.logprobs(tr.unwrapped_policy(), batch)
        assert (lp - batch.ref_logps).abs().max() > 1e-3
    assert_engine_grad_matches_objective(tr, batch, micro=2)  # several micro-batches, pairs kept whole
    tr.policy.zero_grad()
    lp = engine.token_logprobs(tr.policy, batch.input_ids, batch.attention_mask, batch.loss_mask).logps
    (-tr.method.objective(batch, lp, 1.0)).backward()
    grads = {n: p.grad for n, p in tr.policy.named_parameters() if p.requires_grad}
    assert any(g is not None and g.abs().sum() > 0 for n, g in grads.items() if "lora_A" in n)  # A and B both learn
    assert any(g is not None and g.abs().sum() > 0 for n, g in grads.items() if "lora_B" in n)


def test_reference_is_the_base_model_with_no_copy(tmp_path):
    tr = _trainer(tmp_path, "grpo", beta=0.1)
    ref = tr.method.ref
    assert isinstance(ref, AdapterOffReference)
    assert not any(
        isinstance(m, torch.nn.Module) and m is not tr.policy for m in tr.method.owned_models()
    )  # nothing held besides the policy
    _perturb_adapters(tr.policy)
    batch, _ = tr.method.data(0)
    got = tr.services.logprobs(ref, batch)
    base = tiny_model(len(tr.tokenizer), seed=0)  # the oracle: the untouched base model, built afresh
    want = tr.services.logprobs(base, batch)
    assert torch.allclose(got, want, atol=1e-5)
    assert (
        tr.services.logprobs(tr.unwrapped_policy(), batch) - want
    ).abs().max() > 1e-3  # while the policy itself moved


def test_ppo_critic_is_adapters_on_the_shared_base(tmp_path):
    tr = _trainer(tmp_path, "ppo")
    policy_ptrs = {p.data_ptr() for p in tr.policy.parameters() if not p.requires_grad}
    critic = tr.method.critic
    frozen = [p for p in critic.parameters() if not p.requires_grad]
    trained = [n for n, p in critic.named_parameters() if p.requires_grad]
    assert frozen and all(p.data_ptr() in policy_ptrs for p in frozen)  # the base is held once
    assert trained and all("lora_" in n or n.startswith("head.") for n in trained)
    own = {p.data_ptr() for p in critic.parameters() if p.requires_grad}
    assert not own & {p.data_ptr() for p in tr.policy.parameters() if p.requires_grad}  # its own adapters


@pytest.mark.parametrize("method", ["grpo", "ppo"])
def test_lora_resume_is_bitwise_and_checkpoints_hold_only_adapters(tmp_path, method):
    kw = {"lr": 1e-2, "save_every": 1, "mu": 2}
    straight = _trainer(tmp_path / "a", method, max_steps=3, **kw)
    straight.run()
    _trainer(tmp_path / "b", method, max_steps=2, **kw).run()
    resumed = _trainer(tmp_path / "b", method, resume="latest", max_steps=3, **kw)
    resumed.run()
    a, b = _adapters(straight.policy), _adapters(resumed.policy)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert any(
        not torch.equal(a[k], v) for k, v in _adapters(_trainer(tmp_path / "c", method).policy).items()
    )  # it trained
    saved = load_file(str(tmp_path / "a" / method / "checkpoints" / "step-3" / "model.safetensors"))
    assert set(saved) == set(a)  # adapters only, not the base


def test_final_folder_holds_the_adapter_or_the_merged_model(tmp_path):
    from transformers import AutoModelForCausalLM

    tr = _trainer(tmp_path, "sft", max_steps=2, lr=1e-2, merge_lora=True)
    tr.run()
    out = tmp_path / "sft"
    assert (out / "adapter" / "adapter_config.json").is_file() and not (out / "adapter_config.json").exists()
    merged = AutoModelForCausalLM.from_pretrained(out)
    ids = torch.randint(10, len(tr.tokenizer), (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.allclose(merged(ids).logits, tr.unwrapped_policy()(input_ids=ids).logits, atol=1e-5)
    assert any(
        "lora_" in n for n, _ in tr.unwrapped_policy().named_parameters()
    )  # merging a copy left the run's model alone
    # without merge_lora, a base the hub holds leaves the adapter alone (test_artifacts.py: tiny's is merged)
    plain = _trainer(tmp_path / "p", "sft", max_steps=1)
    plain.unwrapped_policy().gcf_base_model = "org/tiny-model"  # stands for a hub id; nothing is downloaded
    plain.run()
    assert (tmp_path / "p" / "sft" / "adapter_config.json").is_file() and not (
        tmp_path / "p" / "sft" / "config.json"
    ).exists()
    assert json.loads((tmp_path / "p" / "sft" / "adapter_config.json").read_text())["r"] == 4


@pytest.mark.parametrize(
    "sets,words", [(["strategy=fsdp2"], "FSDP2"), (["ref_refresh_every=2"], "refreshed"), (["lora_r=-1"], "lora_r")]
)
def test_lora_refusals_are_one_sentence(gcf, tmp_path, sets, words):
    args = [
        "run",
        "--method",
        "grpo",
        "--model",
        "tiny",
        "--max-steps",
        "1",
        "--output-dir",
        str(tmp_path / "x"),
        "--set",
        "lora_r=4",
    ]
    for s in sets:
        args += ["--set", s]
    code, _, err = gcf(*args)
    assert code == 2 and err.strip().startswith("error:") and words in err and "Traceback" not in err


def test_reward_model_refuses_lora(gcf, tmp_path):
    code, _, err = gcf(
        "run",
        "--method",
        "reward-model",
        "--model",
        "tiny",
        "--max-steps",
        "1",
        "--output-dir",
        str(tmp_path / "x"),
        "--set",
        "lora_r=4",
    )
    assert code == 2 and "policy training only" in err


def test_lora_under_ddp_equals_one_process(tmp_path):
    """SFT with LoRA on 2 gloo processes takes the step one process takes on the same global batch."""
    common = [
        "--method",
        "sft",
        "--model",
        "tiny",
        "--max-steps",
        "2",
        "--set",
        "lora_r=4",
        "--set",
        "lr=1e-2",
        "--set",
        "batch_size=4",
        "--set",
        "micro_batch_size=1",
        "--set",
        "progress=false",
        "--set",
        "device=cpu",
    ]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    gcf = [sys.executable, "-m", "gcfamily", "run"]
    for out, extra in [("one", []), ("two", ["--nproc", "2", "--strategy", "ddp"])]:
        res = subprocess.run(
            [*gcf, *common, *extra, "--output-dir", str(tmp_path / out)],
            check=False,
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert res.returncode == 0, res.stderr[-2000:]
    # tiny has no hub model, so the final folder is the merged model and the adapter is in adapter/
    a = load_file(str(tmp_path / "one" / "adapter" / "adapter_model.safetensors"))
    b = load_file(str(tmp_path / "two" / "adapter" / "adapter_model.safetensors"))
    assert a.keys() == b.keys() and len(a) > 0
    assert max(float((a[k] - b[k]).abs().max()) for k in a) < 1e-5


def test_returning_freed_heap_changes_no_value(tmp_path, monkeypatch):
    # The rollout and every training micro-batch hand freed pages back (malloc_trim): the same run without it is bitwise equal.
    import gcfamily.rollout.native
    import gcfamily.run.step

    calls = []
    real = gcfamily.rollout.native.release_free_heap

    def counted():
        calls.append(1)
        real()

    monkeypatch.setattr(gcfamily.run.step, "release_free_heap", counted)
    monkeypatch.setattr(gcfamily.rollout.native, "release_free_heap", counted)
    with_trim = _trainer(tmp_path / "a", "grpo", max_steps=2, lr=1e-2, mu=2, micro_batch_size=2)
    with_trim.run()
    assert len(calls) >= 2 * (1 + 2 * 4)  # per step: the rollout, and each of mu x 4 micro-batches
    monkeypatch.setattr(gcfamily.run.step, "release_free_heap", lambda: None)
    monkeypatch.setattr(gcfamily.rollout.native, "release_free_heap", lambda: None)
    without = _trainer(tmp_path / "b", "grpo", max_steps=2, lr=1e-2, mu=2, micro_batch_size=2)
    without.run()
    a, b = _adapters(with_trim.policy), _adapters(without.policy)
    assert all(torch.equal(a[k], b[k]) for k in a)
