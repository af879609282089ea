"""Pools of the initial policy's own samples, drawn once: the data source of offline RFT and of DPO on the model's own
pairs (DeepSeekMath 5.2: "RFT samples from the SFT model once"; the online variants sample the current policy).

A pool is G completions for each of a set of prompts, drawn with the run's sampling settings and generator from the
policy as it is before any update, and scored once by the run's reward. It is saved in the run folder
(`pools/NAME.jsonl`, one line per sample), so `--resume` reads the same pool, and a later run can reuse it exactly
with the method's `pool` setting (the path of that file). A pool is never redrawn from a trained policy: a resumed run
whose pool file is gone stops in one sentence.

A pool file is untrusted input (a run folder may be copied or downloaded): its first line records what it was drawn for
(a digest of its prompts' token ids, and one of its lines), the run's checkpoints record the same, and a file that was
edited, cut, drawn for other prompts or is not the one a resumed checkpoint trained on is refused in one sentence.
"""

from __future__ import annotations

import errno
import hashlib
import json
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

from gcfamily.errors import GcfError
from gcfamily.methods.samples import sample_scored
from gcfamily.methods.services import Services
from gcfamily.rewards import as_rewards
from gcfamily.rollout import SamplingSettings

COLUMNS = ("prompt_index", "completion_ids", "completions", "rewards", "valid")
"""A pool line's fields, one per sample."""
EPISODE = "policy_mask"
"""A pool of episodes (a run with --env) adds this field to every line: 1 on the episode's tokens the policy wrote, 0
on the environment's; its completion_ids then hold the whole episode after the prompt and completions its last turn."""


@dataclass
class Pool:
    """Scored samples, in the order drawn: sample k belongs to prompt prompt_index[k] (an index into the run's prompts).

    `drawn_for` is what the pool was drawn for, written as its file's first line and in the run's checkpoints:
    `prompts`, a digest of the token ids of the prompts it samples (the task or dataset, its formatting and tokenizer,
    and the choice of prompts), and `samples`, a digest of its lines."""

    prompt_index: list[int] = field(default_factory=list)
    completion_ids: list[list[int]] = field(default_factory=list)
    completions: list[str] = field(default_factory=list)
    rewards: list[float] = field(default_factory=list)
    valid: list[bool] = field(default_factory=list)
    policy_mask: list[list[int]] = field(default_factory=list)
    """Per sample, where the pool holds episodes (EPISODE); empty for one-turn samples."""
    drawn_for: dict[str, Any] = field(default_factory=dict)

    def columns(self) -> tuple[str, ...]:
        return COLUMNS + ((EPISODE,) if self.policy_mask else ())

    def __len__(self) -> int:
        return len(self.prompt_index)

    def save(self, path: Path, prompt_ids: list[list[int]]) -> None:
        """The header (`drawn_for`) and one JSON line per sample, written to a temporary file and renamed: a pool file
        is whole or absent, also on a full disk (one sentence, no temporary file left)."""
        lines = b"".join(
            (json.dumps({c: getattr(self, c)[k] for c in self.columns()}) + "\n").encode() for k in range(len(self))
        )
        self.drawn_for = {
            "gcf_pool": 1,
            "count": len(self),
            "prompts": prompts_digest(prompt_ids, self.prompt_index),
            "samples": hashlib.sha256(lines).hexdigest(),
        }
        data = (json.dumps(self.drawn_for) + "\n").encode() + lines
        tmp = path.with_name(f".tmp-{path.name}")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view) :]
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, path)
        except OSError as e:
            try:
                tmp.unlink()
            except OSError:
                pass
            why = "the disk is full" if e.errno in (errno.ENOSPC, errno.EDQUOT) else (e.strerror or str(e))
            raise GcfError(
                f"Could not write the pool file {path} ({why}); no step was trained on it: free some disk space and "
                "run again."
            ) from None

    @classmethod
    def load(cls, path: Path, prompt_ids: list[list[int]], vocab: Optional[int] = None) -> "Pool":
        """A pool file as `save` wrote it for these prompts (`prompt_ids`, the run's; `vocab`: token ids below it);
        anything else (another format, lines edited or cut, a sample out of range, a pool drawn for other prompts) is
        one sentence naming the file."""
        pool = cls()

        def refuse(why: str) -> GcfError:
            return GcfError(f"The pool file {path} {why}; pass a pool that a run wrote for this run's prompts.")

        try:
            head, _, lines = path.read_bytes().partition(b"\n")
            pool.drawn_for = json.loads(head) if head.strip() else {}
            rows = [json.loads(line) for line in lines.splitlines()]
        except (OSError, UnicodeDecodeError, ValueError, RecursionError) as e:
            raise refuse(f"cannot be read ({type(e).__name__})") from None
        head_ok = isinstance(pool.drawn_for, dict) and pool.drawn_for.get("gcf_pool") == 1
        if not head_ok or not all(isinstance(pool.drawn_for.get(k), str) for k in ("prompts", "samples")):
            raise refuse("cannot be read (it does not begin with the line that says what the pool was drawn for)")
        if not rows:
            raise refuse("holds no samples")
        if hashlib.sha256(lines).hexdigest() != pool.drawn_for["samples"] or len(rows) != pool.drawn_for.get("count"):
            raise refuse("has been edited or cut since it was drawn (its lines do not match its first line's digest)")
        episodes = isinstance(rows[0], dict) and EPISODE in rows[0]
        for k, row in enumerate(rows):
            if not _sample_ok(row, len(prompt_ids), vocab) or (EPISODE in row) != episodes:
                raise refuse(f"has a malformed sample on line {k + 2}")
            if episodes and not _mask_ok(row[EPISODE], row["completion_ids"]):
                raise refuse(f"has a malformed policy mask on line {k + 2}")
            for c in COLUMNS + ((EPISODE,) if episodes else ()):
                getattr(pool, c).append(row[c])
        if prompts_digest(prompt_ids, pool.prompt_index) != pool.drawn_for["prompts"]:
            raise refuse("was drawn for other prompts (another task, dataset, formatting or tokenizer)")
        return pool


def prompts_digest(prompt_ids: list[list[int]], prompt_index: list[int]) -> str:
    """A digest of the prompts a pool samples: each one's index and token ids, in index order."""
    h = hashlib.sha256()
    for p in sorted(set(prompt_index)):
        h.update(json.dumps([p, prompt_ids[p]]).encode() + b"\n")
    return h.hexdigest()


def _is_int(x: Any, below: Optional[int]) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and 0 <= x and (below is None or x < below)


def _mask_ok(mask: Any, ids: list[int]) -> bool:
    """An episode's policy mask: 0/1 per token, the first token the policy's (an episode opens with a policy turn)."""
    return isinstance(mask, list) and len(mask) == len(ids) and all(m in (0, 1) and not isinstance(m, bool) for m in mask) and (not mask or mask[0] == 1)  # fmt: skip


def _sample_ok(row: Any, n_prompts: int, vocab: Optional[int]) -> bool:
    if not isinstance(row, dict) or any(c not in row for c in COLUMNS):
        return False
    ids, r, ok = row["completion_ids"], row["rewards"], row.get("valid")  # a pool line, not a batch
    return (
        _is_int(row["prompt_index"], n_prompts)
        and isinstance(ids, list)
        and all(_is_int(t, vocab) for t in ids)
        and isinstance(row["completions"], str)
        and isinstance(r, (int, float))
        and not isinstance(r, bool)
        and math.isfinite(r)
        and isinstance(ok, bool)
    )


def draw(
    services: Services,
    prompt_ids: list[list[int]],
    rows: list[dict[str, Any]],
    G: int,
    sampling: SamplingSettings,
    reward_fn: Any,
    chunk: int,
    say: Optional[Callable[[str], None]] = None,
) -> Pool:
    """G samples of every prompt from the policy now, `chunk` prompts a call, scored by the reward (a sample whose
    reward failed is kept with valid=False, as a rollout's is); `say` hears how far the draw is after each call."""
    pool, rewards = Pool(), as_rewards(reward_fn)
    t0 = time.perf_counter()
    for s in range(0, len(prompt_ids), chunk):
        part = list(range(s, min(s + chunk, len(prompt_ids))))
        got = sample_scored(services, [prompt_ids[i] for i in part], [rows[i] for i in part], G, sampling, rewards)
        got.scores.require_outcome("a pool of the initial policy's samples")
        pool.prompt_index += [i for i in part for _ in range(G)]
        if got.episodes is None:
            pool.completion_ids += got.completion_ids
        else:  # the whole episode after the prompt, with the policy's tokens marked
            for ep in got.episodes.episodes:
                pool.completion_ids.append([t for ids, _ in ep.pieces for t in ids])
                pool.policy_mask.append([int(lp is not None) for ids, lp in ep.pieces for _ in ids])
        pool.completions += list(got.rollout.completions)
        pool.rewards += [float(r) for r in got.scores.rewards.tolist()]
        pool.valid += [bool(v) for v in got.scores.valid.tolist()]
        if say is not None:
            done = part[-1] + 1
            say(
                f"pool: {done}/{len(prompt_ids)} prompts drawn and scored, G={G} each ({time.perf_counter() - t0:.0f} s)"
            )
    return pool


def pool_for(
    services: Services,
    name: str,
    given: Optional[str],
    make: Callable[[], Pool],
    resumed: bool,
    prompt_ids: list[list[int]],
) -> Pool:
    """This run's pool NAME: its file in the run folder if there is one (a resume), else the `given` pool file (reused
    exactly), else drawn now by `make`; saved to the run folder either way. A file read must have been drawn for this
    run's prompts (`prompt_ids`; Pool.load)."""
    if services.world_size > 1:
        raise GcfError(
            f"A pool of the initial policy's samples ({name}) is drawn in one process for now; run with --nproc 1."
        )
    vocab = _vocab(services)
    path = services.run_file(f"pools/{name}.jsonl")
    if path is not None and path.is_file():
        return Pool.load(path, prompt_ids, vocab)
    if given:
        if not Path(given).is_file():
            raise GcfError(f"pool={given} is not a file; pass the pools/{name}.jsonl of an earlier run.")
        pool = Pool.load(Path(given), prompt_ids, vocab)
    elif resumed:
        raise GcfError(
            f"This resumed run's pool {path} is gone; it held the initial policy's samples, which a trained policy "
            "cannot redraw: start the run again, or pass the pool file with --set pool=PATH."
        )
    else:
        pool = make()
    if path is not None and services.is_main:
        pool.save(path, prompt_ids)
    elif not pool.drawn_for:
        pool.drawn_for = {"prompts": prompts_digest(prompt_ids, pool.prompt_index)}
    return pool


def check_drawn_for(pool: Pool, recorded: Optional[dict[str, Any]], name: str) -> None:
    """A resume: the pool read is the one the checkpoint's steps were trained on (`recorded`, from its state; a
    checkpoint of before pools were recorded has none)."""
    if not recorded:
        return
    if any(recorded.get(k) != pool.drawn_for.get(k) for k in ("prompts", "samples")):
        raise GcfError(
            f"The pool {name} read now is not the one the resumed checkpoint was trained on (it was edited, cut or "
            "replaced); restore the run's pools/ file, or start the run again."
        )


def _vocab(services: Services) -> Optional[int]:
    """The policy's vocabulary size: a pooled token id at or past it is not one the policy drew."""
    try:
        return int(services.policy().get_input_embeddings().num_embeddings)
    except (AttributeError, TypeError):
        return None


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
