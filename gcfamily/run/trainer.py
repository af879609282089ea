"""The loop: data -> prepare -> (coefficient -> backward)* -> step -> log -> checkpoint.

Reads top to bottom. Everything a run depends on travels in the Trainer: settings, device,
dtype, the sampler's generator, the output folder; nothing is global.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import torch

from gcfamily.config import Config, planned_steps, resolve_settings, to_dict, validate
from gcfamily.core import engine, onednn, precision, threads
from gcfamily.core.memory import peak_memory_mb, release_free_heap
from gcfamily.core.engine import gc_stats
from gcfamily.data.batches import select, split_batch, to_device
from gcfamily.data.formats import Formatter
from gcfamily.errors import GcfError, Interrupted, install_stop_handlers
from gcfamily.methods import get_method
from gcfamily.methods.base import GENERATED, Batch, Method
from gcfamily.models import load_model, lora
from gcfamily.rollout import context_length
from gcfamily.run import checkpoint_format
from gcfamily.run.evaluation import Evaluation
from gcfamily.run.folder import RunFolder
from gcfamily.run.folder.transaction import apply_changed_settings
from gcfamily.run.logger import RunLogger
from gcfamily.run.saving import Saving
from gcfamily.run.services import RunServices
from gcfamily.run.folder.writes import resume_hint

_HOST = ("input_ids", "attention_mask", "loss_mask")  # the fields whose CPU copies lay out a micro-batch


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


class Trainer:
    """Owns the policy, its optimizer and the method; runs `max_steps` steps (or what `epochs` passes take). It holds
    its run folder, its rows and evaluations, and its saving as objects (gcfamily/run/folder.py, evaluation.py,
    saving.py), and gives the method its Services (gcfamily/run/services.py)."""

    def __init__(
        self,
        cfg: Config,
        resume: str | None = None,
        dist_env: Any = None,
        *,
        method: type | None = None,
        model: Any = None,
        dataset: Any = None,
        eval_dataset: Any = None,
        rewards: list | None = None,
    ) -> None:
        """Objects from Python (gcfamily.api.train) ride beside cfg: a Method class, a (model, tokenizer) pair,
        a Dataset or list of rows, reward functions; cfg then records their names."""
        validate(cfg)
        self.cfg = cfg
        self.method_cls = method if method is not None else get_method(cfg.method)
        self.dataset = dataset if dataset is not None else cfg.dataset
        self.eval_dataset = eval_dataset if eval_dataset is not None else cfg.eval_dataset
        self.rewards = rewards  # None: cfg.reward
        resolve_settings(cfg, self.method_cls)  # the method's own settings, typed; an unknown key is one sentence
        self.method_cls.apply_setting_defaults(cfg)
        self.method_cls.validate(cfg)
        lora.validate(cfg, self.method_cls)
        self.dist = dist_env
        self.is_main = dist_env is None or dist_env.rank == 0
        self.device = resolve_device(cfg.device) if dist_env is None else dist_env.device
        self.folder = RunFolder(cfg, dist_env)
        self.out_dir = self.folder.out_dir
        self.saving = Saving(cfg, self.out_dir, dist_env)
        self.stop_signal: str | None = None
        """SIGTERM or SIGINT once one arrived: the run checkpoints at the end of the step and stops."""
        self.threads_before = torch.get_num_threads()
        """torch's thread count before the run: put back when the run ends (and auto's ceiling, gcfamily/core/threads.py)."""
        resume_path = self.folder.open(resume)  # takes the folder's lock: released on any failure from here on
        try:
            self._build(resume_path, model)
        except BaseException:
            if getattr(self, "logger", None) is not None:
                self.logger.close()
            self.folder.abandon()  # before its commit: the folder as it was
            threads.apply(self.threads_before)
            raise

    def _build(self, resume_path: Path | None, model: Any) -> None:
        """Everything that can fail, with the folder locked but unchanged: models, the method's data, the optimizer, a
        resumed state, the logger; then the folder's commit (run_config.json is written only once all of it passed)."""
        cfg, dist_env = self.cfg, self.dist
        self.threads = self._choose_threads()  # before any model work; a resume may take its recorded count (_restore)
        self._first_row = {"threads": self.threads.count}  # logged with the first row this start writes
        # forwards compute in precision.compute; parameters, gradients and AdamW live in precision.master
        self.precision = precision.resolve(cfg.dtype, cfg.master_dtype, self.device)
        self.dtype = self.precision.master  # what every model of the run is loaded in
        if dist_env is not None:
            dist_env.set_precision(self.precision)
        torch.manual_seed(cfg.seed)
        self.generator = torch.Generator(device="cpu").manual_seed(cfg.seed + (dist_env.rank if dist_env else 0))
        if model is not None:
            from gcfamily.models import adopt_model

            self.policy, self.tokenizer = adopt_model(model, self.dtype, self.device, cfg.trust_remote_code)
        else:
            self.policy, self.tokenizer = load_model(
                cfg.model, self.dtype, self.device, cfg.trust_remote_code, cfg.seed
            )
        self.formatter = Formatter(
            self.tokenizer, cfg.chat_format, cfg.system_prompt, cfg.assistant_only_loss, cfg.chat_template
        )
        ctx = context_length(
            self.policy
        )  # also for hub models and models passed from Python, which the CLI cannot read ahead
        if ctx is not None and cfg.max_length > ctx:
            raise GcfError(
                f"max_length={cfg.max_length} is past the context of model {cfg.model} ({ctx} positions); set max_length <= {ctx}."
            )
        if lora.enabled(cfg):  # before the method's setup: its reference is this model with the adapters off
            self.policy = lora.wrap(self.policy, cfg)
        precision.check_master(self.policy.parameters(), self.precision, f"The model {cfg.model}")
        self.evaluation = Evaluation(
            cfg,
            self.method_cls,
            self.formatter,
            self.dataset,
            self.eval_dataset,
            self.rewards,
            self.out_dir,
            self.is_main,
        )
        self.task = self.evaluation.task
        self.method: Method = self.method_cls(cfg)
        self.services = RunServices(self)
        self.method.setup(self.services)  # may load a reference or a critic from the untouched policy
        self.evaluation.check(self.method)
        n = self.method.examples_per_epoch() if cfg.epochs else None
        self.max_steps = planned_steps(cfg, n)
        """The steps this run plans: max_steps, or what `epochs` passes take (the lr schedule spans them)."""
        self._bar: Any = None  # the progress bar while the run goes
        self.folder.check_room(self.policy)
        state = (
            self.saving.load_checkpoint(resume_path, self.unwrapped_policy(), self.weight_keys(), self.method)
            if resume_path is not None
            else None
        )
        if cfg.activation_checkpointing and hasattr(self.policy, "gradient_checkpointing_enable"):
            self.policy.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if dist_env is not None:
            self.policy = dist_env.wrap(self.policy, cfg, self.method)
        self.policy.train()
        self.optimizer = engine.build_optimizer(
            self.policy.parameters(), cfg.lr, cfg.weight_decay, tuple(cfg.adam_betas)
        )
        total = self.max_steps * self.method.inner_epochs() * self.method.num_minibatches()
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, engine.lr_lambda(cfg.lr_schedule, cfg.warmup_steps, total, cfg.min_lr_ratio)
        )
        self.step = 0
        self.bad_steps = 0  # in a row, up to now
        self.skipped_steps = 0  # in all
        self.trained_steps = 0  # optimizer steps that updated the model
        self.first_bad_step: int | None = None
        self.elapsed_s = 0.0  # seconds spent in training steps, for max_time
        self.tokens_seen = 0.0  # generated plus trained tokens, for max_tokens
        self.flops_seen = 0.0  # estimated: 6 P per loss token, 2 P per generated token, for max_flops
        self.n_params = sum(p.numel() for p in self.unwrapped_policy().parameters())
        if state is not None:
            self._restore(state)
            if self.folder.change is not None:
                apply_changed_settings(cfg, self.optimizer, self.scheduler, total)
        self.logger = RunLogger(
            self.out_dir, enabled=self.is_main, report_to=cfg.report_to, run_name=self.out_dir.name, config=to_dict(cfg)
        )
        self.saving.logger = self.logger
        self.folder.commit()
        if self.is_main and (cfg.progress or "no longer bitwise" in self.threads.reason):
            print(f"threads: {self.threads.reason}.", file=sys.stderr)  # beside the progress bar; always in the metrics
        if self.is_main and cfg.progress and cfg.epochs:
            given = f", max_steps={cfg.max_steps} given" if "max_steps" in cfg.explicit else ""
            print(
                f"epochs={cfg.epochs:g}: {n} examples a pass at batch_size {cfg.batch_size}{given}: "
                f"{self.max_steps} steps.",
                file=sys.stderr,
            )
        if self.folder.change is not None:
            self._log(self.step, {"settings_changed": 1.0})

    def _choose_threads(self) -> threads.Threads:
        """torch's CPU threads for this run (the `threads` setting; gcfamily/core/threads.py), set now. Under torchrun
        every rank measures the same moment, after a barrier, and takes rank 0's choice; auto shares the free cores among
        the run's processes on this machine."""
        given = self.cfg.threads if isinstance(self.cfg.threads, int) else None
        if self.dist is None:
            choice = threads.decide(given)
        else:
            self.dist.barrier()  # no rank is busy loading while the others measure
            choice = self.dist.broadcast(threads.decide(given, int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))
        threads.apply(choice.count)
        return choice

    # ------------------------------------------------------------------ the state a checkpoint holds
    def training_state(self) -> dict[str, Any]:
        """Everything but the weights that an exact resume needs."""
        return {
            "step": self.step,
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "rng": checkpoint_format.rng_state(self.generator),
            "method": self.method.state_dict(),
            "skipped_steps": self.skipped_steps,
            "bad_steps": self.bad_steps,
            "trained_steps": self.trained_steps,
            "first_bad_step": self.first_bad_step,
            "elapsed_s": self.elapsed_s,
            "tokens_seen": self.tokens_seen,
            "flops_seen": self.flops_seen,
            "threads": self.threads.count,
        }

    def _restore(self, state: dict[str, Any]) -> None:
        """Optimizer, schedule, RNG and counters, once the optimizer exists."""
        if self.dist is not None:
            self.dist.load_optimizer(self.policy, self.optimizer, state["optimizer"])
        else:
            self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        checkpoint_format.set_rng_state(state["rng"], self.generator)
        self.step = int(state["step"])
        self.skipped_steps, self.bad_steps = int(state["skipped_steps"]), int(state["bad_steps"])
        self.first_bad_step = state.get("first_bad_step")
        # a checkpoint from before the count: the scheduler steps once per optimizer step that updated the policy
        self.trained_steps = int(
            state.get("trained_steps", self.scheduler.last_epoch if self.method.trains_policy else self.step)
        )
        self.elapsed_s, self.tokens_seen = float(state.get("elapsed_s", 0.0)), float(state.get("tokens_seen", 0.0))
        self.flops_seen = float(state.get("flops_seen", 0.0))
        # a resume continues with the count the run recorded (thread counts change float rounding), unless threads is given
        explicit = isinstance(self.cfg.threads, int) or "threads" in self.cfg.explicit
        count, reason = threads.resumed_threads(state.get("threads"), self.threads.count, self.threads.reason, explicit)
        if count != self.threads.count:
            threads.apply(count)
        self.threads = dataclasses.replace(self.threads, count=count, reason=reason)
        self._first_row["threads"] = count

    def checkpoint_extras(self) -> Any:
        """The run's settings, and for a full-weight checkpoint config.json and the tokenizer (Saving.checkpoint_extras)."""
        return Saving.checkpoint_extras(self.unwrapped_policy(), self.tokenizer, self.weight_keys(), self.folder.record)

    def save_checkpoint(self) -> Path | None:
        """A resumable checkpoint of this run (rank 0 writes)."""
        return self.saving.save_checkpoint(self)

    def evaluate(self) -> dict[str, float]:
        """The held-out figures of the policy now (Evaluation.evaluate); the console says when one starts and what it
        found, since greedy decoding of the held-out prompts can take minutes with the progress bar standing still."""
        cfg = self.cfg
        say = (
            self.is_main
            and cfg.progress
            and self.method.trains_policy
            and (self.task is not None or self.eval_dataset is not None)
        )
        if say:
            self._say(f"evaluating at step {self.step} on up to {cfg.eval_samples} held-out examples...")
        t0 = time.perf_counter()
        out = self.evaluation.evaluate(
            self.unwrapped_policy(), self.method, self.step, self.full_parameters(), self.autocast()
        )
        if say and out:
            found = ", ".join(f"{k} {v:.4g}" for k, v in out.items())
            self._say(f"evaluated at step {self.step} in {time.perf_counter() - t0:.1f} s: {found}")
        return out

    def summary(self) -> str:
        """The console's closing lines (Saving.summary), then where the curves are."""
        text = self.saving.summary(self.step, time.perf_counter() - getattr(self, "started", time.perf_counter()))
        return "\n".join([text, *self.curves()])

    def curves(self) -> list[str]:
        """Where this run's metrics are: curves.png, metrics.jsonl, and the TensorBoard command when it logged events."""
        import shlex

        lines = []
        if (self.out_dir / "curves.png").is_file():
            lines.append(f"  curves: {self.out_dir / 'curves.png'}")
        if (self.out_dir / "metrics.jsonl").is_file():
            lines.append(f"  metrics: {self.out_dir / 'metrics.jsonl'}")
        if (self.out_dir / "tensorboard").is_dir():
            lines.append(f"  tensorboard: tensorboard --logdir {shlex.quote(str(self.out_dir / 'tensorboard'))}")
        return lines

    # ------------------------------------------------------------------ what a checkpoint holds
    def weight_keys(self) -> set[str] | None:
        """The policy weights a checkpoint holds: all (None), or with LoRA only the adapters."""
        policy = self.unwrapped_policy()
        return lora.adapter_keys(policy) if lora.is_peft(policy) else None

    # ------------------------------------------------------------------ one optimizer step
    def optimizer_step(self, batch: Batch) -> dict[str, float]:
        """Micro-batched weighted backward over `batch`, then clip and step; skips non-finite steps."""
        m, cfg = self.method, self.cfg
        if not m.trains_policy:
            return self.auxiliary_only_step(split_batch(batch, cfg.micro_batch_size, m.rows_per_example))
        # CPU copies of the ids and masks, read back once a step and split with the batch: each micro-batch's packing layout
        # and loss-token indices are worked out from them, so nothing in the loop below waits on the device
        batch = {**batch, **{f"host_{k}": batch[k].cpu() for k in _HOST}}
        mbs = split_batch(batch, cfg.micro_batch_size, m.rows_per_example)
        Z = engine.normaliser(mbs, m.norm, cfg.norm_constant)
        scale = self.dist.world_size if self.dist is not None else 1  # DDP averages; Z is already global
        sums: dict[str, float] = {}
        n_tok = 0
        done = []  # per micro-batch, what its metrics need; read after every backward is queued (no host sync in between)
        for i, mb in enumerate(mbs):
            host = tuple(mb.pop(f"host_{k}") for k in _HOST)
            mb = to_device(mb, self.device)
            sync = (
                self.dist.no_sync(self.policy)
                if self.dist is not None and i < len(mbs) - 1
                else contextlib.nullcontext()
            )
            with sync:
                with self.autocast():
                    out = engine.token_logprobs(
                        self.policy,
                        mb["input_ids"],
                        mb["attention_mask"],
                        mb["loss_mask"],
                        m.logprob_temperature(),
                        cfg.chunk_size,
                        cfg.share_prefix,
                        host,
                    )
                    coef = m.coefficient(mb, out.logps.detach())  # [B, L]
                    loss = engine.weighted_loss(coef, out.logps, mb, m.norm, Z)
                (loss * scale).backward()
            with self.autocast():
                m_aux = m.auxiliary_step(mb)
            done.append((mb, out.logps.detach(), out.entropy.detach(), coef.detach(), loss.detach(), m_aux))
            if self.device.type == "cpu":  # this micro-batch's activations are freed: hand their pages back before the
                del out, coef, loss  # next one, of another length, allocates its own (SmolLM2-135M LoRA GRPO peak RSS
                release_free_heap()  # 2,477 -> 2,255 MB, benchmarks/results-memory-cpu.txt); only free memory goes
        loss_total = (
            float(torch.stack([d[4].double() for d in done]).sum()) if done else 0.0
        )  # the step's first host sync
        for mb, logps, entropy, coef, _, m_aux in done:
            mask = engine.effective_mask(mb)
            k = int(mask.sum())
            n_tok += k
            for stats in (
                {
                    **gc_stats(coef, mask),
                    "entropy": float((entropy * mask).sum()) / max(k, 1),
                    **m.metrics(mb, logps, coef),
                },
                m_aux,
            ):
                for key, v in stats.items():
                    sums[key] = sums.get(key, 0.0) + v * max(k, 1)
        weight = sum(max(int(engine.effective_mask(d[0]).sum()), 1) for d in done)
        if self.dist is not None:
            self.dist.average_method_grads(m)  # a second model the method trains stays equal on every rank
        metrics = {k: v / weight for k, v in sums.items()}
        metrics.update(m.auxiliary_step_end())  # a second model (PPO's critic) steps once per optimizer step
        params = [p for p in self.policy.parameters() if p.requires_grad]
        finite = (
            math.isfinite(loss_total) and engine.grads_finite(params)
            if self.dist is None
            else self.dist.all_finite(loss_total, params)
        )
        if not finite:
            self.optimizer.zero_grad(set_to_none=True)
            self.bad_steps += 1
            self.skipped_steps += 1
            self.first_bad_step = self.first_bad_step or self.step + 1  # the step being trained, as logged
            self.stop_on_bad_steps()
            return {"loss": float("nan"), "skipped": 1.0, **metrics}
        self.bad_steps = 0
        self.trained_steps += 1
        clip = (
            torch.nn.utils.clip_grad_norm_ if self.dist is None else self.dist.clip_grad_norm_
        )  # FSDP2: the norm over every shard
        gn = clip(params, cfg.grad_clip if cfg.grad_clip > 0 else float("inf"))
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return {"loss": loss_total, "grad_norm": float(gn), "tokens": float(n_tok), "skipped": 0.0, **metrics}

    def stop_on_bad_steps(self) -> None:
        """A run stops, its last checkpoint intact, at max_bad_steps skipped steps in a row or at more than
        max_bad_steps in all (`run` also refuses a run that took steps and skipped every one). A step here is an optimizer
        step: a method with several minibatches or inner epochs takes several per logged step."""
        cfg, first = self.cfg, self.first_bad_step
        if self.bad_steps >= cfg.max_bad_steps:
            what = (
                f"{self.bad_steps} consecutive steps had a non-finite loss or gradient, the run's first at step {first}"
            )
        elif self.skipped_steps > cfg.max_bad_steps:
            what = (
                f"{self.skipped_steps} steps in all had a non-finite loss or gradient, more than "
                f"max_bad_steps={cfg.max_bad_steps}, the first at step {first}"
            )
        else:
            return
        last = checkpoint_format.complete_checkpoints(self.out_dir / "checkpoints")
        kept = f"the checkpoint of step {last[-1].name[5:]} intact" if last else "no checkpoint saved"
        raise GcfError(f"{what}; stopping at step {self.step + 1} with {kept} (lower lr or check the data).")

    def auxiliary_only_step(self, mbs: list[Batch]) -> dict[str, float]:
        """One step of a method that trains only its own model (trains_policy=False): no policy pass at all."""
        sums: dict[str, float] = {}
        rows = 0
        for mb in mbs:
            n = int(mb["input_ids"].shape[0])
            with self.autocast():
                aux = self.method.auxiliary_step(to_device(mb, self.device))
            for key, v in aux.items():
                sums[key] = sums.get(key, 0.0) + v * n
            rows += n
        metrics = {k: v / max(rows, 1) for k, v in sums.items()}
        metrics.update(self.method.auxiliary_step_end())
        self.trained_steps += 1
        return {"tokens": float(sum(int(engine.effective_mask(mb).sum()) for mb in mbs)), **metrics}

    def train_step(self, batch: Batch) -> dict[str, float]:
        """mu passes over the prepared batch, each split into minibatches (one optimizer step each)."""
        m = self.method
        B = batch["input_ids"].shape[0]
        n_mb = m.num_minibatches()
        per = max(m.rows_per_example, math.ceil(B / n_mb / m.rows_per_example) * m.rows_per_example)
        agg: dict[str, list[float]] = {}
        for _ in range(m.inner_epochs()):
            for s in range(0, B, per):
                for k, v in self.optimizer_step(select(batch, slice(s, s + per))).items():
                    agg.setdefault(k, []).append(v)
        out = {k: (sum(v) if k == "tokens" else sum(v) / len(v)) for k, v in agg.items()}
        return out

    # ------------------------------------------------------------------ the loop
    def run(self) -> Path:
        """Train to max_steps (or until a budget or a signal), evaluating, logging and checkpointing; returns the run folder."""
        cfg = self.cfg
        self.started = time.perf_counter()
        with contextlib.ExitStack() as stack:
            stack.callback(self.folder.lock.release)
            stack.callback(threads.apply, self.threads_before)  # the program's own count again once the run ends
            stack.callback(self.logger.close)
            stack.callback(install_stop_handlers(self._on_signal))
            bar = self._bar = stack.enter_context(self._progress())
            stack.enter_context(onednn.packing(cfg.rollout_pack_weights))  # rollouts and evaluations of this run
            evaluated = cfg.eval_at_ends and self.step == 0
            if evaluated:
                self._log(0, self.evaluate())
            while self.step < self.max_steps and not self.budget_spent():
                batch, stats, t0 = self.collect()
                metrics = self.train_step(batch)
                self.step += 1
                metrics.update(self.method.after_step(self.step))
                metrics = self.account(metrics, stats, t0)
                self.cadence(metrics, bar)
                evaluated = bool(cfg.eval_every) and self.step % cfg.eval_every == 0  # the end needs no second one
            self.refuse_untrained()
            if (
                cfg.eval_at_ends and not evaluated
            ):  # max_steps=0: the evaluation before is the one after; so is the last step's
                self._log(self.step, self.evaluate())
            self.finish()
        return self.out_dir

    def refuse_untrained(self) -> None:
        """A run that took steps and skipped every one trained nothing: it ends in one sentence, writing no model.
        (max_steps=0 takes no step: the model is written as loaded.)"""
        if self.step == 0 or self.trained_steps > 0:
            return
        why = (
            f"had a non-finite loss or gradient and was skipped, the first at step {self.first_bad_step}"
            if self.first_bad_step is not None
            else "ended without an optimizer step"
        )
        raise GcfError(
            f"Every step of this run ({self.step}) {why}, so nothing was trained and no model was written (lower lr, "
            "or check the data and the method's coefficient)."
        )

    def collect(self) -> tuple[Batch, dict[str, float], float]:
        """This step's batch from the method's data source, prepared (rewards, advantages, pi_old/pi_ref), with the
        statistics the method returned and the two phases' times, and the clock at the step's start."""
        t0 = time.perf_counter()
        with self.autocast():  # rollouts, rewards from a model, pi_old, pi_ref and values compute like the step
            batch, stats = self.method.data(self.step)
            t1 = time.perf_counter()
            batch, more = self.method.prepare(batch)
        return batch, {**stats, **more, "time/data_s": t1 - t0, "time/prepare_s": time.perf_counter() - t1}, t0

    def account(self, metrics: dict[str, float], stats: dict[str, float], t0: float) -> dict[str, float]:
        """The step's row of metrics (one for the whole group of processes), and the budget it used."""
        dt = time.perf_counter() - t0
        train_s = dt - stats["time/data_s"] - stats["time/prepare_s"]
        metrics.update(
            {
                "time/step_s": dt,
                "train_tokens_per_s": metrics.get("tokens", 0.0) / max(train_s, 1e-9),
                "lr": self.scheduler.get_last_lr()[0],
                "peak_memory_mb": peak_memory_mb(self.device),
                "skipped_steps": float(self.skipped_steps),
            }
        )
        metrics.update({k: float(v) for k, v in stats.items()})
        metrics.setdefault(GENERATED, 0.0)  # a data source that samples reports its count (methods/base.py)
        if self.cfg.eval_every and self.step % self.cfg.eval_every == 0:
            metrics.update(self.evaluate())
        # a signal arriving from here on waits for the next step: every rank must act on the same value
        self._stop = self.stop_signal
        if self.dist is not None:  # one row for the whole group; a signal on any rank stops all at this step
            metrics = self.dist.reduce_metrics(metrics)
            self._stop = self.dist.agree_stop(self._stop)
        # the budget counts reduced figures (all ranks' tokens, the slowest rank's time): every rank stops at the same step
        before_s = self.elapsed_s
        self.elapsed_s += metrics["time/step_s"]
        self.tokens_seen += metrics[GENERATED] + metrics.get("tokens", 0.0)
        self.flops_seen += self.n_params * (6 * metrics.get("tokens", 0.0) + 2 * metrics[GENERATED])
        metrics.update(
            {"budget/elapsed_s": self.elapsed_s, "budget/tokens": self.tokens_seen, "budget/flops": self.flops_seen}
        )
        if self._time_to_evaluate(before_s) and not any(
            k.startswith("eval/") for k in metrics
        ):  # the reduced clock: every rank agrees
            metrics.update(self.evaluate())
        return metrics

    def cadence(self, metrics: dict[str, float], bar: Any) -> None:
        """What happens after a step: its metrics row, the progress bar, a periodic checkpoint, a requested stop."""
        cfg = self.cfg
        if (
            self.step % cfg.log_every == 0
            or self.step == self.max_steps
            or self.budget_spent()
            or any(k.startswith("eval/") for k in metrics)
        ):
            self._log(self.step, metrics)
        if bar is not None:
            bar.update(1)
            bar.set_postfix(
                loss=f"{metrics.get('loss', float('nan')):.4f}", tok_s=f"{metrics['train_tokens_per_s']:.0f}"
            )
        if cfg.save_every and self.step % cfg.save_every == 0 and self.step < self.max_steps:
            self.save_checkpoint()
        if self._stop:
            self.save_checkpoint()
            code = 128 + int(getattr(signal, self._stop, signal.SIGTERM))
            raise Interrupted(
                f"Stopped by {self._stop} at step {self.step}; a checkpoint was saved: continue with the same command plus --resume.",
                code,
            )

    def _log(self, step: int, metrics: dict[str, float]) -> None:
        """A row of metrics; the first this start writes also holds its thread count (and the busy cores it measured)."""
        first, self._first_row = self._first_row, {}
        if first and self.threads.busy is not None:
            first["threads/busy_cores"] = round(self.threads.busy, 3)
        self.logger.log(step, {**metrics, **first})

    def finish(self) -> None:
        """The last checkpoint, the final model folder and its card."""
        self.save_checkpoint()
        try:
            self.saving.save_final(self.unwrapped_policy(), self.tokenizer, self.method, self)
        except (OSError, RuntimeError) as e:  # a folder that went away (a full disk is WriteFailed, said already)
            raise GcfError(
                f"Could not write the final model to {self.out_dir} ({str(e).strip().splitlines()[-1][:160]}); "
                f"{resume_hint(self.out_dir)}."
            ) from e
        self.saving.final_saved = True
        if self.is_main:
            self.saving.write_card(self.method, self.step)

    def _time_to_evaluate(self, before_s: float) -> bool:
        """This step's training time crossed a multiple of eval_every_s (and the run goes on: the end has its own evaluation)."""
        every = self.cfg.eval_every_s
        last = self.step >= self.max_steps or self.budget_spent()
        return (
            bool(every)
            and int(self.elapsed_s // every) > int(before_s // every)
            and not (last and self.cfg.eval_at_ends)
        )

    def budget_spent(self) -> bool:
        """max_time, max_tokens or max_flops (when set) is used up."""
        cfg = self.cfg
        return bool(
            (cfg.max_time and self.elapsed_s >= cfg.max_time)
            or (cfg.max_tokens and self.tokens_seen >= cfg.max_tokens)
            or (cfg.max_flops and self.flops_seen >= cfg.max_flops)
        )

    # ------------------------------------------------------------------ compute and wrappers
    def autocast(self) -> contextlib.AbstractContextManager:
        """Forwards in the compute dtype over master weights (a no-op when they are the same dtype)."""
        return self.precision.autocast()

    def unwrapped_policy(self) -> torch.nn.Module:
        """The plain causal LM under any DDP / FSDP2 / LogprobModel wrapper."""
        m = getattr(self.policy, "module", self.policy)
        return m.model if isinstance(m, engine.LogprobModel) else m

    def full_parameters(self) -> contextlib.AbstractContextManager:
        """Context in which unwrapped_policy() holds whole parameters (FSDP2 gathers them for generation)."""
        return self.dist.full_parameters(self.policy) if self.dist is not None else contextlib.nullcontext()

    # ------------------------------------------------------------------ signals and progress
    def _on_signal(self, signum: int, _frame: Any) -> None:
        """SIGTERM/SIGINT: a checkpoint at the end of the step, then stop."""
        self.stop_signal = signal.Signals(signum).name

    def _say(self, line: str) -> None:
        """A line on stderr, above the progress bar when there is one."""
        if self._bar is not None:
            self._bar.write(line, file=sys.stderr)
        else:
            print(line, file=sys.stderr, flush=True)

    def _progress(self) -> contextlib.AbstractContextManager:
        """The progress bar (closed when the run ends), or None without one."""
        if not (self.cfg.progress and self.is_main):
            return contextlib.nullcontext(None)
        from tqdm.auto import tqdm

        return tqdm(total=self.max_steps, initial=self.step, desc=f"{self.cfg.method}", dynamic_ncols=True)
