"""The one error type a user can cause; the CLI prints its message and exits non-zero."""


class GcfError(Exception):
    """A mistake in the user's input, stated in one sentence that names the thing and the fix."""
