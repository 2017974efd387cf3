"""The one exception type for mistakes a user can fix (bad path, bad file, bad flag).

The CLI prints such an error as one line and exits non-zero. Anything else is a bug: the CLI still prints one
line (`internal_error`) and shows the traceback only with --debug; the server answers a JSON 500 and logs it.
"""


class HeteroError(Exception):
    """A user-facing error: its message is one line saying what is wrong and what to do."""


class AneLaneLost(HeteroError):
    """The ANE lane's worker process died, hung past its timeout or returned garbage; it has been killed (the
    prompt it was splitting is prefilled GPU-only)."""


class AneNonFinite(AneLaneLost):
    """A program returned NaN or inf: the prompt held values past the ranges its split was planned with. `layer`
    and `piece` name the program's piece where known (`hetero.pipeline.programs.load_programs` adds them)."""

    def __init__(self, message: str, layer: int | None = None, piece: str | None = None):
        super().__init__(message)
        self.layer, self.piece = layer, piece


def internal_error(e: BaseException) -> str:
    """'Type: first line of the message' for an unexpected exception (one line for the user)."""
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0]}" if text else type(e).__name__
