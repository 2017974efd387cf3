"""`--ane-fraction auto` never loses to GPU-only (hetero/pipeline/auto.py): a split no faster by the planner's
pricing of this machine is never tried, and a verified split is kept only when its TTFT is measured to beat GPU-only's
beyond the noise. The TTFT check's statistics run on scripted prefill times (the real `ratio_of` on a scripted
clock); its decision runs through the real `auto_fraction` on the tiny model, its timing injected; one real timing
runs the real prefills."""

from __future__ import annotations

import numpy as np
import pytest

import hetero
from hetero.host.confidence import Estimate
from hetero.host.settings import save_device_profile, tuning
from hetero.pipeline.auto import auto_fraction, ratio_of, ttft_ratio
from tiny_checkpoint import write_tiny_model

# the tiny model's lanes measured as separate devices (a Mac's model): the planner recommends a split
DEVICES = {"name": "this-machine", "chip": "test", "source": "test", "measured": True, "memory_bandwidth_gbs": 10.0,
           "gpu_fp32_tflops": 0.01, "ane_fp16_tflops": 0.01, "ane_bandwidth_gbs": None, "ram_gb": 8,
           "gpu_efficiency": 1.0, "ane_efficiency": 1.0, "ane_process_weight_limit_gb": None}
# the same rates on the default CPU path: GPU-only on the two-lane wavefront, the ANE lane on one of its cores
SHARED = dict(DEVICES, prefill_lanes=2, lane_threads=1, cpu_cores=2, ane_on_cpu=True, lane_contention=0.9)


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    return hetero.load(write_tiny_model(tmp_path_factory.mktemp("auto") / "m"))


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    return tmp_path_factory.mktemp("auto-home")  # one settings home: the split's programs exported once


@pytest.fixture
def home(exports, monkeypatch):
    """The module's home with no settings yet (no profile, no saved decision); its exported programs kept."""
    monkeypatch.setenv("HETERO_HOME", str(exports))
    (exports / "settings.json").unlink(missing_ok=True)
    return exports


class Clock:
    """Prefill callables on a scripted clock: each call advances it by its side's next time."""

    def __init__(self, base_s, other_s):
        self.now, self.times = 0.0, {"base": iter(base_s), "other": iter(other_s)}

    def side(self, name):
        def run():
            self.now += next(self.times[name])
        return run


@pytest.mark.parametrize("other, below", [(0.8, True), (1.25, False)])
def test_the_ttft_ratio_is_settled_beyond_the_noise_in_alternated_pairs(other, below):
    rng = np.random.default_rng(0)
    noise = lambda: iter(1.0 + 0.1 * rng.random(200))  # noqa: E731  (10% jitter on every prefill)
    c = Clock(noise(), (other * x for x in noise()))
    e = ratio_of(c.side("base"), c.side("other"), cap_s=30.0, clock=lambda: c.now)
    assert e.n == 6 and (e.below(1.0) if below else e.above(1.0))


def test_a_ratio_inside_the_noise_runs_to_the_cap_and_is_not_a_win():
    rng = np.random.default_rng(1)
    c = Clock(iter(1.0 + 0.5 * rng.random(200)), iter(1.0 + 0.5 * rng.random(200)))
    e = ratio_of(c.side("base"), c.side("other"), cap_s=20.0, clock=lambda: c.now)
    assert not e.below(1.0) and not e.above(1.0) and c.now >= 20.0


def test_no_split_is_tried_where_none_is_predicted_faster(engine, home):
    """The default CPU path: GPU-only runs on both cores, so no fraction is predicted to win; auto means GPU-only,
    says so once, and neither verifies nor times a split."""
    save_device_profile(SHARED)
    lines = []
    run = auto_fraction(engine, 64, report=lines.append, time_ttft=lambda *a: pytest.fail("timed a split"))
    assert run.fraction == 0 and run.effective_fraction == 0
    assert len(lines) == 1 and "GPU-only: no split is predicted faster" in lines[0] and "2 CPU lanes" in lines[0]


def test_a_verified_split_that_loses_its_ttft_check_means_gpu_only_said_once_and_saved(engine, home):
    save_device_profile(DEVICES)
    lines, timed = [], []

    def loses(run, ids):
        timed.append(len(ids))
        return Estimate.of([1.1, 1.2, 1.15, 1.3, 1.12, 1.18])

    run = auto_fraction(engine, 64, report=lines.append, time_ttft=loses)
    assert run.fraction == 0 and len(timed) == 1 and timed[0] in range(4 * 64, 8 * 64 + 1, 64)  # 4-8 chunks
    assert len(lines) == 1 and "GPU-only: the split at" in lines[0] and "1.17x (95% interval 1.10-1.30x" in lines[0]
    saved = tuning(f"{engine.identity}#auto-split")
    assert saved["ratio"]["median"] == pytest.approx(1.165) and saved["tokens"] == timed[0]
    lines.clear()
    again = auto_fraction(engine, 64, report=lines.append, time_ttft=lambda *a: pytest.fail("timed again"))
    assert again.fraction == 0 and "(saved earlier)" in lines[0]


def test_a_split_that_wins_beyond_the_noise_is_kept(engine, home):
    save_device_profile(DEVICES)
    lines = []
    run = auto_fraction(engine, 64, report=lines.append, time_ttft=lambda run, ids: Estimate.of([0.8, 0.82] * 3))
    assert run.fraction > 0 and len(lines) == 1 and "verified" in lines[0] and "0.81x" in lines[0]


def test_too_few_pairs_for_an_interval_is_not_a_win(engine, home):
    save_device_profile(DEVICES)
    lines = []
    run = auto_fraction(engine, 64, report=lines.append, time_ttft=lambda run, ids: Estimate.of([0.5, 0.5]))
    assert run.fraction == 0 and "too few for an interval" in lines[0]


def test_the_real_timing_runs_both_prefills(engine, home):
    """One real TTFT check on the tiny model (whatever it measures: both sides ran, in pairs)."""
    save_device_profile(DEVICES)
    from hetero.pipeline import configure

    run = configure(engine, 0.5, 64)
    e = ttft_ratio(run, engine.tokenizer.encode("def add(a, b):\n    return a + b\n" * 20)[:256], cap_s=2.0)
    assert e.n >= 6 and e.median > 0 and run.last is None  # the split's own runs, not a request's


def test_auto_meaning_gpu_only_prefills_on_the_engines_own_path(engine, home):
    """A run whose plan gives the ANE nothing hands the whole prompt back to the engine (its GPU-only prefill, the
    CPU wavefront included), never to a one-lane job graph; the tokens are the GPU-only run's."""
    save_device_profile(SHARED)
    run = auto_fraction(engine, 64, report=lambda line: None)
    ids = engine.tokenizer.encode("def add(a, b):\n    return a + b\n" * 8)
    assert run.prefill(ids)[1] == 0 and run.last is None
    prompt = "def add(a, b):\n    return a + b\n" * 8
    assert engine.generate(prompt, max_tokens=6, split=run, mtp=False).tokens == engine.generate(
        prompt, max_tokens=6, mtp=False).tokens
