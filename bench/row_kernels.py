"""What a few-row product can cost on this machine: every weight matrix of the large bench model times 1, 2 and 4
rows, through each path a batched decode step could take, on 1 and 2 cores.

    python bench/row_kernels.py                      # JSON under bench/results/row_kernels.json
    python bench/row_kernels.py --rounds 1 --calls 1 --threads 1   # a smoke run
    python bench/row_kernels.py --part step          # only the whole step's bound

A batched round of 4 requests multiplies 4 rows by each weight. Memory-bound, that should cost little more than one
row: the weights stream once either way. MLX's CPU backend hands it to sgemm, where MKL's 4-row kernel costs about
2x one row (hetero/models/linear.py). The paths timed, each over the large model's weights (bench/checkpoints.py's
LARGE, random fp32 [out, in], the tied lm_head included; 1.1 GB, so every pass streams from memory):

  mlx_plain           x @ W.T in MLX (sgemm, M = rows): what MLX does;
  mlx_transposed      (W @ x.T).T in MLX (M = output channels): hetero.models.linear's form for 4-48 rows;
  mlx_two_streams     the rows split in halves over two MLX CPU streams (`mx.new_stream(mx.cpu)`), MKL at one
                      thread so each stream's products run on its own core (2 cores only);
  mkl_sgemm           cblas_sgemm on numpy buffers through ctypes (libmkl_rt, the library under MLX), M = rows;
  mkl_sgemm_t         the same, the transposed form (M = output channels);
  mkl_sgemv           cblas_sgemv once per row;
  mkl_packed          cblas_sgemm_pack (the weight packed once, outside the timing) then cblas_sgemm_compute;
  openblas_sgemm      numpy's bundled OpenBLAS (scipy-openblas), cblas_sgemm through ctypes, M = rows;
  openblas_sgemm_t    the same, the transposed form;
  c_kernel            bench/row_kernel.c, compiled here with gcc (AVX2 + FMA): each weight read once for all rows,
                      2 channels x up to 4 rows register-blocked, the matrices split by output channel over pthreads;
                      one parallel section for the whole model: the bound of a custom few-row kernel;
  c_kernel_barrier    the same with the threads meeting after every matrix, as separate ops would.

Threads: MKL's count is set at run time (MKL_Set_Num_Threads), OpenBLAS's through its own setter, the C kernel
takes its own. Each path runs its calls back to back, and the script sleeps between paths so that the spinning
workers of one BLAS (Intel OpenMP waits 200 ms) do not steal a core from the next. Reported per path and thread
count: median ms of a pass for each row count, its ratio to the same path's one row, and to MLX's one row at that
thread count (what a decode step pays now for one request); the row counts alternate call by call and each ratio
is the median over rounds of that round's ratio. The machine is shared: figures are indicative.

--part step (in `all` too) times the batch stepper's rounds on the large checkpoint with 1 and 4 rows, and in the
same process the products in the step's own form and through the C kernel: the step with the kernel in place of
the products (step - products + kernel) is the custom-kernel design's bound for 4 concurrent requests.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from hetero import blas  # noqa: E402  (first: it puts MKL under MLX)
from hetero.host.blas import reexec_with_fast_blas  # noqa: E402
from hetero.host.environment import environment

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402

from bench.batched import large_weights  # noqa: E402
from hetero.cli.measure import median_seconds  # noqa: E402

ROW_MAJOR, NO_TRANS, TRANS, PACKED, B_MATRIX, A_MATRIX = 101, 111, 112, 151, 162, 161  # cblas / mkl_cblas.h
C_SOURCE = Path(__file__).with_name("row_kernel.c")
F32P = ctypes.POINTER(ctypes.c_float)


def ptr(a: np.ndarray) -> int:
    return a.ctypes.data


def mkl() -> ctypes.CDLL:
    """The libmkl_rt that hetero.host.blas put under MLX (its functions typed here)."""
    lib = blas._state.handle
    if lib is None or blas._state.kind != "mkl":
        sys.exit("this bench needs MKL under MLX (x86-64 Linux with the mkl wheel)")
    i, f, p = ctypes.c_int, ctypes.c_float, ctypes.c_void_p
    lib.cblas_sgemm.argtypes = [i, i, i, i, i, i, f, p, i, p, i, f, p, i]
    lib.cblas_sgemv.argtypes = [i, i, i, i, f, p, i, p, i, f, p, i]
    lib.cblas_sgemm_pack_get_size.argtypes = [i, i, i, i]
    lib.cblas_sgemm_pack_get_size.restype = ctypes.c_size_t
    lib.cblas_sgemm_pack.argtypes = [i, i, i, i, i, i, f, p, i, p]
    lib.cblas_sgemm_compute.argtypes = [i, i, i, i, i, i, p, i, p, i, f, p, i]
    return lib


def openblas() -> ctypes.CDLL:
    """numpy's bundled scipy-openblas (64-bit integers, `scipy_` prefixed symbols)."""
    libs = sorted((Path(np.__file__).parents[1] / "numpy.libs").glob("libscipy_openblas*.so"))
    if not libs:
        sys.exit("numpy does not bundle scipy-openblas here")
    lib = ctypes.CDLL(str(libs[0]))
    i, q, f, p = ctypes.c_int, ctypes.c_int64, ctypes.c_float, ctypes.c_void_p
    lib.scipy_cblas_sgemm64_.argtypes = [i, i, i, q, q, q, f, p, q, p, q, f, p, q]
    return lib


def c_kernel(workdir: Path) -> ctypes.CDLL:
    so = workdir / "row_kernel.so"
    subprocess.run(["gcc", "-O3", "-mavx2", "-mfma", "-shared", "-fPIC", "-pthread", str(C_SOURCE), "-o", str(so)],
                   check=True)
    lib = ctypes.CDLL(str(so))
    lib.rows_product.argtypes = [ctypes.c_int] + [ctypes.c_void_p] * 5 + [ctypes.c_int] * 3
    return lib


class Paths:
    """Every path's pass over the weights, as `name -> (rows, threads) -> fn` (None where a path does not apply)."""

    def __init__(self, weights: list[mx.array], workdir: Path):
        self.mx_w = weights
        self.np_w = [np.array(w) for w in weights]  # [out, in] fp32, C-contiguous
        self.mkl, self.oblas, self.ck = mkl(), openblas(), c_kernel(workdir)
        self.packed: dict[int, list[np.ndarray]] = {}  # rows -> packed weights (1.1 GB each; cleared per path)
        self.streams = (mx.new_stream(mx.cpu), mx.new_stream(mx.cpu))

    def inputs(self, rows: int) -> tuple[list[np.ndarray], list[np.ndarray]]:
        rng = np.random.default_rng(rows)
        xs = {k: rng.standard_normal((rows, k), dtype=np.float32) for k in {w.shape[1] for w in self.np_w}}
        return [xs[w.shape[1]] for w in self.np_w], [np.empty((rows, w.shape[0]), np.float32) for w in self.np_w]

    def build(self, name: str, rows: int, threads: int):
        x, y = self.inputs(rows)
        w = self.np_w
        if name.startswith("mlx"):
            mxx = [mx.array(a) for a in x]
            mx.eval(mxx)
            if name == "mlx_plain":
                return lambda: evaluated([a @ b.T for a, b in zip(mxx, self.mx_w)])
            if name == "mlx_transposed":
                return lambda: evaluated([(b @ a.T).T for a, b in zip(mxx, self.mx_w)])
            if threads != 2 or rows % 2:
                return None
            half = rows // 2

            def two_streams():
                outs = []
                for s, part in zip(self.streams, (slice(0, half), slice(half, rows))):
                    with mx.stream(s):
                        outs += [a[part] @ b.T for a, b in zip(mxx, self.mx_w)]
                mx.eval(outs)
                return [mx.concatenate([a, b]) for a, b in zip(outs[:len(mxx)], outs[len(mxx):])]
            return two_streams
        lib, ob = self.mkl, self.oblas
        gemm = lib.cblas_sgemm if name.startswith("mkl") else ob.scipy_cblas_sgemm64_
        if name in ("mkl_sgemm", "openblas_sgemm"):
            return lambda: then(y, [gemm_nt(gemm, a, b, c) for a, b, c in zip(x, w, y)])
        if name in ("mkl_sgemm_t", "openblas_sgemm_t"):
            yt = [np.empty((b.shape[0], rows), np.float32) for b in w]  # [out, rows]
            return lambda: then([c.T for c in yt], [gemm_nt(gemm, b, a, c) for a, b, c in zip(x, w, yt)])
        if name == "mkl_sgemv":
            return lambda: then(y, [lib.cblas_sgemv(ROW_MAJOR, NO_TRANS, *b.shape, 1.0, ptr(b), b.shape[1],
                                                    ptr(a[r]), 1, 0.0, ptr(c[r]), 1)
                                    for a, b, c in zip(x, w, y) for r in range(rows)])
        if name == "mkl_packed":
            if rows not in self.packed:  # B = w.T packed once, as a loader would
                bufs = []
                for b in w:
                    buf = np.empty(lib.cblas_sgemm_pack_get_size(B_MATRIX, rows, b.shape[0], b.shape[1]), np.uint8)
                    lib.cblas_sgemm_pack(ROW_MAJOR, B_MATRIX, TRANS, rows, b.shape[0], b.shape[1], 1.0, ptr(b),
                                         b.shape[1], ptr(buf))
                    bufs.append(buf)
                self.packed[rows] = bufs
            bufs = self.packed[rows]
            return lambda: then(y, [lib.cblas_sgemm_compute(ROW_MAJOR, NO_TRANS, PACKED, rows, *b.shape, ptr(a),
                                                            b.shape[1], ptr(p), b.shape[1], 0.0, ptr(c), b.shape[0])
                                    for a, b, c, p in zip(x, w, y, bufs)])
        if name.startswith("c_kernel"):
            arr = lambda items: (ctypes.c_void_p * len(items))(*items)  # noqa: E731
            ints = lambda items: (ctypes.c_int * len(items))(*items)  # noqa: E731
            args = (len(w), arr([ptr(b) for b in w]), arr([ptr(a) for a in x]), arr([ptr(c) for c in y]),
                    ints([b.shape[0] for b in w]), ints([b.shape[1] for b in w]))
            barrier = int(name == "c_kernel_barrier")
            keep = (w, x)  # the buffers behind the pointers live as long as the call

            def kernel():
                if self.ck.rows_product(*args, rows, threads, barrier) != 0 or not keep:
                    raise RuntimeError("row_kernel.c refused the call")
                return y
            return kernel
        raise ValueError(name)

    def set_threads(self, name: str, threads: int) -> None:
        # the two-stream path runs one MKL thread per stream: its two cores are the streams'
        self.mkl.MKL_Set_Num_Threads(1 if name == "mlx_two_streams" else threads)
        self.oblas.scipy_openblas_set_num_threads64_(threads)


def gemm_nt(gemm, a: np.ndarray, b: np.ndarray, c: np.ndarray) -> None:
    """c [m, n] = a [m, k] @ b [n, k].T through a row-major cblas_sgemm (MKL's or OpenBLAS's)."""
    (m, k), n = a.shape, b.shape[0]
    gemm(ROW_MAJOR, NO_TRANS, TRANS, m, n, k, 1.0, ptr(a), k, ptr(b), k, 0.0, ptr(c), n)


def then(out, _calls):
    """`out`, once the calls that fill it (evaluated before this) are done."""
    return out


def evaluated(outs: list[mx.array]) -> list[mx.array]:
    mx.eval(outs)
    return outs


def errors(paths: Paths, rows: int) -> dict:
    """Each path's largest relative error at `rows` rows against float64 numpy, over every matrix (on 2 threads
    where a path runs on 2 only): a path that computes something else has no speed to report."""
    x, _ = paths.inputs(rows)
    want = [a.astype(np.float64) @ b.astype(np.float64).T for a, b in zip(x, paths.np_w)]
    scale = max(float(np.abs(w).max()) for w in want)
    out = {}
    for name in PATHS:
        threads = 2 if name == "mlx_two_streams" else 1
        paths.set_threads(name, threads)
        got = paths.build(name, rows, threads)()
        out[name] = max(float(np.abs(np.array(g) - w).max()) for g, w in zip(got, want)) / scale
    return out


PATHS = ["mlx_plain", "mlx_transposed", "mlx_two_streams", "mkl_sgemm", "mkl_sgemm_t", "mkl_sgemv", "mkl_packed",
         "openblas_sgemm", "openblas_sgemm_t", "c_kernel", "c_kernel_barrier"]


def summary(times: dict) -> dict:
    """Per thread count and path, per row count: median ms over every call, and the median over rounds of each
    round's ratio to the same path's one row and to MLX's one row (a loaded machine slows whole rounds, so the
    ratios within a round are the steadier figure)."""
    result: dict = {}
    med = statistics.median
    for (threads, name, rows), rounds in sorted(times.items()):
        own = times.get((threads, name, 1))
        mlx = times.get((threads, "mlx_plain", 1))
        row = {"ms": med([t for r in rounds for t in r]) * 1e3,
               "vs_own_one_row": med([med(r) / med(o) for r, o in zip(rounds, own)]) if own else None,
               "vs_mlx_one_row": med([med(r) / med(o) for r, o in zip(rounds, mlx)]) if mlx else None}
        result.setdefault(f"{threads}_threads", {}).setdefault(name, {})[rows] = row
    for threads, by_path in result.items():
        for name, by_rows in by_path.items():
            print(f"{threads:>9} {name:<17} " + "  ".join(
                f"{rows}: {row['ms']:6.1f} ms, {row['vs_own_one_row'] or 0:.2f}x own 1, "
                f"{row['vs_mlx_one_row'] or 0:.2f}x mlx 1" for rows, row in sorted(by_rows.items())), flush=True)
    return result


def step_part(paths: Paths, args: argparse.Namespace) -> dict:
    """The whole decode step against its products: the batch stepper (hetero.decode.stepper.Batch) over 1 and 4
    greedy rows of the large checkpoint, its rounds timed, and in the same process the same weights' products in
    the step's own form (hetero.models.linear.project) and through the C kernel, 1 and 4 rows, alternated. The
    step with the C kernel in place of the products is the custom-kernel design's bound: step - products + kernel.
    """
    from bench.checkpoints import checkpoint
    from hetero.decode.sampling import Sampler, SamplingParams
    from hetero.decode.stepper import Batch
    from hetero.engine import load
    from hetero.models.linear import project

    engine = load(str(checkpoint("large", Path(args.workdir))), dtype=mx.float32)
    prompts = [list(range(10 + 7 * i, 138 + 7 * i)) for i in range(4)]

    def rounds(n: int) -> float:
        """Median seconds of a steady round (the first two left out: they compile and fill the queue)."""
        batch = Batch(engine.model, max_batch=n)
        for p in prompts[:n]:
            batch.join(p, Sampler(SamplingParams()), args.step_tokens, set(), 0)
        times, t = [], time.perf_counter()
        while batch.rows:
            batch.step()
            times.append(time.perf_counter() - t)
            t = time.perf_counter()
        return statistics.median(times[2:])

    def products(n: int):
        xs = [mx.random.normal((n, w.shape[1])) for w in paths.mx_w]
        mx.eval(xs)
        return lambda: evaluated([project(x, w) for x, w in zip(xs, paths.mx_w)])

    kernel = {n: paths.build("c_kernel", n, 2) for n in (1, 4)}
    mlx = {n: products(n) for n in (1, 4)}
    times: dict = {}
    for _ in range(args.rounds):
        for n in (1, 4):
            paths.set_threads("mlx_plain", 2)
            times.setdefault(("step", n), []).append(rounds(n))
            times.setdefault(("products", n), []).append(median_seconds(mlx[n], args.calls))
            time.sleep(0.3)  # Intel OpenMP's spinning workers sleep before the kernel's threads run
            times.setdefault(("c_kernel", n), []).append(median_seconds(kernel[n], args.calls))
    ms = {f"{what}_{n}_ms": statistics.median(ts) * 1e3 for (what, n), ts in times.items()}
    for n in (1, 4):
        ms[f"design_step_{n}_ms"] = ms[f"step_{n}_ms"] - ms[f"products_{n}_ms"] + ms[f"c_kernel_{n}_ms"]
    out = {**ms,
           "step_4_vs_1": ms["step_4_ms"] / ms["step_1_ms"],
           "aggregate_4_vs_1_now": 4 * ms["step_1_ms"] / ms["step_4_ms"],
           "design_aggregate_4_vs_1": 4 * ms["design_step_1_ms"] / ms["design_step_4_ms"],
           "design_aggregate_4_vs_one_row_now": 4 * ms["step_1_ms"] / ms["design_step_4_ms"]}
    print("step: " + ", ".join(f"{k} {v:.2f}" for k, v in out.items()), flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--paths", nargs="+", choices=PATHS, default=PATHS)
    ap.add_argument("--rows", nargs="+", type=int, default=[1, 2, 4])
    ap.add_argument("--threads", nargs="+", type=int, default=[1, 2])
    ap.add_argument("--rounds", type=int, default=3, help="rounds over every path, alternated")
    ap.add_argument("--calls", type=int, default=3, help="timed passes per path, row count and round")
    ap.add_argument("--part", choices=["products", "step", "all"], default="all",
                    help="products: every path's pass over the weights; step: the whole decode step's bound")
    ap.add_argument("--step-tokens", type=int, default=24, help="tokens each row decodes in the step part")
    ap.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(), "hetero-bench"))
    ap.add_argument("--out", default="bench/results/row_kernels.json")
    args = ap.parse_args()
    if 1 not in args.rows:
        ap.error("--rows must include 1 (every ratio is to one row)")
    reexec_with_fast_blas()
    env = environment()
    with tempfile.TemporaryDirectory() as tmp:
        paths = Paths(large_weights(), Path(tmp))
        error = errors(paths, max(args.rows))
        wrong = {name: e for name, e in error.items() if e > 1e-4}
        if wrong:
            sys.exit(f"FAILED: paths that compute something else: {wrong}")
        times: dict = {}  # (threads, path, rows) -> [per-round lists of seconds]
        for _ in range(args.rounds if args.part != "step" else 0):
            for threads in args.threads:
                for name in args.paths:
                    paths.set_threads(name, threads)
                    time.sleep(0.3)  # the last path's spinning BLAS workers go to sleep
                    fns = {rows: fn for rows in args.rows if (fn := paths.build(name, rows, threads)) is not None}
                    for fn in fns.values():
                        fn()  # warm-up
                    block: dict = {rows: [] for rows in fns}
                    for _ in range(args.calls):  # row counts alternate call by call: their ratio is paired
                        for rows, fn in fns.items():
                            t = time.perf_counter()
                            fn()
                            block[rows].append(time.perf_counter() - t)
                    paths.packed.clear()
                    for rows, ts in block.items():
                        times.setdefault((threads, name, rows), []).append(ts)
        result = summary(times)
        if args.part != "products":
            result["step"] = step_part(paths, args)
    gb = sum(w.nbytes for w in paths.np_w) / 1e9
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"environment": env, "args": vars(args), "weight_gb": gb, "relative_error": error,
                               "note": "a machine shared with other jobs: indicative; ratios are medians over rounds "
                                       "of each round's ratio", **result}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
