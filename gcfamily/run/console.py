"""What a run says on the console (stderr) while it runs: its start (threads, the steps of `epochs`), lines above the
progress bar, and the bar itself. The metrics go to the logger (gcfamily/run/logger.py); these lines are for a person.
"""

from __future__ import annotations

import contextlib
import sys
from typing import Any

from gcfamily.config import Config
from gcfamily.core import threads


def announce(cfg: Config, is_main: bool, chosen: threads.Threads, n: int | None, max_steps: int) -> None:
    """The start's console lines: the thread count and why (always when it ends bitwise equality), and the steps
    that `epochs` passes take."""
    if is_main and (cfg.progress or "no longer bitwise" in chosen.reason):
        print(f"threads: {chosen.reason}.", file=sys.stderr)  # beside the progress bar; always in the metrics
    if is_main and cfg.progress and cfg.epochs:
        given = f", max_steps={cfg.max_steps} given" if "max_steps" in cfg.explicit else ""
        print(
            f"epochs={cfg.epochs:g}: {n} examples a pass at batch_size {cfg.batch_size}{given}: {max_steps} steps.",
            file=sys.stderr,
        )


def say(bar: Any, line: str) -> None:
    """A line on stderr, above the progress bar when there is one."""
    if bar is not None:
        bar.write(line, file=sys.stderr)
    else:
        print(line, file=sys.stderr, flush=True)


def progress_bar(enabled: bool, total: int, initial: int, desc: str) -> contextlib.AbstractContextManager:
    """The progress bar (closed when the run ends), or None without one."""
    if not enabled:
        return contextlib.nullcontext(None)
    from tqdm.auto import tqdm

    return tqdm(total=total, initial=initial, desc=desc, dynamic_ncols=True)
