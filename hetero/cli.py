"""`hetero` command line: run, check, tune, serve, convert."""

from __future__ import annotations

import argparse
import json
import os
import sys

from hetero.errors import HeteroError


def _add_model(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="checkpoint directory or hub id (default: the bundled model)")
    p.add_argument("--debug", action="store_true", help="show tracebacks for errors")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hetero", description="Fast hybrid-LLM inference on Apple Silicon.")
    sub = parser.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="generate text for a prompt")
    run.set_defaults(func=cmd_run)
    _add_model(run)
    run.add_argument("--prompt", required=True, help="prompt text, or - to read it from stdin")
    run.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    run.add_argument("--max-tokens", type=int, default=256)
    run.add_argument("--temp", type=float, default=0.0, help="sampling temperature (0 = greedy)")
    run.add_argument("--top-p", type=float, default=1.0)
    run.add_argument("--top-k", type=int, default=0, help="0 disables top-k")
    run.add_argument("--min-p", type=float, default=0.0)
    run.add_argument("--seed", type=int, default=None)
    run.add_argument("--prefill-chunk", type=int, default=512, help="prompt tokens per prefill step")
    run.add_argument("--no-mtp", action="store_true", help="plain decoding (no speculative MTP drafts)")
    run.add_argument("--draft-depth", type=int, default=None, help="MTP draft tokens per step (default: tuned, else 3)")
    run.add_argument("--no-copy", action="store_true", help="no copy-lane drafts from n-grams of the context")
    run.add_argument("--json", action="store_true", help="print one JSON object (text, tokens, stats) instead of streaming")

    check = sub.add_parser("check", help="pre-flight check of a checkpoint without loading weights")
    check.set_defaults(func=cmd_check)
    _add_model(check)
    check.add_argument("--context", type=int, default=4096, help="context length for the peak-memory estimate")
    check.add_argument("--json", action="store_true", help="print the report as JSON")

    tune = sub.add_parser("tune", help="measure plain decoding and MTP draft depths here; save the fastest")
    tune.set_defaults(func=cmd_tune)
    _add_model(tune)
    tune.add_argument("--tokens", type=int, default=256, help="tokens decoded per prompt and setting")

    serve = sub.add_parser("serve", help="OpenAI- and Anthropic-compatible HTTP server with a prefix cache")
    serve.set_defaults(func=cmd_serve)
    _add_model(serve)
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    serve.add_argument("--port", type=int, default=8080)
    serve.add_argument("--api-key", default=os.environ.get("HETERO_API_KEY"),
                       help="require 'Authorization: Bearer KEY' (default: $HETERO_API_KEY, else no key)")
    serve.add_argument("--served-model-name", help="another name clients may use in 'model'")
    serve.add_argument("--prefix-cache-max-gb", type=float, default=2.0, help="RAM for prefix-cache checkpoints")
    serve.add_argument("--session-cache", metavar="DIR", help="on-disk session cache (default: ~/.cache/hetero/sessions)")
    serve.add_argument("--session-cache-max-gb", type=float, default=16.0, help="disk for the session cache")
    serve.add_argument("--no-session-cache", action="store_true", help="keep checkpoints in RAM only")

    convert = sub.add_parser("convert", help="write a converted copy of a checkpoint")
    convert.set_defaults(func=cmd_convert)
    _add_model(convert)
    mode = convert.add_mutually_exclusive_group(required=True)
    mode.add_argument("--quantize", type=int, choices=[2, 3, 4, 5, 6, 8], help="bits per weight")
    mode.add_argument("--coreml", action="store_true", help="export the ANE's share of prefill as Core ML packages")
    mode.add_argument("--lint", metavar="DIR", help="check exported Core ML packages against the ANE rules (exit 1 on errors)")
    convert.add_argument("--group-size", type=int, default=64, choices=[32, 64, 128])
    convert.add_argument("--ane-fraction", type=float, help="with --coreml: share of each offloadable piece for the ANE")
    convert.add_argument("--chunk-size", type=int, default=256, help="with --coreml: prefill chunk (multiple of 64)")
    convert.add_argument("--context", default="4096", help="with --coreml: context bucket(s) in tokens, comma separated")
    convert.add_argument("--out", help="output directory (--quantize: must not exist or be empty; --coreml: reused)")
    return parser


def cmd_run(args: argparse.Namespace) -> int:
    import hetero
    from hetero.progress import ProgressBar

    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    engine = hetero.load(args.model)

    def write(text: str) -> None:
        sys.stdout.write(text)
        sys.stdout.flush()

    result = engine.generate(
        prompt,
        max_tokens=args.max_tokens,
        temperature=args.temp,
        top_k=args.top_k,
        top_p=args.top_p,
        min_p=args.min_p,
        seed=args.seed,
        chat=args.chat,
        prefill_chunk=args.prefill_chunk,
        mtp=False if args.no_mtp else None,
        draft_depth=args.draft_depth,
        copy=not args.no_copy,
        on_text=None if args.json else write,
        progress=ProgressBar("prefill"),
    )
    if args.json:
        print(json.dumps({"text": result.text, "tokens": result.tokens, **result.stats}))
    else:
        s = result.stats
        sys.stdout.write("\n")
        mtp = s.get("mtp")
        spec = f"; MTP depth {mtp['depth']}, {mtp['mean_accepted_length']} tokens/pass" if mtp and mtp["rounds"] else ""
        print(
            f"[{s['prompt_tokens']} prompt tokens, {s['generated_tokens']} generated; TTFT {s['ttft_s']:.3f}s, "
            f"prefill {s['prefill_tps']:.1f} tok/s, decode {s['decode_tps']:.1f} tok/s{spec}]",
            file=sys.stderr,
        )
    return 0


def cmd_check(args: argparse.Namespace) -> int:
    from hetero.loader import preflight

    report = preflight(args.model, context=args.context)
    if args.json:
        print(json.dumps(report.to_json(), indent=1))
    else:
        print("\n".join(report.lines()))
    return 0 if report.ok else 1


def cmd_tune(args: argparse.Namespace) -> int:
    import hetero
    from hetero.tune import tune

    engine = hetero.load(args.model)
    if not engine.model.has_mtp:
        raise HeteroError(f"{engine.name} has no MTP head: there is no draft depth to tune")
    tune(engine, tokens=args.tokens)
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from hetero.server import serve

    serve(args.model, args.host, args.port, args.api_key, args.session_cache, args.session_cache_max_gb,
          args.no_session_cache, args.prefix_cache_max_gb, args.served_model_name)
    return 0


def cmd_convert(args: argparse.Namespace) -> int:
    if args.lint:
        from converters.coreml_export import cli_lint

        return cli_lint(args.lint)
    if args.out is None:
        raise HeteroError("hetero convert --quantize/--coreml needs --out DIR")
    if args.coreml:
        from converters.coreml_export import cli_export

        return cli_export(args.model, args.out, args.ane_fraction, args.chunk_size, args.context)
    from converters.quantize import quantize_checkpoint

    out = quantize_checkpoint(args.model, args.out, bits=args.quantize, group_size=args.group_size)
    print(f"wrote {args.quantize}-bit copy to {out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except HeteroError as e:
        if args.debug:
            raise
        print(f"hetero: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\nhetero: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
