"""Honest logging: every step to metrics.jsonl (for benchmarks), and to TensorBoard or W&B (for people).

metrics.jsonl and completions.jsonl are always written on rank 0; `report_to` only chooses the trackers
that show the same numbers. wandb is imported only when asked for, so it stays an optional extra.

Every write here is whole or not at all (gcfamily/run/folder/writes.py): a row is appended in one write that a full disk
undoes, so a log never ends in half a line, and the run ends in one sentence naming its last intact checkpoint.
TensorBoard's events are written by `EventFile`, in this thread, one appended record per step: torch's
SummaryWriter writes from a background thread, which a full disk kills with a traceback of its own.
"""

from __future__ import annotations

import importlib.util
import io
import json
import math
import os
import socket
import time
from pathlib import Path
from typing import Any

from gcfamily.errors import GcfError
from gcfamily.run.folder.writes import append_bytes, append_lines

TRACKERS = ("tensorboard", "wandb", "none")


def _trackers(report_to: str | list[str] | tuple[str, ...]) -> set[str]:
    """The trackers named by `report_to`, checked; "none" alone (or with others) adds nothing."""
    names = [report_to] if isinstance(report_to, str) else list(report_to)
    for name in names:
        if name not in TRACKERS:
            raise GcfError(
                f"report_to={name!r} is not a tracker; use 'tensorboard', 'wandb' or 'none', or a list of them."
            )
    return set(names) - {"none"}


def _import_wandb() -> Any:
    """wandb, or the one-sentence fix when it is not installed."""
    missing = GcfError("report_to=wandb needs the wandb package: pip install 'gcfamily[wandb]' (or pip install wandb).")
    if importlib.util.find_spec("wandb") is None:
        raise missing
    try:
        import wandb
    except ImportError as e:
        raise missing from e
    return wandb


def _is_scalar(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(float(v))


def prompt_text(prompt: str | list[dict[str, Any]]) -> str:
    """A prompt as text: a chat prompt (a list of messages) becomes one "role: content" line per message."""
    if isinstance(prompt, str):
        return prompt
    return "\n".join(f"{m.get('role', '?')}: {m.get('content', '')}" for m in prompt)


def completions_markdown(rows: list[dict[str, Any]]) -> str:
    """A markdown table of prompt | completion | reward, as TensorBoard's text tab shows it."""

    def cell(v: Any) -> str:
        # a pipe would end the cell and a newline the row
        return str(v).replace("|", "\\|").replace("\n", "<br>")

    lines = ["| prompt | completion | reward |", "|---|---|---|"]
    for r in rows:
        reward = r.get("reward")
        shown = "" if reward is None else f"{reward:.4g}" if isinstance(reward, float) else reward
        lines.append(f"| {cell(prompt_text(r['prompt']))} | {cell(r['completion'])} | {cell(shown)} |")
    return "\n".join(lines)


def completions_table(rows: list[dict[str, Any]]) -> tuple[list[str], list[list[Any]]]:
    """Columns and cells for a W&B Table: prompt, completion, reward, then the extra keys of any row."""
    fixed = ["prompt", "completion", "reward"]
    extra = list(dict.fromkeys(k for r in rows for k in r if k not in fixed))

    def cell(v: Any) -> Any:
        # a Table cell is a plain value; anything else is shown as its JSON
        return v if v is None or isinstance(v, (str, int, float, bool)) else json.dumps(v, default=str)

    data = [
        [prompt_text(r["prompt"]), r["completion"], r.get("reward")] + [cell(r.get(k)) for k in extra] for r in rows
    ]
    return fixed + extra, data


class EventFile:
    """A TensorBoard event file written synchronously: each event is one appended record, whole or, on a failed write,
    not at all (WriteFailed, naming the run's last intact checkpoint). TensorBoard reads it as it reads SummaryWriter's."""

    def __init__(self, folder: Path, run_dir: Path) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        # the name SummaryWriter gives, made unique per writer (a resume in the same second gets its own file)
        self.path = (
            folder / f"events.out.tfevents.{int(time.time())}.{socket.gethostname()}.{os.getpid()}.{time.time_ns()}"
        )
        self.run_dir = run_dir
        self._event(file_version="brain.Event:2")

    def scalars(self, step: int, scalars: dict[str, float]) -> None:
        """One event holding every scalar of the step (TensorBoard shows each under its tag)."""
        from tensorboard.compat.proto.summary_pb2 import Summary
        from torch.utils.tensorboard.summary import scalar

        if scalars:
            values = [v for k, x in scalars.items() for v in scalar(k, float(x)).value]
            self._event(step=step, summary=Summary(value=values))

    def text(self, tag: str, text: str, step: int) -> None:
        """A markdown text under `tag` (shown in TensorBoard's text tab, as SummaryWriter.add_text does)."""
        from torch.utils.tensorboard.summary import text as text_summary

        self._event(step=step, summary=text_summary(tag, text))

    def _event(self, **fields: Any) -> None:
        from tensorboard.compat.proto.event_pb2 import Event
        from tensorboard.summary.writer.record_writer import RecordWriter

        record = io.BytesIO()  # one record (length, CRCs, the event) framed as TensorBoard's writer frames it
        RecordWriter(record).write(Event(wall_time=time.time(), **fields).SerializeToString())
        append_bytes(self.path, record.getvalue(), run_dir=self.run_dir)


class RunLogger:
    """Writes one JSON line per logged step and the same scalars to the chosen trackers; rank 0 only.

    `report_to` is "tensorboard", "wandb", "none" or a list of them; `tensorboard=False` turns TensorBoard
    off whatever `report_to` says (the older switch). `run_name` and `config` (a JSON-ready dict of the
    resolved settings) name and describe the W&B run; its project is $WANDB_PROJECT or "gcfamily", and
    $WANDB_MODE (e.g. offline) is honoured as wandb itself reads it.
    """

    def __init__(
        self,
        out_dir: Path,
        enabled: bool = True,
        tensorboard: bool = True,
        report_to: str | list[str] = "tensorboard",
        run_name: str | None = None,
        config: dict[str, Any] | None = None,
    ) -> None:
        out_dir = Path(out_dir)
        trackers = _trackers(report_to)
        if not tensorboard:
            trackers.discard("tensorboard")
        # checked on every rank, so that all ranks stop together rather than rank 0 alone
        wandb = _import_wandb() if "wandb" in trackers else None
        self.enabled = enabled
        if enabled:
            out_dir.mkdir(parents=True, exist_ok=True)
        self.path = out_dir / "metrics.jsonl"
        self.completions_path = out_dir / "completions.jsonl"
        self.tb = None
        self.wandb = None
        if enabled and wandb is not None:
            try:
                self.wandb = wandb.init(
                    project=os.environ.get("WANDB_PROJECT", "gcfamily"),
                    name=run_name or out_dir.name,
                    dir=str(out_dir),
                    config=config,
                    # each RunLogger owns its run: a second one in the same process (tests, sweeps) must
                    # not return or finish the first one's run
                    reinit="create_new",
                )
            except wandb.errors.Error as e:
                raise GcfError(
                    f"report_to=wandb could not start a W&B run ({e}); run `wandb login` or set WANDB_API_KEY, "
                    "or set WANDB_MODE=offline to log locally."
                ) from e
            self._wandb_table = wandb.Table
        if enabled and "tensorboard" in trackers:
            self.tb = EventFile(out_dir / "tensorboard", out_dir)
        self.t0 = time.time()

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        """Append a step's metrics; non-finite numbers are written as null in JSON and left out of trackers. A failed
        write (a full disk) leaves the files as they were and raises WriteFailed, naming the last intact checkpoint."""
        if not self.enabled:
            return
        row = {"step": step, "time": round(time.time() - self.t0, 3)}
        for k, v in metrics.items():
            if isinstance(v, float) and not math.isfinite(v):
                row[k] = None
            else:
                row[k] = v
        append_lines(self.path, [json.dumps(row)], run_dir=self.path.parent)
        scalars = {k: v for k, v in metrics.items() if _is_scalar(v)}
        if self.tb is not None:
            self.tb.scalars(step, scalars)
        if self.wandb is not None and scalars:
            self.wandb.log(scalars, step=step)

    def completions(self, step: int, rows: list[dict[str, Any]]) -> None:
        """Record sampled completions: rows of {"prompt", "completion", "reward", ...extra keys}.

        completions.jsonl keeps each row as given (a non-finite reward as null), plus its step;
        TensorBoard gets a markdown table under "completions" and W&B a Table under the same key,
        with chat prompts shown as "role: content" lines.
        """
        if not self.enabled or not rows:
            return
        lines = []
        for r in rows:
            reward = r.get("reward")
            if isinstance(reward, float) and not math.isfinite(reward):
                r = {**r, "reward": None}
            lines.append(json.dumps({"step": step, **r}))
        append_lines(self.completions_path, lines, run_dir=self.completions_path.parent)  # the step's rows, all or none
        if self.tb is not None:
            self.tb.text("completions", completions_markdown(rows), step)
        if self.wandb is not None:
            columns, data = completions_table(rows)
            self.wandb.log({"completions": self._wandb_table(columns=columns, data=data)}, step=step)

    def close(self) -> None:
        """Finish the W&B run (TensorBoard's events are on disk as each is written); safe to call twice."""
        self.tb = None
        if self.wandb is not None:
            self.wandb.finish()
            self.wandb = None


def read_metrics(path: Path | str) -> list[dict[str, Any]]:
    """The rows of a metrics.jsonl file."""
    p = Path(path)
    if p.is_dir():
        p = p / "metrics.jsonl"
    return [json.loads(line) for line in p.read_text().splitlines() if line.strip()]
