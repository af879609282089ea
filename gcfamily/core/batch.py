"""The step batch: every field a training step carries, each declaring its role.

A field's role says how micro-batches, ranks and minibatches cut it (data/batches.py reads it, never the shape):

    TOKEN  [B, L], aligned with input_ids: cut by rows, and by columns when all-padding columns are trimmed
    ROW    [B, ...] tensor, or a list of B items: cut by rows
    STEP   a constant of the step (a number, a nested batch): kept whole in every part

`select`, `trim`, `to_device` and `concat` (below) cut and join batches by those roles. The built-in methods' fields
are declared below, grouped by who fills them: the data source (`Method.data`), then
`Method.prepare`. A field a method does not use stays None. A user's rule keeps fields of its own in `own`, each put
with its role (`batch.put("bonus", tensor, ROW)`) and read back as `batch.own["bonus"]`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import torch

TOKEN, ROW, STEP = "token", "row", "step"
ROLES = (TOKEN, ROW, STEP)


def _field(role: str) -> Any:
    return field(default=None, metadata={"role": role})


@dataclass(eq=False)
class Batch:
    """One step's rows (or a micro-batch of them). Shapes: B rows, L positions. Every data source sets the three
    sequences; a test of one part of a rule may build a batch of only the fields that part reads."""

    # -- the sequences (data/batches.collate) ------------------------------------------
    input_ids: torch.Tensor = _field(TOKEN)
    """[B, L] token ids, right-padded."""
    attention_mask: torch.Tensor = _field(TOKEN)
    """[B, L] 1 on real tokens."""
    loss_mask: torch.Tensor = _field(TOKEN)
    """[B, L] 1 on the tokens the policy wrote and the loss trains (a completion's, EOS included)."""

    # -- the normaliser's weights (engine.normaliser) ----------------------------------
    valid: Optional[torch.Tensor] = _field(ROW)
    """[B] bool; off: the row gives no gradient and leaves Z (a failed reward, an excluded group). None: all valid."""
    example_weight: Optional[torch.Tensor] = _field(ROW)
    """[B] the row's weight in the sequence counts (1/2 for each row of a preference pair). None: 1."""

    # -- what sampling adds (methods/onpolicy.py, the pools) ---------------------------
    sample_logps: Optional[torch.Tensor] = _field(TOKEN)
    """[B, L] the sampler's log-probs of the tokens it drew."""
    rewards: Optional[torch.Tensor] = _field(ROW)
    """[B] each sample's (weighted) reward."""
    prompt_index: Optional[torch.Tensor] = _field(ROW)
    """[B] which of the step's prompts the row answers (row n of a rollout belongs to prompt n // G)."""
    completions: Optional[list[str]] = _field(ROW)
    """B completion texts, as the reward read them."""
    reward_parts: Optional[torch.Tensor] = _field(ROW)
    """[B, K] each reward function's own value, in the order of --reward (reward_aggregation=normalize_then_sum)."""
    truncated: Optional[torch.Tensor] = _field(ROW)
    """[B] bool: the completion hit max_new_tokens (or the episode's room) without EOS or a stop string."""
    step_rewards: Optional[torch.Tensor] = _field(TOKEN)
    """[B, L] process supervision: each step's reward on the token that ends it."""
    step_mask: Optional[torch.Tensor] = _field(TOKEN)
    """[B, L] bool: the tokens that end a scored step."""

    # -- what prepare adds (no grad) -----------------------------------------------------
    old_logps: Optional[torch.Tensor] = _field(TOKEN)
    """[B, L] pi_old's log-probs (computed only when there is more than one pass or minibatch)."""
    ref_logps: Optional[torch.Tensor] = _field(TOKEN)
    """[B, L] pi_ref's log-probs."""
    advantages: Optional[torch.Tensor] = _field(ROW)
    """[B] A_i, one advantage per sample (GRPO and its variants)."""
    token_advantages: Optional[torch.Tensor] = _field(TOKEN)
    """[B, L] A_t, one advantage per token (PPO's GAE, process supervision)."""
    kl_rewards: Optional[torch.Tensor] = _field(ROW)
    """[B] sum_t KL_t at pi_old, which kl_placement=reward takes from the reward."""
    values: Optional[torch.Tensor] = _field(TOKEN)
    """[B, L] the critic's values at pi_old (PPO)."""
    returns: Optional[torch.Tensor] = _field(TOKEN)
    """[B, L] the critic's targets (PPO)."""
    token_rewards: Optional[torch.Tensor] = _field(TOKEN)
    """[B, L] per-token rewards before GAE (PPO: the outcome on the last token, minus the KL penalty)."""
    kept: Optional[torch.Tensor] = _field(ROW)
    """[B] bool: the samples rejection sampling keeps (RFT)."""
    desirable: Optional[torch.Tensor] = _field(ROW)
    """[B] bool: the example's label (KTO)."""
    kl_pairs: Optional["Batch"] = _field(STEP)
    """KTO's mismatched (prompt, other completion) pairs, which prepare turns into z0 (kept whole)."""
    z0: Optional[float] = _field(STEP)
    """KTO's reference point, a constant of the step."""

    # -- the check's stand-in rows (gcfamily/check) --------------------------------------
    row_id: Optional[torch.Tensor] = _field(ROW)
    """[B] which row of the check's logit table a batch row is."""

    # -- a method's own fields -------------------------------------------------------
    own: dict[str, Any] = field(default_factory=dict, metadata={"role": "own"})
    """Fields of a user's method, by name; each was put with its role (`put`), kept in `own_roles`."""
    own_roles: dict[str, str] = field(default_factory=dict, metadata={"role": "own"})

    def __post_init__(self) -> None:
        for name, role in self.own_roles.items():
            if role not in ROLES or name not in self.own:
                raise ValueError(f"batch field {name!r} has role {role!r}; put it with one of {', '.join(ROLES)}")

    # -- fields by role ----------------------------------------------------------------
    def put(self, name: str, value: Any, role: str) -> "Batch":
        """Set a method's own field with its role (TOKEN, ROW or STEP); returns the batch."""
        if role not in ROLES:
            raise ValueError(f"batch field {name!r}: role must be one of {', '.join(ROLES)}, not {role!r}")
        if name in DECLARED:
            raise ValueError(f"batch field {name!r} is declared: set batch.{name} instead")
        self.own[name], self.own_roles[name] = value, role
        return self

    def items(self) -> list[tuple[str, Any, str]]:
        """(name, value, role) of every field that is set, declared then own."""
        declared = [(name, getattr(self, name), role) for name, role in DECLARED.items()]
        return [f for f in declared if f[1] is not None] + [(k, v, self.own_roles[k]) for k, v in self.own.items()]

    def replaced(self, **values: Any) -> "Batch":
        """A new batch with these fields (declared, or own ones already put) replaced; the rest shared with this one."""
        unknown = [k for k in values if k not in DECLARED and k not in self.own]
        if unknown:
            raise ValueError(f"batch field {unknown[0]!r} is neither declared nor put; put it with its role first")
        declared = {k: v for k, v in values.items() if k in DECLARED}
        own = {**self.own, **{k: v for k, v in values.items() if k not in DECLARED}}
        return dataclasses.replace(self, **declared, own=own, own_roles=dict(self.own_roles))

    def clone(self) -> "Batch":
        """A deep copy of the tensors (and lists) of every field, so that writing into the copy leaves this one."""
        return self.replaced(
            **{
                k: v.clone() if isinstance(v, (torch.Tensor, Batch)) else list(v) if isinstance(v, list) else v
                for k, v, _ in self.items()
            }
        )

    def copy(self) -> "Batch":
        """A shallow copy: setting a field of the copy leaves this batch as it was."""
        return self.replaced()

    def __repr__(self) -> str:
        def show(v: Any) -> str:
            return f"[{', '.join(map(str, v.shape))}] {v.dtype}" if isinstance(v, torch.Tensor) else type(v).__name__

        return "Batch(" + ", ".join(f"{k}={show(v)}" for k, v, _ in self.items()) + ")"

    @property
    def rows(self) -> int:
        """B."""
        return int(self.input_ids.shape[0])


DECLARED: dict[str, str] = {
    f.name: f.metadata["role"] for f in dataclasses.fields(Batch) if f.metadata["role"] != "own"
}
"""Every declared field's role, by name."""


# -- cutting a batch by its fields' roles (micro-batches, ranks, minibatches) ------------------


def select(batch: Batch, idx: slice | torch.Tensor | list[int]) -> Batch:
    """Rows idx of a batch, by each field's declared role (core/batch.py): TOKEN and ROW fields are indexed, STEP
    fields kept. A TOKEN or ROW field of another length than input_ids is a bug in whoever built the batch, refused
    here rather than passed on."""
    B = batch.rows
    rows = idx.tolist() if isinstance(idx, torch.Tensor) else idx
    out: dict[str, Any] = {}
    for k, v, role in batch.items():
        if role == STEP:
            continue
        if len(v) != B:
            raise ValueError(f"batch field {k!r} ({role}) has {len(v)} rows, not the batch's {B}")
        out[k] = v[idx] if isinstance(v, torch.Tensor) or isinstance(idx, slice) else [v[i] for i in rows]
    return batch.replaced(**out)


def trim(batch: Batch) -> Batch:
    """Drop columns that are padding in every row (left and right), in every TOKEN field."""
    am = batch.attention_mask
    L = am.shape[1]
    cols = am.any(0).nonzero()
    if cols.numel() == 0:
        return batch
    lo, hi = int(cols[0]), int(cols[-1]) + 1
    if lo == 0 and hi == L:
        return batch
    return batch.replaced(**{k: v[:, lo:hi] for k, v, role in batch.items() if role == TOKEN})


def to_device(batch: Batch, device: torch.device | str) -> Batch:
    """Move every TOKEN and ROW tensor of a batch."""
    return batch.replaced(
        **{
            k: v.to(device, non_blocking=True)
            for k, v, role in batch.items()
            if role in (TOKEN, ROW) and isinstance(v, torch.Tensor)
        }
    )


def concat(batches: Sequence[Batch]) -> Batch:
    """Rows of several batches of equal width, one after another (STEP fields from the first)."""
    first = batches[0]
    out: dict[str, Any] = {}
    for k, v, role in first.items():
        if role == STEP:
            continue
        parts = [_get(b, k) for b in batches]
        out[k] = torch.cat(parts) if isinstance(v, torch.Tensor) else [x for p in parts for x in p]
    return first.replaced(**out)


def _get(batch: Batch, name: str) -> Any:
    return batch.own[name] if name in batch.own else getattr(batch, name)
