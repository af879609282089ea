"""Packed micro-batches: every real token of a micro-batch through the model in one call, no padding.

A prefix that rows share (GRPO's G samples of a prompt, a DPO pair, a system prompt in front of
different questions) is laid down once per packed row; each row's own tokens follow end to end;
a block-causal mask (narrowed to its window for a sliding-window layer, in positions: `families`)
and the original position ids give every token the hidden state it has in its padded row.
`backbone_hidden` gathers those hidden states back to the [B, L] layout, so the engine's chunked
head, the coefficient and the loss never see the packing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from gcfamily.core import families


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions that skip left padding, so a left-padded row sees the positions an unpadded one would."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


PACK_LENGTH = 512
"""Packed rows grow to this many tokens (or to the longest row, if longer): attention over a packed
row costs its length squared, so a micro-batch is not packed into one very long row."""


def shared_prefix(
    input_ids: torch.Tensor, attention_mask: torch.Tensor, loss_mask: torch.Tensor
) -> tuple[int, torch.Tensor, torch.Tensor] | None:
    """(S, first, inverse) when rows repeat their first S columns, else None.

    Rows are compared on their real tokens (padding ignored); `first` [U] picks one row per
    distinct prefix and `inverse` [B] maps each row to it. Of two candidates, the one that saves
    more tokens wins: the whole prompt, up to the column before the first loss token of any row
    (GRPO's G samples of a prompt, a DPO pair), or the longest prefix that every row has in
    common, shared by all (a system prompt in front of different questions). S never passes the
    column before the first loss token, so every hidden state a log-prob needs lies at or after S.
    """
    B = input_ids.shape[0]
    cols = loss_mask[:, 1:].any(0).nonzero()
    if cols.numel() == 0 or B < 2:
        return None
    S = int(cols[0])  # hidden state S predicts the first loss token, at column S + 1
    if S < 1:
        return None
    key = torch.stack([input_ids[:, :S] * attention_mask[:, :S], attention_mask[:, :S]], -1)  # [B, S, 2]
    uniq, inverse = torch.unique(key.flatten(1), dim=0, return_inverse=True)  # [U, 2S], [B]
    differs = (key != key[:1]).any(-1).any(0).nonzero()  # columns where some row differs from row 0
    common = S if differs.numel() == 0 else int(differs[0])
    if (B - 1) * common > (B - uniq.shape[0]) * S:  # one prefix for every row saves more
        S, inverse = common, torch.zeros(B, dtype=torch.long, device=input_ids.device)
    U = int(inverse.max()) + 1
    if U == B or S < 1:
        return None
    first = torch.full((U,), B, dtype=torch.long, device=input_ids.device)
    first.scatter_reduce_(0, inverse, torch.arange(B, device=input_ids.device), reduce="amin")  # [U]
    return S, first, inverse


@dataclass
class Packing:
    """A micro-batch laid out without padding: shared prefixes once, rows end to end, one backbone call.

    Packed row r holds segments one after another; a token attends to the real tokens before it in
    its own segment and to its row's shared prefix (a block-causal mask), at its original position
    id, so every hidden state is the one the unpacked row would have.
    """

    input_ids: torch.Tensor  # [R, T]
    position_ids: torch.Tensor  # [R, T]
    allowed: torch.Tensor  # [R, 1, T, T] bool: query i may attend to key j
    source: torch.Tensor  # [B, L - S] long: flat index into [R * T] of each original column S..
    S: int  # original columns before S are not needed (they are only a shared prefix)


def pack_rows(
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    loss_mask: torch.Tensor,
    share_prefix: bool = True,
    device: torch.device | None = None,
) -> Packing | None:
    """Pack a micro-batch: a prefix that rows share (`shared_prefix`) once per packed row, then each
    row's own tokens end to end, first fit into rows of up to PACK_LENGTH tokens (a group's rows
    only with that group's prefix). None when there is nothing to share and no two rows fit in one.
    The layout is worked out on the CPU (give CPU tensors to read nothing back from a GPU) and its
    tensors are sent to `device` (default the inputs' device) without waiting for them."""
    B, L = input_ids.shape
    device = device if device is not None else input_ids.device
    # the layout is worked out on the CPU (a few small ops per row) and moved to the device once
    input_ids, attention_mask, loss_mask = input_ids.cpu(), attention_mask.cpu(), loss_mask.cpu()
    dev = input_ids.device
    real = attention_mask.bool()  # [B, L]
    cols = torch.arange(L, device=dev)
    pos = position_ids_from_mask(attention_mask)  # [B, L]
    split = shared_prefix(input_ids, attention_mask, loss_mask) if share_prefix else None
    # spans [lo, hi) of the original columns each row contributes, after its group's prefix [0, S)
    hi = ((real * (cols + 1)).amax(1)).clamp(min=1).tolist()  # one past the last real token
    if split is not None:
        S, first, inverse = split
        lo = [S] * B
        hi = [max(h, S) for h in hi]  # a row without loss tokens may end inside the prefix: it adds no tokens after it
        members: list[list[int]] = [[] for _ in range(len(first))]
        for b, g in enumerate(inverse.tolist()):
            members[g].append(b)
        prefix_rows: list[int | None] = first.tolist()  # the row whose prefix its group's packed rows start with
    else:
        S = 0
        lo = [L - x if x > 0 else 0 for x in (real * (L - cols)).amax(1).tolist()]  # the first real column
        members, prefix_rows = [list(range(B))], [None]
    cap = max(PACK_LENGTH, S + max(h - l for h, l in zip(hi, lo)))
    groups, heads, room = [], [], []  # packed rows: their rows, their prefix row, room left
    for g, head in zip(members, prefix_rows):
        mine = []  # packed rows of this group (they all start with its prefix)
        order = sorted(g, key=lambda b: lo[b] - hi[b])  # longest first
        for b in order:  # first fit: as few packed rows as the cap allows
            n = hi[b] - lo[b]
            k = next((k for k in mine if room[k] >= n), None)
            if k is None:
                k = len(groups)
                groups.append([])
                heads.append(head)
                room.append(cap - S)
                mine.append(k)
            groups[k].append(b)
            room[k] -= n
        _balance(order, mine, groups, room, [hi[b] - lo[b] for b in range(B)])
    if split is None and (len(groups) == B or all(h - l == L for h, l in zip(hi, lo))):
        return None  # nothing to share, and no padding to drop: the plain pass is as cheap
    lengths = [S + sum(hi[b] - lo[b] for b in g) for g in groups]
    R, T = len(groups), max(lengths)
    ids = torch.zeros(R, T, dtype=input_ids.dtype, device=dev)
    ppos = torch.zeros(R, T, dtype=pos.dtype, device=dev)
    seg = torch.full((R, T), -2, dtype=torch.long, device=dev)  # -2 padding, -1 shared prefix, else the row
    preal = torch.zeros(R, T, dtype=torch.bool, device=dev)
    source = torch.zeros(B, L - S, dtype=torch.long, device=dev)
    for r, (g, head) in enumerate(zip(groups, heads)):
        at = 0
        if head is not None:
            ids[r, :S], ppos[r, :S], preal[r, :S], seg[r, :S] = input_ids[head, :S], pos[head, :S], real[head, :S], -1
            at = S
        for b in g:
            n = hi[b] - lo[b]
            ids[r, at : at + n], ppos[r, at : at + n], preal[r, at : at + n] = (
                input_ids[b, lo[b] : hi[b]],
                pos[b, lo[b] : hi[b]],
                real[b, lo[b] : hi[b]],
            )
            seg[r, at : at + n] = b
            source[b, lo[b] - S : hi[b] - S] = r * T + at + torch.arange(n, device=dev)
            at += n
    i, j = torch.arange(T, device=dev)[:, None], torch.arange(T, device=dev)[None, :]
    same = (seg[:, None, :] == seg[:, :, None]) | (seg[:, None, :] == -1)  # [R, T(q), T(k)]
    allowed = (same & preal[:, None, :] & (j <= i)) | (i == j)  # every query sees itself: no all-masked row
    send = {"device": device, "non_blocking": True}  # no wait for the device: the copies queue behind its work
    return Packing(ids.to(**send), ppos.to(**send), allowed[:, None].to(**send), source.to(**send), S)


def _balance(order: list[int], mine: list[int], groups: list[list[int]], room: list[int], size: list[int]) -> None:
    """Spread a group's rows (`order`, longest first) over its packed rows `mine` so the longest packed row is as short as
    the greedy rule makes it: each row goes to the packed row with the most room left. First fit fills the first packed
    rows and leaves the last nearly empty, and every packed row is padded to the longest: 8 rows of 64 tokens behind a
    40-token prompt made rows of 488 and 104 tokens, 976 columns of compute and activations; balanced, 2 x 296. Kept
    only where it shortens the longest packed row (so no row passes the cap); the rows' order within a packed row
    does not change any hidden state (the block-causal mask)."""
    if len(mine) < 2:
        return
    free = {k: room[k] + sum(size[b] for b in groups[k]) for k in mine}  # each packed row's room when empty
    new = {k: [] for k in mine}
    left = dict(free)
    for b in order:
        k = max(mine, key=lambda k: (left[k], -k))  # the most room; ties to the first
        new[k].append(b)
        left[k] -= size[b]
    if min(left.values()) > min(room[k] for k in mine):
        for k in mine:
            groups[k], room[k] = sorted(new[k]), left[k]


PACKED_ATTENTION = ("sdpa", "eager")
"""Attention implementations that take a custom [R, 1, T, T] mask; others run the plain padded pass."""


def backbone_hidden(
    backbone: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    loss_mask: torch.Tensor,
    share_prefix: bool,
    host: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, int]:
    """Hidden states [B, L - S, H] of the original columns S.. (S > 0 only past a shared prefix).

    Packed (`pack_rows`), the backbone runs once over every real token of the micro-batch and over
    a prompt that G rows share once, instead of over B x L padded columns: the same function, so
    the same log-probs and gradients (a shared prefix's gradient is summed over its rows by the
    gather). Each layer type gets its own mask (`families.layer_masks`: full or sliding window).
    An attention implementation without custom masks, or a family or layer type the packed path
    is not checked on, runs one plain padded pass; a model no pass can make exact is refused
    (`families.attention`).
    """
    config = getattr(backbone, "config", None)
    impl = getattr(config, "_attn_implementation", None)
    att = families.attention(config) if config is not None else None  # refuses a model no pass makes exact
    packable = impl in PACKED_ATTENTION and att is not None and att.packable
    # CPU copies: the layout reads nothing back
    src = host if host is not None else (input_ids, attention_mask, loss_mask)
    packing = pack_rows(*src, share_prefix, device=input_ids.device) if packable else None
    if packing is None:
        out = backbone(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids_from_mask(attention_mask),
            use_cache=False,
        )
        return (out[0] if isinstance(out, tuple) else out.last_hidden_state), 0
    # one [R, 1, T, T] or {layer type: [R, 1, T, T]}
    mask = families.layer_masks(att, packing.allowed, packing.position_ids)
    if impl == "eager":  # additive float masks
        dtype = next(backbone.parameters()).dtype
        mask = {k: _additive(m, dtype) for k, m in mask.items()} if isinstance(mask, dict) else _additive(mask, dtype)
    out = backbone(input_ids=packing.input_ids, attention_mask=mask, position_ids=packing.position_ids, use_cache=False)
    h = out[0] if isinstance(out, tuple) else out.last_hidden_state  # [R, T, H]
    return h.reshape(-1, h.shape[-1])[packing.source], packing.S  # [B, L - S, H]


def _additive(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A boolean mask as eager attention takes it: 0 where allowed, the dtype's minimum elsewhere."""
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill(~allowed, torch.finfo(dtype).min)
