"""Saving under torch.distributed: checkpoints in the single-process format written by rank 0 from gathered state
(plus every rank's RNG), a resumed optimizer state scattered back onto each rank's shard, and the final folder written by
rank 0 with its outcome said on every rank. Saving (gcfamily/run/saving.py) calls these when the run has a DistEnv.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from gcfamily.errors import GcfError
from gcfamily.models import lora
from gcfamily.run import checkpoint_format
from gcfamily.run.distributed import DistEnv
from gcfamily.run.folder.writes import write_folder
from gcfamily.run.view import TrainerView


def save_checkpoint(env: DistEnv, trainer: TrainerView) -> Path | None:
    """The single-process checkpoint format, written by rank 0 from gathered state, plus every rank's RNG."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    weights = env.full_state_dict(trainer.unwrapped_policy())
    optim = get_optimizer_state_dict(
        trainer.policy, trainer.optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )
    method_state = _full(trainer.method.state_dict())
    rngs: list[Any] = [None] * env.world_size
    dist.all_gather_object(rngs, checkpoint_format.rng_state(trainer.generator))
    path = None
    if env.is_main:
        state = {
            **trainer.saving.training_state(trainer),
            "optimizer": optim,
            "method": method_state,
            "rank_rng": rngs,
            "strategy": env.strategy,
        }
        as_model = types.SimpleNamespace(state_dict=lambda: weights)  # what checkpoint_format.save reads of a model
        path = checkpoint_format.save(
            trainer.out_dir / "checkpoints",
            trainer.step,
            as_model,
            state,
            trainer.cfg.keep_last,
            trainer.weight_keys(),
            trainer.saving.extras_of(trainer),
        )
    dist.barrier()
    return path


def load_optimizer(model: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
    """Scatter a full optimizer state (every rank read the same file) onto this rank's parameters."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    set_optimizer_state_dict(model, optimizer, state, options=StateDictOptions(full_state_dict=True))


def save_final(
    env: DistEnv, trainer: TrainerView, write: Callable[[Path, dict[str, torch.Tensor] | None], None]
) -> None:
    """Rank 0 writes the final folder with `write(folder, weights)` (save_pretrained of the full model and the
    tokenizer: loadable without torch.distributed), all of its files or none (writes.write_folder); `weights` are
    gathered on every rank first (FSDP2), None for a LoRA model (DDP keeps a whole copy on every rank).

    Under FSDP2 mixed precision that is the float32 master weights, as the config then says. Rank 0's outcome reaches
    every rank in place of a barrier, so a full disk there ends every rank in the same sentence and none waits."""
    policy = trainer.unwrapped_policy()
    weights = None if lora.is_peft(policy) else env.full_state_dict(policy)
    failed: Exception | None = None
    if env.is_main:
        try:
            write_folder(
                trainer.out_dir,
                lambda folder: write(folder, weights),
                run_dir=trainer.out_dir,
                what=f"the final model to {trainer.out_dir}",
            )
        except Exception as e:  # noqa: BLE001 - said on every rank (so none hangs), then raised here
            failed = e
    said = env.broadcast(None if failed is None else str(failed))
    if failed is not None:
        raise failed
    if said is not None:
        raise GcfError(said)


def local_state(state: dict[str, Any], env: DistEnv | None) -> dict[str, Any]:
    """A loaded checkpoint's state for this process: its own RNG; a clear error on another process count."""
    rngs = state.get("rank_rng")
    n = len(rngs) if rngs is not None else 1
    if n != (env.world_size if env is not None else 1):
        hint = f"--nproc {n}" if n > 1 else "one process (no --nproc)"
        raise GcfError(f"The checkpoint was written by {n} process(es); resume it with {hint}.")
    return state if env is None else {**state, "rng": rngs[env.rank]}


def _full(obj: Any) -> Any:
    """obj with every DTensor gathered to a whole CPU tensor (a sharded reference in a method's state)."""
    from torch.distributed.tensor import DTensor

    if isinstance(obj, DTensor):  # a method may have moved its shards to the CPU already; gather where the mesh lives
        return obj.to(obj.device_mesh.device_type).full_tensor().cpu()
    if isinstance(obj, dict):
        return {k: _full(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_full(v) for v in obj)
    return obj
