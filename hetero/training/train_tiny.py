"""Train the bundled tiny Qwen3.5-architecture model (with its MTP head) on the Python standard library.

    python -m hetero.training.train_tiny --out hetero/bundled [--steps N] [--minutes M] [--seed 0]

Corpus and byte-level BPE tokenizer come from `hetero.training.tokenizer_train`; the network is our own
`hetero.models.qwen3_5.Model`, trained jointly on CE(next token) + mtp_weight * CE(MTP draft of token t+2), where
the MTP head at position p sees embed(t_{p+1}) and the backbone's post-norm hidden h_p (`Model.mtp_forward`).
The learning-rate schedule depends only on --steps, so the same machine, seed and flags give the same weights;
--minutes is a safety stop. The result is written as an HF-format checkpoint (`hetero.training.hf_export`) and checked
by loading it back with hetero and with mlx-lm.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten, tree_map_with_path

from hetero.checkpoint.loader import load_model
from hetero.host.blas import describe, reexec_with_fast_blas
from hetero.models import attention
from hetero.models.qwen3_5 import Model, ModelArgs
from hetero.training import chat_samples, hf_export, tokenizer_train
from hetero.training.evaluation import chat_endings, check_checkpoint, evaluate, greedy

SHAPE = dict(  # the bundled model's shape (vocab_size comes from the tokenizer)
    hidden_size=256,
    num_hidden_layers=8,
    intermediate_size=512,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=64,
    linear_value_head_dim=64,
    linear_conv_kernel_dim=4,
    full_attention_interval=4,
)


def make_args(vocab_size: int, eos: list[int], window: int = 65536, **shape) -> ModelArgs:
    """ModelArgs for a tiny tied-embedding Qwen3.5 text model with one MTP layer and a `window`-token context."""
    s = {**SHAPE, **shape}
    interval = s.pop("full_attention_interval")
    n = s["num_hidden_layers"]
    return ModelArgs(
        model_type="qwen3_5",
        vocab_size=vocab_size,
        layer_types=["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(n)],
        rms_norm_eps=1e-6,
        rope_theta=10_000.0,
        partial_rotary_factor=0.25,
        tie_word_embeddings=True,
        max_position_embeddings=window,  # RoPE extrapolates past the training windows: agents' prompts are 20-30K tokens
        mtp_num_hidden_layers=1,
        eos_token_id=list(eos),
        **s,
    )


def init_model(args: ModelArgs, seed: int) -> Model:
    """GPT-2 style init: N(0, 0.02) matrices, residual output projections scaled by 1/sqrt(2 * depth)."""
    mx.random.seed(seed)
    model = Model(args, with_mtp=True)
    depth = args.num_hidden_layers + 1
    residual_out = ("o_proj.weight", "out_proj.weight", "down_proj.weight")

    def init(path: str, p: mx.array) -> mx.array:
        if path.endswith("A_log"):
            return mx.log(mx.random.uniform(1.0, 16.0, p.shape))  # as HF: A ~ U(1, 16)
        if path.endswith("conv1d.weight"):
            return mx.random.uniform(-1.0, 1.0, p.shape) / math.sqrt(p.shape[1])
        if p.ndim < 2:
            return p  # norms (shifted: ones), dt_bias (ones)
        std = 0.02 / math.sqrt(2 * depth) if path.endswith(residual_out) else 0.02
        return mx.random.normal(p.shape) * std

    model.update(tree_map_with_path(init, model.parameters()))
    mx.eval(model.parameters())
    return model


def count_params(model: Model) -> int:
    return sum(v.size for _, v in tree_flatten(model.parameters()))


# ----------------------------------------------------------------------------------------------------------
# Loss, step, schedule


LOG2E = 1.4426950408889634


def cross_entropy(logits: mx.array, targets: mx.array) -> mx.array:
    """Mean cross-entropy in nats; the softmax uses 2^x because mx.exp is ~3x slower than mx.power on x86 CPUs."""
    top = mx.stop_gradient(logits.max(axis=-1, keepdims=True))  # [..., 1]
    lse = mx.log(mx.power(2.0, (logits - top) * LOG2E).sum(axis=-1)) + top[..., 0]  # [...]
    picked = mx.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]  # [...]
    return (lse - picked).mean()


def losses(model: Model, window: mx.array) -> tuple[mx.array, mx.array]:
    """window [B, S+2] -> (next-token CE, MTP CE on t+2), both mean nats/token."""
    inputs, next1, next2 = window[:, :-2], window[:, 1:-1], window[:, 2:]  # [B, S] each
    logits, hidden = model(inputs)  # [B, S, V], [B, S, hidden] (post-norm)
    draft, _ = model.mtp_forward(next1, hidden)  # [B, S, V]: at p, from embed(t_{p+1}) and h_p, predicts t_{p+2}
    return cross_entropy(logits, next1), cross_entropy(draft, next2)


def schedule(peak: float, steps: int, warmup: int, final_fraction: float = 0.1):
    warm = optim.linear_schedule(peak / warmup, peak, warmup)
    decay = optim.cosine_decay(peak, max(1, steps - warmup), end=peak * final_fraction)
    return optim.join_schedules([warm, decay], [warmup])


def make_optimizer(lr, weight_decay: float) -> optim.Optimizer:
    """AdamW; weight decay on matrices only (norms hold 1 + w in memory, so decaying them would shrink the scale)."""
    betas = (0.9, 0.95)
    return optim.MultiOptimizer(
        [optim.AdamW(lr, betas=betas, weight_decay=weight_decay), optim.AdamW(lr, betas=betas, weight_decay=0.0)],
        [lambda path, w: w.ndim >= 2 and not path.endswith("conv1d.weight")],
    )


def make_step(model: Model, optimizer: optim.Optimizer, mtp_weight: float, clip: float, compile: bool):
    def loss_fn(model: Model, window: mx.array):
        ce, ce_mtp = losses(model, window)
        return ce + mtp_weight * ce_mtp, ce, ce_mtp

    grad_fn = nn.value_and_grad(model, loss_fn)

    def step(window: mx.array):
        (loss, ce, ce_mtp), grads = grad_fn(model, window)
        grads, norm = optim.clip_grad_norm(grads, clip)
        optimizer.update(model, grads)
        return loss, ce, ce_mtp, norm

    if compile:
        state = [model.state, optimizer.state]
        step = partial(mx.compile, inputs=state, outputs=state)(step)
    return step


def agent_windows(tokens: np.ndarray, conversations: list[np.ndarray], head: list[int], tail: list[int], seq: int,
                  seed: int):
    """Endless [1, seq+2] windows shaped like a coding agent's request: a system turn (`head` ... `tail`) holding a
    long stretch of the training text, then one whole chat conversation, so the model learns to answer, and to end
    its answer, thousands of tokens into the window rather than only within its first 256."""
    rng = np.random.default_rng(seed)
    while True:
        conversation = conversations[rng.integers(len(conversations))]
        n = seq + 2 - len(head) - len(tail) - len(conversation)
        start = rng.integers(0, len(tokens) - n)
        yield mx.array(np.concatenate([head, tokens[start : start + n], tail, conversation]).astype(np.int32)[None])


def batches(tokens: np.ndarray, batch: int, seq: int, seed: int):
    """Endless random windows of seq+2 tokens, from a seeded generator (same seed, same order)."""
    rng = np.random.default_rng(seed)
    high = len(tokens) - (seq + 2)
    offsets = np.arange(seq + 2)
    while True:
        starts = rng.integers(0, high, size=batch)
        yield mx.array(tokens[starts[:, None] + offsets[None, :]])


def train(
    model: Model,
    tokens: np.ndarray,
    steps: int,
    batch: int = 16,
    seq: int = 256,
    lr: float = 2e-3,
    warmup: int = 100,
    weight_decay: float = 0.1,
    mtp_weight: float = 0.5,
    clip: float = 1.0,
    seed: int = 0,
    minutes: float | None = None,
    compile: bool = True,
    log_every: int = 25,
    log=print,
    data=None,
) -> dict:
    """Train in place for `steps` steps (or until `minutes` pass) on `data` (windows [B, seq+2]; default: random
    windows of `tokens`); returns a summary of the run."""
    optimizer = make_optimizer(schedule(lr, steps, min(warmup, max(1, steps // 10))), weight_decay)
    step = make_step(model, optimizer, mtp_weight, clip, compile)
    data = batches(tokens, batch, seq, seed) if data is None else data
    model.train()
    start = time.perf_counter()
    history = []
    done = 0
    for i in range(steps):
        with attention.differentiable():  # MLX's attention kernel: the CPU one's numpy softmax has no gradient
            loss, ce, ce_mtp, norm = step(next(data))
        mx.eval(loss, ce, ce_mtp, norm, model.state, optimizer.state)
        done = i + 1
        elapsed = time.perf_counter() - start
        if done % log_every == 0 or done == steps or i == 0:
            rec = dict(step=done, loss=loss.item(), ce=ce.item(), ce_mtp=ce_mtp.item(), grad_norm=norm.item(),
                       lr=optimizer.optimizers[0].learning_rate.item(), seconds=round(elapsed, 1))
            history.append(rec)
            log(f"step {done:5d}/{steps}  loss {rec['loss']:.3f}  ce {rec['ce']:.3f}  mtp {rec['ce_mtp']:.3f}  "
                f"|g| {rec['grad_norm']:.2f}  lr {rec['lr']:.2e}  {done * batch * seq / elapsed:,.0f} tok/s  {elapsed:.0f}s")
        if minutes is not None and elapsed > 60 * minutes:
            log(f"stopping at step {done}: the --minutes {minutes} budget is spent")
            break
    model.eval()
    return dict(steps=done, steps_planned=steps, tokens_seen=done * batch * seq, train_seconds=time.perf_counter() - start,
                history=history)


def chat_tokens(tok, conversations: list[str], budget: int) -> np.ndarray:
    """The conversations' tokens, each followed by <|endoftext|>, until about `budget` tokens are taken."""
    out, taken = [], 0
    for enc in tok.encode_batch([c + tokenizer_train.DOC_SEPARATOR for c in conversations]):
        if taken >= budget:
            break
        out.append(enc.ids)
        taken += len(enc.ids)
    return np.concatenate(out).astype(np.int32) if out else np.zeros(0, np.int32)


# ----------------------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The script's flags, checked (argparse's one-line errors)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True, help="checkpoint directory to write")
    p.add_argument("--steps", type=int, default=400, help="optimizer steps (fixes the LR schedule)")
    p.add_argument("--minutes", type=float, default=None, help="stop training early after this wall time")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup", type=int, default=40)
    p.add_argument("--mtp-weight", type=float, default=0.5)
    p.add_argument("--hidden", type=int, default=SHAPE["hidden_size"])
    p.add_argument("--layers", type=int, default=SHAPE["num_hidden_layers"])
    p.add_argument("--intermediate", type=int, default=SHAPE["intermediate_size"])
    p.add_argument("--corpus-bytes", type=int, default=None, help="cap the training text (for quick trials)")
    p.add_argument("--no-compile", action="store_true")
    p.add_argument("--eval-tokens", type=int, default=None, help="cap the validation tokens evaluated")
    p.add_argument("--chat-share", type=float, default=0.25,
                   help="fraction of training tokens that are chat conversations (hetero.training.chat_samples)")
    p.add_argument("--window", type=int, default=65536, help="max_position_embeddings written to config.json")
    p.add_argument("--chat-eval", type=int, default=16, help="held-out chat prompts decoded to check replies end")
    p.add_argument("--long-steps", type=int, default=60,
                   help="then steps on one --long-seq window each: a long system turn, then a conversation")
    p.add_argument("--long-seq", type=int, default=8192)
    p.add_argument("--long-lr", type=float, default=1e-3)
    p.add_argument("--from", dest="start", type=Path, default=None,
                   help="start from this checkpoint (written by a run with the same corpus and seed) and run only "
                        "the long phase")
    a = p.parse_args(argv)
    if not 0 <= a.chat_share < 1:
        p.error(f"--chat-share {a.chat_share}: a fraction of the training tokens, at least 0 and below 1")
    if a.long_steps and a.long_seq < 2048:
        p.error(f"--long-seq {a.long_seq}: the long phase needs windows of at least 2048 tokens (a system turn and a "
                "whole conversation)")
    if a.start is not None and not (a.start / "training.json").is_file():
        p.error(f"--from {a.start}: not a checkpoint written by this script (no training.json there)")
    return a


@dataclass
class Corpus:
    """The training and validation tokens: code, and chat conversations made from it; the tokenizer trained on it."""

    tok: object  # tokenizers.Tokenizer
    code_ids: np.ndarray  # [n] int32 the training code
    train_ids: np.ndarray  # [n + chat] int32 the code, then the chat conversations' tokens
    valid_ids: np.ndarray  # [m] int32 held-out code
    eos: list[int]  # <|im_end|>, <|endoftext|>
    sources: list  # (module, text, held out) of the corpus
    chat_train: list[str]
    chat_valid: list[str]


def corpus(a: argparse.Namespace, t0: float) -> Corpus:
    """The corpus and its tokenizer (trained on code only: held-out losses compare), as `a` asks."""
    train_text, valid_text = tokenizer_train.load_corpus(a.corpus_bytes)
    tok = tokenizer_train.train_tokenizer(train_text, vocab_size=a.vocab)
    code_ids = np.array(tok.encode(train_text).ids, dtype=np.int32)
    sources = list(tokenizer_train.corpus_sources())
    chat_train = chat_samples.conversations([(m, t) for m, t, held in sources if not held], seed=a.seed)
    chat_valid = chat_samples.conversations([(m, t) for m, t, held in sources if held], seed=a.seed + 1)
    budget = int(len(code_ids) * a.chat_share / (1 - a.chat_share)) if a.chat_share > 0 else 0
    train_ids = np.concatenate([code_ids, chat_tokens(tok, chat_train, budget)])
    valid_ids = np.array(tok.encode(valid_text).ids, dtype=np.int32)
    eos = [tok.token_to_id("<|im_end|>"), tok.token_to_id(tokenizer_train.EOS_TEXT)]
    print(f"corpus: {len(train_text) / 1e6:.1f} MB train -> {len(code_ids):,} code tokens + "
          f"{len(train_ids) - len(code_ids):,} chat tokens ({len(chat_train):,} conversations), {len(valid_ids):,} valid tokens; "
          f"tokenizer vocab {tok.get_vocab_size()} ({time.perf_counter() - t0:.0f}s)", flush=True)
    return Corpus(tok, code_ids, train_ids, valid_ids, eos, sources, chat_train, chat_valid)


def train_phases(a: argparse.Namespace, args: ModelArgs, c: Corpus, log) -> tuple[Model, dict]:
    """The first phase (or the checkpoint `--from` names), then the long phase: (model, what the runs record)."""
    if a.start is None:
        model = init_model(args, a.seed)
        run = train(model, c.train_ids, a.steps, batch=a.batch, seq=a.seq, lr=a.lr, warmup=a.warmup,
                    mtp_weight=a.mtp_weight, seed=a.seed, minutes=a.minutes, compile=not a.no_compile, log=log)
    else:
        model, _, _ = load_model(a.start, dtype=mx.float32, fuse_projections=False)
        run = json.loads((a.start / "training.json").read_text())
        run = {k: run[k] for k in ("steps", "steps_planned", "tokens_seen", "train_seconds", "history")}
        log(f"from {a.start}: its {run['steps']} steps are the first phase")
    print(f"model: {count_params(model):,} parameters, layers {args.layer_types}", flush=True)
    if a.long_steps:
        titles = chat_samples.title_requests([(m, t) for m, t, held in c.sources if not held], seed=a.seed)
        conversations = [np.array(e.ids, np.int32) for e in c.tok.encode_batch(c.chat_train + titles)]
        head, tail = c.tok.encode("<|im_start|>system\n").ids, c.tok.encode("<|im_end|>\n").ids
        data = agent_windows(c.code_ids, conversations, head, tail, a.long_seq, a.seed)
        long = train(model, c.train_ids, a.long_steps, batch=1, seq=a.long_seq, lr=a.long_lr, warmup=5,
                     mtp_weight=a.mtp_weight, seed=a.seed, compile=not a.no_compile, log_every=5, log=log, data=data)
        run = {**run, "long_phase": {"steps": long["steps"], "seq": a.long_seq, "lr": a.long_lr,
                                     "tokens_seen": long["tokens_seen"], "train_seconds": long["train_seconds"],
                                     "history": long["history"]}}
    return model, run


def evaluate_shipped(a: argparse.Namespace, c: Corpus, shipped: Model) -> tuple[dict, dict, dict]:
    """What ships (bf16 weights, reloaded), measured: (validation metrics, greedy samples, chat endings)."""
    tok, eos = c.tok, c.eos
    metrics = evaluate(shipped, c.valid_ids, seq=a.seq, batch=a.batch, max_tokens=a.eval_tokens)
    print(f"validation ({metrics['valid_tokens']:,} tokens): loss {metrics['valid_loss']:.4f} nats/token, "
          f"backbone top-1 {metrics['backbone_top1']:.4f}, MTP loss {metrics['valid_mtp_loss']:.4f}, "
          f"MTP top-1 (t+2) {metrics['mtp_top1']:.4f}", flush=True)
    samples = {}
    for prompt in ("def ", "import os\n"):
        ids = greedy(shipped, tok.encode(prompt).ids, 60, eos=set(eos))
        samples[prompt] = prompt + tok.decode(ids)
        print(f"--- greedy 60 tokens after {prompt!r}:\n{samples[prompt]}\n---", flush=True)
    hello = chat_samples.render([("system", chat_samples.SYSTEM_PROMPTS[0]), ("user", "Say hello.")]) + "<|im_start|>assistant\n"
    samples[hello] = tok.decode(greedy(shipped, tok.encode(hello).ids, 300, eos=set(eos)))
    print(f"--- greedy chat reply to 'Say hello.': {samples[hello]!r}", flush=True)
    chat = chat_endings(shipped, tok, c.chat_valid[: a.chat_eval], end=eos[0])
    print(f"chat: {chat['chat_ended']}/{chat['chat_prompts']} held-out replies end with <|im_end|> within "
          f"{chat['chat_limit']} tokens (median {chat['chat_median_reply_tokens']})", flush=True)
    context = tok.decode(c.valid_ids[: a.long_seq].tolist())  # held-out text as a long system turn, as agents send
    long_chats = [f"<|im_start|>system\n{context}<|im_end|>\n{x}" for x in c.chat_valid[: a.chat_eval]]
    long_chat = chat_endings(shipped, tok, long_chats, end=eos[0])
    chat["long_context"] = {"context_tokens": a.long_seq, **long_chat}
    print(f"chat after {a.long_seq} tokens of context: {long_chat['chat_ended']}/{long_chat['chat_prompts']} end "
          f"(median {long_chat['chat_median_reply_tokens']})", flush=True)
    return metrics, samples, chat


def main(argv: list[str] | None = None) -> dict:
    a = parse_args(argv)
    reexec_with_fast_blas(["-m", "hetero.training.train_tiny", *sys.argv[1:]])

    t0 = time.perf_counter()
    blas = describe()
    print(f"BLAS: {blas}", flush=True)
    mx.random.seed(a.seed)
    np.random.seed(a.seed)
    c = corpus(a, t0)
    args = make_args(c.tok.get_vocab_size(), c.eos, window=a.window, hidden_size=a.hidden,
                     num_hidden_layers=a.layers, intermediate_size=a.intermediate)
    model, run = train_phases(a, args, c, log=lambda s: print(s, flush=True))

    out = a.out
    out.mkdir(parents=True, exist_ok=True)
    config = hf_export.hf_config(args, c.eos, SHAPE["full_attention_interval"])
    hf_export.save_hf_checkpoint(model, config, out)
    tokenizer_train.save_tokenizer(c.tok, out, max_length=a.window)
    check = check_checkpoint(model, out, c.valid_ids[: a.seq], log=lambda s: print(s, flush=True))
    shipped, _, _ = load_model(out, dtype=mx.float32)  # evaluate what ships (bf16 weights), not the fp32 copy
    metrics, samples, chat = evaluate_shipped(a, c, shipped)

    size = (out / "model.safetensors").stat().st_size
    summary = dict(
        shape={**{k: v for k, v in config["text_config"].items() if k != "layer_types"}, "layer_types": args.layer_types},
        parameters=count_params(model),
        checkpoint_bytes=size,
        seed=a.seed,
        blas=blas,
        batch=a.batch,
        seq=a.seq,
        lr=a.lr,
        warmup=a.warmup,
        mtp_weight=a.mtp_weight,
        compile=not a.no_compile,
        train_tokens_available=int(len(c.train_ids)),
        chat_share=a.chat_share,
        chat_tokens=int(len(c.train_ids) - len(c.code_ids)),
        **chat,
        **{k: v for k, v in run.items() if k != "history"},
        **metrics,
        reload_check=check,
        samples=samples,
        wall_seconds=round(time.perf_counter() - t0, 1),
        mlx_version=mx.__version__,
        history=run["history"],
    )
    (out / "training.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(f"wrote {out} ({size / 1e6:.1f} MB weights), total wall time {summary['wall_seconds'] / 60:.1f} min", flush=True)
    return summary


if __name__ == "__main__":
    main()
