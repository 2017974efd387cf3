"""How much of a quantized checkpoint `--ane-weights blockwise` can hold as shift-scale, and what each form costs.

    python bench/weight_forms.py

For matrices quantized by MLX's own quantizer (`mx.quantize`, N(0, 0.02) weights, 1024x5120, scales and biases stored
in bf16 and fp16), per bits and group size: the share of groups with an exact shift-scale form
(`hetero.coreml.graphs.palette.group_affine`), the share of rows all of whose groups have one, whether the whole matrix
does (the op takes one block size per matrix), and bytes per weight in each form. Then the bundled model quantized
by `hetero convert --quantize` at 2 and 4 bits: how many of its quantized matrices take shift-scale. No timing:
which form the Neural Engine runs faster is for `hetero doctor` on a Mac.
JSON goes to bench/results/weight_forms.json.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import hetero  # noqa: E402,F401  (before mlx: the fast BLAS)
import mlx.core as mx  # noqa: E402
import mlx.nn as nn  # noqa: E402
import numpy as np  # noqa: E402

from hetero.checkpoint.loader import load_model  # noqa: E402
from hetero.checkpoint.source import BUNDLED_MODEL  # noqa: E402
from hetero.cli.quantize import quantize_checkpoint  # noqa: E402
from hetero.coreml.export import palettize  # noqa: E402

OUT = Path(__file__).resolve().parent / "results" / "weight_forms.json"


def matrix_row(w: mx.array, bits: int, group: int, store) -> dict:
    wq, s, b = mx.quantize(w, group_size=group, bits=bits)
    p = palettize(wq, s.astype(store), b.astype(store), bits, group).with_affine()
    exact = np.isfinite(p.affine[..., 0])  # [rows, groups]
    return {"bits": bits, "group": group, "store": str(store).split(".")[-1],
            "groups_exact": round(float(exact.mean()), 4), "rows_exact": round(float(exact.all(axis=1).mean()), 4),
            "matrix_exact": bool(exact.all()), "mirrored_groups": round(float((p.affine[..., 2] == 1).mean()), 4),
            "lut_bytes_per_weight": p.nbytes / p.indices.size,
            "blockwise_bytes_per_weight": p.shift_scale_nbytes() / p.indices.size}


def checkpoint_row(bits: int, tmp: Path) -> dict:
    q = quantize_checkpoint(str(BUNDLED_MODEL), tmp / f"q{bits}", bits=bits, group_size=64)
    net, _, _ = load_model(str(q))
    counts = {"matrices": 0, "blockwise": 0}
    for name, layer in net.named_modules():
        if isinstance(layer, nn.QuantizedLinear) and not name.startswith(("lm_head", "mtp")):
            p = palettize(layer.weight, layer.scales, layer.biases, layer.bits, layer.group_size).with_affine()
            counts["matrices"] += 1
            counts["blockwise"] += p.shift_scale() is not None
    return {"bits": bits, "group": 64, **counts}


def main() -> None:
    rng = np.random.default_rng(0)
    w = mx.array(rng.normal(0, 0.02, (1024, 5120)).astype(np.float32))
    rows = [matrix_row(w, bits, group, store) for bits in (2, 3, 4) for group in (32, 64, 128)
            for store in (mx.bfloat16, mx.float16)]
    for r in rows:
        print(json.dumps(r))
    with tempfile.TemporaryDirectory() as tmp:
        models = [checkpoint_row(bits, Path(tmp)) for bits in (2, 4)]
    for r in models:
        print(json.dumps(r))
    OUT.write_text(json.dumps({"random_1024x5120": rows, "bundled_model": models}, indent=1))
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
