"""The one error type a user can cause; the CLI prints its message and exits non-zero."""


class GcfError(Exception):
    """A mistake in the user's input, stated in one sentence that names the thing and the fix."""


class Interrupted(GcfError):
    """The run was stopped by a signal after saving a checkpoint; exit code 128 + signal number."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code
