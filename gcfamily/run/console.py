"""What a run says on the console (stderr) while it runs: its start (threads, what dtype=auto chose, the steps of `epochs`), lines above the
progress bar, the bar itself, and each phase longer than a few seconds (converting and loading the model, each
evaluation as a bar over its prompts that shows the token its batch decodes); quiet with progress=false. The
metrics go to the logger (gcfamily/run/logger.py); these lines are for a person.
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

from gcfamily.config import Config
from gcfamily.core import precision, threads


def announce(
    cfg: Config, is_main: bool, chosen: threads.Threads, n: int | None, max_steps: int, prec: precision.Precision
) -> None:
    """The start's console lines: the thread count and why (always when it ends bitwise equality), what dtype=auto
    chose, and the steps that `epochs` passes take."""
    if is_main and (cfg.progress or "no longer bitwise" in chosen.reason):
        print(f"threads: {chosen.reason}.", file=sys.stderr)  # beside the progress bar; always in the metrics
    if is_main and cfg.progress and cfg.dtype == "auto":
        print(precision.auto_choice(prec.compute, prec.device_type), file=sys.stderr)
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


Say = Callable[[str], None]
"""Where a phase's lines go: a function of one line, or None for silence (progress=false, a rank other than 0)."""


def teller(enabled: bool) -> Say | None:
    """`say` without a bar when enabled, else None: what model loading and conversion are given."""
    return (lambda line: say(None, line)) if enabled else None


@contextlib.contextmanager
def timed(tell: Say | None, doing: str, done: str) -> Iterator[None]:
    """'doing...' before a phase and 'done in N s' after it, when `tell` is given."""
    t0 = time.perf_counter()
    if tell is not None:
        tell(f"{doing}...")
    yield
    if tell is not None:
        tell(f"{done} in {time.perf_counter() - t0:.1f} s")


def eval_bar(enabled: bool, total: int, desc: str) -> contextlib.AbstractContextManager:
    """A bar over an evaluation's prompts, under the run's bar and cleared when the evaluation ends; None without one.
    It first shows a second in, so an evaluation that fails at once leaves its error sentence alone on stderr."""
    if not enabled:
        return contextlib.nullcontext(None)
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, unit="prompt", leave=False, dynamic_ncols=True, delay=1.0)


@contextlib.contextmanager
def ticking(model: Any, bar: Any, max_new_tokens: int) -> Iterator[None]:
    """While a batch of prompts decodes, the bar shows the token it is at, redrawn at most ten times a second: greedy
    decoding of a batch takes one forward per token (the prefill first), and the bar moves by prompts only when the
    batch ends. A forward hook on the module `generate` calls (a LoRA model's base), removed on the way out."""
    if bar is None:
        yield
        return
    target = model.get_base_model() if hasattr(model, "get_base_model") and hasattr(model, "peft_config") else model
    calls = [0]

    def tick(*_: Any) -> None:
        calls[0] += 1
        bar.set_postfix_str(f"token {min(calls[0] - 1, max_new_tokens)}/{max_new_tokens}", refresh=False)
        bar.update(0)  # a redraw when tqdm's mininterval has passed

    handle = target.register_forward_hook(tick)
    try:
        yield
    finally:
        handle.remove()


def evaluated(shown: bool, run_bar: Any, step: int, samples: int, evaluate: Callable[[Any], dict]) -> dict[str, float]:
    """One held-out evaluation, `evaluate(bar)`, told when `shown`: a line as it starts, a bar over its prompts while it
    decodes, and a line with what it found and how long it took; the time also goes to the log (time/eval_s)."""
    if shown:
        say(run_bar, f"evaluating at step {step} on up to {samples} held-out examples...")
    t0 = time.perf_counter()
    with eval_bar(shown, samples, f"evaluating at step {step}") as bar:
        out = evaluate(bar)
    if not out:
        return out
    if shown:
        found = ", ".join(f"{k} {v:.4g}" for k, v in out.items())
        say(run_bar, f"evaluated at step {step} in {time.perf_counter() - t0:.1f} s: {found}")
    return {**out, "time/eval_s": time.perf_counter() - t0}
