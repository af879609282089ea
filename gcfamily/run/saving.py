"""The Trainer's saving: resumable checkpoints and their exact restore, the final model folder, its card and the
console summary. A mixin of gcfamily.run.trainer.Trainer.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Callable, Optional

from gcfamily.run import checkpoint, distributed
from gcfamily.models import lora
from gcfamily.core import precision
from gcfamily.config import to_dict


class Saving:
    """Checkpoints, the final folder and what is said at the end."""

    def training_state(self) -> dict[str, Any]:
        """Everything but the weights that an exact resume needs."""
        return {
            "step": self.step, "optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict(),
            "rng": checkpoint.rng_state(self.generator), "method": self.method.state_dict(),
            "skipped_steps": self.skipped_steps, "bad_steps": self.bad_steps, "elapsed_s": self.elapsed_s, "tokens_seen": self.tokens_seen, "flops_seen": self.flops_seen,
        }

    def save_checkpoint(self) -> Optional[Path]:
        """A resumable checkpoint in out_dir/checkpoints (rank 0 writes)."""
        if self.dist is not None:
            return self.dist.save_checkpoint(self)
        if not self.is_main:
            return None
        return checkpoint.save(self.out_dir / "checkpoints", self.step, self.unwrapped_policy(), self.training_state(), self.cfg.keep_last,
                               self.weight_keys(), self.checkpoint_extras())

    def checkpoint_extras(self) -> Optional[Callable[[Path], None]]:
        """What makes a full-weight checkpoint loadable by from_pretrained: config.json and the tokenizer (LoRA ones hold only adapters)."""
        if self.weight_keys() is not None:
            return None
        model = self.unwrapped_policy()

        def write(folder: Path) -> None:
            model.config.save_pretrained(folder)
            self.tokenizer.save_pretrained(folder)

        return write

    def _load_checkpoint(self, path: Path) -> dict[str, Any]:
        """Weights and the method's state into the plain models (every rank the checkpoint rank 0 chose); the rest waits for _restore."""
        state = distributed.local_state(checkpoint.load(path, self.unwrapped_policy(), self.weight_keys()), self.dist)
        self.method.load_state_dict(state["method"])
        return state

    def _restore(self, state: dict[str, Any]) -> None:
        """Optimizer, schedule, RNG and counters, once the optimizer exists."""
        if self.dist is not None:
            self.dist.load_optimizer(self.policy, self.optimizer, state["optimizer"])
        else:
            self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        checkpoint.set_rng_state(state["rng"], self.generator)
        self.step = int(state["step"])
        self.skipped_steps, self.bad_steps = int(state["skipped_steps"]), int(state["bad_steps"])
        self.elapsed_s, self.tokens_seen = float(state.get("elapsed_s", 0.0)), float(state.get("tokens_seen", 0.0))
        self.flops_seen = float(state.get("flops_seen", 0.0))

    def save_final(self) -> None:
        """The final model and tokenizer with save_pretrained, loadable by transformers."""
        if self.method.save_final(self.out_dir):  # the run's product is the method's own model
            return
        if lora.is_peft(self.unwrapped_policy()):  # DDP keeps a whole copy on every rank: rank 0 writes it
            if self.is_main:
                lora.save_final(self.unwrapped_policy(), self.tokenizer, self.out_dir, self.cfg.merge_lora, self.cfg.save_dtype)
            if self.dist is not None:
                self.dist.barrier()
            return
        if self.dist is not None:
            self.dist.save_final(self)
            return
        model = self.unwrapped_policy()
        precision.save_pretrained(model, self.out_dir, model.state_dict(), self.cfg.save_dtype)
        self.tokenizer.save_pretrained(self.out_dir)

    def write_card(self) -> None:
        """The final folder's README.md: method, base model, data, settings and final metrics (gcfamily/run/card.py)."""
        from gcfamily.run.card import write_model_card
        from gcfamily.run.logger import read_metrics
        from gcfamily.methods.onpolicy import OnPolicy

        m = self.method
        info = {"name": self.cfg.method, "data_source": m.data_source, "gc_formula": m.gc_formula, "on_policy": isinstance(m, OnPolicy)}
        write_model_card(self.out_dir, to_dict(self.cfg), read_metrics(self.out_dir), self.cfg.model, info)

    def summary(self) -> str:
        """A few lines for the console at the end of a run: held-out figures before and after, reward, loss, where the model is."""
        from gcfamily.run.card import summary
        from gcfamily.run.logger import read_metrics

        rows = read_metrics(self.out_dir) if (self.out_dir / "metrics.jsonl").is_file() else []
        seconds = time.perf_counter() - getattr(self, "started", time.perf_counter())
        return summary(rows, self.step, seconds, self.out_dir, getattr(self, "final_saved", False))

    def log_samples(self, step: int, rows: list[dict[str, Any]]) -> None:
        """Prompts, completions and rewards of a step to completions.jsonl and the trackers (every log_completions_every steps)."""
        every = self.cfg.log_completions_every
        if every and step % every == 0 and getattr(self, "logger", None) is not None:
            self.logger.completions(step, rows)
