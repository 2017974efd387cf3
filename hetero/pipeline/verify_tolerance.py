"""`--verify`'s tolerance per compute dtype, from measured errors against a float64 oracle.

`verify` accepts a split when max |split - gpu| / max |gpu| <= tol on the last logits and every cache array. Each
run carries its own rounding error against the exact result, so by the triangle inequality
|split - gpu| <= e_split + e_gpu. `MEASURED_ERROR` is, per dtype, the largest error either path (GPU-only, or the
split at fraction 0.5) showed against the float64 oracle in the same measure (`python tests/oracle64.py`: the
bundled model and random checkpoints with Qwen3.5's real layer shapes, code and random-token prompts of 160 and
1024 tokens, chunk 64, and the split at 8K and 16K tokens in bench/ttft.py; docs/planner.md has every row). The ANE
lane computes in fp16 whatever the GPU lane's dtype, so a split is taken to be no more exact than its fp16 share
ever measured: that error floors every dtype's. Two runs each within that error of the exact result differ by at
most twice it: `K` = 2, and a larger difference means that one of them is farther from the exact result than any
run measured.

What that leaves visible: on the bundled model an MLP program losing half its output moves the compared arrays
29% and a GDN z program returning zeros 140%, above every dtype's tolerance; on a random real-shape checkpoint,
whose layers move the residual stream less, the same MLP defect moves them 2.3%, which fp32's and fp16's tolerance
(2.1%) catch and bf16's (3.6%) does not: two bf16 runs cannot be told apart below about twice bf16's own error.
"""

from __future__ import annotations

import mlx.core as mx

# max |path - float64| / max |float64| over the last logits and every cache array, the largest over the GPU-only
# and split paths and every measured checkpoint and prompt (docs/planner.md, "Verify tolerance per dtype"): bf16 from
# the real-shape checkpoint's GDN state after 1024 code tokens, fp16 from the bundled model's last attention values
# after 160 random tokens, fp32 from the split (its fp16 ANE share) on bench/ttft.py's model at 8K and 16K tokens,
# where the oracle is too slow: split - GPU-only 1.04e-2 (the last attention layer's keys), and the fp32 GPU-only
# path is within 1.2e-5 of float64 wherever measured, so that is the split's own error to within 0.2% (up to 1024
# tokens the fp32 split's largest was 1.47e-3: errors grow with the prompt).
MEASURED_ERROR = {"float32": 1.04e-2, "bfloat16": 1.80e-2, "float16": 5.19e-3}
ANE_DTYPE = "float16"  # what the ANE lane computes in, whatever the GPU lane's dtype
# fp32's worst run is a split, so its error is the fp16 ANE share's: with fp16 runs' own, it floors every dtype
ANE_SHARE_ERROR = max(MEASURED_ERROR[ANE_DTYPE], MEASURED_ERROR["float32"])
K = 2  # the triangle inequality: two runs within E of the exact result differ by at most 2 E

_NAMES = {mx.float32: "float32", mx.bfloat16: "bfloat16", mx.float16: "float16"}


def reference_error(dtype: mx.Dtype) -> float:
    """The largest measured error of a run computing in `dtype`, floored at the ANE lane's fp16 share's."""
    if dtype not in _NAMES:
        raise ValueError(f"no verify tolerance is measured for {dtype}")
    return max(MEASURED_ERROR[_NAMES[dtype]], ANE_SHARE_ERROR)


def verify_tolerance(dtype: mx.Dtype) -> float:
    """The default `--verify-tol` for a model computing in `dtype`: K x its reference error."""
    return round(K * reference_error(dtype), 6)


def tolerance_table() -> dict[str, float]:
    """{dtype name: default tolerance}, for `--help` and the docs."""
    return {name: verify_tolerance(d) for d, name in _NAMES.items()}
