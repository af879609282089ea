"""Building a run, in parts a reader can name and a test can call: the device and threads, the policy (loaded or
adopted, its context checked, LoRA adapters on), the method (set up on the untouched policy, its evaluation checked),
the policy made ready to train (activation checkpointing, DDP / FSDP2) with its optimizer and schedule, and a resumed
checkpoint's optimizer, schedule and thread count restored. The Trainer calls them in this order (Trainer._build);
everything that can fail runs here, before the run folder commits.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from typing import TYPE_CHECKING, Any

import torch

from gcfamily.config import Config
from gcfamily.core import engine, float32_parts, precision, threads
from gcfamily.data.encoding import Formatter
from gcfamily.errors import GcfError
from gcfamily.methods.base import Method
from gcfamily.models import load_model, lora
from gcfamily.rollout import context_length
from gcfamily.run import distributed_save

if TYPE_CHECKING:
    from gcfamily.methods.services import Services
    from gcfamily.run.distributed import DistEnv
    from gcfamily.run.evaluation import Evaluation


def resolve_device(name: str) -> torch.device:
    """auto -> cuda when available, else cpu."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise GcfError(f"device={name} was asked for but no CUDA GPU is available; use device=cpu.")
    try:
        return torch.device(name)
    except RuntimeError as e:
        raise GcfError(f"device={name!r} is not a device; use auto, cpu, cuda or cuda:N.") from e


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """auto -> bfloat16 on a GPU that supports it, float32 otherwise (the compute dtype)."""
    return precision.compute_dtype(name, device)


def choose_threads(cfg: Config, dist: DistEnv | None) -> threads.Threads:
    """torch's CPU threads for this run (the `threads` setting; gcfamily/core/threads.py), set now. Under torchrun
    every rank measures the same moment, after a barrier, and takes rank 0's choice; auto shares the free cores among
    the run's processes on this machine."""
    given = cfg.threads if isinstance(cfg.threads, int) else None
    if dist is None:
        choice = threads.decide(given)
    else:
        dist.barrier()  # no rank is busy loading while the others measure
        choice = dist.broadcast(threads.decide(given, int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))
    threads.apply(choice.count)
    return choice


def environments(cfg: Config, method_cls: type[Method], given: Any) -> Any:
    """The run's environments (cfg.env, or `given`, an Environment class from Python), started now; None without one.
    A method that trains on data it does not sample refuses them in one sentence."""
    env = given if given is not None else cfg.env
    if env is None:
        return None
    if not method_cls.runs_episodes:
        raise GcfError(
            f"env={cfg.env or getattr(env, '__name__', env)} makes each of the policy's samples an episode, but "
            f"{method_cls.name or cfg.method} trains on data it does not sample now; use an on-policy method (grpo, rft, "
            "ppo, online-dpo, ...)."
        )
    if cfg.strategy == "fsdp2" and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise GcfError(
            "env with strategy=fsdp2: each rank's episodes take their own number of turns, and every turn gathers the "
            "sharded weights together with the other ranks; train with strategy=ddp (or one process)."
        )
    from gcfamily.envs.worker import open_envs

    return open_envs(env, cfg.env_options, cfg.env_timeout)


def build_policy(
    cfg: Config, model: Any, prec: precision.Precision, device: torch.device, say: Any = None, envs: Any = None
) -> tuple[torch.nn.Module, Any, Formatter]:
    """The policy in the master dtype on `device` (cfg.model loaded, or a (model, tokenizer) pair from Python adopted),
    its tokenizer and its formatter (an environment's instructions as the system prompt where none is set, its tools
    for templates that render them); refused past its context; with LoRA adapters when asked. `say`: where loading (and
    a first use's conversion) tells what it does (console.teller), None for silence."""
    dtype = prec.master  # what every model of the run is loaded in
    if model is not None:
        from gcfamily.models import adopt_model

        policy, tokenizer = adopt_model(model, dtype, device, cfg.trust_remote_code)
    else:
        policy, tokenizer = load_model(cfg.model, dtype, device, cfg.trust_remote_code, cfg.seed, say)
    desc = envs.description if envs is not None else {"system": None, "tools": None}
    system = cfg.system_prompt if cfg.system_prompt is not None else desc["system"]
    formatter = Formatter(tokenizer, cfg.chat_format, system, cfg.assistant_only_loss, cfg.chat_template, desc["tools"])
    ctx = context_length(policy)  # also for hub models and models passed from Python, which the CLI cannot read ahead
    if ctx is not None and cfg.max_length > ctx:
        raise GcfError(
            f"max_length={cfg.max_length} is past the context of model {cfg.model} ({ctx} positions); set max_length <= {ctx}."
        )
    if lora.enabled(cfg):  # before the method's setup: its reference is this model with the adapters off
        policy = lora.wrap(policy, cfg)
    precision.check_master(policy.parameters(), prec, f"The model {cfg.model}")
    keep_float32(policy, cfg, prec)
    return policy, tokenizer, formatter


def keep_float32(policy: torch.nn.Module, cfg: Config, prec: precision.Precision) -> None:
    """cfg.float32_components kept in float32 under the run's bf16 autocast (its reference, a deep copy, keeps them
    too); nothing to keep in a float32 run; refused where autocast does not compute the forwards."""
    parts = float32_parts.parse(cfg.float32_components)
    if not parts or prec.compute == torch.float32:
        return
    if not prec.mixed:
        raise GcfError(
            f"float32_components={','.join(parts)} keeps float32 weights' components in float32 under bf16 compute; "
            "master_dtype=bfloat16 has no float32 weights: leave it out or train with master_dtype=float32."
        )
    if cfg.strategy == "fsdp2" and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise GcfError(
            f"float32_components={','.join(parts)} with strategy=fsdp2: FSDP2 casts whole layers' weights to the compute "
            "dtype, so no component can stay float32; train with strategy=ddp (or one process)."
        )
    float32_parts.keep_float32(policy, parts)


def build_method(method_cls: type[Method], cfg: Config, services: Services, evaluation: Evaluation) -> Method:
    """The method, set up through the run's Services while the policy is untouched (it may load a reference or a critic
    from it), and its evaluation checked (the held-out batch made from the initial policy)."""
    method = method_cls(cfg)
    method.setup(services)
    evaluation.check(method)
    return method


def ready_to_train(policy: torch.nn.Module, cfg: Config, method: Method, dist: DistEnv | None) -> torch.nn.Module:
    """The policy as the steps train it: activation checkpointing when asked, wrapped for DDP / FSDP2 under torchrun
    (the method's second model too), in train mode."""
    if cfg.activation_checkpointing and hasattr(policy, "gradient_checkpointing_enable"):
        policy.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if dist is not None:
        policy = dist.wrap(policy, cfg, method)
    policy.train()
    return policy


def build_optimizer(
    policy: torch.nn.Module, cfg: Config, total_steps: int
) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    """AdamW over the policy's parameters and its lr schedule over `total_steps` optimizer steps."""
    optimizer = engine.build_optimizer(policy.parameters(), cfg.lr, cfg.weight_decay, tuple(cfg.adam_betas))
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, engine.lr_lambda(cfg.lr_schedule, cfg.warmup_steps, total_steps, cfg.min_lr_ratio)
    )
    return optimizer, scheduler


def restore_optimizer(
    state: dict[str, Any],
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LambdaLR,
    policy: torch.nn.Module,
    dist: DistEnv | None,
) -> None:
    """A checkpoint's optimizer and schedule, once the optimizer exists (FSDP2: each rank its shard)."""
    if dist is not None:
        distributed_save.load_optimizer(policy, optimizer, state["optimizer"])
    else:
        optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])


def resumed_threads(cfg: Config, state: dict[str, Any], chosen: threads.Threads) -> threads.Threads:
    """The thread count a resume continues with: the one the run recorded (thread counts change float rounding), unless
    threads is given; set now when it differs from the count chosen at the start."""
    explicit = isinstance(cfg.threads, int) or "threads" in cfg.explicit
    count, reason = threads.resumed_threads(
        state.get("threads"), chosen.count, chosen.reason, explicit, threads.usable_cores()
    )
    if count != chosen.count:
        threads.apply(count)
    return dataclasses.replace(chosen, count=count, reason=reason)


def apply_changed_settings(
    cfg: Config, optimizer: torch.optim.Optimizer, scheduler: torch.optim.lr_scheduler.LambdaLR, total_steps: int
) -> None:
    """allow_changed_settings: the resumed optimizer takes the new lr, schedule, weight decay and betas (the checkpoint holds the old)."""
    f = engine.lr_lambda(cfg.lr_schedule, cfg.warmup_steps, total_steps, cfg.min_lr_ratio)
    groups = optimizer.param_groups
    scheduler.base_lrs = [cfg.lr] * len(groups)
    scheduler.lr_lambdas = [f] * len(groups)
    for i, g in enumerate(groups):
        g["initial_lr"], g["lr"], g["betas"] = cfg.lr, cfg.lr * f(scheduler.last_epoch), tuple(cfg.adam_betas)
        if i == 0:  # the decayed group (engine.build_optimizer: matrices first, then biases and norms at 0)
            g["weight_decay"] = cfg.weight_decay
    scheduler._last_lr = [g["lr"] for g in groups]


def rollout_backend(t: Any) -> Any:
    """The run's rollout backend (cfg.rollout) over the trainer `t`'s unwrapped policy; an engine with its own copy of
    the weights checks each push against the trainer's own log-probs (its services' logprobs, temperature 1)."""
    from gcfamily.core.batch import Batch
    from gcfamily.rollout import build_backend
    from gcfamily.rollout.vllm_engine import VllmOptions

    cfg, policy, tokenizer, compute, services = (
        t.cfg,
        t.unwrapped_policy(),
        t.tokenizer,
        t.precision.compute,
        t.services,
    )
    if cfg.rollout == "native":
        return build_backend("native", policy, tokenizer)

    def trainer_logps(ids: torch.Tensor) -> torch.Tensor:
        ones = torch.ones_like(ids)
        loss = ones.clone()
        loss[:, 0] = 0
        was = policy.training
        policy.eval()
        try:
            return services.logprobs(policy, Batch(input_ids=ids, attention_mask=ones, loss_mask=loss), 1.0)
        finally:
            policy.train(was)

    if t.is_main:  # what vLLM cannot reproduce, said once rather than approximated silently
        truncated = cfg.top_p < 1 or cfg.top_k > 0
        print(
            "note: rollout=vllm samples with the engine's own generator, seeded once from the run's seed, so a resumed "
            "run does not redraw the samples it would have drawn"
            + (
                "; with top_p/top_k its log-probs are those of the truncated distribution it drew from"
                if truncated
                else ""
            )
            + ".",
            file=sys.stderr,
        )
    options = VllmOptions(compute, cfg.seed, cfg.vllm_gpu_memory, cfg.vllm_cpu_kv_gb, cfg.rollout_check_tol)
    return build_backend(cfg.rollout, policy, tokenizer, options, trainer_logps)


LOGP_PROBE = "Question: what is 17 + 25? Answer: 17 + 25 = 42. The quick brown fox jumps over the lazy dog."
"""The text whose log-probs a mixed-precision run compares with float32 at its start (precision_note)."""


def precision_note(t: Any) -> None:
    """With 16-bit compute over float32 weights (one process), the policy's log-probs of LOGP_PROBE under the run's
    compute dtype against float32; a mean gap past cfg.logprob_error_bound is said on the run's first lines."""
    from gcfamily.core.batch import Batch

    prec, cfg = t.precision, t.cfg
    if not (prec.mixed and prec.master == torch.float32) or t.dist is not None or not t.is_main:
        return
    policy = t.unwrapped_policy()
    ids = torch.tensor([t.tokenizer(LOGP_PROBE)["input_ids"]])
    ones = torch.ones_like(ids)
    loss = ones.clone()
    loss[:, 0] = 0
    batch = Batch(input_ids=ids, attention_mask=ones, loss_mask=loss)
    was = policy.training
    policy.eval()
    try:
        low = t.services.logprobs(policy, batch, 1.0)[0, 1:]  # the run's own path, under its compute dtype
        full = engine.batch_logprobs(policy, batch, 1.0, 1, cfg.chunk_size, False, t.device)[0, 1:]
    finally:
        policy.train(was)
    gap = (low - full).abs()
    if float(gap.mean()) > cfg.logprob_error_bound:
        print(
            f"note: under dtype={str(prec.compute).removeprefix('torch.')} this model's log-probs of a probe text differ "
            f"from float32 by {float(gap.mean()):.3g} nats a token on average (up to {float(gap.max()):.3g}), past "
            f"logprob_error_bound={cfg.logprob_error_bound:g}; ratios and KL see gaps of this size (docs/precision.md).",
            file=sys.stderr,
        )
