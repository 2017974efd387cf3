"""`--verify`'s tolerance per compute dtype, from measured errors against a float64 oracle.

`verify` accepts a split when max |split - gpu| / max |gpu| <= tol on the last logits and every cache array. Both
runs carry their own rounding error against the exact result, so by the triangle inequality
|split - gpu| <= e_split + e_gpu. A dtype's reference error, `REFERENCE_ERROR`, is the GPU-only prefill's largest
measured error against the float64 oracle (`tests/oracle64.py`, the same measure; the bundled model and random
checkpoints with Qwen3.5's real layer shapes, 149 to 1024 tokens; docs/planner.md has the table). The ANE lane
computes in fp16 whatever the GPU's dtype, so no split is more exact than fp16's reference error: the floor of every
dtype. Measured, a correct split's difference from GPU-only was 0.4-1.3 times that floor, and its own error against
float64 1.0-1.2 times GPU-only's. `K` = 3 accepts a split up to twice as far from the exact result as the floor
(for prompts, models and fractions not measured) plus the GPU-only run's own error.

What that leaves visible: on the bundled model an MLP program losing half its output moves the compared arrays
29% and a GDN z program returning zeros 140%, far above every dtype's tolerance; on a random real-shape checkpoint,
whose layers move the residual stream less, the same MLP defect moves them 2.3%, which fp32's and fp16's tolerance
catch and bf16's (3.9%) does not: comparing two bf16 runs cannot resolve less than a few times bf16's own error.
"""
from __future__ import annotations

import mlx.core as mx

# The GPU-only prefill's largest max |path - float64| / max |float64| over the last logits and every cache array
# (bundled model at 149 and 1024 tokens, random real-shape checkpoints of seeds 0 and 1 at 167 and 1024, the tiny
# random checkpoint at 167; chunk 64; `tests/oracle64.py`): bf16 from seed 1's GDN state, fp16 and fp32 from the
# bundled model's last attention keys at 1024 tokens.
REFERENCE_ERROR = {"float32": 9.3e-6, "bfloat16": 1.31e-2, "float16": 4.06e-3}
ANE_DTYPE = "float16"  # what the ANE lane computes in, whatever the GPU lane's dtype
K = 3  # a split up to twice the floor from float64, plus the GPU-only run's own error


def _name(dtype: mx.Dtype) -> str:
    names = {mx.float32: "float32", mx.bfloat16: "bfloat16", mx.float16: "float16"}
    if dtype not in names:
        raise ValueError(f"no verify tolerance is measured for {dtype}")
    return names[dtype]


def verify_tolerance(dtype: mx.Dtype) -> float:
    """The default `--verify-tol` for a model computing in `dtype`: K x the larger of its and fp16's reference error."""
    return round(K * max(REFERENCE_ERROR[_name(dtype)], REFERENCE_ERROR[ANE_DTYPE]), 6)


def tolerance_table() -> dict[str, float]:
    """{dtype name: default tolerance} for the docs and `--help`."""
    return {name: verify_tolerance(d) for name, d in (("float32", mx.float32), ("bfloat16", mx.bfloat16),
                                                       ("float16", mx.float16))}
