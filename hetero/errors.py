"""The one exception type for mistakes a user can fix (bad path, bad file, bad flag).

The CLI prints such an error as one line and exits non-zero; anything else is a bug and keeps its traceback.
"""


class HeteroError(Exception):
    """A user-facing error: its message is one line saying what is wrong and what to do."""
