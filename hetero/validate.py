"""One place for the limits on user input: numeric ranges shared by the CLI, the server and the library, and
text that must be UTF-8.

A `Bound` is a numeric interval. The CLI uses it as an argparse `type` (`--seed`, `--temp`, ...), the server
and the library call `Bound.check`; both say what is wrong and what is allowed in one line. `AneSplit` is the
ANE split (`--ane-fraction F|auto`), parsed by one parser wherever it enters. A checkpoint's config.json has its
own checks (`hetero.checkpoint.config_checks`).
"""

from __future__ import annotations

import argparse
import math
import numbers
import sys
from dataclasses import dataclass

from hetero.errors import HeteroError

SEED_MAX = 2**64 - 1  # MLX keys take an unsigned 64-bit seed


@dataclass(frozen=True)
class Bound:
    """Allowed values: an integer or a finite number in [lo, hi] (an end is open when `lo_open` / `hi_open`)."""

    lo: float | None = None
    hi: float | None = None
    integer: bool = False
    lo_open: bool = False
    hi_open: bool = False

    def describe(self) -> str:
        """'an integer >= 1', 'a number in (0, 1]', ..."""
        bounded = self.lo is not None and self.hi is not None
        what = "an integer" if self.integer else "a number" if bounded else "a finite number"
        fmt = lambda v: "2^64-1" if v == SEED_MAX else f"{v:g}" if not self.integer else str(int(v))  # noqa: E731
        if self.lo is not None and self.hi is not None:
            return f"{what} in {'(' if self.lo_open else '['}{fmt(self.lo)}, {fmt(self.hi)}{')' if self.hi_open else ']'}"
        if self.lo is not None:
            return f"{what} {'>' if self.lo_open else '>='} {fmt(self.lo)}"
        if self.hi is not None:
            return f"{what} {'<' if self.hi_open else '<='} {fmt(self.hi)}"
        return what

    def problem(self, value) -> str | None:
        """Why `value` is not allowed, or None when it is."""
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            return f"must be {self.describe()}, got {type(value).__name__}"
        if self.integer and not isinstance(value, numbers.Integral):
            return f"must be {self.describe()}, got {value!r}"
        if not self.integer and not math.isfinite(value):
            return f"must be {self.describe()}, got {value}"
        low = self.lo is not None and (value <= self.lo if self.lo_open else value < self.lo)
        high = self.hi is not None and (value >= self.hi if self.hi_open else value > self.hi)
        if low or high:
            return f"must be {self.describe()}, got {value}"
        return None

    def check(self, value, name: str):
        """`value` itself when allowed, else a HeteroError naming `name`."""
        why = self.problem(value)
        if why is not None:
            raise HeteroError(f"{name} {why}")
        return value

    def __call__(self, text: str):
        """argparse `type=`: parse a command-line string and check it."""
        try:
            value = int(text) if self.integer else float(text)
        except ValueError:
            value = None
        if value is None and self.integer:  # "2**70" and the like: say what is wanted, not "invalid int value"
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer: give {self.describe()}")
        if value is None:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number: give {self.describe()}")
        why = self.problem(value)
        if why is not None:
            raise argparse.ArgumentTypeError(why)
        return value

    @property
    def __name__(self) -> str:  # argparse names the type in some messages
        return "integer" if self.integer else "number"


POSITIVE_INT = Bound(1, integer=True)
NONNEG_INT = Bound(0, integer=True)
POSITIVE = Bound(0, lo_open=True)
NONNEG = Bound(0)
FRACTION = Bound(0, 1)
SEED = Bound(0, SEED_MAX, integer=True)
PORT = Bound(1, 65535, integer=True)
# Sampling: the same limits for `hetero run`, the server and `SamplingParams`
TEMPERATURE = NONNEG
TOP_K = NONNEG_INT
TOP_P = Bound(0, 1, lo_open=True)
MIN_P = Bound(0, 1, hi_open=True)


@dataclass(frozen=True)
class AneSplit:
    """The ANE + GPU split of prefill, parsed once where it enters (`--ane-fraction F|auto` of every subcommand,
    `ServerSettings`, `hetero.prefill`): GPU-only (`fraction` 0, the default), the ANE's share F in (0, 1] of each
    offloadable piece, or `auto` (the fraction this machine's measured profile recommends, verified on a
    calibration prompt when the split is configured)."""

    fraction: float = 0.0
    auto: bool = False

    @classmethod
    def parse(cls, value, name: str = "--ane-fraction") -> AneSplit:
        """The one parser: an AneSplit as it is; None or 0: GPU-only; "auto"; a number in [0, 1] or the text of
        one. Anything else: a one-line HeteroError naming `name`."""
        if isinstance(value, AneSplit):
            return value
        if value is None:
            return GPU_ONLY
        if value == "auto":
            return cls(auto=True)
        number = math.nan
        if isinstance(value, str):
            try:
                number = float(value)
            except ValueError:
                pass
        elif isinstance(value, numbers.Real) and not isinstance(value, bool):
            number = float(value)
        if FRACTION.problem(number) is not None:
            raise HeteroError(f"{name} {value!r}: give a number in [0, 1] (0: GPU-only) or 'auto'")
        return cls(number)

    @property
    def gpu_only(self) -> bool:
        """No split: every prefill runs on the GPU."""
        return not self.auto and self.fraction == 0.0

    def fixed(self, command: str) -> float:
        """The fraction for `command`, which needs one given split (`hetero doctor`, `convert --coreml`); a
        one-line HeteroError for GPU-only or auto."""
        if self.auto:
            raise HeteroError(f"{command} needs a given --ane-fraction F with 0 < F <= 1, not 'auto' (auto picks "
                              "one per machine when a prompt runs: hetero run/serve/prefill)")
        if self.fraction == 0.0:
            raise HeteroError(f"{command} needs --ane-fraction F with 0 < F <= 1 (the ANE's share of each piece; "
                              "0 is GPU-only, with no split)")
        return self.fraction

    def __str__(self) -> str:
        return "auto" if self.auto else f"{self.fraction:g}"


GPU_ONLY = AneSplit()


def ane_split_arg(text: str) -> AneSplit:
    """argparse `type=` for `--ane-fraction` in every subcommand: `AneSplit.parse`, its error as argparse's."""
    try:
        return AneSplit.parse(text, "")
    except HeteroError as e:
        raise argparse.ArgumentTypeError(str(e).strip()) from None


def check_seed(seed: int | None) -> int | None:
    """A seed MLX accepts (None: a random one)."""
    return None if seed is None else SEED.check(seed, "seed")


def check_text(text: str, name: str) -> str:
    """`text` when it is valid Unicode that encodes to UTF-8 (no lone surrogates), else a HeteroError."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        bad = text[e.start]
        raise HeteroError(
            f"{name} is not valid UTF-8 text (character {e.start} is {bad!r}, a lone surrogate or an undecodable byte); "
            "pass UTF-8 text"
        ) from None
    return text


def decode_utf8(data: bytes, name: str) -> str:
    """Bytes -> str, or a HeteroError that says where the first invalid byte is."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise HeteroError(f"{name} is not valid UTF-8 (byte 0x{data[e.start]:02x} at offset {e.start}); pass UTF-8 text") from None


def read_prompt(prompt: str) -> str:
    """The prompt text (from stdin for '-'), refused in one line when it is not valid UTF-8."""
    if prompt == "-":
        return decode_utf8(sys.stdin.buffer.read(), "the prompt on stdin")
    # argv bytes that are not UTF-8 arrive as lone surrogates (Python's surrogateescape)
    return check_text(prompt, "--prompt")
