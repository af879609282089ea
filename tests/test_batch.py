"""The typed step batch (gcfamily/core/batch.py): every field declares its role, and cutting reads the role."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from gcfamily.core.batch import DECLARED, ROLES, ROW, STEP, TOKEN, Batch, concat, select, to_device, trim
from gcfamily.data.batches import split_batch

ROOT = Path(__file__).resolve().parents[1]


def _batch() -> Batch:
    """4 rows of width 6; columns 0 and 5 are padding in every row."""
    am = torch.tensor([[0, 1, 1, 1, 1, 0]] * 4)
    return Batch(
        input_ids=torch.arange(24).view(4, 6),
        attention_mask=am,
        loss_mask=torch.tensor([[0, 0, 1, 1, 1, 0]] * 4),
        valid=torch.tensor([True, False, True, True]),
        ref_logps=-torch.arange(24.0).view(4, 6),
        rewards=torch.tensor([1.0, 2.0, 3.0, 4.0]),
        completions=["a", "b", "c", "d"],
        z0=0.25,
    )


def test_every_declared_field_has_a_role_and_a_docstring() -> None:
    assert set(DECLARED.values()) <= set(ROLES)
    src = (ROOT / "gcfamily" / "core" / "batch.py").read_text()
    for name in DECLARED:  # a docstring line right under each field
        assert re.search(rf"\n    {name}: [^\n]+\n    \"\"\"", src), name


def test_select_cuts_token_and_row_fields_and_keeps_step_fields() -> None:
    b = _batch()
    s = select(b, [3, 0])
    assert s.input_ids.tolist() == [b.input_ids[3].tolist(), b.input_ids[0].tolist()]
    assert s.rewards.tolist() == [4.0, 1.0] and s.completions == ["d", "a"] and s.valid.tolist() == [True, True]
    assert s.z0 == 0.25 and s.old_logps is None  # a step constant kept whole; an unset field stays unset
    assert select(b, slice(1, 3)).completions == ["b", "c"]
    assert b.rows == 4 and b.rewards.tolist() == [1.0, 2.0, 3.0, 4.0]  # the source batch is untouched


def test_a_row_field_of_another_length_is_refused() -> None:
    b = _batch()
    b.rewards = torch.ones(3)
    with pytest.raises(ValueError, match="'rewards' .*3 rows, not the batch's 4"):
        select(b, slice(0, 2))


def test_trim_drops_all_padding_columns_of_token_fields_only() -> None:
    t = trim(_batch().put("bonus", torch.arange(4.0), ROW).put("per_token", torch.ones(4, 6), TOKEN))
    assert t.input_ids.shape == (4, 4) and t.ref_logps.shape == (4, 4) and t.own["per_token"].shape == (4, 4)
    assert t.input_ids[0].tolist() == [1, 2, 3, 4]
    assert t.own["bonus"].shape == (4,) and t.rewards.shape == (4,)  # ROW fields keep their shape
    # a per-row field as wide as the sequences by chance (6 scores a row) is a ROW: the role, not the shape, decides
    wide = trim(_batch().put("scores", torch.arange(24.0).view(4, 6), ROW))
    assert wide.own["scores"].shape == (4, 6) and wide.input_ids.shape == (4, 4)


def test_split_keeps_examples_whole_and_trims_each_part() -> None:
    b = _batch()
    b.attention_mask = torch.tensor([[1, 1, 0, 0, 0, 0]] * 2 + [[1, 1, 1, 1, 1, 1]] * 2)
    parts = split_batch(b, 3, rows_per_example=2)  # 3 rounds down to whole pairs
    assert [p.rows for p in parts] == [2, 2]
    assert parts[0].input_ids.shape == (2, 2) and parts[1].input_ids.shape == (2, 6)
    assert parts[1].completions == ["c", "d"] and all(p.z0 == 0.25 for p in parts)


def test_own_fields_are_put_with_a_role_and_cut_by_it() -> None:
    b = _batch().put("bonus", torch.tensor([0.1, 0.2, 0.3, 0.4]), ROW).put("tag", "x", STEP)
    s = select(b, [2])
    assert s.own["bonus"].tolist() == pytest.approx([0.3]) and s.own["tag"] == "x"
    with pytest.raises(ValueError, match="declared"):
        b.put("rewards", torch.zeros(4), ROW)  # a declared field is set as an attribute, never shadowed
    with pytest.raises(ValueError, match="role"):
        b.put("bad", torch.zeros(4), "per row")
    with pytest.raises(ValueError, match="neither declared nor put"):
        b.replaced(bonsu=torch.zeros(4))  # a typo is refused, not added


def test_copy_clone_and_replaced_leave_the_source_batch_alone() -> None:
    b = _batch()
    c = b.copy()
    c.valid = None
    assert b.valid is not None
    d = b.clone()
    d.ref_logps[0, 0] = 99.0
    d.completions[0] = "z"
    assert b.ref_logps[0, 0] == 0.0 and b.completions[0] == "a"
    e = b.replaced(rewards=torch.zeros(4))
    assert e.rewards.sum() == 0 and b.rewards.sum() == 10 and e.input_ids is b.input_ids


def test_concat_and_to_device() -> None:
    b = _batch()
    both = concat([select(b, [0]), select(b, [1, 2])])
    assert both.rows == 3 and both.completions == ["a", "b", "c"] and both.z0 == 0.25
    assert torch.equal(both.ref_logps, b.ref_logps[:3])
    moved = to_device(b, "cpu")
    assert moved.completions == b.completions and moved.input_ids.device.type == "cpu"


def test_no_dict_lookup_of_the_batch_is_left_in_the_package() -> None:
    """The batch is typed: its fields are attributes, never string keys (issue 44's grep, kept as a test)."""
    pattern = re.compile(r'\["(loss_mask|valid|ref_logps|old_logps|advantages)"\]')
    hits = [
        f"{p.relative_to(ROOT)}:{i}"
        for p in sorted((ROOT / "gcfamily").rglob("*.py"))
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if pattern.search(line)
    ]
    assert hits == []
