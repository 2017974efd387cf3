"""Context buckets load lazily: a chunk loads the smallest bucket that holds it when it first needs it, the next one
loads in the background, a short prompt never maps a long one's functions, and the memory governor is charged for
every function a prompt loads (each at its package's whole weights, coremltools#2351)."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hetero.coreml.backends.reference_executor import ReferenceExecutor
from hetero.coreml.export import export_coreml
from hetero.coreml.graphs.attention import attention_masks, cache_inputs, rope_tables
from hetero.pipeline import load_programs
from hetero.planner import loaded_budget
from test_coreml_graphs import save_checkpoint, tiny_model

CONTEXTS = [64, 128, 256]


@pytest.fixture(scope="module")
def export(tmp_path_factory):
    """A split of a tiny checkpoint at 0.5 with three context buckets (attention as multifunction packages)."""
    out = tmp_path_factory.mktemp("lazy") / "export"
    manifest = export_coreml(save_checkpoint(tiny_model(9), out.parent / "ckpt"), out, 0.5, chunk=64,
                             contexts=CONTEXTS)
    return out, manifest


class CountingLoader:
    """The reference executor as a loader (the in-process lane's), recording every (package, function) it loads."""

    def __init__(self):
        self.loads, self.lock = [], threading.Lock()

    def __call__(self, path, function=None):
        with self.lock:
            self.loads.append((path.name, function))
        return ReferenceExecutor(path, function)


def _settle():
    """Wait for the background loads the programs started (their threads are named `warm bucket <slots>`)."""
    for t in [t for t in threading.enumerate() if t.name.startswith("warm bucket")]:
        t.join(timeout=60)


def _attention_call(run, shape, start: int) -> dict:
    rng = np.random.default_rng(start)
    kv = rng.standard_normal((2, 1, shape.kv_heads, start, shape.head_dim)).astype(np.float32)
    return run({"x": rng.standard_normal((1, shape.hidden, 1, shape.chunk)).astype(np.float32),
                **rope_tables(start, shape, 1e6), **attention_masks(start, shape), **cache_inputs(kv[0], kv[1], shape)})


def test_a_chunk_loads_the_smallest_bucket_it_needs_and_warms_the_next(export):
    out, manifest = export
    loader = CountingLoader()
    progs = load_programs(out, loader)
    eager = {(p["file"], p.get("function")) for p in manifest["programs"] if p["piece"] != "attention"}
    _settle()
    assert set(loader.loads) == eager | {(p["file"], "ctx64") for p in manifest["programs"]
                                         if p["piece"] == "attention" and p["context"] == 64}  # the first bucket
    assert progs.loaded_functions() == len(progs.attention)
    layer = sorted(progs.attention)[0]
    for start, loaded_buckets in ((0, 2), (64, 3), (128, 3)):  # each chunk's bucket, and the next one warming
        (run, shape, _), = progs.attention_at(layer, start)
        assert shape.cache_slots >= start
        _attention_call(run, shape, start)
        _settle()
        assert progs.loaded_functions() == loaded_buckets * len(progs.attention)
    assert len(loader.loads) == len(set(loader.loads))  # nothing loaded twice, however many threads asked


def test_a_short_prompt_never_loads_the_largest_bucket(export):
    out, manifest = export
    loader = CountingLoader()
    progs = load_programs(out, loader)
    for layer in progs.attention:
        (run, shape, _), = progs.attention_at(layer, 0)
        _attention_call(run, shape, 0)
    _settle()
    assert not any(f == "ctx256" for _, f in loader.loads)


@pytest.fixture(scope="module")
def programs(export):
    progs = load_programs(export[0], CountingLoader())
    _settle()
    return progs


@settings(max_examples=60, deadline=None)
@given(tokens=st.integers(1, 256))
def test_the_governor_is_charged_for_every_function_a_prompt_loads(export, programs, tokens):
    """A prompt of `tokens` is charged the up-front programs' weights plus, per attention layer, its package's whole
    weights once for every bucket its chunks reach (the bucket of each chunk start below `tokens`, and the next,
    warmed), whatever is loaded yet; the governor takes that as the ANE lane's line."""
    _, manifest = export
    attention = [p for p in manifest["programs"] if p["piece"] == "attention"]
    package = {p["file"]: p["package_weight_bytes"] for p in attention}
    starts = range(0, tokens, 64)
    reached = sorted({min(c for c in CONTEXTS if c - 64 >= s) for s in starts})
    later = [c for c in CONTEXTS if c > reached[-1]]
    reached += later[:1]
    want = sum(p["weight_bytes"] for p in manifest["programs"] if p["piece"] != "attention")
    want += sum(package[p["file"]] for p in attention if p["context"] in reached)
    assert programs.charged_bytes(tokens) == want
    assert all(p["package_weight_bytes"] == package[p["file"]] > 0 for p in attention)  # each function its whole


def test_the_governor_takes_the_charge_as_the_ane_lanes_line(export, programs):
    from hetero.checkpoint.loader import load_model

    model, _, _ = load_model(export[0].parent / "ckpt")
    charged = programs.charged_bytes(256) + (3 << 20)  # a few MiB more, as a 27B's functions would be
    budget = loaded_budget(model, memory_gb=4.0, ane_worker_bytes=charged)
    line = next(b for name, b in budget.lines if name.startswith("ANE lane"))
    assert line == charged >> 20 << 20 > 0  # whole MiB
