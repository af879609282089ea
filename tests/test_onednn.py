"""gcfamily.core.onednn: packed oneDNN linears give the model's own outputs, switch only what they may, and always undo."""

import pytest
import torch
from torch import nn
from transformers import Qwen2Config, Qwen2ForCausalLM

from gcfamily.core import onednn
from gcfamily.core.onednn import packed_linears

pytestmark = pytest.mark.skipif(not onednn.available(), reason="this torch build has no oneDNN packed linear ops")


@pytest.fixture(scope="module")
def model() -> Qwen2ForCausalLM:
    # Qwen2: q/k/v projections carry a bias; tied head and embedding share one weight.
    torch.manual_seed(0)
    cfg = Qwen2Config(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        tie_word_embeddings=True,
    )
    m = Qwen2ForCausalLM(cfg).eval()
    with torch.no_grad():
        for layer in m.model.layers:
            layer.self_attn.q_proj.bias.normal_()  # nonzero, so a dropped bias would show
    return m


def _linears(m: nn.Module) -> list[nn.Linear]:
    return [x for x in m.modules() if type(x) is nn.Linear]


@torch.no_grad()
@pytest.mark.parametrize("rows", [1, 5, 64])
def test_logits_equal_the_plain_forward_for_any_row_count(model, rows):
    ids = torch.randint(0, 96, (3, 7))
    ref = model(input_ids=ids).logits
    with packed_linears(model, rows) as n:
        got = model(input_ids=ids).logits
    assert n == len(_linears(model)) > 0
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


@torch.no_grad()
def test_forwards_are_restored_even_after_an_error(model):
    with pytest.raises(RuntimeError, match="inside"):
        with packed_linears(model, 4):
            assert all("forward" in m.__dict__ for m in _linears(model))
            raise RuntimeError("inside")
    assert not any("forward" in m.__dict__ for m in model.modules())


def test_nothing_is_switched_with_gradients_on_or_when_disabled(model, monkeypatch):
    with packed_linears(model, 4) as n:  # gradients on: training keeps autograd's linear
        assert n == 0 and not any("forward" in m.__dict__ for m in model.modules())
    monkeypatch.setattr(onednn, "ENABLED", False)
    with torch.no_grad(), packed_linears(model, 4) as n:
        assert n == 0


@torch.no_grad()
def test_only_plain_float32_linears_are_switched():
    class Adapter(nn.Linear):  # a subclass may change forward: left alone
        pass

    net = nn.Sequential(nn.Linear(4, 4), Adapter(4, 4), nn.Linear(4, 4).to(torch.bfloat16))
    with packed_linears(net, 2) as n:
        assert n == 1 and "forward" in net[0].__dict__
        x = torch.randn(2, 4)
        torch.testing.assert_close(net[0](x), nn.functional.linear(x, net[0].weight, net[0].bias))
        with torch.enable_grad():  # a backward inside the block still gets autograd's linear
            assert net[0](x).requires_grad


@torch.no_grad()
def test_greedy_rollout_is_the_same_with_and_without(model, monkeypatch):
    from gcfamily.rollout import SamplingSettings, generate

    class Tok:  # ids in, ids out: enough for generate
        pad_token_id, eos_token_id = 0, 1

        def batch_decode(self, rows, skip_special_tokens=True):
            return [" ".join(map(str, r)) for r in rows]

    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]
    settings = SamplingSettings(greedy=True, max_new_tokens=12)
    on = generate(model, Tok(), prompts, 2, settings)
    monkeypatch.setattr(onednn, "ENABLED", False)
    off = generate(model, Tok(), prompts, 2, settings)
    assert torch.equal(on.input_ids, off.input_ids)
    torch.testing.assert_close(on.sample_logps, off.sample_logps, rtol=0, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_linear_equals_f_linear(dtype):
    x, w, b = torch.randn(7, 16, dtype=dtype), torch.randn(40, 16, dtype=dtype), torch.randn(40, dtype=dtype)
    for bias in (None, b):
        torch.testing.assert_close(onednn.linear(x, w, bias), nn.functional.linear(x, w, bias), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(
        onednn.linear(x, w.t().contiguous().t()), x @ w.t(), rtol=1e-5, atol=1e-5
    )  # strided weight


def test_packing_off_in_the_block_and_for_a_run(model, monkeypatch, tmp_path):
    """`onednn.packing(False)` (a run's rollout_pack_weights: false) samples on the plain weights; the run's rollouts and
    evaluations pack nothing, the default run packs every one, and the setting is undone when the run ends."""
    import contextlib

    from gcfamily.config import Config
    from gcfamily.rollout import native as rollout
    from gcfamily.run.trainer import Trainer

    with torch.no_grad(), onednn.packing(False), packed_linears(model, 4) as n:
        assert n == 0 and not any("forward" in m.__dict__ for m in model.modules())
    counts = {}
    real = rollout.packed_linears

    @contextlib.contextmanager
    def spy(
        m, rows
    ):  # whether the rollout runs on packed weights (its own, or its evaluation's packed for all its batches)
        with real(m, rows) as k:
            counts.setdefault(flag, []).append(sum("forward" in x.__dict__ for x in m.modules()))
            yield k

    monkeypatch.setattr(rollout, "packed_linears", spy)
    for flag in (True, False):
        Trainer(
            Config(
                method="grpo",
                model="tiny",
                task="arithmetic",
                output_dir=str(tmp_path / str(flag)),
                max_steps=1,
                batch_size=2,
                group_size=2,
                max_new_tokens=4,
                eval_at_ends=True,
                eval_samples=4,
                progress=False,
                save_every=0,
                rollout_pack_weights=flag,
            )
        ).run()
    assert len(counts[True]) >= 3 and all(k > 0 for k in counts[True])  # evaluation, the step's rollout, evaluation
    assert len(counts[False]) >= 3 and all(k == 0 for k in counts[False])
    with torch.no_grad(), packed_linears(model, 4) as n:  # the default is back after the run
        assert n > 0


@torch.no_grad()
def test_an_evaluation_packs_the_weights_once_for_all_its_batches(model, monkeypatch):
    from gcfamily.data.encoding import Formatter
    from gcfamily.run.heldout import evaluate_rows, sampled_pass_at_k

    class Tok:  # ids in, ids out: enough for encoding prompts and generate
        pad_token_id, eos_token_id, chat_template = 0, 1, None

        def __call__(self, text, add_special_tokens=False):
            return {"input_ids": [2 + int(w) % 90 for w in text.split()]}

        def batch_decode(self, rows, skip_special_tokens=True):
            return [" ".join(map(str, r)) for r in rows]

    packs = []
    real = onednn._pack
    monkeypatch.setattr(onednn, "_pack", lambda w, rows: packs.append(w.data_ptr()) or real(w, rows))
    rows = [{"prompt": f"{i} {i + 1} {i + 2}", "answer": "x"} for i in range(7)]
    weights = {m.weight.data_ptr() for m in _linears(model)}  # the tied head packs with the embedding once
    evaluate_rows(
        model,
        Formatter(Tok()),
        rows,
        lambda prompts, completions, **kw: [0.0] * len(completions),
        max_new_tokens=3,
        batch_size=3,
    )
    assert sorted(packs) == sorted(weights)  # three batches, each weight packed once
    packs.clear()
    sampled_pass_at_k(
        model,
        Formatter(Tok()),
        rows,
        lambda prompts, completions, **kw: [0.0] * len(completions),
        k=2,
        max_new_tokens=3,
        batch_prompts=2,
    )
    assert sorted(packs) == sorted(weights)  # four batches
