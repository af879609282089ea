"""The run's saving: what goes into its resumable checkpoints and their exact restore (the files' format is
gcfamily/run/checkpoint_format.py), the final model folder, its card and the console summary. An object the Trainer
holds; a checkpoint is of the run it is given (`save_checkpoint(run)`), as the distributed save is
(gcfamily/run/distributed.py).

A full disk loses nothing saved: the final model's files are written into a temporary folder inside the run folder and
moved into place once all are written (gcfamily/run/folder/writes.py), a checkpoint's extras go into the checkpoint's own
temporary folder (gcfamily/run/checkpoint_format.py), and a failure ends in one sentence naming the last intact checkpoint.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from gcfamily.config import to_dict
from gcfamily.core import precision
from gcfamily.models import lora
from gcfamily.run import checkpoint_format, distributed_save
from gcfamily.run.folder.writes import WriteFailed, os_error, write_folder
from gcfamily.run.view import TrainerView


class Saving:
    """Checkpoints, the final folder and what is said at the end."""

    def __init__(self, cfg: Any, out_dir: Path, dist: Any) -> None:
        self.cfg, self.out_dir, self.dist = cfg, out_dir, dist
        self.is_main = dist is None or dist.rank == 0
        self.logger: Any = None
        """The run's RunLogger, once it is open (completions go to it)."""
        self.final_saved = False

    def save_checkpoint(self, run: TrainerView) -> Path | None:
        """A resumable checkpoint of `run` (the Trainer) in out_dir/checkpoints (rank 0 writes)."""
        if self.dist is not None:
            return distributed_save.save_checkpoint(self.dist, run)
        if not self.is_main:
            return None
        return checkpoint_format.save(
            self.out_dir / "checkpoints",
            run.step,
            run.unwrapped_policy(),
            self.training_state(run),
            self.cfg.keep_last,
            run.weight_keys(),
            self.extras_of(run),
        )

    @staticmethod
    def training_state(run: TrainerView) -> dict[str, Any]:
        """Everything but the weights that an exact resume needs (Trainer._restore reads it back)."""
        return {
            "step": run.step,
            "optimizer": run.optimizer.state_dict(),
            "scheduler": run.scheduler.state_dict(),
            "rng": checkpoint_format.rng_state(run.generator),
            "method": run.method.state_dict(),
            "skipped_steps": run.skipped_steps,
            "bad_steps": run.bad_steps,
            "trained_steps": run.trained_steps,
            "first_bad_step": run.first_bad_step,
            "elapsed_s": run.budget.elapsed_s,
            "tokens_seen": run.budget.tokens_seen,
            "flops_seen": run.budget.flops_seen,
            "threads": run.threads.count,
        }

    @staticmethod
    def extras_of(run: TrainerView) -> Callable[[Path], None] | None:
        """The run's settings, and for a full-weight checkpoint config.json and the tokenizer (checkpoint_extras)."""
        return Saving.checkpoint_extras(run.unwrapped_policy(), run.tokenizer, run.weight_keys(), run.folder.record)

    @staticmethod
    def checkpoint_extras(
        model: Any, tokenizer: Any, weight_keys: set[str] | None, settings: dict[str, Any] | None = None
    ) -> Callable[[Path], None] | None:
        """The settings the checkpoint was written under (its run_config.json: a resume compares with them, wherever it
        continues), and what makes a full-weight checkpoint loadable by from_pretrained: config.json and the tokenizer
        (LoRA ones: the adapter as peft writes it and the tokenizer, which PeftModel.from_pretrained(base, folder)
        loads)."""
        if weight_keys is not None and settings is None and not lora.is_peft(model):
            return None

        def write(folder: Path) -> None:
            # `folder` is the checkpoint's temporary folder, which checkpoint_format.save removes when a write raises OSError:
            # the tokenizer's own error type (tokenizers raise a bare Exception for a full disk) is turned into one
            try:
                if settings is not None:
                    (folder / checkpoint_format.SETTINGS).write_text(json.dumps(settings, indent=2))
                if weight_keys is None:
                    model.config.save_pretrained(folder)
                    tokenizer.save_pretrained(folder)
                elif lora.is_peft(model):
                    lora.save_adapter(model, tokenizer, folder)
            except OSError:
                raise
            except Exception as e:
                cause = os_error(e)
                if cause is None:
                    raise
                raise cause from e

        return write

    def load_checkpoint(self, path: Path, policy: Any, weight_keys: set[str] | None, method: Any) -> dict[str, Any]:
        """Weights and the method's state into the plain models (every rank the checkpoint rank 0 chose); the rest of the
        state (optimizer, schedule, RNG, counters) is returned for the run to restore once its optimizer exists."""
        state = distributed_save.local_state(checkpoint_format.load(path, policy, weight_keys), self.dist)
        method.load_state_dict(state["method"])
        return state

    def save_final(self, policy: Any, tokenizer: Any, method: Any, run: TrainerView) -> None:
        """The final model and tokenizer with save_pretrained, loadable by transformers (`run` for the distributed save).

        All of its files or none: they are written into a temporary folder in the run folder, then moved into place; a
        full disk leaves the run folder as it was and raises WriteFailed, naming the last intact checkpoint."""
        cfg = self.cfg

        def write(folder: Path, weights: dict[str, Any] | None = None) -> None:
            if method.save_final(folder):  # the run's product is the method's own model
                return
            if lora.is_peft(policy):  # DDP keeps a whole copy on every rank: rank 0 writes it
                lora.save_final(policy, tokenizer, folder, cfg.merge_lora, cfg.save_dtype)
                return
            precision.save_pretrained(
                policy, folder, policy.state_dict() if weights is None else weights, cfg.save_dtype
            )
            tokenizer.save_pretrained(folder)

        if self.dist is not None:  # every rank gathers (FSDP2), rank 0 writes, every rank hears how it went
            distributed_save.save_final(self.dist, run, write)
            return
        write_folder(self.out_dir, write, run_dir=self.out_dir, what=f"the final model to {self.out_dir}")

    def write_card(self, method: Any, steps: int) -> None:
        """The final folder's README.md: method, base model, data, settings and final metrics (gcfamily/run/card.py);
        a run that logged nothing (max_steps=0 without --eval) has no metrics."""
        from gcfamily.methods.onpolicy import OnPolicy
        from gcfamily.run.card import write_model_card
        from gcfamily.run.logger import read_metrics

        m = method
        info = {
            "name": self.cfg.method,
            "data_source": m.data_source,
            "gc_formula": m.gc_formula,
            "on_policy": isinstance(m, OnPolicy),
        }
        rows = read_metrics(self.out_dir) if (self.out_dir / "metrics.jsonl").is_file() else []
        try:  # written to a temporary file and renamed (gcfamily/run/card.py): a failure leaves no part of a card
            write_model_card(self.out_dir, to_dict(self.cfg), rows, self.cfg.model, info, steps=steps)
        except (OSError, WriteFailed) as e:  # the sentence names what the run keeps, not only the file
            path = self.out_dir / "README.md"
            cause = e.cause if isinstance(e, WriteFailed) else e
            raise WriteFailed(path, cause, run_dir=self.out_dir, what=f"the model card {path}") from None
        from gcfamily.run.curves import write_curves

        write_curves(self.out_dir, rows)  # curves.png; a failed write raises WriteFailed naming what is kept

    def summary(self, step: int, seconds: float) -> str:
        """A few lines for the console at the end of a run: held-out figures before and after, reward, loss, where the model is."""
        from gcfamily.run.logger import read_metrics
        from gcfamily.run.summary import summary

        rows = read_metrics(self.out_dir) if (self.out_dir / "metrics.jsonl").is_file() else []
        return summary(rows, step, seconds, self.out_dir, self.final_saved)

    def log_samples(self, step: int, rows: list[dict[str, Any]]) -> None:
        """Prompts, completions and rewards of a step to completions.jsonl and the trackers (every log_completions_every steps)."""
        every = self.cfg.log_completions_every
        if every and step % every == 0 and self.logger is not None:
            self.logger.completions(step, rows)
