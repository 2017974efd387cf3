"""The client's errors, and the one boundary where a decoder's failure becomes one.

The server runs decoders on what clients send: the body's JSON, base64 text, image bytes (Pillow), the chat
template over the messages (Jinja), JSON schemas and tool definitions (the grammar library), local image files.
Whatever such a decoder raises while reading the client's bytes is the client's error, never the server's: a
decoder runs inside `refusing(param, what)`, which turns any exception into a 400 that names the field and says what
could not be read and why (the decoder's own words). A `HeteroError` is the engine's own refusal, already one clear
line; a `RequestError` raised inside passes as it is. A 500 is left for bugs in the server itself.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from hetero.errors import HeteroError


class RequestError(Exception):
    """A client mistake: HTTP `status`, one-line `message`, the offending field as `param`."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


@contextmanager
def refusing(param: str | None, what: str, code: str | None = None, prefix: bool = True) -> Iterator[None]:
    """Run a decoder on the client's bytes: any exception inside is a 400 naming `param`, worded `'param': what
    (the decoder's reason)`, or `'param': reason` for a HeteroError (its message is the reason already); `prefix`
    False leaves the `'param': ` out (a message that names its field itself)."""
    try:
        yield
    except RequestError:
        raise
    except HeteroError as e:
        raise RequestError(400, f"{_head(param, prefix)}{e}", param, code) from None
    except Exception as e:  # noqa: BLE001  (whatever the decoder raises: the bytes were the client's)
        raise RequestError(400, f"{_head(param, prefix)}{what} ({reason(e)})", param, code) from None


def reason(e: BaseException) -> str:
    """An exception as one short line: its message (first line, at most 200 characters) and its type."""
    text = str(e).strip().splitlines()[0][:200] if str(e).strip() else ""
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def _head(param: str | None, prefix: bool) -> str:
    return f"'{param}': " if prefix and param else ""
