"""Rows in, tokens out: masks, EOS, chat templates, micro-batching."""

import torch

from gcfamily.core.batch import ROW, Batch
from gcfamily.data.batches import collate, epoch_indices, split_batch
from gcfamily.data.encoding import Formatter, encode
from gcfamily.models import tiny_tokenizer


def test_prompt_is_masked_and_eos_is_trained_even_when_pad_is_eos():
    tok = tiny_tokenizer()
    tok.pad_token = tok.eos_token  # pad == eos: the mask, not the id, decides what is trained
    data = encode("labelled", [{"prompt": "2+2?", "completion": "4", "label": True}], Formatter(tok), 512)
    (ex,), skipped = data.examples, data.n_skipped
    p, c = ex
    assert skipped == 0 and c[-1] == tok.eos_token_id
    b = collate([ex, (p, c[:1])], tok.pad_token_id)
    n = len(p) + len(c)
    assert b.loss_mask[0].tolist() == [0] * len(p) + [1] * len(c)  # EOS position is in the loss
    assert b.input_ids[0, n - 1] == tok.eos_token_id and b.attention_mask[0, :n].all()
    assert b.loss_mask[1].sum() == 1  # padding is not trained


def test_chat_template_is_applied():
    tok = tiny_tokenizer()
    fmt = Formatter(tok)
    ids = fmt.prompt_ids("hi")
    assert tok.decode(ids) == "<|user|>hi\n<|assistant|>"
    assert fmt.completion_ids("hi", "ok") == tok("ok", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]


def test_long_prompt_is_skipped_and_counted():
    tok = tiny_tokenizer()
    rows = [{"prompt": "x" * 100, "completion": "y"}, {"prompt": "short", "completion": "y"}]
    data = encode("demonstrations", rows, Formatter(tok), max_length=40)
    assert data.n_skipped == 1 and len(data.examples) == 1


def test_epoch_indices_cover_each_epoch_once_and_are_deterministic():
    idx = [i for s in range(5) for i in epoch_indices(10, seed=3, step=s, batch_size=4)]  # 20 draws = 2 epochs
    assert sorted(idx[:10]) == list(range(10)) and sorted(idx[10:20]) == list(range(10))
    assert epoch_indices(10, 3, 2, 4) == epoch_indices(10, 3, 2, 4)


def test_split_batch_keeps_pairs_and_trims_padding():
    b = Batch(
        input_ids=torch.arange(24).view(6, 4),
        attention_mask=torch.tensor([[0, 1, 1, 0]] * 6),
        loss_mask=torch.tensor([[0, 0, 1, 0]] * 6),
    ).put("names", list("abcdef"), ROW)
    parts = split_batch(b, 3, rows_per_example=2)  # 3 rounds down to whole pairs
    assert [p.input_ids.shape for p in parts] == [torch.Size([2, 2])] * 3
    assert parts[1].own["names"] == ["c", "d"] and parts[0].input_ids[0].tolist() == [1, 2]
