"""The sampler of gcf check's on-policy batches (gcfamily/check/): where its log-probs (sample_logps) lie against pi_old,
so that every branch of the sampler correction (setting tis, gcfamily/methods/tis.py) occurs on the batch.

pi_sampler = pi_old / exp(World.sample_offset). Per token (token_* modes) the offsets cycle through ratios
pi_old/pi_sampler past tis_max, inside [tis_min, tis_max] (away from 1) and below tis_min; per row (sequence_* modes)
each row's product takes one of those values while its tokens' own ratios differ (a sequence mode computed per token
fails). tis=off gets the same placement at the default bounds: a method that weighs tokens with tis off fails too.
The placement is deterministic: it draws nothing from the batch's generator, whose stream the other placements read.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from gcfamily.check.world import StubServices, World
from gcfamily.methods.base import Batch

SPREAD = 0.3
"""How far apart, in log-ratio, the tokens of a row are placed around the row's mean (sequence modes)."""


def design_sampler(world: World, s: Any) -> None:
    """Set world.sample_offset = log pi_old - log pi_sampler on every completion token, from the settings' bounds."""
    hi = s.tis_max
    lo = s.tis_min if s.tis_min is not None and s.tis_min > 0 else None
    floor = lo or 0.0
    candidates = (0.8 * hi, 1.2 * lo if lo else 0.4 * hi, (floor + hi) / 2)
    inside = [x for x in candidates if floor < x < hi and abs(x - 1) > 1e-3] or [(floor + hi) / 2]
    ratios = [1.5 * hi, inside[0], *([lo / 2] if lo else []), *inside[1:2]]
    logs = [math.log(x) for x in ratios]
    k = 0  # tokens placed so far: the token cycle runs on across rows
    for i in range(len(world.tokens)):
        pos = world.positions(i)
        if s.tis.startswith("sequence"):
            d = [logs[i % len(logs)] / len(pos)] * len(pos)  # the row's product is the i-th ratio
            for j in range(0, len(pos) - 1, 2):  # pairs of tokens pushed apart, the sum kept
                d[j], d[j + 1] = d[j] + SPREAD, d[j + 1] - SPREAD
        else:
            d = [logs[(k + j) % len(logs)] for j in range(len(pos))]
            k += len(pos)
        if getattr(s, "off_policy_mask", None) is not None and i % 2:  # odd rows far off-policy: the mask drops them
            d = [x - 3.0 for x in d]
        world.sample_offset[i, pos] = torch.tensor(d, dtype=torch.float64)


def sampled(raw: Batch, stub: StubServices) -> Batch:
    """`raw` with the sampler's log-probs [B, L]: pi_old's at the sampling temperature, less the World's offsets."""
    old = stub.logprobs(stub.policy_model, raw, stub.tau)  # [B, L] float32, as the rollout's
    return raw.replaced(sample_logps=old - stub.world.sample_offset[raw.row_id].float() * raw.loss_mask)
