"""Pools of the initial policy's own samples, drawn once: the data source of offline RFT and of DPO on the model's own
pairs (DeepSeekMath 5.2: "RFT samples from the SFT model once"; the online variants sample the current policy).

A pool is G completions for each of a set of prompts, drawn with the run's sampling settings and generator from the
policy as it is before any update, and scored once by the run's reward. It is saved in the run folder
(`pools/NAME.jsonl`, one line per sample), so `--resume` reads the same pool, and a later run can reuse it exactly
with the method's `pool` setting (the path of that file). A pool is never redrawn from a trained policy: a resumed run
whose pool file is gone stops in one sentence.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

from gcfamily.errors import GcfError
from gcfamily.methods.services import Services
from gcfamily.rewards import as_rewards
from gcfamily.rollout import SamplingSettings


@dataclass
class Pool:
    """Scored samples, in the order drawn: sample k belongs to prompt prompt_index[k] (an index into the run's prompts)."""

    prompt_index: list[int] = field(default_factory=list)
    completion_ids: list[list[int]] = field(default_factory=list)
    completions: list[str] = field(default_factory=list)
    rewards: list[float] = field(default_factory=list)
    valid: list[bool] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.prompt_index)

    def save(self, path: Path) -> None:
        """One JSON line per sample, written to a temporary file and renamed: a pool file is whole or absent."""
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".tmp-{path.name}")
        with tmp.open("w", encoding="utf-8") as f:
            for k in range(len(self)):
                row = {key: getattr(self, key)[k] for key in asdict(self)}
                f.write(json.dumps(row) + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: Path) -> "Pool":
        """A pool file as `save` wrote it; anything else is one sentence naming the file."""
        pool = cls()
        try:
            for line in path.read_text(encoding="utf-8").splitlines():
                row = json.loads(line)
                for key in asdict(pool):
                    getattr(pool, key).append(row[key])
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as e:
            raise GcfError(
                f"The pool file {path} cannot be read ({type(e).__name__}); pass a pool that a run wrote."
            ) from e
        bad = [k for k in range(len(pool)) if not _sample_ok(pool, k)]
        if bad:
            raise GcfError(
                f"The pool file {path} has a malformed sample on line {bad[0] + 1}; pass a pool that a run wrote."
            )
        return pool


def _sample_ok(pool: Pool, k: int) -> bool:
    ids, r = pool.completion_ids[k], pool.rewards[k]
    return (
        isinstance(pool.prompt_index[k], int)
        and isinstance(ids, list)
        and all(isinstance(t, int) for t in ids)
        and isinstance(pool.completions[k], str)
        and isinstance(r, (int, float))
        and isinstance(pool.valid[k], bool)
    )


def draw(
    services: Services,
    prompt_ids: list[list[int]],
    rows: list[dict[str, Any]],
    G: int,
    sampling: SamplingSettings,
    reward_fn: Any,
    chunk: int,
) -> Pool:
    """G samples of every prompt from the policy now, `chunk` prompts a call, scored by the reward (a sample whose
    reward failed is kept with valid=False, as a rollout's is)."""
    pool, rewards = Pool(), as_rewards(reward_fn)
    for s in range(0, len(prompt_ids), chunk):
        part = list(range(s, min(s + chunk, len(prompt_ids))))
        ro = services.generate([prompt_ids[i] for i in part], G, sampling)
        prompts = [rows[i]["prompt"] for i in part for _ in range(G)]
        columns = {
            k: [rows[i].get(k) for i in part for _ in range(G)]
            for k in rows[part[0]]
            if k not in ("prompt", "completion")
        }
        ids = [row[keep].tolist() for row, keep in zip(ro.input_ids, ro.completion_mask.bool())]
        scored = rewards.score(prompts, ro.completions, ids, columns, should_stop=services.stop_requested)
        scored.require_outcome("a pool of the initial policy's samples")
        pool.prompt_index += [i for i in part for _ in range(G)]
        pool.completion_ids += ids
        pool.completions += list(ro.completions)
        pool.rewards += [float(r) for r in scored.rewards.tolist()]
        pool.valid += [bool(v) for v in scored.valid.tolist()]
    return pool


def pool_for(services: Services, name: str, given: Optional[str], make: Callable[[], Pool], resumed: bool) -> Pool:
    """This run's pool NAME: its file in the run folder if there is one (a resume), else the `given` pool file (reused
    exactly), else drawn now by `make`; saved to the run folder either way."""
    if services.world_size > 1:
        raise GcfError(
            f"A pool of the initial policy's samples ({name}) is drawn in one process for now; run with --nproc 1."
        )
    path = services.run_file(f"pools/{name}.jsonl")
    if path is not None and path.is_file():
        return Pool.load(path)
    if given:
        if not Path(given).is_file():
            raise GcfError(f"pool={given} is not a file; pass the pools/{name}.jsonl of an earlier run.")
        pool = Pool.load(Path(given))
    elif resumed:
        raise GcfError(
            f"This resumed run's pool {path} is gone; it held the initial policy's samples, which a trained policy "
            "cannot redraw: start the run again, or pass the pool file with --set pool=PATH."
        )
    else:
        pool = make()
    if path is not None and services.is_main:
        pool.save(path)
    return pool


def pairs_of(pool: Pool, threshold: float) -> tuple[list[tuple[int, int, int]], int]:
    """(prompt, kept sample, rejected sample) per prompt that has both: the first valid sample scoring >= threshold and
    the first scoring below it, in the order drawn; and the number of prompts that have no such pair."""
    kept: dict[int, int] = {}
    rejected: dict[int, int] = {}
    prompts: list[int] = []
    for k, p in enumerate(pool.prompt_index):
        if p not in prompts:
            prompts.append(p)
        if not pool.valid[k]:
            continue
        (kept if pool.rewards[k] >= threshold else rejected).setdefault(p, k)
    pairs = [(p, kept[p], rejected[p]) for p in prompts if p in kept and p in rejected]
    return pairs, len(prompts) - len(pairs)
