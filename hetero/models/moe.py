"""The sparse mixture-of-experts MLP of Qwen3.5-MoE and Qwen3-Next: router, routed experts, gated shared expert.

    probs = softmax(gate(x))                      fp32, over all experts
    top-k experts per token (ties: the lower expert index wins), weights = their probs (renormalised to sum 1
    when `norm_topk_prob`)
    y = sum_j weights_j * expert_j(x) + sigmoid(shared_expert_gate(x)) * shared_expert(x)

Each expert is a SwiGLU `down(silu(gate(x)) * up(x))`. The routed experts are stored stacked, `[experts, out, in]`
per projection, under mlx-lm's names (`switch_mlp.gate_proj.weight` ...), so mlx-community checkpoints load as they
are; per-expert checkpoints (`experts.{e}.gate_proj.weight`, HF's) are stacked at load (`hetero.checkpoint.loader`). Every
token's k experts run in one `mx.gather_mm` per projection (one matrix-vector product per (token, expert) pair,
the expert's weights picked by index), never a Python loop over experts, so a decode step compiles to one graph.

Three exact forms of the routed experts (`SwitchGLU`), picked by size:
- "pairs": one matrix-vector product per (token, expert) pair in token order; decode and verify steps.
- "sorted": the pairs ordered by expert first, `gather_mm(..., sorted_indices=True)`: runs of rows share an
  expert's weights while they are in cache. From SORT_MIN_PAIRS pairs.
- "grouped" (CPU backend only): the pairs ordered by expert and laid out in `Buckets`: experts of similar pair
  counts share a bucket `[experts, capacity, dims]`, padded to the bucket's largest count, so one `gather_mm` per
  projection multiplies each expert's tokens as a matrix (M = its token count, a real GEMM). It reads the routing on
  the host mid-graph (so never inside a compiled step): from GROUPED_MIN_ROWS pairs per expert on average and
  GROUPED_MIN_TOKENS tokens, falling back to "sorted" if the padding ever exceeded PAD_LIMIT times the pairs.
Measured on this project's 2-core x86 machine (`bench/moe_prefill.py --parts forms`, bench/results/moe_prefill.json:
MLX 0.32.4 CPU backend, MKL 2026.2 sequential, fp32; one routed-expert block, random router, top-8; the forms
alternated, the fastest of 5 runs each; time ratios, lower is faster):
    256 experts (Qwen3.5-35B-A3B: hidden 2048, expert width 512)
      tokens (pairs per expert)   64 (2)   128 (4)   512 (16)
      grouped / sorted             1.00     0.91      0.40
      buckets / one capacity       0.80     0.86      0.87
    64 experts (bench MoE: hidden 1024, expert width 256)
      tokens (pairs per expert)   128 (16)   512 (64)   1024 (128)
      grouped / sorted             0.51       0.43       0.28
      buckets / one capacity       0.93       0.97       0.96
One capacity for every expert (the largest count) ran 1.23x the pairs in rows at 64 experts x 64 rows, 1.69x at
256 x 16 and 3.5x at 256 x 2; four buckets run 1.05x, 1.10x and 1.11x. Sorting wins over pairs from a few tokens
on (0.35-0.8x at 16-256 tokens, an earlier run), grouping over sorting from about 2 pairs per expert (an A/B run of
the same code: 0.91x at 2, 0.80x at 64 experts x 8).
Metal keeps "pairs"/"sorted" (mlx-lm's choice there; its sorted kernel is not measured here).

Gate and up as one product: at load (`hetero.models.fused`, as for the dense layers' projections) each expert's
gate rows and up rows are concatenated into one stack `[experts, 2 x width, dims]` (transformers' `gate_up_proj`
order, whichever layout the checkpoint came in; a quantized stack's packed weight, scales and biases the same way,
never dequantized), `gate_proj` / `up_proj` become views of its rows under their checkpoint names, and every form
runs one `gather_mm` (or `gather_qmm`) for both instead of two. Each output channel is the same dot product as
before, so the numbers are bitwise those of the separate products (tests/test_fused_projections.py); the grouped
form's numpy SwiGLU reads the product's two halves in place (`activations.silu_mul_halves_now`). Measured on the
2-core machine while other jobs loaded it (load 5-10; indicative only, not rerun quiet alone):
- `bench/moe_prefill.py --parts fused` (the whole routed-expert block, fastest of alternated runs, two threads):
  a 512-token chunk at Qwen3.5-35B-A3B's shape 0.79x the unfused time (1,321 against 1,664 ms), at the qwen4
  bench shape (128 experts, width 128, hidden 256, top-10) even (76.0 against 76.0 ms); one- and four-token calls
  (decode, verify) 0.95-1.03x, all bitwise equal.
- one thread, CPU time (MKL_NUM_THREADS=1, `time.process_time`), qwen4 shape, 512 tokens: the gate and up
  products alone 13.95 ms fused against 14.37 ms separate (0.97x), the whole block 27.9 against 28.2 ms (0.99x);
  the qwen4 bench model's whole 4K prefill, 8 alternated rounds, median 7.03 s against 7.22 s with only the experts
  unfused (0.97x; single runs spread 6.8-8.3 s), a decode step 22.2 against 23.4 ms, the same tokens.
"""

from __future__ import annotations

import contextlib
import threading

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from hetero.models import activations as act
from hetero.models.fused import FusedProjection, products, project_inputs, run_products
from hetero.models.linear import Linear

# Which form of the routed experts runs (`SwitchGLU.form`; the measurements are in the module docstring)
SORT_MIN_PAIRS = 64  # (token, expert) pairs from which they run sorted by expert (32: even, 128: 0.6-0.9x)
GROUPED_MIN_ROWS = 2  # mean pairs per expert from which they run grouped (CPU only; 1: even, 2: 0.91-1.00x, 16: 0.40x)
GROUPED_MIN_TOKENS = 17  # the grouped form evaluates mid-graph: never for a compiled step (<= 16 tokens per sequence)
QUANTIZED_GROUPED_MIN_TOKENS = 64  # quantized experts on the CPU: grouped (dequantized) from this many tokens
PAD_LIMIT = 4  # the grouped form's padded rows may be at most this many times the pairs (else: sorted)
MAX_BUCKETS = 4  # runs of experts of similar counts in the grouped form, each padded to its own largest count


def gather_mm(a: mx.array, b: mx.array, **kwargs) -> mx.array:
    """`mx.gather_mm`, in any float dtype on any backend: MLX's CPU backend multiplies only float32 there
    ("[GatherMM::eval] Currently only supports float32"), so on the CPU a bf16 or fp16 product runs in fp32 and
    its result is rounded back, as Metal's half-precision products accumulate in fp32 and round their result."""
    if a.dtype == mx.float32 or mx.default_device() != mx.cpu:
        return mx.gather_mm(a, b, **kwargs)
    return mx.gather_mm(a.astype(mx.float32), b.astype(mx.float32), **kwargs).astype(a.dtype)


def route(logits: mx.array, k: int, normalize: bool) -> tuple[mx.array, mx.array]:
    """Router logits [..., E] -> (expert indices [..., k] uint32, weights [..., k] fp32).

    Softmax in fp32 over all experts, the k largest probabilities (equal ones: lower index first, a stable sort,
    so the choice is deterministic; torch.topk leaves the order of ties unspecified), renormalised to sum 1 when
    `normalize`. With k == E every expert is taken.
    """
    probs = mx.softmax(logits.astype(mx.float32), axis=-1, precise=True)  # [..., E]
    if k == probs.shape[-1]:
        order = mx.broadcast_to(mx.arange(k, dtype=mx.uint32), probs.shape)  # [..., E] all experts
    else:
        order = mx.argsort(-probs, axis=-1)[..., :k].astype(mx.uint32)  # [..., k]; stable: ties keep index order
    weights = mx.take_along_axis(probs, order, axis=-1)  # [..., k]
    if normalize:
        weights = weights / weights.sum(axis=-1, keepdims=True)
    return order, weights


class SwitchLinear(nn.Module):
    """The same projection of every expert, stacked: `weight` [experts, out, in]; rows pick their expert by index."""

    def __init__(self, input_dims: int, output_dims: int, num_experts: int):
        super().__init__()
        self.weight = mx.zeros((num_experts, output_dims, input_dims))

    @property
    def num_experts(self) -> int:
        return self.weight.shape[0]

    def __call__(self, x: mx.array, indices: mx.array, sorted_indices: bool = False) -> mx.array:
        """x [..., 1, in] (broadcast against indices' batch shape), indices [...] -> [..., 1, out]."""
        return gather_mm(x, self["weight"].swapaxes(-1, -2), rhs_indices=indices, sorted_indices=sorted_indices)

    def to_quantized(self, group_size: int = 64, bits: int = 4, mode: str = "affine") -> "QuantizedSwitchLinear":
        """The quantized form `nn.quantize` swaps in (same names plus `scales`/`biases`, as mlx-lm writes)."""
        q = QuantizedSwitchLinear(0, 0, 0, group_size, bits, mode)
        q.weight, q.scales, *biases = mx.quantize(self.weight, group_size, bits, mode=mode)
        q.biases = biases[0] if biases else None
        return q


class QuantizedSwitchLinear(nn.Module):
    """`SwitchLinear` with group-quantized weights (`weight` packed uint32 [E, out, in*bits/32], `scales`, `biases`)."""

    def __init__(self, input_dims: int, output_dims: int, num_experts: int, group_size: int = 64, bits: int = 4,
                 mode: str = "affine"):
        super().__init__()
        self.group_size, self.bits, self.mode = group_size, bits, mode
        self.weight = mx.zeros((num_experts, output_dims, input_dims * bits // 32), dtype=mx.uint32)
        self.scales = mx.zeros((num_experts, output_dims, max(1, input_dims // group_size)))
        self.biases = mx.zeros((num_experts, output_dims, max(1, input_dims // group_size)))
        self.freeze()

    num_experts = SwitchLinear.num_experts  # weight.shape[0]: the packed weight keeps the experts axis

    def __call__(self, x: mx.array, indices: mx.array, sorted_indices: bool = False) -> mx.array:
        """x [..., 1, in], indices [...] -> [..., 1, out]."""
        return mx.gather_qmm(
            x, self["weight"], self["scales"], self.get("biases"), rhs_indices=indices, transpose=True,
            group_size=self.group_size, bits=self.bits, mode=self.mode, sorted_indices=sorted_indices,
        )


def dequantized(proj: QuantizedSwitchLinear) -> mx.array:
    """The stacked experts' weights [E, out, in] in float."""
    return mx.dequantize(proj["weight"], proj["scales"], proj.get("biases"), proj.group_size, proj.bits, mode=proj.mode)


class SwitchGLU(nn.Module):
    """The routed experts: SwiGLU `down(silu(gate(x)) * up(x))` of each token's chosen experts.

    Three exact forms of the same products (module docstring: which is faster when):
    "pairs": one matrix-vector product per (token, expert) pair, in token order (decode, verify: a few tokens);
    "sorted": the pairs ordered by expert, `gather_mm(sorted_indices=True)`;
    "grouped": the pairs ordered by expert and padded into `[experts, capacity]` rows, so that each expert's
    tokens are one matrix-matrix product (M = its token count) inside a single `gather_mm`.
    gate_proj and up_proj run as one `gate|up` product [experts, 2 x hidden, dims] in every form once `fused.fuse`
    has fused them (at load; module docstring).
    """

    PROJECTIONS = ("gate_proj", "up_proj")
    fused: FusedProjection | None = None

    def __init__(self, dims: int, hidden: int, num_experts: int):
        super().__init__()
        self.gate_proj = SwitchLinear(dims, hidden, num_experts)
        self.up_proj = SwitchLinear(dims, hidden, num_experts)
        self.down_proj = SwitchLinear(hidden, dims, num_experts)

    def _glu(self, x: mx.array, indices: mx.array, sorted_indices: bool) -> mx.array:
        g, u = project_inputs(self, x, indices, sorted_indices)  # [..., M, hidden] each
        return self.down_proj(act.silu(g) * u, indices, sorted_indices)  # [..., M, dims]

    def form(self, tokens: int, pairs: int) -> str:
        """The form for `pairs` (token, expert) pairs from sequences of `tokens` tokens (module docstring).

        "grouped" evaluates mid-graph, so it never serves a compiled decode step: those run at most 16 tokens per
        sequence, below GROUPED_MIN_TOKENS. It is measured on the CPU backend only, where it alone is used.
        """
        if pairs < SORT_MIN_PAIRS:
            return "pairs"
        if tokens < GROUPED_MIN_TOKENS or mx.default_device() != mx.cpu:
            return "sorted"
        if isinstance(self.gate_proj, QuantizedSwitchLinear):  # grouped dequantizes every expert: worth it from here
            return "grouped" if tokens >= QUANTIZED_GROUPED_MIN_TOKENS else "sorted"
        return "grouped" if pairs >= GROUPED_MIN_ROWS * self.gate_proj.num_experts else "sorted"

    def __call__(self, x: mx.array, indices: mx.array, form: str | None = None) -> mx.array:
        """x [..., dims], indices [..., k] -> each chosen expert's output [..., k, dims].

        `form` None picks by size (`form()`); "grouped" falls back to "sorted" when routing is so uneven that
        the padding would exceed PAD_LIMIT times the pairs.
        """
        *lead, k = indices.shape
        dims = x.shape[-1]
        form = form or self.form(lead[-1] if lead else 1, indices.size)
        if form == "pairs":
            y = self._glu(x[..., None, None, :], indices, False)  # x [..., 1, 1, dims] -> [..., k, 1, dims]
            return y.squeeze(-2)  # [..., k, dims]
        flat = indices.reshape(-1)  # [P] expert of each (token, slot) pair, P = N*k
        tokens = x.reshape(-1, dims)  # [N, dims]
        if form == "grouped":
            y = self._grouped(tokens, flat, k)
            if y is not None:
                return y.reshape(*lead, k, dims)
        order = mx.argsort(flat)  # [P] pairs grouped by expert
        rows = tokens[order // k][:, None]  # [P, 1, dims] each pair's token, in expert order
        y = self._glu(rows, flat[order], True).squeeze(-2)  # [P, dims] in expert order
        return y[mx.argsort(order)].reshape(*lead, k, dims)  # back in (token, slot) order

    def _grouped(self, tokens: mx.array, flat: mx.array, k: int, max_buckets: int = MAX_BUCKETS) -> mx.array | None:
        """The "grouped" form: [P, dims] in (token, slot) order, or None when the padding would be too large.

        Reads the routing on the host (so it never runs inside `mx.compile`) and lays the pairs out as `Buckets`:
        experts of similar counts share a bucket, padded to its largest count, one `gather_mm` per projection each.
        """
        P = flat.size
        layout = Buckets.of(np.array(flat), self.gate_proj.num_experts, k, max_buckets)
        if layout.rows > PAD_LIMIT * P:
            return None
        padded = mx.concatenate([tokens, mx.zeros((1, tokens.shape[1]), dtype=tokens.dtype)])  # [N+1, dims]
        rows = padded[mx.array(layout.source)]  # [R, dims] each bucket's experts' tokens, then zero rows
        def stacked(p: nn.Module) -> mx.array:  # [E, in, out]
            if isinstance(p, QuantizedSwitchLinear):
                # MLX's CPU gather_qmm runs its own kernel (~2 GFLOP/s here): dequantized once per chunk, the grouped
                # rows are MKL sgemms (4-bit, bench MoE shape, 512 tokens: 368 ms against 2,837 ms; even near 64)
                return dequantized(p).astype(rows.dtype).swapaxes(-1, -2)
            return p["weight"].swapaxes(-1, -2)

        gate_up = [(stacked(p), offsets) for p, offsets in products(self)]  # gate|up [E, dims, 2*hid] once fused
        d = stacked(self.down_proj)  # [E, hid, dims]
        outs = []
        for start, experts, cap in layout.buckets:
            xb = rows[start : start + len(experts) * cap].reshape(len(experts), cap, -1)  # [n, cap, dims]
            ids = mx.array(experts)  # [n] each batch's expert
            # a prefill chunk's SwiGLU (grouped runs no compiled step): numpy's exp
            if len(gate_up) == 1:  # fused: [n, cap, 2*hid], gate|up
                h = act.silu_mul_halves_now(gather_mm(xb, gate_up[0][0], rhs_indices=ids))
            else:
                h = act.silu_mul_now(*run_products(gate_up, lambda w: gather_mm(xb, w, rhs_indices=ids)))
            outs.append(gather_mm(h, d, rhs_indices=ids).reshape(len(experts) * cap, -1))  # [n*cap, dims]
        y = outs[0] if len(outs) == 1 else mx.concatenate(outs)  # [R, dims]
        return y[mx.array(layout.pair_row)]  # [P, dims]


class Buckets:
    """Where the "grouped" form puts each (token, expert) pair: experts sorted by pair count and cut into at most
    MAX_BUCKETS runs (`buckets`: (first row, expert ids, capacity)), each expert's pairs padded to its run's largest
    count. The cuts minimise the padded rows (an exact dynamic programme over the sorted counts); experts with no
    pair take no row (one run, `max_buckets=1`, is one capacity for every expert).
    """

    def __init__(self, buckets: list[tuple[int, np.ndarray, int]], source: np.ndarray, pair_row: np.ndarray):
        self.buckets, self.source, self.pair_row = buckets, source, pair_row

    @property
    def rows(self) -> int:
        """Rows the products run over, padding included."""
        return len(self.source)

    @classmethod
    def of(cls, flat: np.ndarray, num_experts: int, k: int, max_buckets: int = MAX_BUCKETS) -> "Buckets":
        """The layout for `flat` [P] (the expert of each (token, slot) pair, token-major with k slots each)."""
        counts = np.bincount(flat, minlength=num_experts)  # [E]
        by_count = np.argsort(-counts, kind="stable")  # [E] experts, most pairs first
        used = by_count[counts[by_count] > 0]  # [U]
        cuts = _cuts(counts[used], max_buckets)
        order = np.argsort(flat, kind="stable")  # [P] pairs grouped by expert, then in token order
        rank = np.arange(flat.size) - (np.cumsum(counts) - counts)[flat[order]]  # [P] place within its expert
        first_row = np.zeros(num_experts, dtype=np.int64)  # [E] row of each expert's first pair
        buckets, start = [], 0
        for a, b in zip(cuts, cuts[1:]):
            experts, cap = used[a:b], int(counts[used[a]])
            first_row[experts] = start + cap * np.arange(b - a)
            buckets.append((start, experts.astype(np.uint32), cap))
            start += (b - a) * cap
        row = first_row[flat[order]] + rank  # [P] the row of each sorted pair
        source = np.full(start, flat.size // k, dtype=np.int32)  # [R] padding reads the zero row
        source[row] = order // k
        pair_row = np.empty(flat.size, dtype=np.int32)
        pair_row[order] = row
        return cls(buckets, source, pair_row)


def _cuts(counts: np.ndarray, max_buckets: int) -> list[int]:
    """Boundaries [0, ..., U] of at most `max_buckets` runs of `counts` (sorted descending), each run padded to its
    first count, with the fewest padded rows: best[b][j] = min_i best[b-1][i] + (j - i) * counts[i]."""
    n = len(counts)
    if n == 0:
        return [0]
    idx = np.arange(n + 1)
    span = (idx[None, :] - idx[:n, None]) * counts[:, None].astype(np.int64)  # [i, j] rows of run [i, j)
    span = np.where(idx[None, :] > idx[:n, None], span, np.iinfo(np.int64).max // 4)  # only j > i
    best = span[0].copy()  # [j] the fewest rows for [0, j) in one run
    best[0] = 0
    back = []  # per extra run: the start of the last run for each j
    for _ in range(1, max_buckets):
        total = best[:n, None] + span  # [i, j]: [0, i) in the runs so far, then [i, j); i == 0: one run
        choice = total.argmin(axis=0)  # [j]
        best = total[choice, idx]
        best[0] = 0
        back.append(choice)
    cuts, j = [n], n
    for choice in reversed(back):
        i = int(choice[j])
        if i == 0:
            break
        cuts.append(i)
        j = i
    return [0] + cuts[::-1]


class SparseMoeBlock(nn.Module):
    """Qwen3.5-MoE / Qwen3-Next MoE MLP: `gate` (router), `switch_mlp` (routed experts), `shared_expert` and its
    sigmoid `shared_expert_gate` (one logit per token). Names equal mlx-lm's, so `switch_mlp` checkpoints map."""

    def __init__(self, dims: int, num_experts: int, top_k: int, expert_hidden: int, norm_topk_prob: bool,
                 shared_expert: nn.Module):
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok {top_k} must be between 1 and num_experts {num_experts}")
        self.top_k, self.norm_topk_prob = top_k, norm_topk_prob
        self.gate = Linear(dims, num_experts, bias=False)
        self.switch_mlp = SwitchGLU(dims, expert_hidden, num_experts)
        self.shared_expert = shared_expert
        self.shared_expert_gate = Linear(dims, 1, bias=False)

    def routed(self, x: mx.array) -> mx.array:
        """The router and the routed experts' weighted sum: x [B, S, dims] -> [B, S, dims] (the split prefill runs
        it on the GPU lane while the ANE lane takes shared-expert channels). Under `Routes.using`, the routes are
        recorded or replayed (`--verify`)."""
        routes = _routes[0]
        if routes is not None:
            indices, weights = routes.route(self, self.gate(x))
        else:
            indices, weights = route(self.gate(x), self.top_k, self.norm_topk_prob)  # [B, S, k] each
        routed = self.switch_mlp(x, indices)  # [B, S, k, dims]
        return (routed * weights[..., None].astype(routed.dtype)).sum(axis=-2)  # [B, S, dims]

    def __call__(self, x: mx.array) -> mx.array:
        """x [B, S, dims] -> [B, S, dims]."""
        shared = self.shared_expert(x) * act.sigmoid(self.shared_expert_gate(x))  # [B, S, dims] * [B, S, 1]
        return self.routed(x) + shared


_routes: list[Routes | None] = [None]  # the `Routes` in use (one `--verify` at a time), else None


class Routes:
    """Each token's experts as one prefill chose them, recorded (`replay` None) or imposed on another prefill of
    the same prompt and chunks (`replay`: a recording), for `--verify`: a router whose k-th and (k+1)-th experts lie
    within rounding of each other sends a token to either, and two runs that differ only in rounding may each
    choose its own. Replaying the split's routes in the reference run leaves the two runs' arithmetic alone to
    compare, and `flips` counts the routes the reference would have chosen otherwise.

    A block's calls are told apart by its name in the model and matched by their router logits (a replayed call
    takes the recorded call of the same block whose logits lie nearest on its rows; a padded last chunk's extra rows
    aside). Only prefills run under it, never a compiled step (it reads the logits on the host).
    """

    def __init__(self, model: nn.Module, replay: Routes | None = None):
        self.names = {id(m): name for name, m in model.named_modules() if isinstance(m, SparseMoeBlock)}
        self.replay = replay
        self.calls: dict[str, list[tuple[np.ndarray, np.ndarray]]] = {}  # name -> [(logits [N, E], experts taken [N, k])]
        self.flips = 0
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def using(self):
        """Record or replay the routes of every SparseMoeBlock call inside the block (this thread and the lanes)."""
        _routes[0] = self
        try:
            yield self
        finally:
            _routes[0] = None

    def route(self, block: SparseMoeBlock, logits: mx.array) -> tuple[mx.array, mx.array]:
        """`route` for `block`'s router logits [B, S, E], recorded or replaced by the replayed call's experts."""
        indices, weights = route(logits, block.top_k, block.norm_topk_prob)  # [B, S, k] each
        name = self.names.get(id(block))
        if name is None:
            return indices, weights
        own = np.array(indices).reshape(-1, block.top_k)  # [N, k]
        flat = np.array(logits.astype(mx.float32)).reshape(own.shape[0], -1)  # [N, E]
        if self.replay is None:
            with self._lock:
                self.calls.setdefault(name, []).append((flat, own))
            return indices, weights
        chosen = self.replay.match(name, flat)
        with self._lock:
            self.calls.setdefault(name, []).append((flat, own if chosen is None else chosen))  # the routes taken
        if chosen is None or (np.sort(chosen, -1) == np.sort(own, -1)).all():
            return indices, weights
        with self._lock:
            self.flips += int((np.sort(chosen, -1) != np.sort(own, -1)).any(-1).sum())
        order = mx.array(chosen.reshape(indices.shape).astype(np.uint32))  # [B, S, k] the replayed experts
        probs = mx.softmax(logits.astype(mx.float32), axis=-1, precise=True)
        weights = mx.take_along_axis(probs, order, axis=-1)  # their probabilities in this run
        if block.norm_topk_prob:
            weights = weights / weights.sum(axis=-1, keepdims=True)
        return order, weights

    def differs(self, other: Routes) -> int:
        """How many tokens' routes of this recording another recording of the same prompt chose otherwise."""
        count = 0
        for name, calls in self.calls.items():
            for logits, experts in calls:
                theirs = other.match(name, logits)
                if theirs is not None:
                    count += int((np.sort(theirs, -1) != np.sort(experts[: len(theirs)], -1)).any(-1).sum())
        return count

    def match(self, name: str, logits: np.ndarray) -> np.ndarray | None:
        """The experts [N, k] of the recorded call of `name` whose logits lie nearest `logits` [N, E] (a recorded
        call may hold more rows: a padded chunk), or None."""
        n = logits.shape[0]
        calls = [(f, e) for f, e in self.calls.get(name, []) if f.shape[0] >= n and f.shape[1] == logits.shape[1]]
        if not calls:
            return None
        flat, experts = min(calls, key=lambda c: float(np.abs(c[0][:n] - logits).max()))
        return experts[:n]
