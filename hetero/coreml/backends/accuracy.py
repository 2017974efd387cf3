"""Agreement between an offloaded piece's output and the MLX reference: cosine, max abs error, PSNR."""

from __future__ import annotations

import numpy as np


def compare(ours: np.ndarray, ref: np.ndarray) -> dict[str, float]:
    """cosine similarity, max |ours - ref| and PSNR in dB (peak = max |ref|), computed in float64."""
    a = np.asarray(ours, dtype=np.float64).ravel()
    b = np.asarray(ref, dtype=np.float64).ravel()
    if a.shape != b.shape:
        raise ValueError(f"shapes differ: {np.shape(ours)} vs {np.shape(ref)}")
    cosine = float(a @ b / max(np.linalg.norm(a) * np.linalg.norm(b), 1e-300))
    rmse = float(np.sqrt(np.mean((a - b) ** 2)))
    peak = float(np.abs(b).max())
    psnr = float("inf") if rmse == 0 else float(20 * np.log10(peak / rmse))
    return {"cosine": cosine, "max_abs": float(np.abs(a - b).max()), "psnr_db": psnr}
