"""The vision tower on the ANE lane against GPU-only, in the same run: a chat prompt with a long text before a
1024x1024 image; the image's encode time and the prompt's TTFT with the tower on the second lane (its Core ML
programs, the reference executor in the lane's worker process here) while the GPU lane prefills the text before
the image, against GPU-only (the MLX tower, then the prefill).

    python bench/vision.py                     # 4K tokens of text, then the 1024x1024 image, 3 rounds
    python bench/vision.py --text-tokens 2048 --image 512 --rounds 2

The checkpoint is a random `qwen3_5` vision-language model written by transformers, as tests/vision_checkpoint.py
writes them (with its character-level chat tokenizer), sized so the tower's work is comparable to the text's: the
tower on the ANE lane (the reference executor: about 3.5x the MLX tower's time here, its softmax over 4096 x 4096
scores rounded to fp16 after every op) takes about as long as the 4K-token text prefill on the GPU, so the tower on
the GPU takes about a third of it (all three are printed and saved). The split offloads
nothing of the text (`--ane-fraction 0`): the only difference between the two runs is where the tower runs.
Rounds alternate the two arms after a warm-up; medians. Target (issue 33): TTFT with the tower on the lane at most
0.85x GPU-only here. Writes bench/results/vision.json and vision.png.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # one BLAS thread per lane, as in bench/ttft.py: each lane one
os.environ.setdefault("OMP_NUM_THREADS", "1")  # core, GPU-only too (the worker is the second core's device)
from hetero.host.blas import reexec_with_fast_blas  # noqa: E402  (before mlx: the fast BLAS under it)
from hetero.host.environment import environment

RESULTS = Path(__file__).resolve().parent / "results"
TARGET = 0.85
CHUNK = 256
TEXT = dict(vocab_size=256, hidden_size=512, intermediate_size=1536, num_hidden_layers=4, num_attention_heads=8,
            num_key_value_heads=2, head_dim=64, linear_conv_kernel_dim=4, linear_key_head_dim=64,
            linear_value_head_dim=64, linear_num_key_heads=4, linear_num_value_heads=8, rms_norm_eps=1e-6,
            eos_token_id=None, pad_token_id=None, bos_token_id=None, full_attention_interval=2,
            max_position_embeddings=32768)
# Qwen3.5's tower scaled down (16-pixel patches merged 2x2): 1024x1024 is 4096 patches, 1024 tokens
VISION = dict(depth=1, hidden_size=512, intermediate_size=2048, num_heads=1, patch_size=16, temporal_patch_size=2,
              spatial_merge_size=2, num_position_embeddings=2304, hidden_act="gelu_pytorch_tanh")


def checkpoint(workdir: Path) -> Path:
    """Write (once) the random VL checkpoint with transformers, its processor config and the tests' chat tokenizer."""
    import torch
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    from tests.vision_checkpoint import IMAGE_TOKEN, VIDEO_TOKEN, VISION_END, VISION_START, save_chat_tokenizer

    out = workdir / "vlm"
    if (out / "model.safetensors").is_file():
        return out
    torch.manual_seed(0)
    text = dict(TEXT, tie_word_embeddings=False, rope_parameters={
        "rope_type": "default", "rope_theta": 10_000.0, "partial_rotary_factor": 0.25,
        "mrope_section": [2, 3, 3], "mrope_interleaved": True})
    config = Qwen3_5Config(text_config=text, vision_config=dict(VISION, out_hidden_size=TEXT["hidden_size"]),
                           tie_word_embeddings=False, image_token_id=IMAGE_TOKEN, video_token_id=VIDEO_TOKEN,
                           vision_start_token_id=VISION_START, vision_end_token_id=VISION_END)
    model = Qwen3_5ForConditionalGeneration(config).float().eval()
    model.save_pretrained(out)
    saved = json.loads((out / "config.json").read_text())
    saved["text_config"]["full_attention_interval"] = TEXT["full_attention_interval"]
    (out / "config.json").write_text(json.dumps(saved, indent=1))
    (out / "preprocessor_config.json").write_text(json.dumps(dict(
        image_processor_type="Qwen2VLImageProcessor", do_resize=True, do_rescale=True, rescale_factor=1 / 255,
        do_normalize=True, do_convert_rgb=True, image_mean=[0.5] * 3, image_std=[0.5] * 3, resample=3,
        patch_size=16, temporal_patch_size=2, merge_size=2, size={"shortest_edge": 64 * 64,
                                                                  "longest_edge": 2048 * 2048})))
    save_chat_tokenizer(out)
    return out


def main() -> None:
    reexec_with_fast_blas()
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--text-tokens", type=int, default=4096, help="text tokens before the image")
    ap.add_argument("--image", type=int, default=1024, help="side of the square image in pixels")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()) / "hetero-bench-vision-lane")
    args = ap.parse_args()

    import mlx.core as mx

    import hetero
    from hetero.pipeline import configure
    from tests.vision_checkpoint import draw_image, encoded

    engine = hetero.load(checkpoint(args.workdir))
    png = encoded(draw_image(args.image, args.image, seed=1), "PNG")
    words = "the quick brown fox jumps over a lazy dog while we wait for the picture "
    before = (words * (args.text_tokens // len(words) + 1))[: args.text_tokens]
    ids = engine.encode_prompt(before + engine.image_marker + "What is in the picture?", chat=True)
    prompt = engine.image_prompt(ids, [png])
    (lo, hi), = prompt.spans
    run = configure(engine, 0.0, CHUNK)  # no text on the ANE lane: only the tower
    run.prepare(prompt.tokens, images=prompt)  # export + load before any clock

    def gpu_encode() -> float:
        fresh = engine.image_prompt(ids, [png])
        t0 = time.perf_counter()
        engine.vision.encode(fresh)
        return time.perf_counter() - t0

    def text_prefill() -> float:  # the text before the image alone, GPU-only
        t0 = time.perf_counter()
        engine.generate(ids[:lo], max_tokens=1, mtp=False, use_prefix_cache=False, prefill_chunk=CHUNK)
        return time.perf_counter() - t0

    def arm(split) -> dict:
        out = engine.generate(ids, images=[png], max_tokens=4, mtp=False, use_prefix_cache=False,
                              prefill_chunk=CHUNK, split=split)
        res = {"ttft_s": out.stats["ttft_s"], "tokens": out.tokens}
        if split is not None:
            vision = split.last.vision if split.last is not None else []
            if [v["lane"] for v in vision] != ["ane"]:
                sys.exit(f"the tower did not run on the ANE lane: {vision}; the plan's prediction: "
                         f"{split.vision_choice}")
            res.update(encode_s=vision[0]["seconds"], wall_s=split.last.wall_s, gpu_busy_s=split.last.gpu_busy_s,
                       ane_busy_s=split.last.ane_busy_s)
        return res

    arm(None), arm(run)  # warm-up: compile, allocate, the worker's first calls
    rounds = []
    for r in range(args.rounds):
        gpu_only, lane = arm(None), arm(run)
        if lane["tokens"] != gpu_only["tokens"]:
            sys.exit(f"round {r}: the lane's tokens {lane['tokens']} differ from GPU-only's {gpu_only['tokens']}")
        row = {"gpu_only": gpu_only, "lane": lane, "gpu_encode_s": gpu_encode(), "text_prefill_s": text_prefill(),
               "ratio": lane["ttft_s"] / gpu_only["ttft_s"]}
        rounds.append(row)
        print(f"round {r}: TTFT GPU-only {gpu_only['ttft_s']:.3f} s, tower on the lane {lane['ttft_s']:.3f} s "
              f"({row['ratio']:.3f}x); encode GPU {row['gpu_encode_s']:.3f} s, lane {lane['encode_s']:.3f} s; "
              f"text before the image {row['text_prefill_s']:.3f} s", flush=True)
    med = lambda f: statistics.median(f(r) for r in rounds)  # noqa: E731
    ratio = med(lambda r: r["ratio"])
    result = {
        "image_px": args.image, "image_tokens": hi - lo, "patches": int(sum(t * h * w for t, h, w in prompt.grids)),
        "text_tokens_before_image": lo, "prompt_tokens": len(prompt.tokens), "chunk": CHUNK,
        "text_config": TEXT, "vision_config": VISION, "lane": f"{run.backend} in the ANE lane's worker process",
        "median_ttft_gpu_only_s": med(lambda r: r["gpu_only"]["ttft_s"]),
        "median_ttft_lane_s": med(lambda r: r["lane"]["ttft_s"]),
        "median_ratio": ratio, "target": TARGET, "met": ratio <= TARGET,
        "spread_ratio": [min(r["ratio"] for r in rounds), max(r["ratio"] for r in rounds)],
        "median_encode_gpu_s": med(lambda r: r["gpu_encode_s"]),
        "median_encode_lane_s": med(lambda r: r["lane"]["encode_s"]),
        "median_text_prefill_s": med(lambda r: r["text_prefill_s"]),
        "sizing": "the tower on the ANE lane ~ the text before the image on the GPU (all measured here)",
        "lane_choice": run.vision_choice,  # the plan's prediction that sent the image to the lane
        "rounds": rounds, "environment": environment(), "mlx": mx.__version__,
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "vision.json").write_text(json.dumps(result, indent=1))
    plot(result, RESULTS / "vision.png")
    print(f"sizing: the tower on the ANE lane {result['median_encode_lane_s']:.3f} s, on the GPU "
          f"{result['median_encode_gpu_s']:.3f} s; the {lo} text tokens before the image on the GPU "
          f"{result['median_text_prefill_s']:.3f} s (the lane's tower comparable to the text by design)")
    print(f"TTFT tower on the lane / GPU-only: median {ratio:.3f} (target <= {TARGET}) -> bench/results/vision.json")


def plot(result: dict, path: Path) -> None:
    """Two bars per arm: TTFT, and the tower's encode time."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(6, 3.5))
    arms = ["GPU-only", "tower on the ANE lane"]
    ttft = [result["median_ttft_gpu_only_s"], result["median_ttft_lane_s"]]
    enc = [result["median_encode_gpu_s"], result["median_encode_lane_s"]]
    x = range(len(arms))
    ax.bar([i - 0.2 for i in x], ttft, 0.4, label="TTFT")
    ax.bar([i + 0.2 for i in x], enc, 0.4, label="image encode")
    ax.set_xticks(list(x), arms)
    ax.set_ylabel("seconds (median)")
    ax.set_title(f"{result['image_px']}px image after {result['text_tokens_before_image']} text tokens: "
                 f"{result['median_ratio']:.2f}x", fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
