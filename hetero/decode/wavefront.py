"""CPU prefill as a two-lane wavefront: chunk c on one thread and chunk c+1 on the other, one layer apart.

On MLX's CPU backend a prefill chunk's matmuls spread over the cores (the BLAS's own threads), but everything else
does not: MLX's elementwise kernels and the numpy parts of a chunk (the activations' exp, the attention softmax, the
experts' routing) run on one core. Two chunks in flight fill the second core with that work. Chunk c+1 at layer l
needs chunk c's layer-l state (GDN state and conv window, PLE token context and conv window, the attention's KV and
index keys) and its own layer l-1 output, so each lane runs a layer once the other lane's previous chunk has
finished it: a wavefront, lane b one layer behind lane a.

The lanes are threads, each with its own MLX stream (MLX's default stream is per thread) and one BLAS thread (the
cores are now the lanes'). After every layer a lane evaluates the layer's output and its cache, then signals; the
other lane builds its chunk's same layer on those evaluated arrays. Host syncs inside a layer (numpy's exp, the
softmax, the routing buckets) stay: a lane waits on its own work only. Each chunk runs the same ops in the same
order as the one-lane `prefill`, so the caches and logits are those of the sequential run up to the BLAS's
summation order (one thread against two: ~1e-6 relative), and greedy tokens are identical.

Not used (the sequential `prefill` runs instead) with a chunk callback or marks (a checkpoint needs every layer's
state after the same chunk, while the wavefront has the next chunk already in its first layers), with images, on a
GPU, on one core, or for fewer than two chunks. `HETERO_PREFILL_WAVEFRONT=0` turns it off.
"""

from __future__ import annotations

import ctypes
import os
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import mlx.core as mx

from hetero import blas
from hetero.cache import ModelCache

MIN_TOKENS = 17  # chunks of at most 16 tokens run compiled steps (`RECURRENT_MAX_TOKENS`): the calling thread's lane
ENV = "HETERO_PREFILL_WAVEFRONT"


def enabled() -> bool:
    """Whether this process may prefill by wavefront: a CPU default device, two cores or more, and not turned off."""
    if os.environ.get(ENV, "").strip().lower() in ("0", "off", "false", "no"):
        return False
    return mx.default_device() == mx.cpu and (os.cpu_count() or 1) >= 2


def applies(model, edges: list[int]) -> bool:
    """Whether a prefill cut at `edges` goes by wavefront: `enabled`, a backbone that runs layer by layer
    (`begin` / `run_layer` / `end`), and at least two chunks long enough for the second lane."""
    backbone = getattr(model, "model", None)
    if not enabled() or not all(hasattr(backbone, f) for f in ("begin", "run_layer", "end")):
        return False
    return sum(b - a >= MIN_TOKENS for a, b in zip(edges, edges[1:])) >= 2


@contextmanager
def one_blas_thread() -> Iterator[None]:
    """MKL at one thread while the lanes run (each lane's matmuls on its own core), its count restored after."""
    handle = blas._state.handle if blas._state.kind == "mkl" else None
    if handle is None or blas._state.layer == "sequential":
        yield
        return
    before = handle.MKL_Get_Max_Threads()
    handle.MKL_Set_Num_Threads(ctypes.c_int(1))
    try:
        yield
    finally:
        handle.MKL_Set_Num_Threads(ctypes.c_int(before))


class _Aborted(Exception):
    """The other lane failed: this one stops (the other lane's error is raised)."""


def run(model, tokens: list[int], cache: ModelCache, edges: list[int],
        after: Callable[[int, mx.array, list], None]) -> None:
    """Prefill tokens[edges[0]:edges[-1]] chunk by chunk (chunk k = tokens[edges[k]:edges[k+1]]) into `cache` on two
    lanes. `after(k, h, out)` runs on chunk k's lane once its backbone is done (h: `model.model`'s output
    [1, S, H]), in chunk order (chunk k's after chunk k-1's): it may write caches past the backbone's (the MTP
    head's) and appends what to evaluate to `out`, which is evaluated before chunk k+1's `after` starts."""
    backbone, layers = model.model, len(model.model.layers)
    chunks = list(zip(edges, edges[1:]))
    # done[k][l]: chunk k finished layer l (l == layers: its `after`)
    done = [[threading.Event() for _ in range(layers + 1)] for _ in chunks]
    failed: list[BaseException] = []

    def wait(event: threading.Event) -> None:
        while not event.wait(0.05):
            if failed:
                raise _Aborted

    def chunk(k: int) -> None:
        start, stop = chunks[k]
        h, ctx = backbone.begin(mx.array(tokens[start:stop])[None])  # [1, S, H]
        for i in range(layers):
            if k:
                wait(done[k - 1][i])
            h = backbone.run_layer(i, h, ctx, cache.backbone[i])
            mx.eval(h, *cache.backbone[i].state)
            done[k][i].set()
        if k:
            wait(done[k - 1][layers])
        out: list = []
        after(k, backbone.end(h), out)
        mx.eval(*out)
        done[k][layers].set()

    def lane(ks: list[int], own_stream: bool) -> None:
        try:
            if own_stream:  # a stream made in this thread: MLX's streams belong to the thread that made them
                with mx.stream(mx.new_stream(mx.cpu)):
                    for k in ks:
                        chunk(k)
            else:
                for k in ks:
                    chunk(k)
        except _Aborted:
            pass
        except BaseException as e:  # noqa: BLE001 (raised again on the calling thread)
            failed.append(e)

    # Chunks alternate between the lanes; a short chunk (compiled steps, which compile once per thread) stays on the
    # calling thread's lane. Each lane takes its chunks in order, so neither waits on work queued behind its own.
    ks = [[], []]
    for k, (a, b) in enumerate(chunks):
        ks[k % 2 if b - a >= MIN_TOKENS else 0].append(k)
    with one_blas_thread():
        other = threading.Thread(target=lane, args=(ks[1], True), name="hetero-prefill-lane", daemon=True)
        other.start()
        lane(ks[0], False)
        other.join()
    if failed:
        raise failed[0]
