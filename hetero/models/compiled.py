"""`mx.compile` for functions that may run on any thread, compiled separately in each thread that runs them.

Decode steps are many small ops (about 1,400 per token on the bundled model), and on MLX's CPU backend the
cost of dispatching them, not arithmetic, sets the speed; compiling fuses the elementwise ones.

Why per thread: MLX keeps compiled graphs in a thread-local cache that also holds Python objects. When a
thread that ran a compiled function ends while the interpreter is finalizing (the server's and the split
pipeline's worker threads at exit), that cache's destructor takes the GIL and MLX 0.32 aborts the process
("terminate called without an active exception", about half of the runs of a worker-thread repro). A function
compiled in the thread that runs it lives in that thread's `threading.local`, which Python clears while the
thread still holds the GIL; dropping the function empties its cache entry, and the destructor has nothing
left to do (0 aborts in 24 runs of the same repro).

The weights are the model's as of each function's first call: `mx.compile` keeps the arrays a function closes over
(a layer's parameters) as constants of its trace. A loaded model's weights never change, so nothing in hetero
meets it; code that edits a model's weights (tests, benches building a draft head that agrees) must do so before
the model's first decode step, or on a freshly loaded model.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import mlx.core as mx


class PerThread:
    """`fn` compiled with `mx.compile` once per calling thread; called like `fn` (array arguments only).
    `shapeless`: one compilation for inputs of any shape (elementwise functions only, `mx.compile`'s rule)."""

    def __init__(self, fn: Callable, shapeless: bool = False) -> None:
        self._fn = fn
        self._shapeless = shapeless
        self._local = threading.local()

    def __call__(self, *args: mx.array):
        compiled = getattr(self._local, "compiled", None)
        if compiled is None:
            compiled = self._local.compiled = mx.compile(self._fn, shapeless=self._shapeless)
        return compiled(*args)
