"""The run folder as a transaction: refuse a folder that would lose or mix work, take its lock, clear a replaced run,
check a resume's settings and choose its checkpoint (rank 0 decides for every rank; gcfamily/run/transaction.py does the
file work). An object the Trainer holds, given the settings, the processes and the folder.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, Callable, Optional

from gcfamily.run import checkpoint, transaction as runfolder
from gcfamily.core import engine
from gcfamily.models import lora
from gcfamily.config import to_dict
from gcfamily.errors import GcfError


class RunFolder:
    """Setting up the run folder, its lock, and a resume's changed settings."""

    def __init__(self, cfg: Any, dist: Any) -> None:
        self.cfg, self.dist = cfg, dist
        self.is_main = dist is None or dist.rank == 0
        self.out_dir = Path(cfg.output_dir)
        self.lock = runfolder.RunLock(self.out_dir)
        self.change: Optional[dict[str, Any]] = None
        """A resume's changed settings (allow_changed_settings), or None."""

    def decide(self, fn: Callable[[], Any]) -> Any:
        """fn() run once, on rank 0 under torch.distributed, its result (or its one-sentence error) on every rank."""
        if self.dist is None:
            return fn()
        out, err = None, None
        if self.is_main:
            try:
                out = fn()
            except GcfError as e:
                err = str(e)
        out, err = self.dist.broadcast((out, err))
        if err is not None:
            raise GcfError(err)
        return out

    def open(self, resume: Optional[str]) -> Optional[Path]:
        """The run folder as a transaction (runfolder.py): refuse a folder that would lose or mix work, take its lock,
        clear a replaced run, check a resume's settings and choose its checkpoint (rank 0 chooses for all). Returns it."""
        cfg, out = self.cfg, self.out_dir

        def prepare() -> tuple[Optional[str], Optional[dict[str, Any]]]:
            runfolder.check_target(out, cfg.model, resume, cfg.overwrite)
            try:
                out.mkdir(parents=True, exist_ok=True)
            except OSError as e:
                raise GcfError(
                    f"Output folder {out} cannot be made ({e.strerror or e}); choose another --output-dir."
                ) from e
            runfolder.check_writable(out, 0)
            runfolder.say(self.lock.acquire())
            try:
                return self._prepare(resume)
            except BaseException:
                self.lock.release()
                raise

        path, self.change = self.decide(prepare)
        return None if path is None else Path(path)

    def _prepare(self, resume: Optional[str]) -> tuple[Optional[str], Optional[dict[str, Any]]]:
        """Rank 0, holding the lock: (the checkpoint to resume, the recorded change of settings)."""
        cfg, out = self.cfg, self.out_dir
        saved = json.loads((out / "run_config.json").read_text()) if (out / "run_config.json").is_file() else {}
        path, change = None, None
        if resume is None and cfg.overwrite:
            removed = runfolder.clear_previous_run(out)
            if removed:
                print(
                    f"note: --overwrite removed the previous contents of {out} ({', '.join(removed[:5])}{', ...' if len(removed) > 5 else ''}).",
                    file=sys.stderr,
                )
        runfolder.clean_partial_checkpoints(out)
        record = to_dict(cfg)
        if resume is not None:
            path = checkpoint.find(resume, out)
            step = int(path.name[5:]) if path.name[5:].isdigit() else None
            change = runfolder.check_resume(out, record, cfg.allow_changed_settings, step)
            record["changes"] = (saved.get("changes") or []) + (
                [{"step": step, "changed": change["changed"]}] if change else []
            )
            if step is not None:
                runfolder.truncate_logs(out, step)
        (out / "run_config.json").write_text(json.dumps(record, indent=2))
        return (None if path is None else str(path)), change

    def abandon(self, resumed: bool) -> None:
        """A start that failed: a run that never started leaves no run behind; the lock goes."""
        if not resumed and self.is_main and not runfolder.holds_run_output(self.out_dir):
            (self.out_dir / "run_config.json").unlink(missing_ok=True)
        self.lock.release()

    def check_room(self, policy: Any) -> None:
        """Rank 0: the disk holds a checkpoint (the trained weights and AdamW's two moments, in the master dtype, plus 10%)."""
        if not self.is_main:
            return
        trained = sum(p.numel() * p.element_size() for p in policy.parameters() if p.requires_grad)
        weights = trained if lora.is_peft(policy) else sum(p.numel() * p.element_size() for p in policy.parameters())
        runfolder.check_writable(self.out_dir, int((weights + 2 * trained) * 1.1))


def apply_changed_settings(cfg: Any, optimizer: Any, scheduler: Any, total_steps: int) -> None:
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
