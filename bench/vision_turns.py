"""Two chat turns with the same image: TTFT of the first (tower + prefill) against the second (the image's tokens
and the text before them restored from the prefix cache), and the tower's encode time alone.

    python bench/vision_turns.py                            # 512x512 image after ~1K tokens of text, 3 rounds
    python bench/vision_turns.py --text-tokens 4096 --image 1024 --rounds 2

A random `qwen3_5` checkpoint with a vision tower (MLX weights saved in transformers' names, the bundled
tokenizer with Qwen's vision tokens added) is written once. Each round builds a fresh prefix cache and runs turn 1
(system text, the image, a question) then turn 2 (turn 1, its reply, a new question); greedy, MTP off. Turn 2 must
report at least the image's tokens as cached. Target (issue 33): turn 2's TTFT <= 10% of turn 1's.
Writes bench/results/vision_turns.json.
"""

from __future__ import annotations

import argparse
import io
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from hetero.host.blas import reexec_with_fast_blas  # noqa: E402  (before mlx: the fast BLAS under it)
from hetero.host.environment import environment

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
TEXT = dict(model_type="qwen3_5_text", hidden_size=512, num_hidden_layers=8, intermediate_size=1536,
            num_attention_heads=8, num_key_value_heads=2, head_dim=64, linear_num_key_heads=4,
            linear_num_value_heads=8, linear_key_head_dim=64, linear_value_head_dim=64, vocab_size=8192,
            full_attention_interval=4, tie_word_embeddings=True, max_position_embeddings=65536)
# Qwen3.5's tower scaled down: 16-pixel patches merged 2x2, 12 blocks
VISION = dict(depth=12, hidden_size=512, intermediate_size=1536, num_heads=8, patch_size=16, temporal_patch_size=2,
              spatial_merge_size=2, num_position_embeddings=2304, hidden_act="gelu_pytorch_tanh", in_channels=3)
VISION_TOKENS = ("<|vision_start|>", "<|image_pad|>", "<|vision_end|>")


def checkpoint(workdir: Path) -> Path:
    """Write (once) the random VL checkpoint."""
    import tokenizers
    from mlx.utils import tree_flatten

    from hetero.checkpoint.source import BUNDLED_MODEL
    from hetero.models.qwen3_5 import Model, ModelArgs
    from hetero.models.qwen3_5_vision.args import VisionArgs
    from hetero.models.qwen3_5_vision.model import VisionModel
    from hetero.training.hf_export import hf_config, save_hf_checkpoint

    out = workdir / "vlm"
    if (out / "model.safetensors").is_file():
        return out
    mx.random.seed(0)
    args = ModelArgs.from_config(TEXT)
    model = Model(args)
    mx.eval(model.parameters())
    tok = tokenizers.Tokenizer.from_file(str(BUNDLED_MODEL / "tokenizer.json"))
    tok.add_special_tokens([tokenizers.AddedToken(t, special=True, normalized=False) for t in VISION_TOKENS])
    start, image, end = (tok.token_to_id(t) for t in VISION_TOKENS)
    config = hf_config(args, eos_token_id=[])
    config.update(vision_config=dict(VISION, out_hidden_size=TEXT["hidden_size"]), image_token_id=image,
                  vision_start_token_id=start, vision_end_token_id=end)
    save_hf_checkpoint(model, config, out, dtype=mx.float32)
    tower = VisionModel(VisionArgs.from_config(config["vision_config"]))
    mx.eval(tower.parameters())
    weights = dict(mx.load(str(out / "model.safetensors")))
    weights.update({"model.visual." + k: v for k, v in tree_flatten(tower.parameters())})
    mx.save_safetensors(str(out / "model.safetensors"), weights)
    (out / "config.json").write_text(json.dumps(config, indent=1))
    tok.save(str(out / "tokenizer.json"))
    shutil.copy(BUNDLED_MODEL / "tokenizer_config.json", out / "tokenizer_config.json")
    (out / "preprocessor_config.json").write_text(json.dumps(dict(
        patch_size=16, temporal_patch_size=2, merge_size=2, image_mean=[0.5] * 3, image_std=[0.5] * 3,
        size={"shortest_edge": 64 * 64, "longest_edge": 2048 * 2048})))
    return out


def png(side: int, seed: int = 0) -> bytes:
    from PIL import Image

    rng = np.random.default_rng(seed)
    pixels = rng.integers(0, 256, (side, side, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels, "RGB").save(buf, format="PNG")
    return buf.getvalue()


def main() -> None:
    reexec_with_fast_blas()
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--text-tokens", type=int, default=1024, help="system text before the image (about)")
    ap.add_argument("--image", type=int, default=512, help="side of the square test image in pixels")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()) / "hetero-bench-vision")
    args = ap.parse_args()
    from hetero.caches.prefix import PrefixCache
    from hetero.engine import load
    from hetero.training.tokenizer_train import load_corpus

    engine = load(checkpoint(args.workdir))
    _, valid = load_corpus()
    system = engine.tokenizer.decode(engine.tokenizer.encode(valid[:20 * args.text_tokens])[: args.text_tokens])
    image = png(args.image)
    user = [{"role": "system", "content": system},
            {"role": "user", "content": engine.image_marker + "What is in the picture?"}]

    def turn(messages: list[dict]) -> dict:
        prompt = engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        out = engine.generate(engine.encode_prompt(prompt), max_tokens=8, images=[image], mtp=False)
        return {"ttft_s": out.stats["ttft_s"], "prompt_tokens": out.stats["prompt_tokens"],
                "cached_tokens": out.stats["cached_tokens"], "text": out.text}

    ids = engine.encode_prompt(engine.tokenizer.apply_chat_template(user, add_generation_prompt=True))
    prompt = engine.image_prompt(ids, [image])
    (lo, hi), = prompt.spans
    turn(user)  # warm-up: compile, allocate
    rounds = []
    for _ in range(args.rounds):
        t0 = time.perf_counter()
        fresh = engine.image_prompt(ids, [image])
        engine.vision.encode(fresh)
        encode_s = time.perf_counter() - t0
        engine.prefix_cache = PrefixCache()
        first = turn(user)
        second = turn(user + [{"role": "assistant", "content": first["text"]},
                              {"role": "user", "content": "And the colours?"}])
        rounds.append({"encode_s": encode_s, "first": first, "second": second,
                       "ratio": second["ttft_s"] / first["ttft_s"]})
        ok = second["cached_tokens"] >= hi
        print(f"encode {encode_s:.3f} s  turn 1 TTFT {first['ttft_s']:.3f} s  turn 2 TTFT {second['ttft_s']:.3f} s "
              f"({second['cached_tokens']}/{second['prompt_tokens']} cached{'' if ok else ', IMAGE NOT CACHED'})",
              flush=True)
        if not ok:
            sys.exit(1)
    ratio = statistics.median(r["ratio"] for r in rounds)
    result = {"image_px": args.image, "image_tokens": hi - lo, "text_tokens": args.text_tokens,
              "median_ratio": ratio, "target": 0.10, "met": ratio <= 0.10,
              "median_encode_s": statistics.median(r["encode_s"] for r in rounds),
              "spread_ratio": [min(r["ratio"] for r in rounds), max(r["ratio"] for r in rounds)],
              "rounds": rounds, "environment": environment()}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "vision_turns.json").write_text(json.dumps(result, indent=1))
    print(f"turn 2 / turn 1 TTFT: median {ratio:.3f} (target <= 0.10) -> bench/results/vision_turns.json")


if __name__ == "__main__":
    main()
