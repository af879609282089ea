"""The one error type a user can cause; the CLI prints its message and exits non-zero.

Also the stop signals: SIGTERM / SIGINT handled so that a run stops at a checkpoint (`Interrupted`).
"""

import contextlib
import signal
from typing import Any, Callable


class GcfError(Exception):
    """A mistake in the user's input, stated in one sentence that names the thing and the fix."""


class Interrupted(GcfError):
    """The run was stopped by a signal after saving a checkpoint; exit code 128 + signal number."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code


def install_stop_handlers(handler: Callable[[int, Any], None]) -> Callable[[], None]:
    """Call `handler` on SIGTERM and SIGINT; returns the function that puts the old handlers back.

    Off the main thread (a test runner's thread) signals cannot be handled, and nothing changes.
    """
    previous: dict[int, Any] = {}
    with contextlib.suppress(ValueError):
        for signum in (signal.SIGTERM, signal.SIGINT):
            previous[signum] = signal.signal(signum, handler)

    def restore() -> None:
        for signum, old in previous.items():
            signal.signal(signum, old)

    return restore
