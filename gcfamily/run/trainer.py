"""The loop: data -> prepare -> (coefficient -> backward)* -> step -> log -> checkpoint.

Reads top to bottom. Everything a run depends on travels in the Trainer: settings, device,
dtype, the sampler's generator, the output folder; nothing is global.
"""

from __future__ import annotations

import contextlib
import math
import signal
import time
from pathlib import Path
from typing import Any

import torch

from gcfamily.config import Config, planned_steps, resolve_settings, to_dict, validate
from gcfamily.core import engine, onednn, precision, threads
from gcfamily.core.batch import select
from gcfamily.core.memory import peak_memory_mb
from gcfamily.data.batches import split_batch
from gcfamily.errors import GcfError, install_stop_handlers
from gcfamily.methods import get_method
from gcfamily.methods.base import GENERATED, Batch, Method
from gcfamily.models import lora
from gcfamily.run import build, checkpoint_format, console, curves, step
from gcfamily.run.budget import Budget
from gcfamily.run.distributed import DistEnv
from gcfamily.run.evaluation import Evaluation
from gcfamily.run.folder import RunFolder
from gcfamily.run.folder.writes import resume_hint
from gcfamily.run.hooks import RunHooks
from gcfamily.run.logger import RunLogger
from gcfamily.run.saving import Saving
from gcfamily.run.services import RunServices


class Trainer:
    """Owns the policy, its optimizer and the method; runs `max_steps` steps (or what `epochs` passes take). It holds
    its run folder, its rows and evaluations, and its saving as objects (gcfamily/run/folder/, evaluation.py,
    saving.py), and gives the method its Services (gcfamily/run/services.py). Building is gcfamily/run/build.py's, the
    optimizer step's parts gcfamily/run/step.py's; the loop is here."""

    def __init__(
        self,
        cfg: Config,
        resume: str | None = None,
        dist_env: DistEnv | None = None,
        *,
        method: type | None = None,
        model: Any = None,
        dataset: Any = None,
        eval_dataset: Any = None,
        rewards: list | None = None,
        hooks: RunHooks | None = None,
    ) -> None:
        """Objects from Python (gcfamily.api.train) ride beside cfg: a Method class, a (model, tokenizer) pair,
        a Dataset or list of rows, reward functions; cfg then records their names. `hooks`: what the caller configures
        the run to hand out or take in (gcfamily/run/hooks.py)."""
        validate(cfg)
        self.cfg = cfg
        self.method_cls = method if method is not None else get_method(cfg.method)
        self.dataset = dataset if dataset is not None else cfg.dataset
        self.eval_dataset = eval_dataset if eval_dataset is not None else cfg.eval_dataset
        self.rewards = rewards  # None: cfg.reward
        self.hooks = hooks or RunHooks()
        resolve_settings(cfg, self.method_cls)  # the method's own settings, typed; an unknown key is one sentence
        self.method_cls.apply_setting_defaults(cfg)
        self.method_cls.validate(cfg)
        lora.validate(cfg, self.method_cls)
        self.dist = dist_env
        self.is_main = dist_env is None or dist_env.rank == 0
        self.device = build.resolve_device(cfg.device) if dist_env is None else dist_env.device
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
        cfg, dist_env, t0 = self.cfg, self.dist, time.perf_counter()
        # before any model work; a resume may take its recorded count
        self.threads = build.choose_threads(cfg, dist_env)
        self._first_row = {"threads": self.threads.count}  # logged with the first row this start writes
        # forwards compute in precision.compute; parameters, gradients and AdamW live in precision.master
        self.precision = precision.resolve(cfg.dtype, cfg.master_dtype, self.device)
        self.dtype = self.precision.master  # what every model of the run is loaded in
        if dist_env is not None:
            dist_env.set_precision(self.precision)
        torch.manual_seed(cfg.seed)
        self.generator = torch.Generator(device="cpu").manual_seed(cfg.seed + (dist_env.rank if dist_env else 0))
        tell = console.teller(cfg.progress and self.is_main)  # converting and loading the model say so
        self.envs = build.environments(cfg, self.method_cls, self.hooks.environment)  # None: one turn per sample
        self.policy, self.tokenizer, self.formatter = build.build_policy(
            cfg, model, self.precision, self.device, tell, self.envs
        )
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
        self.services = RunServices(self)
        self.rollout = build.rollout_backend(self)  # every sampling path's engine (cfg.rollout)
        build.precision_note(self)  # 16-bit compute: the log-prob gap to float32 said when past its bound
        self.method: Method = build.build_method(self.method_cls, cfg, self.services, self.evaluation)
        n = self.method.examples_per_epoch() if cfg.epochs else None
        self.max_steps = planned_steps(cfg, n)
        """The steps this run plans: max_steps, or what `epochs` passes take (the lr schedule spans them)."""
        self.bar: Any = None  # the progress bar while the run goes
        self.folder.check_room(self.policy)
        state = (
            self.saving.load_checkpoint(resume_path, self.unwrapped_policy(), self.weight_keys(), self.method)
            if resume_path is not None
            else None
        )
        self.policy = build.ready_to_train(self.policy, cfg, self.method, dist_env)
        total = self.max_steps * self.method.inner_epochs() * self.method.num_minibatches()
        self.optimizer, self.scheduler = build.build_optimizer(self.policy, cfg, total)
        self.step = 0
        self.bad_steps = 0  # in a row, up to now
        self.skipped_steps = 0  # in all
        self.trained_steps = 0  # optimizer steps that updated the model
        self.first_bad_step: int | None = None
        self.budget = Budget()  # max_time, max_tokens, max_flops
        self.n_params = sum(p.numel() for p in self.unwrapped_policy().parameters())
        if state is not None:
            self._restore(state)
            if self.folder.change is not None:
                build.apply_changed_settings(cfg, self.optimizer, self.scheduler, total)
        self.logger = RunLogger(
            self.out_dir, enabled=self.is_main, report_to=cfg.report_to, run_name=self.out_dir.name, config=to_dict(cfg)
        )
        self.saving.logger = self.logger
        self.folder.commit()
        self._first_row["time/start_s"] = time.perf_counter() - t0  # the model's conversion and loading, and the build
        console.announce(cfg, self.is_main, self.threads, n, self.max_steps, self.precision)
        if self.folder.change is not None:
            self._log(self.step, {"settings_changed": 1.0})

    # ------------------------------------------------------------------ the state a checkpoint holds (Saving.training_state)
    def _restore(self, state: dict[str, Any]) -> None:
        """Optimizer, schedule, RNG, counters and thread count, once the optimizer exists."""
        build.restore_optimizer(state, self.optimizer, self.scheduler, self.policy, self.dist)
        checkpoint_format.set_rng_state(state["rng"], self.generator)
        self.step = int(state["step"])
        self.skipped_steps, self.bad_steps = int(state["skipped_steps"]), int(state["bad_steps"])
        self.first_bad_step = state.get("first_bad_step")
        # a checkpoint from before the count: the scheduler steps once per optimizer step that updated the policy
        self.trained_steps = int(
            state.get("trained_steps", self.scheduler.last_epoch if self.method.trains_policy else self.step)
        )
        self.budget = Budget(
            float(state.get("elapsed_s", 0.0)),
            float(state.get("tokens_seen", 0.0)),
            float(state.get("flops_seen", 0.0)),
        )
        self.threads = build.resumed_threads(self.cfg, state, self.threads)
        self._first_row["threads"] = self.threads.count

    def save_checkpoint(self) -> Path | None:
        """A resumable checkpoint of this run (rank 0 writes)."""
        return self.saving.save_checkpoint(self)

    def evaluate(self) -> dict[str, float]:
        """The held-out figures of the policy now (Evaluation.evaluate); the console says when one starts, shows a bar
        over its prompts and says what it found, since greedy decoding can take minutes (console.evaluated)."""
        cfg, ev = self.cfg, self.evaluation
        if self.step == 0 and self.hooks.start_evaluation is not None:
            return self.hooks.record_start_evaluation(self.out_dir, self.is_main)
        shown = (
            self.is_main
            and cfg.progress
            and self.method.trains_policy
            and (ev.task is not None or ev.eval_dataset is not None)
        )
        policy, gathered, autocast = self.unwrapped_policy(), self.full_parameters(), self.autocast()
        return console.evaluated(
            shown,
            self.bar,
            self.step,
            cfg.eval_samples,
            lambda bar: ev.evaluate(policy, self.method, self.step, gathered, autocast, bar),
        )

    def summary(self) -> str:
        """The console's closing lines (Saving.summary), then where the curves are (curves.where)."""
        text = self.saving.summary(self.step, time.perf_counter() - getattr(self, "started", time.perf_counter()))
        return "\n".join([text, *curves.where(self.out_dir)])

    # ------------------------------------------------------------------ what a checkpoint holds
    def weight_keys(self) -> set[str] | None:
        """The policy weights a checkpoint holds: all (None), or with LoRA only the adapters."""
        policy = self.unwrapped_policy()
        return lora.adapter_keys(policy) if lora.is_peft(policy) else None

    # ------------------------------------------------------------------ one optimizer step
    def optimizer_step(self, batch: Batch) -> dict[str, float]:
        """Micro-batched weighted backward over `batch`, then clip and step; skips non-finite steps (gcfamily/run/step.py)."""
        m, cfg = self.method, self.cfg
        if not m.trains_policy:
            return self.auxiliary_only_step(split_batch(batch, cfg.micro_batch_size, m.rows_per_example))
        done = step.backward(self.policy, m, batch, cfg, self.device, self.precision, self.dist)
        loss_total = step.total_loss(done)  # the step's first host sync
        metrics, n_tok = step.metrics(done, m)
        if self.hooks.on_coefficients is not None:
            self.hooks.on_coefficients(self.step + 1, [(d.coef, engine.effective_mask(d.mb)) for d in done])
        if self.dist is not None:
            self.dist.average_method_grads(m)  # a second model the method trains stays equal on every rank
        metrics.update(m.auxiliary_step_end())  # a second model (PPO's critic) steps once per optimizer step
        params = [p for p in self.policy.parameters() if p.requires_grad]
        if not step.grads_finite(loss_total, params, self.dist):
            self.optimizer.zero_grad(set_to_none=True)
            self.bad_steps += 1
            self.skipped_steps += 1
            self.first_bad_step = self.first_bad_step or self.step + 1  # the step being trained, as logged
            step.refuse_bad_steps(
                self.bad_steps, self.skipped_steps, self.first_bad_step, cfg.max_bad_steps, self.step, self.out_dir
            )
            return {"loss": float("nan"), "skipped": 1.0, **metrics}
        self.bad_steps = 0
        self.trained_steps += 1
        gn = step.apply(params, self.optimizer, self.scheduler, cfg.grad_clip, self.dist)
        self.rollout.weights_changed()
        return {"loss": loss_total, "grad_norm": gn, "tokens": float(n_tok), "skipped": 0.0, **metrics}

    def auxiliary_only_step(self, mbs: list[Batch]) -> dict[str, float]:
        """One step of a method that trains only its own model (trains_policy=False): no policy pass at all."""
        metrics = step.auxiliary_only(self.method, mbs, self.device, self.precision)
        self.trained_steps += 1
        return metrics

    def train_step(self, batch: Batch) -> dict[str, float]:
        """mu passes over the prepared batch, each split into minibatches (one optimizer step each)."""
        m = self.method
        B = batch.input_ids.shape[0]
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
            stack.callback(self.rollout.close)
            stack.callback(lambda: self.envs is not None and self.envs.close())
            stack.callback(install_stop_handlers(self._on_signal))
            bar = self.bar = stack.enter_context(
                console.progress_bar(cfg.progress and self.is_main, self.max_steps, self.step, f"{cfg.method}")
            )
            stack.enter_context(onednn.packing(cfg.rollout_pack_weights))  # rollouts and evaluations of this run
            evaluated = cfg.eval_at_ends and self.step == 0
            if evaluated:
                self._log(0, self.evaluate())
            while self.step < self.max_steps and not self.budget.spent(cfg):
                batch, stats, t0 = self.collect()
                metrics = self.train_step(batch)
                self.step += 1
                metrics.update(self.method.after_step(self.step))
                metrics = self.account(metrics, stats, t0)
                self.cadence(metrics, bar)
                evaluated = bool(cfg.eval_every) and self.step % cfg.eval_every == 0  # the end needs no second one
            step.refuse_untrained(self.step, self.trained_steps, self.first_bad_step)
            # max_steps=0: the evaluation before is the one after; so is the last step's
            if cfg.eval_at_ends and not evaluated:
                self._log(self.step, self.evaluate())
            self.finish()
        return self.out_dir

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
        before_s = self.budget.spend(metrics, self.n_params)
        metrics.update(self.budget.row())
        # the reduced clock: every rank agrees
        if self._time_to_evaluate(before_s) and not any(k.startswith("eval/") for k in metrics):
            metrics.update(self.evaluate())
        return metrics

    def cadence(self, metrics: dict[str, float], bar: Any) -> None:
        """What happens after a step: its metrics row, the progress bar, a periodic checkpoint, a requested stop."""
        cfg = self.cfg
        last = self.step == self.max_steps or self.budget.spent(cfg)
        if self.step % cfg.log_every == 0 or last or any(k.startswith("eval/") for k in metrics):
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
            raise step.interrupted(self._stop, self.step)

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
        last = self.step >= self.max_steps or self.budget.spent(self.cfg)
        return self.budget.crossed(self.cfg.eval_every_s, before_s) and not (last and self.cfg.eval_at_ends)

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
