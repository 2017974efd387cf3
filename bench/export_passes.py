"""First-use export time of hetero's conversion against coremltools' stock one, alternated in one run.

    python bench/export_passes.py                  # JSON under bench/results/export_passes.json

Three ways to convert, each exporting the bundled model at ANE fraction `--fraction` (chunk 64, contexts 512 and
1024: attention as multifunction packages) into a fresh folder, `--repeats` times, alternating:
- `default`: coremltools' default pass pipeline, validating the program around every pass, a gc after each convert;
- `trimmed`: hetero's pass pipeline (`hetero.coreml.graphs.package.PASSES`), coremltools' validation and gc;
- `hetero`: the trimmed pipeline within `hetero.coreml.graphs.package.lean_conversion` (validated once, no debug text, no
  whole-heap gc): what the export does.
Reported: the median seconds of each, their ratios to `default`, and whether all packages are equal byte for byte
(they must be: tests/test_coreml_passes.py checks it per builder).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import hetero  # noqa: E402,F401  # first: the fast BLAS is under MLX whatever imports next
from hetero.host.environment import environment  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def package_files(out: Path) -> dict[str, bytes]:
    """Every file of an export but the manifests (Manifest.json names files by random identifiers; the export's
    manifest records timings and reuse)."""
    return {str(f.relative_to(out)): f.read_bytes() for f in sorted(out.rglob("*"))
            if f.is_file() and f.name not in ("Manifest.json", "manifest.json")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--fraction", type=float, default=1.0)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "export_passes.json"))
    opts = ap.parse_args()

    import coremltools as ct

    from hetero.coreml.export import export_coreml
    import hetero.coreml.graphs.package as package

    trimmed, once = package.pass_pipeline, package.lean_conversion
    arms = {"default": (ct.PassPipeline, contextlib.nullcontext), "trimmed": (trimmed, contextlib.nullcontext),
            "hetero": (trimmed, once)}
    work = Path(tempfile.mkdtemp(prefix="hetero-export-passes-"))
    times = {k: [] for k in arms}
    try:
        for r in range(opts.repeats):
            for name, (pipeline, validation) in arms.items():
                package.pass_pipeline = pipeline  # what save_program converts with when given none
                package.lean_conversion = validation  # what it converts within
                out = work / f"{name}{r}"
                t = time.perf_counter()
                manifest = export_coreml(None, out, opts.fraction, chunk=64, contexts=[512, 1024])
                times[name].append(time.perf_counter() - t)
                print(f"round {r + 1}: {name:8s} {times[name][-1]:6.1f} s ({len(manifest['programs'])} programs)",
                      flush=True)
        equal = all(package_files(work / "default0") == package_files(work / f"{k}0") for k in arms)
    finally:
        package.pass_pipeline, package.lean_conversion = trimmed, once
        shutil.rmtree(work, ignore_errors=True)
    med = {k: statistics.median(v) for k, v in times.items()}
    result = {
        "environment": {**environment(), "coremltools": ct.__version__},
        "settings": vars(opts),
        "seconds": times,
        "median_s": med,
        "trimmed_over_default": med["trimmed"] / med["default"],
        "hetero_over_default": med["hetero"] / med["default"],
        "packages_equal": equal,
        "passes": list(package.PASSES),
    }
    print(f"export: default {med['default']:.1f} s, trimmed {med['trimmed']:.1f} s "
          f"({result['trimmed_over_default']:.2f}x), hetero {med['hetero']:.1f} s "
          f"({result['hetero_over_default']:.2f}x the time); packages equal: {equal}")
    Path(opts.out).parent.mkdir(parents=True, exist_ok=True)
    Path(opts.out).write_text(json.dumps(result, indent=1))
    print(f"wrote {opts.out}")


if __name__ == "__main__":
    main()
