"""One place for the limits on user input: numeric ranges (shared by the CLI, the server and the library) and
the checks on a checkpoint's config.json.

A `Bound` is a numeric interval. The CLI uses it as an argparse `type` (`--seed`, `--temp`, ...), the server
and the library call `Bound.check`; both say what is wrong and what is allowed in one line. `AneSplit` is the
ANE split (`--ane-fraction F|auto`), parsed by one parser wherever it enters. `check_config`
validates the JSON types and ranges of config.json before any field is used, so a bad file is one clear
error, not a traceback deep in the model code.
"""

from __future__ import annotations

import argparse
import math
import numbers
import sys
from dataclasses import dataclass
from pathlib import Path

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


# ----------------------------------------------------------------------------------------------------------
# config.json

# Sizes that must be integers >= 1 wherever they appear (flat or under text_config)
CONFIG_POSITIVE_INTS = (
    "hidden_size", "num_hidden_layers", "intermediate_size", "num_attention_heads", "num_key_value_heads",
    "head_dim", "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim",
    "vocab_size", "linear_conv_kernel_dim", "max_position_embeddings", "full_attention_interval",
    "decoder_sparse_step", "num_experts_per_tok", "moe_intermediate_size",
)
CONFIG_NONNEG_INTS = ("mtp_num_hidden_layers", "num_experts", "shared_expert_intermediate_size")
MAX_DIM = 2**31 - 1  # MLX array dimensions are 32-bit
# Counts that size Python lists (one object per layer): far above any released model, far below a hang
CONFIG_MAX = {"num_hidden_layers": 4096, "mtp_num_hidden_layers": 64}
CONFIG_FLOATS = {
    "rms_norm_eps": POSITIVE,
    "rope_theta": POSITIVE,
    "partial_rotary_factor": Bound(0, 1, lo_open=True),
}
CONFIG_BOOLS = ("tie_word_embeddings", "attention_bias", "norm_topk_prob")
CONFIG_DICTS = ("rope_parameters", "rope_scaling", "quantization", "quantization_config")
# A supported model's text config needs these; head_dim may be derived from hidden_size / num_attention_heads
CONFIG_REQUIRED = (
    "hidden_size", "num_hidden_layers", "intermediate_size", "num_attention_heads", "linear_num_key_heads",
    "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim", "vocab_size",
)
QUANT_BITS = (2, 3, 4, 5, 6, 8)


def check_config(config, where: str = "config.json", required: bool = False) -> dict:
    """`config` itself when its fields have the JSON types and ranges hetero relies on, else a HeteroError.

    Checks the fields that are present, flat or under `text_config`; with `required` also that the text
    model's size fields are there (a supported architecture's config needs them).
    """
    if not isinstance(config, dict):
        raise HeteroError(f"{where} must hold a JSON object, got a JSON {_json_type(config)}; re-download it")
    text = config.get("text_config")
    if text is not None and not isinstance(text, dict):
        raise HeteroError(f"{where}: text_config must be an object, got a JSON {_json_type(text)}; fix or re-download it")
    if not isinstance(config.get("model_type", ""), str):
        raise HeteroError(f"{where}: model_type must be a string, got a JSON {_json_type(config['model_type'])}")
    for scope, fields in ((None, config), ("text_config", text or {})):
        _check_fields(fields, where, scope)
    if required:
        merged = {**config, **(text or {})}
        needed = CONFIG_REQUIRED
        if merged.get("num_experts"):  # MoE: ModelArgs checks the experts' sizes, and the dense width where a layer is dense
            needed = tuple(k for k in CONFIG_REQUIRED if k != "intermediate_size")
        missing = [k for k in needed if merged.get(k) is None]
        if missing:
            raise HeteroError(f"{where} lacks {', '.join(missing)}: a {config.get('model_type')} config needs them; re-download it")
        heads, kv = merged["num_attention_heads"], merged.get("num_key_value_heads") or merged["num_attention_heads"]
        if heads % kv:
            raise HeteroError(f"{where}: num_attention_heads ({heads}) must be a multiple of num_key_value_heads ({kv})")
        if merged.get("head_dim") is None and merged["hidden_size"] % heads:
            raise HeteroError(f"{where}: without head_dim, hidden_size ({merged['hidden_size']}) must be a multiple of "
                              f"num_attention_heads ({heads})")
    return config


def _check_fields(fields: dict, where: str, scope: str | None) -> None:
    """Type and range of each known field present in one level of the config."""
    name = lambda k: f"{where}: {scope + '.' if scope else ''}{k}"  # noqa: E731
    for key in CONFIG_POSITIVE_INTS:
        _check_value(fields, key, Bound(1, CONFIG_MAX.get(key, MAX_DIM), integer=True), name(key))
    for key in CONFIG_NONNEG_INTS:
        _check_value(fields, key, Bound(0, CONFIG_MAX.get(key, MAX_DIM), integer=True), name(key))
    for key, bound in CONFIG_FLOATS.items():
        _check_value(fields, key, bound, name(key))
    for key in CONFIG_BOOLS:
        if fields.get(key) is not None and not isinstance(fields[key], bool):
            raise HeteroError(f"{name(key)} must be true or false, got {fields[key]!r}")
    for key in CONFIG_DICTS:
        if fields.get(key) is not None and not isinstance(fields[key], dict):
            raise HeteroError(f"{name(key)} must be an object, got a JSON {_json_type(fields[key])}")
    rope = fields.get("rope_parameters") or fields.get("rope_scaling") or {}
    for key, bound in CONFIG_FLOATS.items():
        _check_value(rope, key, bound, name(f"rope_parameters.{key}"))
    if not isinstance(rope.get("rope_type", rope.get("type", "default")), str):
        raise HeteroError(f"{name('rope_parameters.rope_type')} must be a string")
    layer_types = fields.get("layer_types")
    if layer_types is not None and not (isinstance(layer_types, list) and all(isinstance(t, str) for t in layer_types)):
        raise HeteroError(f"{name('layer_types')} must be a list of 'linear_attention' / 'full_attention' strings")
    for key in ("mlp_only_layers",):
        v = fields.get(key)
        if v is not None and not (isinstance(v, list) and all(NONNEG_INT.problem(i) is None for i in v)):
            raise HeteroError(f"{name(key)} must be a list of layer indices (integers >= 0)")
    eos = fields.get("eos_token_id")
    ids = eos if isinstance(eos, list) else [eos] if eos is not None else []
    if any(NONNEG_INT.problem(i) is not None for i in ids):
        raise HeteroError(f"{name('eos_token_id')} must be a token id or a list of them (integers >= 0), got {eos!r}")
    if fields.get("quantization"):  # MLX's own format; other tools' quantization_config is not ours to judge
        _check_quantization(fields["quantization"], name("quantization"))


def _check_quantization(q: dict, name: str) -> None:
    bits, group = q.get("bits", 4), q.get("group_size", 64)
    if isinstance(bits, bool) or bits not in QUANT_BITS:
        raise HeteroError(f"{name}.bits must be one of {list(QUANT_BITS)}, got {bits!r}")
    POSITIVE_INT.check(group, f"{name}.group_size")


def _check_value(fields: dict, key: str, bound: Bound, name: str) -> None:
    if fields.get(key) is not None:
        why = bound.problem(fields[key])
        if why is not None:
            raise HeteroError(f"{name} {why}; fix or re-download config.json")


def _json_type(value) -> str:
    """The JSON name of a parsed value's type."""
    if value is None:
        return "null"
    for t, n in ((bool, "boolean"), (str, "string"), (int, "number"), (float, "number"), (list, "array"), (dict, "object")):
        if isinstance(value, t):
            return n
    return type(value).__name__


def read_images(files: list[str] | None) -> list:
    """`hetero run --image` files as decoded images, in order; one that cannot be read or is no PNG / JPEG / WebP
    image is refused in one line that names it."""
    from hetero.models.qwen3_5_vision.preprocess import decode_image

    images = []
    for name in files or []:
        try:
            images.append(decode_image(Path(name).read_bytes()))
        except OSError as e:
            raise HeteroError(f"--image {name}: cannot read it ({e.strerror or e})") from None
        except HeteroError as e:
            raise HeteroError(f"--image {name}: {e}") from None
    return images


def read_prompt(prompt: str) -> str:
    """The prompt text (from stdin for '-'), refused in one line when it is not valid UTF-8."""
    if prompt == "-":
        return decode_utf8(sys.stdin.buffer.read(), "the prompt on stdin")
    # argv bytes that are not UTF-8 arrive as lone surrogates (Python's surrogateescape)
    return check_text(prompt, "--prompt")
