"""The `hetero` command line's flags: one parser per subcommand, one-line usage errors, defaults in the help."""

from __future__ import annotations

import argparse
import os

from hetero.checkpoint.dtypes import DTYPES, dtype_name, parse_dtype, platform_dtype
from hetero.cli.tune import TUNE_SECONDS
from hetero.coreml.export import DEFAULT_WEIGHT_FORM, WEIGHT_FORMS
from hetero.decode.depth import DEPTH
from hetero.decode.penalties import BIAS, FREQUENCY, PRESENCE, REPETITION
from hetero.errors import HeteroError
from hetero.host.settings import DEFAULT_DRAFT_DEPTH
from hetero.validate import (
    GPU_ONLY, MIN_P, NONNEG, PORT, POSITIVE, POSITIVE_INT, SEED, TEMPERATURE, TOP_K, TOP_P, AneSplit, Bound,
    ane_split_arg,
)
from hetero.pipeline.verify_tolerance import tolerance_table
from hetero.version import __version__

HALF = AneSplit(0.5)  # the split `hetero plan` and `hetero doctor` take when none is given


def add_ane_weights(p: argparse.ArgumentParser) -> None:
    """`--ane-weights`: how a quantized checkpoint's weights reach the ANE's programs (both exact)."""
    p.add_argument("--ane-weights", choices=WEIGHT_FORMS, default=DEFAULT_WEIGHT_FORM,
                   help="with --ane-fraction: the Core ML form of 4-bit (and fewer) weights, all MLX's weights exactly: "
                   "fp16 (expanded), lut (a lookup table per row and group) or blockwise "
                   "(constexpr_blockwise_shift_scale for every matrix whose every group has an exact scale and offset, "
                   "the rest tables); below macOS 15 every form is fp16; `hetero doctor` recommends one for this Mac")


class Parser(argparse.ArgumentParser):
    """argparse with one-line usage errors (exit 1, like every other user error) and defaults shown in help."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", DefaultsFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str):
        """Print what is wrong on one line and where to look, then exit 1 (argparse's own way is usage + exit 2)."""
        self.exit(1, f"{self.prog}: error: {message} (see `{self.prog} --help`)\n")


class DefaultsFormatter(argparse.HelpFormatter):
    """Appends '(default: X)' to each option's help unless the help already says its default."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" in text or action.default in (None, argparse.SUPPRESS) or action.nargs == 0:
            return text  # flags are off unless given; None defaults are explained in the help itself
        return f"{text} (default: %(default)s)"


def token_counts(text: str) -> str:
    """argparse type for --context lists: comma-separated integers >= 1 (kept as given; the exporter splits it)."""
    parts = [c.strip() for c in text.split(",") if c.strip()]
    if not parts:
        raise argparse.ArgumentTypeError("give one or more token counts separated by commas")
    for c in parts:
        POSITIVE_INT(c)
    return text


def logit_bias_item(text: str) -> tuple[int, float]:
    """argparse type for --logit-bias ID=BIAS: a token id and a bias in [-100, 100]."""
    token, sep, bias = text.partition("=")
    try:
        item = int(token), float(bias)
    except ValueError:
        item = None
    if not sep or item is None or item[0] < 0:
        raise argparse.ArgumentTypeError(f"{text!r}: give a token id and a bias as ID=BIAS, e.g. 13=-100")
    why = BIAS.problem(item[1])
    if why is not None:
        raise argparse.ArgumentTypeError(f"the bias {why}")
    return item


def _add_model(p: argparse.ArgumentParser, also: str = "") -> None:
    p.add_argument("--model", help=f"checkpoint directory or hub id{', ' + also if also else ''} "
                                   "(default: the bundled model)")
    p.add_argument("--debug", action="store_true", help="show tracebacks for errors")


def dtype_arg(text: str):
    """argparse type for --dtype: a dtype name -> mx.Dtype (a bad name: one line naming the choices)."""

    try:
        return parse_dtype(text)
    except HeteroError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _add_dtype(p: argparse.ArgumentParser) -> None:
    """--dtype, the one parser of it for every command that loads a model to compute with."""

    p.add_argument("--dtype", type=dtype_arg, default=dtype_name(platform_dtype()), metavar="{" + ",".join(DTYPES) + "}",
                   help="compute dtype the model loads in (the platform's: float32 on a CPU, bfloat16 on a GPU; "
                   "the ANE lane computes fp16 whatever it is)")


def _add_kv(p: argparse.ArgumentParser) -> None:
    """--kv-bits / --kv-group-size: the attention layers' KV stored quantized (`hetero.models.kv_quant`)."""

    p.add_argument("--kv-bits", type=int, choices=[8, 4],
                   help="store the attention layers' KV quantized to 8 or 4 bits (the GDN state stays fp32); a "
                   "longer context fits in the same memory (default: the compute dtype, full precision)")
    p.add_argument("--kv-group-size", type=int, choices=[32, 64, 128],
                   help="with --kv-bits: values per scale and bias along head_dim (default: 64)")


def build_parser() -> argparse.ArgumentParser:

    parser = Parser(prog="hetero", description="Fast hybrid-LLM inference on Apple Silicon.")
    parser.add_argument("--version", action="version", version=f"hetero {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    run = sub.add_parser("run", help="generate text for a prompt")
    _add_model(run)
    _add_dtype(run)
    run.add_argument("--prompt", required=True, help="prompt text, or - to read it from stdin")
    run.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    run.add_argument("--image", action="append", metavar="FILE",
                     help="an image file (PNG, JPEG or WebP) for a model with a vision tower, placed before the "
                     "prompt in one chat-template user turn (implies --chat; repeatable, in order; default: none)")
    run.add_argument("--max-tokens", type=POSITIVE_INT, default=256, help="most tokens to generate")
    run.add_argument("--temp", type=TEMPERATURE, default=0.0, help="sampling temperature (0 = greedy)")
    run.add_argument("--top-p", type=TOP_P, default=1.0, help="nucleus sampling: keep the most likely tokens up to this mass")
    run.add_argument("--top-k", type=TOP_K, default=0, help="keep the k most likely tokens; 0 disables top-k")
    run.add_argument("--min-p", type=MIN_P, default=0.0, help="drop tokens below this share of the most likely one's probability")
    run.add_argument("--seed", type=SEED, default=None, help="random seed for sampling (default: a fresh random seed)")
    run.add_argument("--presence-penalty", type=PRESENCE, default=0.0,
                     help="subtract this from the logit of every token the reply already holds (vLLM's semantics)")
    run.add_argument("--frequency-penalty", type=FREQUENCY, default=0.0,
                     help="subtract this times the count of each token in the reply so far")
    run.add_argument("--repetition-penalty", type=REPETITION, default=1.0,
                     help="divide positive / multiply negative logits of tokens in the prompt or reply (1 = off)")
    run.add_argument("--logit-bias", type=logit_bias_item, action="append", metavar="ID=BIAS",
                     help="add BIAS (-100..100) to token ID's logit (repeatable; default: none)")
    run.add_argument("--prefill-chunk", type=POSITIVE_INT, default=512, help="prompt tokens per prefill step")
    run.add_argument("--no-mtp", action="store_true", help="plain decoding (no speculative MTP drafts)")
    run.add_argument("--draft-depth", type=DEPTH, default=None,
                     help=f"MTP draft tokens per step (default: tuned, else calibrated, else {DEFAULT_DRAFT_DEPTH})")
    run.add_argument("--no-copy", action="store_true", help="no copy-lane drafts from n-grams of the context")
    run.add_argument("--json", action="store_true", help="print one JSON object (text, tokens, stats) instead of streaming")
    run.add_argument("--memory-gb", type=POSITIVE, help="RAM the memory governor budgets (default: this machine's)")
    _add_kv(run)
    run.add_argument("--ane-fraction", type=ane_split_arg, default=GPU_ONLY,
                     help="split prefill: share F of each offloadable piece for the ANE lane, "
                     "or 'auto' (this machine's measured profile, verified on a calibration prompt); 0 or default: GPU-only")
    add_ane_weights(run)
    run.add_argument("--verify", action="store_true", help="with --ane-fraction: rerun GPU-only and compare; under "
                     "mlx.launch: rerun in one process on rank 0 and compare; exit 3 on mismatch")
    run.add_argument("--verify-tol", type=NONNEG, default=None,
                     help="a fixed tolerance instead of the default judgement (the split no farther from the same "
                     "prompt in fp32 than 1.5x GPU-only's own distance plus the fp16 share's allowance): the largest "
                     "distance from GPU-only that still matches, the largest relative RMS difference of any block of "
                     "the last logits and the cache (a head's keys over 64 tokens, a head's state; without an fp32 "
                     "copy's room the dtype's: "
                     + ", ".join(f"{k} {v:g}" for k, v in tolerance_table().items()) + ")")
    run.add_argument("--verify-tokens", type=POSITIVE_INT, default=32, help="greedy tokens that must be identical")
    run.add_argument("--trace", metavar="FILE",
                     help="with --ane-fraction: write a Chrome trace (one track per device; default: no trace)")
    run.add_argument("--dist-timeout", type=POSITIVE, default=60.0, metavar="S",
                     help="under mlx.launch (layers split across ranks): seconds without progress from the other "
                     "ranks (or to connect) before a rank stops with an error")

    check = sub.add_parser("check", help="pre-flight check of a checkpoint without loading weights")
    _add_model(check)
    check.add_argument("--context", type=POSITIVE_INT, default=4096, help="context length for the peak-memory estimate")
    check.add_argument("--json", action="store_true", help="print the report as JSON")

    tune = sub.add_parser("tune", help="measure plain decoding and MTP draft depths here, until the verdict is beyond "
                                       "the noise; save it")
    _add_model(tune)
    _add_dtype(tune)
    tune.add_argument("--tokens", type=POSITIVE_INT, default=256, help="tokens decoded per prompt and setting")
    tune.add_argument("--seconds", type=POSITIVE, default=TUNE_SECONDS,
                      help=f"time cap of the measurement (default {TUNE_SECONDS:g}); a verdict still inside the noise "
                           "is measured again later")
    tune.add_argument("--show", action="store_true",
                      help="print what is saved for this machine (each verdict and why, the device profile) and what "
                           "would be measured again; measures nothing")
    tune.add_argument("--devices", action="store_true",
                      help="measure the GPU lane (MLX) and the ANE lane (with --model: at its shapes); save them as "
                           "the this-machine profile")

    serve = sub.add_parser("serve", help="OpenAI- and Anthropic-compatible HTTP server with a prefix cache")
    _add_model(serve)
    _add_dtype(serve)
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    serve.add_argument("--port", type=PORT, default=8080, help="TCP port to listen on")
    serve.add_argument("--api-key", default=os.environ.get("HETERO_API_KEY"),
                       help="require 'Authorization: Bearer KEY' (default: $HETERO_API_KEY, else no key)")
    serve.add_argument("--served-model-name", help="another name clients may use in 'model' (default: only the model's own name)")
    serve.add_argument("--prefix-cache-max-gb", type=NONNEG, default=2.0, help="RAM for prefix-cache checkpoints")
    serve.add_argument("--session-cache", metavar="DIR", help="on-disk session cache (default: ~/.cache/hetero/sessions)")
    serve.add_argument("--session-cache-max-gb", type=NONNEG, default=16.0, help="disk for the session cache")
    serve.add_argument("--no-session-cache", action="store_true", help="keep checkpoints in RAM only")
    _add_kv(serve)
    serve.add_argument("--ane-fraction", type=ane_split_arg, default=GPU_ONLY,
                       help="split each prompt's prefill: share F for the ANE lane, or 'auto' (0 or default: GPU-only)")
    add_ane_weights(serve)
    serve.add_argument("--draft-depth", type=DEPTH, default=None,
                       help="every MTP request's draft tokens per step (default: tuned, else calibrated at start-up)")
    serve.add_argument("--prefill-chunk", type=POSITIVE_INT, default=512, help="prompt tokens per prefill step (and per turn)")
    serve.add_argument("--max-concurrent", type=POSITIVE_INT, default=4,
                       help="requests generating at once, taking turns on the model (more wait in line)")
    serve.add_argument("--default-max-tokens", type=POSITIVE_INT, default=4096,
                       help="max_tokens of an OpenAI request that leaves it out (capped by the context window)")
    serve.add_argument("--max-body-mb", type=POSITIVE, default=32.0,
                       help="largest request body in MB; a larger one gets a 413")
    serve.add_argument("--decode-share", type=Bound(0, 1, hi_open=True), default=0.8,
                       help="share of the model's time that decoding requests, and requests sent earlier, keep "
                            "while a later prompt prefills (0: chunk for chunk, round-robin)")
    serve.add_argument("--max-batch", type=POSITIVE_INT, default=None,
                       help="decoding requests that share each decode pass (1: each decodes in its own turns; "
                            "default: 4, or 1 under mlx.launch)")
    serve.add_argument("--dist-timeout", type=POSITIVE, default=60.0, metavar="S",
                       help="under mlx.launch (layers split across ranks, rank 0 serving HTTP): seconds without "
                       "progress from the other ranks during a request (or to connect) before a rank stops with an error")
    serve.add_argument("--model-alias", action="append", metavar="PATTERN=NAME",
                       help="serve requests whose 'model' matches PATTERN (shell wildcards, e.g. 'claude-*') with the "
                            "model NAME; replies report the name asked (repeatable; default: none, names must match)")
    serve.add_argument("--reject-images", action="store_true",
                       help="refuse an image in a text-only model's conversation with a 400 (default: a text "
                            "placeholder stands in for it, with an x-hetero-warning header)")
    serve.add_argument("--allow-local-images", action="store_true",
                       help="a model with a vision tower may read image parts that name a local file (an absolute "
                            "path or file:// URL) on this machine (default: only data URLs and base64 images)")
    serve.add_argument("--max-image-mb", type=POSITIVE, default=20.0, metavar="MB",
                       help="the largest image file a request may send, in MB (default: 20); larger is a 400")
    serve.add_argument("--metrics-public", action="store_true",
                       help="serve GET /metrics (Prometheus text) without the --api-key, for a scraper that sends "
                            "none (default: /metrics needs the key like the /v1 routes)")

    plan = sub.add_parser("plan", help="plan the ANE/GPU split of prefill, predict its time, resolve the context window")
    _add_model(plan)
    plan.add_argument("--profile", help="hardware profile (m4-pro, m3-ultra, m5-max, ..., this-machine; "
                      "default: this-machine when `hetero tune --devices` has measured it, else m4-pro)")
    plan.add_argument("--ane-fraction", type=ane_split_arg, default=HALF,
                      help="requested ANE share of each offloadable piece (0: GPU-only; auto: as --recommend, the "
                      "fraction `--ane-fraction auto` starts from)")
    plan.add_argument("--recommend", action="store_true", help="pick the fraction that balances both devices")
    plan.add_argument("--pieces", metavar="KINDS",
                      help="comma-separated piece kinds that take the ANE share (attention, mlp, gdn_in_proj or z, "
                           "shared_expert; all: every kind; default: those whose share shortens the predicted prefill); "
                           "the others stay whole on the GPU")
    plan.add_argument("--context", type=POSITIVE_INT, help="context length in tokens (default: min(32768, model maximum))")
    plan.add_argument("--chunk", type=POSITIVE_INT, default=512, help="prefill chunk in tokens (multiple of 64)")
    plan.add_argument("--prompt-tokens", type=POSITIVE_INT, help="prompt length for the TTFT prediction (default: the context)")
    plan.add_argument("--bits", type=int, choices=[2, 3, 4, 5, 6, 8, 16],
                      help="weight bits when the config has no quantization (default 16)")
    plan.add_argument("--group-size", type=int, choices=[32, 64, 128], help="quantization group size (default 64)")
    plan.add_argument("--memory-gb", type=POSITIVE,
                      help="RAM to budget: prints the budget and the largest context window (default: no budget)")
    _add_kv(plan)
    plan.add_argument("--accepted-length", type=Bound(1), default=2.5, help="MTP tokens per verify pass for the decode estimate")
    plan.add_argument("--draft-depth", type=DEPTH, default=DEFAULT_DRAFT_DEPTH, help="MTP draft depth for the decode estimate")
    plan.add_argument("--hosts", type=POSITIVE_INT,
                      help="also plan a pipeline over N hosts: the layer split, memory per host, pipelined prefill and "
                      "decode (default: one host, no pipeline section)")
    plan.add_argument("--link-gbps", type=POSITIVE, help="with --hosts: the link's usable bandwidth in Gb/s "
                      "(default: the profile's; unknown when it has none)")
    plan.add_argument("--link-latency-ms", type=NONNEG, help="with --hosts: a message's fixed cost over the link in ms "
                      "(default: the profile's; unknown when it has none)")
    plan.add_argument("--json", action="store_true", help="print the plan as one JSON object")

    convert = sub.add_parser("convert", help="write a converted copy of a checkpoint")
    _add_model(convert)
    mode = convert.add_mutually_exclusive_group(required=True)
    mode.add_argument("--quantize", type=int, choices=[2, 3, 4, 5, 6, 8], help="bits per weight (default: no quantization)")
    mode.add_argument("--coreml", action="store_true", help="export the ANE's share of prefill as Core ML packages")
    mode.add_argument("--lint", metavar="DIR",
                      help="check exported Core ML packages against the ANE rules (exit 1 on errors; default: no lint)")
    convert.add_argument("--group-size", type=int, default=64, choices=[32, 64, 128], help="with --quantize: group size")
    convert.add_argument("--ane-fraction", type=ane_split_arg, default=GPU_ONLY,
                         help="with --coreml: share of each offloadable piece for the ANE (required there; default: none)")
    convert.add_argument("--chunk-size", type=POSITIVE_INT, default=256, help="with --coreml: prefill chunk (multiple of 64)")
    add_ane_weights(convert)
    convert.add_argument("--target", choices=("macos14", "macos15"), default=None,
                         help="with --coreml: the macOS the programs are built for (macos14: fp16 weights, one "
                              "package per context bucket, Core ML spec 8; macos15: any weight form, spec 9; default: "
                              "this machine's, macos15 off a Mac)")
    convert.add_argument("--context", type=token_counts, default="4096", help="with --coreml: context bucket(s) in tokens, comma separated")
    convert.add_argument("--out",
                         help="output directory (--quantize: must not exist or be empty; --coreml: reused; default: none, required)")

    doc = sub.add_parser("doctor", help="check the split prefill end to end here, each check with its verdict: backend, "
                                        "OS target, placement, CPU fallback, numbers, weight forms, the split")
    _add_model(doc, also="or a bare config.json (the plan's programs probed with random weights; no split)")
    _add_dtype(doc)
    doc.add_argument("--tokens", type=POSITIVE_INT, default=1024, help="prompt tokens of the split prefill measured")
    doc.add_argument("--ane-fraction", type=ane_split_arg, default=HALF, help="the split's ANE share (0 < F <= 1)")
    add_ane_weights(doc)
    doc.add_argument("--json", action="store_true", help="print the findings as one JSON object")

    pre = sub.add_parser("prefill", help="prefill a prompt and write mlx-lm's prompt-cache file (mlx_lm.generate --prompt-cache-file)")
    _add_model(pre)
    _add_dtype(pre)
    pre.add_argument("--prompt-file", required=True, help="the prompt: a UTF-8 text file, or - for stdin")
    pre.add_argument("--out", required=True, help="the .safetensors prompt-cache file to write")
    pre.add_argument("--prefill-chunk", type=POSITIVE_INT, default=None, help="prompt tokens per prefill step (default: 512; 256 split)")
    pre.add_argument("--ane-fraction", type=ane_split_arg, default=GPU_ONLY,
                     help="split prefill as in `hetero run` (0 or default: GPU-only)")
    add_ane_weights(pre)
    pre.add_argument("--verify", action="store_true", help="with --ane-fraction: check the split against GPU-only; exit 1 on mismatch")
    return parser
