"""Several processes with torch.distributed: DDP or FSDP2, one normaliser across ranks.

How a run scales out (the single-process path does not change):

- `gcf run ... --nproc N` re-runs the same command under torch.distributed.run (torchrun;
  `gcfamily/run/launch.py`). Under
  torchrun, WORLD_SIZE > 1 makes `cli.run` build a DistEnv (gloo on CPU, NCCL on GPU) and give it
  to the Trainer, which calls the hooks below.
- The policy's log-prob pass goes through ONE module forward, `engine.LogprobModel`: that is what
  DDP wraps and what FSDP2 shards (each decoder layer, then the wrapper as root), because their
  hooks (DDP's gradient reducer, FSDP2's gather and free) only run when that forward is called.
- Every rank takes a contiguous 1/world share of each step's examples (`Method.step_indices`),
  so each prompt's whole group stays on one rank; Z is all-reduced in `engine.normaliser` and the
  trainer multiplies the loss by world_size because DDP and FSDP2 both average gradients. So N
  ranks take exactly the step one process takes on the same global batch.
- FSDP2: generation and evaluation run inside `full_parameters` (every group gathered once,
  freed after), and a method's frozen reference is sharded like the policy. Checkpoints gather
  the full state on rank 0, in the single-process format plus each rank's RNG state
  (gcfamily/run/distributed_save.py).
- GPU: NCCL, one device per process (LOCAL_RANK). Master weights stay in master_dtype (float32)
  under both strategies; with a bfloat16 compute dtype FSDP2 casts the gathered parameters
  (MixedPrecisionPolicy, gradients reduced in float32) and DDP runs under the trainer's autocast,
  as one process does (gcfamily/core/precision.py).
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from gcfamily.core.engine import LogprobModel
from gcfamily.errors import GcfError
from gcfamily.methods.base import extreme

# each rank holds a share: add them
SUM_METRICS = (
    "loss",
    "tokens",
    "tokens/generated",
    "train_tokens_per_s",
    "reward/failed",
)
MAX_PREFIXES = ("time/", "peak_memory_mb")  # the slowest / largest rank is the one that matters


# ----------------------------------------------------------------------------------
# one process's view of the group


def check_batch_size(batch_size: int, world_size: int) -> None:
    """batch_size is the global number of examples per step: each rank takes an equal share."""
    if batch_size % world_size:
        raise GcfError(
            f"batch_size={batch_size} is the global number of examples per step and must divide evenly over {world_size} processes; pick a multiple of {world_size}."
        )


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks FSDP2 shards one by one: the classes HF lists in `_no_split_modules`."""
    # a critic holds a backbone
    names = {n for sub in model.modules() for n in (getattr(sub, "_no_split_modules", None) or [])}
    layers = [m for m in model.modules() if type(m).__name__ in names]
    return layers or (list(getattr(model.get_decoder(), "layers", [])) if hasattr(model, "get_decoder") else [])


class DistEnv:
    """Rank, world size and device of this process, and the hooks the Trainer calls under torchrun."""

    def __init__(self, rank: int, world_size: int, local_rank: int, device: torch.device) -> None:
        self.rank, self.world_size, self.local_rank, self.device = rank, world_size, local_rank, device
        self.strategy = "ddp"
        self.compute_dtype: torch.dtype | None = None  # bfloat16 under FSDP2 mixed precision
        self._roots: dict[int, nn.Module] = {}  # id(plain causal LM) -> its FSDP2-sharded LogprobModel

    @classmethod
    def from_env(cls, device: str = "auto", timeout_s: float = 600.0) -> DistEnv | None:
        """The process group torchrun describes in the environment, or None when WORLD_SIZE <= 1.

        A collective waits at most timeout_s for the other processes (dist_timeout), not torch's 30 minutes."""
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if world <= 1:
            return None
        rank, local_rank = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
        if device.startswith("cuda") and not torch.cuda.is_available():
            raise GcfError(f"device={device} was asked for but no CUDA GPU is available; use device=cpu.")
        use_cuda = torch.cuda.is_available() and device != "cpu"
        if use_cuda and local_rank >= torch.cuda.device_count():
            raise GcfError(
                f"{int(os.environ.get('LOCAL_WORLD_SIZE', local_rank + 1))} processes on this machine but {torch.cuda.device_count()} GPU(s): start one process per GPU (--nproc / --nproc_per_node), or set device=cpu."
            )
        dev = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
        if use_cuda:
            torch.cuda.set_device(dev)
        if not dist.is_initialized():
            import datetime

            dist.init_process_group(
                "nccl" if use_cuda else "gloo",
                device_id=dev if use_cuda else None,
                timeout=datetime.timedelta(seconds=timeout_s),
            )
        return cls(rank, world, local_rank, dev)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def check(self, cfg: Any) -> None:
        """Settings that cannot be split over the ranks; one clear sentence."""
        check_batch_size(cfg.batch_size, self.world_size)

    def close(self, agree: bool = False) -> None:
        """Leave the process group. `agree` (a run that ended normally on every rank): first a barrier, so that no rank
        tears its connections down while a peer is still inside a collective, which can abort that peer's process
        ("terminate called without an active exception"). Without it (an error path, where a peer may be gone or in
        another collective), the group is destroyed at once; closing twice is closing once."""
        if not dist.is_initialized():
            return
        if agree:
            try:
                dist.barrier()
            except RuntimeError:  # a peer already left: nothing to wait for
                pass
        dist.destroy_process_group()

    def barrier(self) -> None:
        dist.barrier()

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's obj on every rank (a decision rank 0 makes: a checkpoint path, an error message)."""
        box = [obj if self.is_main else None]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    # -- wrapping ----------------------------------------------------------------------
    def set_precision(self, prec: Any) -> None:
        """FSDP2 casts the gathered parameters to the compute dtype (its MixedPrecisionPolicy) when it differs
        from the master dtype; DDP, like one process, computes under the trainer's autocast."""
        self.compute_dtype = prec.compute if prec.mixed else None

    def wrap(self, model: nn.Module, cfg: Any, method: Any = None) -> nn.Module:
        """The policy as a LogprobModel under DDP or FSDP2. Under FSDP2 the method's own models are
        sharded too: a frozen pi_ref, and a model it trains (PPO's critic) with its optimizer's state."""
        self.check(cfg)
        self.strategy = cfg.strategy
        root = LogprobModel(model)
        if cfg.strategy == "ddp":
            # buffers (rotary tables) are the same on every rank: no broadcast, which would be a collective per forward
            ids = [self.device.index] if self.device.type == "cuda" else None
            return nn.parallel.DistributedDataParallel(root, device_ids=ids, forward_sync_buffers=False)
        self._shard(root)
        for m in method.owned_models() if method is not None else []:
            if any(p.requires_grad for p in m.parameters()):
                self._shard_trained(m, method)
            elif _is_causal_lm(m):  # pi_ref; anything else stays whole
                self._shard(LogprobModel(m))
        return root

    def _mesh_and_precision(self) -> tuple[Any, Any]:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy

        mesh = init_device_mesh(self.device.type, (self.world_size,))
        mp = (
            MixedPrecisionPolicy(param_dtype=self.compute_dtype, reduce_dtype=torch.float32)
            if self.compute_dtype
            else MixedPrecisionPolicy()
        )
        return mesh, mp

    def _shard_trained(self, module: nn.Module, owner: Any) -> None:
        """Shard a second trained model (PPO's critic) in place, layer by layer, and move the
        optimizers of `owner` that hold its parameters onto the shards (their state too: a resumed
        checkpoint's whole state is split the way each parameter is)."""
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor import distribute_tensor

        mesh, mp = self._mesh_and_precision()
        old = dict(module.named_parameters())
        # every group frees its parameters after forward: the critic is called whole
        for layer in decoder_layers(module):
            fully_shard(layer, mesh=mesh, mp_policy=mp, reshard_after_forward=True)
        fully_shard(module, mesh=mesh, mp_policy=mp, reshard_after_forward=True)
        new = dict(module.named_parameters())
        swap = {id(p): new[name] for name, p in old.items()}
        for opt in (v for v in vars(owner).values() if isinstance(v, torch.optim.Optimizer)):
            for group in opt.param_groups:
                if any(id(p) in swap for p in group["params"]):
                    group["params"] = [swap.get(id(p), p) for p in group["params"]]
                    if group.get("fused"):  # as engine.build_optimizer does for sharded parameters
                        group["fused"], group["foreach"] = False, True
            for p, st in list(opt.state.items()):
                if id(p) in swap:
                    q = swap[id(p)]
                    opt.state[q] = {
                        k: distribute_tensor(v.to(self.device), q.device_mesh, q.placements)
                        if isinstance(v, torch.Tensor) and v.dim() and v.shape == p.shape
                        else v
                        for k, v in st.items()
                    }
                    del opt.state[p]

    def _shard(self, root: LogprobModel) -> LogprobModel:
        from torch.distributed.fsdp import fully_shard

        mesh, mp = self._mesh_and_precision()
        for layer in decoder_layers(root.model):
            fully_shard(layer, mesh=mesh, mp_policy=mp)
        fully_shard(root, mesh=mesh, mp_policy=mp)
        # One forward through the wrapper makes it FSDP2's root before anything calls a layer
        # directly (generation does, inside full_parameters).
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            ids = torch.ones(1, 2, dtype=torch.long, device=self.device)
            root(ids, torch.ones_like(ids), torch.zeros_like(ids))
        root.reshard()  # the root keeps its parameters gathered after a forward; the optimizer must see the shards
        self._roots[id(root.model)] = root
        return root

    def logprob_module(self, model: nn.Module) -> nn.Module:
        """What to run a no-grad log-prob pass of `model` through: its FSDP2 root, or the model itself."""
        return self._roots.get(id(model), model)

    @contextlib.contextmanager
    def no_sync(self, model: nn.Module) -> Iterator[None]:
        """Accumulate this micro-batch's gradients locally; the step's last micro-batch reduces them."""
        if self.strategy == "ddp":
            with model.no_sync():
                yield
            return
        model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)

    @contextlib.contextmanager
    def full_parameters(self, model: nn.Module) -> Iterator[None]:
        """Under FSDP2, gather every parameter group of the policy once (generation runs many forwards
        without collectives) and free them after; a no-op under DDP, whose parameters are whole."""
        if self.strategy != "fsdp2":
            yield
            return
        from torch.distributed.fsdp import FSDPModule

        mods = [m for m in model.modules() if isinstance(m, FSDPModule)]
        model.set_reshard_after_forward(False)  # recursive: a layer's forward keeps it gathered
        for m in mods:
            m.unshard()
        try:
            yield
        finally:
            for m in mods:
                m.reshard()
                # layers free after forward; the root keeps its params for backward
                m.set_reshard_after_forward(m is not model, recurse=False)

    # -- the step ------------------------------------------------------------------------
    def all_finite(self, loss: float, params: list[nn.Parameter]) -> bool:
        """Every rank's loss and gradient shard finite: all ranks step, or all skip."""
        grads = [_local(p.grad) for p in params if p.grad is not None]
        ok = math.isfinite(loss) and (not grads or bool(torch.isfinite(torch.stack(torch._foreach_norm(grads))).all()))
        flag = torch.tensor([1.0 if ok else 0.0], device=self._comm_device())
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        return bool(flag.item() > 0)

    def clip_grad_norm_(self, params: list[nn.Parameter], max_norm: float) -> torch.Tensor:
        """Global gradient norm (over every shard under FSDP2) and clipping to max_norm, as one process does."""
        if self.strategy == "ddp":  # gradients are whole and equal on every rank
            return torch.nn.utils.clip_grad_norm_(params, max_norm)
        grads = [p.grad for p in params if p.grad is not None]
        norms = torch._foreach_norm([_local(g) for g in grads])  # of this rank's shards
        sq = torch.stack(norms).double().pow(2).sum().to(self._comm_device())
        dist.all_reduce(sq)
        total = sq.sqrt().float()
        coef = float(torch.clamp(max_norm / (total + 1e-6), max=1.0))
        torch._foreach_mul_(grads, coef)
        return total

    def average_method_grads(self, method: Any) -> None:
        """A second model the method trains (PPO's critic), whole on every rank under DDP: average its
        gradients (under FSDP2 it is sharded, and its reduce-scatter has averaged them already)."""
        from torch.distributed.tensor import DTensor

        for module in method.owned_models():
            for p in module.parameters():
                if p.requires_grad and p.grad is not None and not isinstance(p.grad, DTensor):
                    dist.all_reduce(p.grad)
                    p.grad.div_(self.world_size)

    def reduce_metrics(self, metrics: dict[str, float]) -> dict[str, float]:
        """One row for the log: shares added (loss, tokens), times and memory the max, a figure named ..._max or ..._min
        the max or min over the ranks (methods/base.py's EXTREMES), the rest averaged over the ranks."""
        rows: list[Any] = [None] * self.world_size
        dist.all_gather_object(rows, metrics)
        out: dict[str, float] = {}
        for k in sorted({k for r in rows for k in r}):
            vals = [float(r[k]) for r in rows if k in r]
            finite = [v for v in vals if math.isfinite(v)] or vals
            if k in SUM_METRICS:
                out[k] = sum(vals)
            elif k.startswith(MAX_PREFIXES):
                out[k] = max(finite)
            elif (how := extreme(k)) is not None:
                out[k] = how(finite)
            else:
                out[k] = sum(finite) / len(finite)
        return out

    def all_sum(self, t: torch.Tensor) -> torch.Tensor:
        """`t` summed over the processes (a copy, on t's device)."""
        out = t.to(self._comm_device(), copy=True)
        dist.all_reduce(out)
        return out.to(t.device)

    def agree_stop(self, signal_name: str | None) -> str | None:
        """A signal seen by any rank stops every rank at the same step (the checkpoint is collective)."""
        flag = torch.tensor([1.0 if signal_name else 0.0], device=self._comm_device())
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return (signal_name or "SIGTERM") if flag.item() > 0 else None

    def full_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """Whole CPU tensors of `model` (every rank calls this: FSDP2 gathers); tied weights stay one tensor."""
        from torch.distributed.tensor import DTensor

        cache: dict[int, torch.Tensor] = {}
        out = {}
        for k, v in model.state_dict(keep_vars=True).items():
            if id(v) not in cache:
                t = v.detach()
                cache[id(v)] = (t.full_tensor() if isinstance(t, DTensor) else t).cpu()
            out[k] = cache[id(v)]
        return out

    def _comm_device(self) -> torch.device:
        return self.device if dist.get_backend() == "nccl" else torch.device("cpu")


def _is_causal_lm(m: nn.Module) -> bool:
    try:
        return m.get_decoder() is not None and getattr(m.get_output_embeddings(), "weight", None) is not None
    except (AttributeError, NotImplementedError):
        return False


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t
