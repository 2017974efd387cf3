"""The two-lane runtime: split prefill against the GPU-only run (logits, greedy continuation, K/V in the cache,
GDN state), scheduling with simulated devices, the Chrome trace, `hetero run --ane-fraction/--verify/--trace`,
and the memory governor's refusal of a prompt beyond its window."""

from __future__ import annotations

import json
import threading
import time
import types

import mlx.core as mx
import numpy as np
import pytest

from hetero.checkpoint.loader import load_model
from hetero.checkpoint.source import BUNDLED_MODEL
from hetero.cli.main import main
from hetero.decode.options import DecodeOptions
from hetero.decode.prefill import prefill
from hetero.errors import HeteroError
from hetero.pipeline import Job, Lane, Trace, ane_backend, configure, run_jobs, verify
from hetero.planner import OFFLOADABLE
from test_coreml_graphs import TINY, save_checkpoint, tiny_model
from tiny_checkpoint import write_tiny_model

# TINY with wider value heads: z = 4 x 32 = 128 rows of 328, so a fraction can take part of z (not all or none).
PIPE = dict(TINY, linear_value_head_dim=32)


@pytest.fixture(scope="module")
def tiny_engine(tmp_path_factory):
    path = save_checkpoint(tiny_model(3, PIPE), tmp_path_factory.mktemp("pipe") / "ckpt", PIPE)
    model, path, config = load_model(path, dtype=mx.float32)
    return types.SimpleNamespace(model=model, config=config, path=path, name=str(path), identity="pipe-tiny@test")


@pytest.fixture(scope="module")
def bundled_engine():
    assert (BUNDLED_MODEL / "config.json").is_file(), "hetero/bundled/ is missing: the package ships it"
    import hetero

    return hetero.load()


def _prompt(n: int, seed: int = 0) -> list[int]:
    return np.random.default_rng(seed).integers(0, TINY["vocab_size"], n).tolist()


def _split_vs_gpu(engine, fraction: float, ids: list[int], chunk: int = 64):
    """(split cache, GPU-only cache, verify block) for one prompt."""
    run = configure(engine, fraction, chunk)
    model = engine.model
    split_cache, gpu_cache = model.make_cache(), model.make_cache()
    run.splitter(len(ids)).run(ids, split_cache, logits=False)
    prefill(model, ids, gpu_cache, chunk)
    return run, split_cache, gpu_cache, verify(run, ids, n_tokens=32)


@pytest.mark.parametrize("fraction", [0.25, 1.0])
def test_split_prefill_matches_gpu_only(tiny_engine, fraction):
    """150 tokens = 3 chunks (the last padded): logits within tolerance, 32 greedy tokens identical, K/V of the
    ANE's heads within fp16 rounding of the GPU-only cache, the GPU's heads equal, GDN state untouched by z."""
    ids = _prompt(150)
    run, split, gpu, check = _split_vs_gpu(tiny_engine, fraction, ids)
    assert check["match"], check
    assert check["greedy_match_tokens"] == check["greedy_compared_tokens"] == 32
    progs = run.splitter(len(ids)).programs
    for i, layer in enumerate(tiny_engine.model.layers):
        if layer.is_linear:
            continue
        k_ane = progs.share("attention", i)
        assert split[i].offset == gpu[i].offset == 150
        ks, kg = np.array(split[i].keys[:, :, :150]), np.array(gpu[i].keys[:, :, :150])  # [1, Hkv, 150, D]
        vs, vg = np.array(split[i].values[:, :, :150]), np.array(gpu[i].values[:, :, :150])
        assert 0 < k_ane
        # fp16 storage on the ANE lane (ulp 2^-10 relative), and its rounding carried through the residual
        # stream of this random (chaotic) network to both lanes' heads: within 1% of the largest entry
        tol = 4e-3 if i == 1 else 1e-2
        assert np.abs(ks - kg).max() <= tol * np.abs(kg).max()
        assert np.abs(vs - vg).max() <= tol * np.abs(vg).max()
    # Layer 0 is GDN: only z leaves, and z does not feed the recurrence, so its state is the GPU-only one.
    np.testing.assert_allclose(np.array(split[0].recurrent), np.array(gpu[0].recurrent), rtol=1e-6, atol=1e-6)


def test_gpu_shares_are_exact_slices_of_the_layer(tiny_engine):
    """The GPU's rest of an MLP plus the first channels' partial sum is the whole MLP; the GPU's attention heads
    write exactly the K/V the whole layer writes for them."""
    from hetero.models.cache import KVCache
    from hetero.pipeline import GpuAttentionRest, GpuMLPRest

    model = tiny_engine.model
    layer = model.layers[1]  # full attention
    h = mx.random.normal((1, 70, PIPE["hidden_size"]), key=mx.random.key(0))  # [1, S, hidden]
    x = layer.post_attention_layernorm(h)
    mlp = layer.mlp
    head = (nn_silu(x @ mlp.gate_proj.weight[:64].T) * (x @ mlp.up_proj.weight[:64].T)) @ mlp.down_proj.weight[:, :64].T
    np.testing.assert_allclose(np.array(GpuMLPRest(layer, np.arange(64)).partial(x) + head), np.array(mlp(x)),
                               rtol=1e-5, atol=1e-5)
    blocks = np.r_[0:32, 96:128]  # any set of channels: the rest is every other one
    idx = mx.array(blocks)
    part = (nn_silu(x @ mlp.gate_proj.weight[idx].T) * (x @ mlp.up_proj.weight[idx].T)) @ mlp.down_proj.weight[:, idx].T
    np.testing.assert_allclose(np.array(GpuMLPRest(layer, blocks).partial(x) + part), np.array(mlp(x)),
                               rtol=1e-5, atol=1e-5)
    whole = KVCache()
    layer.self_attn(layer.input_layernorm(h), whole)
    _, keys, values = GpuAttentionRest(layer, 1)(layer.input_layernorm(h), KVCache())  # [1, 1, S, D]
    np.testing.assert_allclose(np.array(keys), np.array(whole.keys[:, 1:, :70]), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(np.array(values), np.array(whole.values[:, 1:, :70]), rtol=1e-6, atol=1e-6)


def nn_silu(x: mx.array) -> mx.array:
    return x * mx.sigmoid(x)


def test_fraction_slices_each_piece_as_planned(tiny_engine):
    run = configure(tiny_engine, 0.25, 64)
    progs = run.splitter(150).programs
    assert progs.share("attention", 1) == 1  # 0.5 of 2 KV groups rounds (half up) to 1
    assert progs.share("mlp", 0) == 64  # 0.25 x 192 = 48 -> 64 channels
    assert progs.share("gdn_in_proj", 0) == 64  # 0.25 x 328 = 82 -> 64 of 128 z rows: the GPU computes the rest of z
    assert any("multiples of 64" in c for c in run.caps)


def test_the_profile_a_split_is_planned_for_caps_its_slices(tiny_engine):
    """configure plans with a real profile (this machine's, else the default chip's): only a per-process ANE
    weight limit that a profile measured shrinks the slices, and the cap says so."""
    import dataclasses

    from hetero.profiles import DEFAULT_PROFILE, load_profile

    chip = load_profile(DEFAULT_PROFILE)
    assert configure(tiny_engine, 1.0, 64, profile=chip).fraction == 1.0  # no per-process limit is documented
    limited = dataclasses.replace(chip, ane_process_weight_limit_gb=1e-4)  # 100 KB of fp16 weights
    run = configure(tiny_engine, 1.0, 64, profile=limited)
    assert 0 < run.fraction < 1.0 and any("ANE memory" in c for c in run.caps)


def test_gpu_shares_share_the_weights_memory(tiny_engine):
    """The GPU's slices of each split piece are views of the loaded weights (rows contiguous, columns strided):
    building them allocates no weight memory, which is why the governor budgets the weights once."""
    from hetero.pipeline.split import SplitPrefill

    run = configure(tiny_engine, 0.5, 64)
    programs = run.splitter(150).programs
    mx.eval(tiny_engine.model.parameters())
    before = mx.get_active_memory()
    split = SplitPrefill(tiny_engine.model, programs)
    assert split.pieces.attn_rest and split.pieces.mlp_rest and split.pieces.gdn_rest
    assert mx.get_active_memory() - before < 4096  # bookkeeping at most: no copied weight slice


def test_kinds_left_out_of_the_split_run_whole_on_the_gpu(tiny_engine):
    """A plan that offloads only the MLPs (as `recommend` does when the ANE lane runs attention too slowly)
    exports and runs MLP programs alone, and still matches the GPU-only run."""
    run = configure(tiny_engine, 0.5, 64, offload=("mlp",))
    progs = run.splitter(150).programs
    assert progs.mlp and not progs.attention and not progs.gdn_in_proj
    assert any(c.startswith("attention") and "kept on the GPU" in c for c in run.caps)
    check = verify(run, _prompt(150, seed=5), n_tokens=16)
    assert check["match"] and check["greedy_match_tokens"] == 16


def test_the_runtime_split_offloads_the_kinds_that_shorten_the_prefill_unless_told(bundled_engine):
    """`--ane-fraction F` plans like `hetero plan`: on the calibrated m3-ultra the bundled model's GDN and shared
    pieces lengthen the predicted prefill at 0.5, so its split offloads attention and the MLPs only; on the
    default chip every kind pays; `offload` given is kept as given."""
    from hetero.profiles import DEFAULT_PROFILE, load_profile

    ultra = load_profile("m3-ultra")
    run = configure(bundled_engine, 0.5, 64, profile=ultra)
    assert run.offload == ("attention", "mlp")
    every = configure(bundled_engine, 0.5, 64, profile=ultra, offload=OFFLOADABLE)
    assert run.plan.predicted["split_prefill_s"] < every.plan.predicted["split_prefill_s"]
    assert any("offloads only attention, mlp" in a for a in run.plan.assumptions)
    assert configure(bundled_engine, 0.5, 64, profile=load_profile(DEFAULT_PROFILE)).offload == OFFLOADABLE


@pytest.mark.parametrize("fraction", [0.25, 0.5, 1.0])
def test_bundled_model_split_matches_gpu_only(bundled_engine, fraction):
    text = open(__file__).read()
    ids = bundled_engine.tokenizer.encode(text)[:128]  # two chunks: the second attends the first from the cache
    _, split, gpu, check = _split_vs_gpu(bundled_engine, fraction, ids)
    assert check["match"], check
    attention = [i for i, layer in enumerate(bundled_engine.model.layers) if not layer.is_linear]
    assert attention  # the keys below are compared at all
    for i in attention:
        kg = np.array(gpu[i].keys[:, :, :128].astype(mx.float32))
        ks = np.array(split[i].keys[:, :, :128].astype(mx.float32))
        assert np.abs(ks - kg).max() <= 1e-2 * np.abs(kg).max()


# ----------------------------------------------------------------------------------------------------------
# Scheduling with simulated devices


def _sleepy_graph(chunks: int, layers: int, gpu_s: float, ane_s: float) -> list[Job]:
    """A prefill-shaped graph of sleeps: mixer(l, c) on the GPU after mlp(l-1, c) and mixer(l, c-1); mlp(l, c) on
    the ANE after mixer(l, c)."""
    jobs, state = [], {}
    for c in range(chunks):
        h = None
        for layer in range(layers):
            after = tuple(j for j in (h, state.get(layer)) if j is not None)
            mixer = Job(f"mixer {layer} @{c}", "gpu", lambda: time.sleep(gpu_s), after, (c, layer, 0))
            h = Job(f"mlp {layer} @{c}", "ane", lambda: time.sleep(ane_s), (mixer,), (c, layer, 1))
            state[layer] = mixer
            jobs += [mixer, h]
    return jobs


def test_wavefront_keeps_both_lanes_busy_across_chunks():
    """Each layer's mixer (GPU) and MLP (ANE) depend on each other within a chunk, so lock-step stages would leave
    one lane idle at every step; with chunks in flight the GPU runs the next chunk's mixers while the ANE runs
    this chunk's MLPs. Checked by events, not by measured overlaps: chunk c's first MLP and chunk c+1's first mixer
    (ready together, once chunk c's first mixer is done) meet at a barrier inside both jobs, which they pass only by
    running at the same time; a lock-step schedule never starts the mixer while the MLP runs, and times out."""
    import anyio

    chunks, layers = 6, 4
    meet = [threading.Barrier(2, timeout=60) for _ in range(chunks - 1)]  # 60 s: a hang guard only
    jobs = _sleepy_graph(chunks, layers, 0.0, 0.0)
    for j in jobs:
        chunk, layer, _ = j.rank
        if layer == 0 and j.lane == "ane" and chunk < chunks - 1:
            j.fn = meet[chunk].wait
        elif layer == 0 and j.lane == "gpu" and chunk > 0:
            j.fn = meet[chunk - 1].wait
    trace = Trace()
    anyio.run(run_jobs, jobs, Lane("GPU", 1, trace), Lane("ANE", 2, trace))
    assert not any(b.broken for b in meet) and all(b.n_waiting == 0 for b in meet)  # every pair met
    spans = {tid: [(e["ts"], e["ts"] + e["dur"], int(e["name"].split("@")[1])) for e in trace.events if e["tid"] == tid]
             for tid in (1, 2)}
    first_gpu_of = {c: min(g[0] for g in spans[1] if g[2] == c) for c in range(chunks)}
    last_ane_of = {c: max(a[1] for a in spans[2] if a[2] == c) for c in range(chunks)}
    assert all(first_gpu_of[c + 1] < last_ane_of[c] for c in range(chunks - 1))  # chunk c+1 starts before c ends


def test_jobs_run_after_their_dependencies_oldest_chunk_first():
    """Every job starts after all of its `after` jobs ended; among ready jobs of a lane the lowest rank runs first."""
    import anyio

    order: list[str] = []
    jobs = _sleepy_graph(3, 3, 0.0, 0.0)
    for j in jobs:
        j.fn = lambda j=j: order.append(j.label)
    anyio.run(run_jobs, list(reversed(jobs)), Lane("GPU", 1), Lane("ANE", 2))
    assert sorted(order) == sorted(j.label for j in jobs)
    for j in jobs:
        assert all(order.index(d.label) < order.index(j.label) for d in j.after), j.label
    gpu = [x for x in order if x.startswith("mixer")]
    assert gpu.index("mixer 0 @0") < gpu.index("mixer 0 @1") < gpu.index("mixer 0 @2")


def test_a_failing_job_stops_both_lanes_and_raises_its_error():
    import anyio

    ran = []
    boom = Job("boom", "ane", lambda: 1 / 0)
    after = Job("after", "gpu", lambda: ran.append(1), (boom,))
    with pytest.raises(ZeroDivisionError):
        anyio.run(run_jobs, [boom, after], Lane("GPU", 1), Lane("ANE", 2))
    assert not ran
    a = Job("a", "gpu", lambda: None)
    b = Job("b", "ane", lambda: None, (a,))
    a.after = (b,)
    with pytest.raises(RuntimeError, match="cycle"):
        anyio.run(run_jobs, [a, b], Lane("GPU", 1), Lane("ANE", 2))


def test_trace_file_is_chrome_trace_json_with_both_tracks(tmp_path):
    import anyio

    trace = Trace()
    anyio.run(run_jobs, _sleepy_graph(2, 2, 0.01, 0.01), Lane("GPU (MLX)", 1, trace), Lane("ANE", 2, trace))
    path = tmp_path / "trace.json"
    trace.write(path)
    data = json.loads(path.read_text())
    names = {e["tid"]: e["args"]["name"] for e in data["traceEvents"] if e["ph"] == "M" and e["name"] == "thread_name"}
    assert names == {1: "GPU (MLX)", 2: "ANE"}
    events = [e for e in data["traceEvents"] if e["ph"] == "X"]
    assert {e["tid"] for e in events} == {1, 2}
    for e in events:
        assert {"name", "ph", "ts", "dur", "pid", "tid"} <= set(e) and e["dur"] >= 0 and e["ts"] >= 0


# ----------------------------------------------------------------------------------------------------------
# The command line and the memory governor


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("tinyck") / "ckpt")


PROMPT = "def add(a, b):\n    return a + b\n" * 12


def test_run_with_split_verify_and_trace(tiny_checkpoint, tmp_path, capsys):
    trace = tmp_path / "t.json"
    argv = ["run", "--model", str(tiny_checkpoint), "--prompt", PROMPT, "--max-tokens", "8", "--ane-fraction", "0.5",
            "--prefill-chunk", "64", "--verify", "--verify-tokens", "8", "--trace", str(trace), "--json"]
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    # the backend this platform runs the ANE lane on: Core ML on a Mac, the reference executor elsewhere
    assert out["ane"]["backend"] == ane_backend()[0] and out["ane"]["requested_fraction"] == 0.5
    assert {"gpu_busy_s", "ane_busy_s", "wall_s", "overlap"} <= set(out["pipeline"])
    assert out["pipeline"]["ane_busy_s"] > 0 and out["pipeline"]["gpu_busy_s"] > 0
    assert out["verify"]["match"] and out["verify"]["greedy_compared_tokens"] == 8
    assert out["pipeline"]["lane"] == "process" and out["pipeline"]["ipc_s"] > 0  # the ANE lane's worker process
    assert {e["tid"] for e in json.loads(trace.read_text())["traceEvents"] if e["ph"] == "X"} == {1, 2, 3}
    assert main(["run", "--model", str(tiny_checkpoint), "--prompt", PROMPT, "--max-tokens", "4", "--json"]) == 0
    plain = json.loads(capsys.readouterr().out)
    assert plain["tokens"][:4] == out["tokens"][:4]  # the split run generates what the GPU-only run does


def test_verify_mismatch_exits_3(tiny_checkpoint, capsys):
    """A zero tolerance cannot hold: fp16 on the ANE lane moves the logits a little."""
    argv = ["run", "--model", str(tiny_checkpoint), "--prompt", PROMPT, "--max-tokens", "2", "--ane-fraction", "1.0",
            "--prefill-chunk", "64", "--verify", "--verify-tol", "0", "--verify-tokens", "4"]
    assert main(argv) == 3
    assert "MISMATCH" in capsys.readouterr().err


def test_verify_and_trace_need_a_split(tiny_checkpoint, capsys):
    assert main(["run", "--model", str(tiny_checkpoint), "--prompt", "x", "--verify"]) == 1
    assert "--ane-fraction" in capsys.readouterr().err
    try:  # a usage error: argparse's own exit
        code = main(["run", "--model", str(tiny_checkpoint), "--prompt", "x", "--ane-fraction", "half"])
    except SystemExit as e:
        code = e.code
    assert code == 1 and "--ane-fraction" in capsys.readouterr().err


def test_prompt_beyond_the_governors_window_is_refused(tiny_checkpoint, capsys):
    """A memory size that leaves KV room for 1000 tokens: the window is 512 (aligned down to the 512-token chunk),
    and a 600-token prompt is refused with the reason."""
    import hetero
    from hetero.decode import wavefront
    from hetero.planner import loaded_budget

    engine = hetero.load(tiny_checkpoint)
    in_flight = wavefront.chunks_in_flight()  # the engine counts both lanes' chunks where it prefills by wavefront
    b = loaded_budget(engine.model, 100.0, in_flight=in_flight)
    fixed = sum(n for name, n in b.lines if not name.startswith(("KV cache", "unused")))
    engine.memory_gb = (fixed + 1000 * b.kv_bytes_per_token) / 0.75 / 1e9
    assert loaded_budget(engine.model, engine.memory_gb, in_flight=in_flight).context_window == 512  # aligned down
    engine.encode_prompt([5] * 100)
    with pytest.raises(HeteroError, match="memory governor's context window is 512"):
        engine.encode_prompt([5] * 600)
    gb = f"{engine.memory_gb:.9f}"
    assert main(["run", "--model", str(tiny_checkpoint), "--prompt", "x " * 700, "--memory-gb", gb]) == 1
    assert "memory governor" in capsys.readouterr().err


def test_the_governor_counts_both_wavefront_lanes_chunks(tiny_checkpoint, monkeypatch):
    """A CPU wavefront prefill holds two chunks' buffers at once: with room for 1000 KV tokens beside two chunks,
    the window is 512 and a 600-token prompt is refused; the same memory with one lane holds it."""
    import hetero
    from hetero.decode import wavefront
    from hetero.planner import loaded_budget

    engine = hetero.load(tiny_checkpoint)
    b = loaded_budget(engine.model, 100.0, in_flight=2)
    fixed = sum(n for name, n in b.lines if not name.startswith(("KV cache", "unused")))
    engine.memory_gb = (fixed + 1000 * b.kv_bytes_per_token) / 0.75 / 1e9
    monkeypatch.setattr(wavefront, "enabled", lambda: True)
    with pytest.raises(HeteroError, match="memory governor's context window is 512"):
        engine.encode_prompt([5] * 600)
    monkeypatch.setattr(wavefront, "enabled", lambda: False)
    assert len(engine.encode_prompt([5] * 600)) == 600


# ----------------------------------------------------------------------------------------------------------
# Several requests: decode rounds of one interleave with another's split prefill


def test_decode_rounds_fill_the_gpu_lane_while_the_ane_works():
    """Simulated devices: two generating requests' rounds run during a third request's prefill, alternately
    (neither starves), while the ANE lane works on the prefill's shares. By events, not durations: each ANE job but
    the last (after it the GPU lane has no prefill work left, and the lanes are done) ends only once two decode
    rounds ran after it began (the GPU lane, waiting on it, has nothing else to do), so a lane that left its idle
    time unfilled would time out."""
    import anyio

    from hetero.pipeline import DecodeQueue

    chunks, layers = 1, 8  # one chunk: the GPU lane waits for each ANE job
    done = {"a": 0, "b": 0}
    moved = threading.Condition()

    def stream(name):
        def round_() -> bool:
            with moved:
                done[name] += 1
                moved.notify_all()
            return True

        return round_

    during = []

    def ane_job(layer: int) -> None:
        if layer == layers - 1:
            return
        with moved:
            start = sum(done.values())
            assert moved.wait_for(lambda: sum(done.values()) >= start + 2, timeout=60), "no decode round ran"
            during.append(sum(done.values()) - start)

    queue = DecodeQueue([stream("a"), stream("b")])
    jobs = _sleepy_graph(chunks, layers, 0.0, 0.0)
    for j in jobs:
        if j.lane == "ane":
            j.fn = lambda layer=j.rank[1]: ane_job(layer)
    anyio.run(run_jobs, jobs, Lane("GPU", 1), Lane("ANE", 2), queue)
    assert len(during) == layers - 1 and all(n >= 2 for n in during)  # the rounds ran while the ANE worked
    assert queue.rounds >= 2 * (layers - 1) and abs(done["a"] - done["b"]) <= 1  # round-robin: fair


def test_decode_never_starves_behind_a_gpu_only_prefill():
    import anyio

    from hetero.pipeline import DecodeQueue

    count = []
    queue = DecodeQueue([lambda: count.append(1) or True], every=3)
    jobs: list[Job] = []
    for i in range(12):  # a chain of GPU jobs: always one ready, no ANE work to hide behind
        jobs.append(Job(f"j{i}", "gpu", lambda: time.sleep(0.001), tuple(jobs[-1:]), (i,)))
    anyio.run(run_jobs, jobs, Lane("GPU", 1), Lane("ANE", 2), queue)
    assert len(count) == 3  # one round after every 3 GPU jobs (after the 3rd, 6th and 9th; the 12th ends it)


def test_real_requests_interleave_and_stay_exact(tiny_checkpoint):
    """Request A decodes (MTP rounds) while request B's split prefill runs: A's tokens equal its solo run and B's
    logits match B's GPU-only prefill."""
    import hetero
    from hetero.decode.sampling import SamplingParams
    from hetero.decode.stepper import Batch
    from hetero.pipeline import DecodeQueue

    engine = hetero.load(tiny_checkpoint)
    model = engine.model
    a_ids = engine.tokenizer.encode(PROMPT)[:40]
    b_ids = engine.tokenizer.encode(PROMPT[::-1])[:150]

    def decode_a(n: int, interleave: bool) -> tuple[list[int], int]:
        batch = Batch(model, max_batch=1)
        options = DecodeOptions(n, SamplingParams(0.0, 0, 1.0, 0.0), copy=False, prefill_chunk=64)
        row = batch.join(a_ids, options, set(), 3)
        out = row.tokens

        def a_round() -> bool:
            batch.step()
            return not row.done

        if not interleave:
            while a_round():
                pass
            return out[:n], 0
        run = configure(types.SimpleNamespace(model=model, config=engine.config, path=engine.path, name=engine.name,
                                              identity=engine.identity), 1.0, 64)
        queue = DecodeQueue([a_round])
        cache = model.make_cache()
        res = run.splitter(len(b_ids)).run(b_ids, cache, decode=queue)
        rounds = queue.rounds
        while queue.pending:  # A finishes after B's prefill
            queue.run_one()
        ref, _ = prefill(model, b_ids, model.make_cache(), 64)
        a, b = np.array(res.logits[-1]), np.array(ref[-1])
        assert np.abs(a - b).max() <= 0.02 * np.abs(b).max() and int(a.argmax()) == int(b.argmax())
        return out[:n], rounds

    solo, _ = decode_a(24, interleave=False)
    mixed, rounds = decode_a(24, interleave=True)
    assert rounds > 0  # A's rounds ran during B's prefill
    assert mixed == solo


def test_auto_fraction_lowers_a_split_that_fails_verification(tiny_checkpoint, monkeypatch, tmp_path):
    """With a zero tolerance every real split fails: auto halves the fraction, says so each time, and keeps
    only a split with nothing offloaded (or none)."""
    import hetero
    from hetero.host.confidence import Estimate
    from hetero.host.settings import save_device_profile
    from hetero.pipeline import auto_fraction

    monkeypatch.setenv("HETERO_HOME", str(tmp_path))
    save_device_profile({"name": "this-machine", "chip": "test", "source": "test", "measured": True,
                         "memory_bandwidth_gbs": 10.0, "gpu_fp32_tflops": 0.01, "ane_fp16_tflops": 0.01,
                         "ane_bandwidth_gbs": None, "ram_gb": 8, "gpu_efficiency": 1.0, "ane_efficiency": 1.0,
                         "ane_process_weight_limit_gb": None})
    engine = hetero.load(tiny_checkpoint)
    lines: list[str] = []
    wins = lambda run, ids: Estimate.of([0.8] * 6)  # noqa: E731  (the TTFT check, scripted: tests/test_auto.py)
    run = auto_fraction(engine, 64, report=lines.append, tol=0.0, time_ttft=wins)
    assert any("failed verification" in line and "lowering" in line for line in lines)
    assert run.effective_fraction == 0.0
    lines.clear()
    good = auto_fraction(engine, 64, report=lines.append, time_ttft=wins)
    assert good.fraction > 0 and "verified" in lines[-1]


def test_each_chunk_runs_the_smallest_attention_bucket_that_holds_it():
    """Attention programs come per context bucket; a chunk at position p runs those with the fewest cache slots
    >= p (never a larger one: the ANE would attend over padding), and a position past every bucket is refused."""
    from hetero.coreml.graphs.attention import AttentionShape
    from hetero.pipeline import Programs

    def part(slots: int, kv: range):
        return (f"run{slots}", AttentionShape(64, 2, 1, 32, 8, 64, slots, 1e-6), kv)

    progs = Programs(64, attention={3: [part(s, range(k, k + 1)) for s in (0, 64, 192) for k in (0, 1)]})
    assert [p[0] for p in progs.attention_at(3, 0)] == ["run0", "run0"]
    assert [p[0] for p in progs.attention_at(3, 64)] == ["run64", "run64"]
    assert [p[0] for p in progs.attention_at(3, 128)] == ["run192", "run192"]
    assert progs.share("attention", 3) == 2
    with pytest.raises(HeteroError, match="largest cache has 192 slots"):
        progs.attention_at(3, 256)


def test_verify_catches_a_defective_program_at_the_default_tolerance(bundled_engine):
    """A real defect on the ANE lane fails `--verify` at its default tolerance: one layer's MLP program losing half
    its output (the honest split of the same prompt passes)."""
    ids = bundled_engine.tokenizer.encode(open(__file__).read())[:128]  # two chunks: the second reads the cache
    run = configure(bundled_engine, 1.0, 64)
    assert verify(run, ids)["match"]
    progs = run.splitter(len(ids)).programs
    layer = sorted(progs.mlp)[0]
    program, units = progs.mlp[layer][0]
    progs.mlp[layer][0] = (lambda feed, p=program: {k: v * 0.5 for k, v in p(feed).items()}, units)
    check = verify(run, ids)
    assert check["reference"] == "fp32", check
    assert not check["match"], check


def test_verify_catches_kv_heads_written_in_the_wrong_order(bundled_engine):
    """An attention program that returns its KV heads swapped leaves the chunk's own output right and the cache
    wrong: the next chunk reads the wrong heads. The logits of a short prompt hardly move (this defect passed the
    last-position check at 2%); the cache comparison fails it at the default tolerance and names the array."""
    ids = bundled_engine.tokenizer.encode(open(__file__).read())[:128]
    run = configure(bundled_engine, 1.0, 64, offload=("attention",))
    honest = verify(run, ids)
    assert honest["match"] and honest["distance"] < 0.005, honest
    progs = run.splitter(len(ids)).programs
    layer = sorted(progs.attention)[0]
    for k, (program, shape, units) in enumerate(progs.attention[layer]):
        def swapped(feed, p=program):
            out = p(feed)
            return {**out, "k_new": out["k_new"][:, ::-1], "v_new": out["v_new"][:, ::-1]}
        progs.attention[layer][k] = (swapped, shape, units)
    check = verify(run, ids)
    assert check["reference"] == "fp32", check
    assert not check["match"], check
    assert check["worst"].startswith(f"layer {layer} "), check
