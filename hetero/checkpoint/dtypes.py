"""The compute dtype a model loads in: `--dtype` by name, the platform's default (fp32 on the CPU, bf16 on a GPU),
and the one a command chose for every load inside it (`using_dtype`)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import mlx.core as mx

from hetero.errors import HeteroError

# The compute dtypes a model loads in (`--dtype`), by name.
DTYPES = {"float32": mx.float32, "bfloat16": mx.bfloat16, "float16": mx.float16}
_chosen: list[mx.Dtype] = []  # dtypes chosen by `using_dtype`, innermost last


def platform_dtype() -> mx.Dtype:
    """fp32 on the CPU (half-precision matmuls are far slower there), bf16 on a GPU."""
    return mx.float32 if mx.default_device() == mx.cpu else mx.bfloat16


def default_dtype() -> mx.Dtype:
    """The dtype a model loads in when none is given: the one `using_dtype` chose (a command's `--dtype`), else
    the platform's (`platform_dtype`)."""
    return _chosen[-1] if _chosen else platform_dtype()


@contextmanager
def using_dtype(dtype: mx.Dtype | None) -> Iterator[None]:
    """Load models in `dtype` inside the block (None: no change), also where a caller passes no dtype (the
    server's and the pipelined ranks' loads)."""
    if dtype is None:
        yield
        return
    _chosen.append(dtype)
    try:
        yield
    finally:
        _chosen.pop()


def dtype_name(dtype: mx.Dtype) -> str:
    """"bfloat16" for mx.bfloat16: the name `--dtype` takes."""
    return next(name for name, d in DTYPES.items() if d == dtype)


def parse_dtype(name: str) -> mx.Dtype:
    """A `--dtype` name -> the mx.Dtype; any other name is a HeteroError naming the choices."""
    if name not in DTYPES:
        raise HeteroError(f"dtype {name!r}: choose one of {', '.join(DTYPES)}")
    return DTYPES[name]
