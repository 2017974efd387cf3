"""MTP speculative decoding against plain decoding, in the same run.

    python bench/mtp.py                 # both parts; JSON + PNGs under bench/results/
    python bench/mtp.py --part bundled  # 1. the bundled model on code prompts
    python bench/mtp.py --part large    # 2. a ~540 MB random model: step costs and forced-acceptance speed
    python bench/mtp.py --part qwen4 --tokens 64 --out bench/results/mtp_qwen4.json  # 3. depths 1..5 on Qwen4-Exp

Part 1 (bundled model, greedy, code-like prompts from the standard library): decode tok/s with MTP at depths
1..4 and with --no-mtp, alternating, median of the repeats; acceptance by depth and mean accepted length; and
acceptance against context length (prompts of ~1K, 4K and 8K tokens). Every depth's greedy output must equal plain
decoding's on every prompt, or the run exits with status 1 after writing its results.
Part 2 (large random model, where a decode step reads ~1 GB of weights): the cost of one verify pass over k+1
tokens and of one draft step, each relative to a plain decode step; then tokens/s when drafts are accepted at
forced per-depth rates (a benchmark-only mode that decides acceptance by coin flips and discards the output)
against plain decoding: the speed-vs-acceptance curve. Copy lane off throughout, so MTP alone is measured.
Part 3 (the random scaled-down Flash-Next of bench/checkpoints.py, `qwen4_exp`; not in `both`): draft depths 1..5.
The head's own cost first: a pass over M pending pairs with its draft logits, against a plain step, as the
catch-up runs it (the last pair alone past its keys) and over every pair. No trained Qwen4-Exp head exists here, and a random head accepts nothing, so two stand-ins: (a) the random model's
own step costs (verify over k+1 tokens, one draft step) and its speed under acceptance forced to the published
27B Qwen3.5 rates, continued at depths 4 and 5 by the same fall per position (an assumption, said in the JSON); (b)
real greedy decoding with a constructed head that agrees with the backbone (tests/test_qwen4_mtp.py `agreeing`:
the backbone's blocks scaled down so that it mostly says f(last token), the head built to draft f), whose
acceptance is real but whose fall with depth is not a trained head's. Greedy output at every depth must equal
plain decoding's.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.checkpoints import checkpoint  # noqa: E402
from hetero.cli.measure import median_seconds  # noqa: E402
from hetero.decode.records import DecodeTimes  # noqa: E402
from hetero.decode.rows import Round  # noqa: E402
from hetero.decode.sampling import Sampler, SamplingParams  # noqa: E402
from hetero.decode.solo import decode_tokens  # noqa: E402
from hetero.decode.stepper import Batch  # noqa: E402
from hetero.engine import Engine, load  # noqa: E402
from hetero.host.blas import reexec_with_fast_blas  # noqa: E402
from hetero.host.environment import environment
from hetero.training.tokenizer_train import load_corpus  # noqa: E402

PUBLISHED_RATES = (0.95, 0.88, 0.80)  # acceptance by depth reported for a real 27B Qwen3.5 MTP head


def code_prompts(engine: Engine, n: int, tokens: int) -> list[list[int]]:
    """n prompts of `tokens` tokens cut from held-out standard-library source (the bundled model never trained on it)."""
    _, valid = load_corpus()
    ids = engine.tokenizer.encode(valid)
    step = max(tokens, (len(ids) - tokens) // n)
    return [ids[i * step : i * step + tokens] for i in range(n) if i * step + tokens <= len(ids)]


def bundled_part(args: argparse.Namespace) -> dict:
    engine = load(None, dtype=mx.float32)
    prompts = code_prompts(engine, args.prompts, 256)
    settings = ["plain"] + [f"depth {d}" for d in (1, 2, 3, 4)]

    outputs: dict[tuple[int, str], list[int]] = {}

    def run(setting: str, prompt: list[int]) -> dict:
        depth = None if setting == "plain" else int(setting.split()[1])
        result = engine.generate(prompt, max_tokens=args.tokens, mtp=depth is not None, draft_depth=depth, copy=False)
        outputs[(id(prompt), setting)] = result.tokens
        return result.stats

    run("plain", prompts[0]), run("depth 3", prompts[0])  # warm-up
    samples: dict[str, list[dict]] = {s: [] for s in settings}
    for _ in range(args.repeats):
        for prompt in prompts:
            for s in settings:  # alternate the contenders on the same prompt
                samples[s].append(run(s, prompt))
    differ = sorted({s for (p, s), toks in outputs.items() if toks != outputs[(p, "plain")]})
    rows = {}
    plain_tps = statistics.median(r["decode_tps"] for r in samples["plain"])
    for s in settings:
        tps = [r["decode_tps"] for r in samples[s]]
        row = {"decode_tps": statistics.median(tps), "decode_tps_runs": tps, "speedup": statistics.median(tps) / plain_tps}
        if s != "plain":
            mtp = [r["mtp"] for r in samples[s]]
            depth = mtp[0]["depth"]
            row["acceptance_by_depth"] = [statistics.mean(m["acceptance_by_depth"][i] for m in mtp) for i in range(depth)]
            row["mean_accepted_length"] = statistics.mean(m["mean_accepted_length"] for m in mtp)
        rows[s] = row
        extra = f"  accepted length {row['mean_accepted_length']:.2f}  by depth {[round(a, 2) for a in row['acceptance_by_depth']]}" if s != "plain" else ""
        print(f"bundled {s:8s} {row['decode_tps']:7.1f} tok/s  {row['speedup']:5.2f}x{extra}", flush=True)

    by_context = {}
    for length in args.contexts:
        if length + args.tokens >= engine.max_context:
            continue
        accepted = [
            engine.generate(p, max_tokens=args.tokens, mtp=True, draft_depth=3, copy=False).stats["mtp"]
            for p in code_prompts(engine, 2, length)
        ]
        by_context[length] = {
            "acceptance_by_depth": [statistics.mean(m["acceptance_by_depth"][i] for m in accepted) for i in range(3)],
            "mean_accepted_length": statistics.mean(m["mean_accepted_length"] for m in accepted),
        }
        print(f"bundled context {length:5d}: accepted length {by_context[length]['mean_accepted_length']:.2f}", flush=True)
    return {"settings": rows, "acceptance_vs_context": by_context, "prompt_tokens": 256, "decode_tokens": args.tokens,
            "greedy_identical_to_plain": not differ, "differing_settings": differ}


class Forced(Batch):
    """The stepper with its acceptance forced: draft i is kept with the conditional probability that makes
    acceptance_by_depth == `rates`, and the next token is the target's argmax after the kept drafts. `drafts`, when
    set, replaces the MTP head's proposals (a verify pass alone). Every other step is the stepper's own."""

    def __init__(self, model, rates: tuple[float, ...], rng, drafts: list[int] | None = None):
        super().__init__(model, max_batch=1)
        self.rates, self.rng, self.drafts = rates, rng, drafts

    def _propose(self, rows, plans):
        return super()._propose(rows, plans) if self.drafts is None else Round([list(self.drafts)], [None], [False])

    def _accept(self, rows, rnd, target):
        accepted = 0
        for i in range(len(rnd.drafts[0])):
            keep = self.rates[i] / (self.rates[i - 1] if i else 1.0) if self.rates[i] else 0.0
            if self.rng.random() >= keep:
                break
            accepted += 1
        rnd.accepted, rnd.next = [accepted], [int(mx.argmax(target[0, accepted]).item())]


def forced_tps(model, prompt: list[int], depth: int, rates: tuple[float, ...], rounds: int, rng) -> float:
    """Tokens/s of `rounds` stepper rounds at `depth` under forced acceptance (`Forced`)."""
    batch = Forced(model, rates, rng)
    row = batch.join(prompt, Sampler(SamplingParams()), 10**6, set(), depth)
    t0 = time.perf_counter()
    for _ in range(rounds):
        batch.step()
    return (len(row.tokens) - 1) / (time.perf_counter() - t0)


def _plain_decode_tps(model, prompt: list[int], sampler: Sampler) -> float:
    times = DecodeTimes()
    for _ in decode_tokens(model, prompt, sampler, 33, set(), times=times):
        pass
    return times.decode_tps


def blas_floor(model, repeats: int) -> dict[int, float]:
    """The backbone's weight matrices multiplied by M = 2..5 rows, against one row: the cost that a verify pass
    over M tokens cannot go below on this machine's BLAS (the rest of a step is small on this model)."""
    weights = [w for name, w in tree_flatten(model.model.parameters())
               if name.startswith("layers.") and w.ndim == 2 and "proj" in name]

    def product(m: int) -> float:
        xs = {w.shape[1]: mx.ones((m, w.shape[1])) for w in weights}
        mx.eval(list(xs.values()))
        return median_seconds(lambda: mx.eval([xs[w.shape[1]] @ w.T for w in weights]), repeats)

    one = product(1)
    return {m: product(m) / one for m in range(2, 6)}


def large_part(args: argparse.Namespace) -> dict:
    engine = load(str(checkpoint("large", Path(args.workdir))), dtype=mx.float32)
    model = engine.model
    sampler = Sampler(SamplingParams())
    prompt = np.random.default_rng(0).integers(3, model.args.vocab_size, 512).tolist()

    # a plain decode step, as plain decoding runs it (median over repeats of 32-token decodes)
    plain_tps = statistics.median(
        _plain_decode_tps(model, prompt, sampler) for _ in range(args.repeats + 1)
    )
    plain_s = 1.0 / plain_tps
    verify_cost = {}
    for k in (1, 2, 3, 4):  # a stepper round over [x, k fixed drafts], none kept: one verify pass and its commit
        batch = Forced(model, (0.0,) * k, np.random.default_rng(0), drafts=[3] * k)
        batch.join(prompt, sampler, 10**6, set(), k)
        verify_cost[k + 1] = median_seconds(batch.step, args.repeats * 3) / plain_s
    batch = Forced(model, (0.0,), np.random.default_rng(0))
    row = batch.join(prompt, sampler, 10**6, set(), 1)
    batch._draft([row], [1])  # catch the MTP head up so the next steps are single-token draft steps
    mtp_cache = row.decoder.mtp_cache
    z = mx.zeros((1, 1, model.args.hidden_size))

    def draft_step():
        out = model.mtp_hidden(mx.array([[5]]), z, mtp_cache)
        mx.eval(model.logits(out))
        for c in mtp_cache:
            c.trim_to(c.offset - 1)

    draft_cost = median_seconds(draft_step, args.repeats * 5) / plain_s
    floor = blas_floor(model, args.repeats * 3)
    print(f"large: plain step {plain_s * 1e3:.1f} ms; verify cost vs plain step {json.dumps({k: round(v, 3) for k, v in verify_cost.items()})}; draft step {draft_cost:.3f}", flush=True)
    print(f"large: the same weights times M rows vs one row (BLAS alone) {json.dumps({k: round(v, 3) for k, v in floor.items()})}", flush=True)

    rng = np.random.default_rng(0)
    curve = []
    for rates in [PUBLISHED_RATES, (0.9, 0.75, 0.6), (0.8, 0.6, 0.4), (0.6, 0.35, 0.2), (0.3, 0.1, 0.03), (0.0, 0.0, 0.0)]:
        tps = forced_tps(model, prompt, 3, rates, args.forced_rounds, rng)
        curve.append({"rates": rates, "mean_accepted_length": 1 + sum(rates), "tps": tps, "speedup": tps / plain_tps})
        print(f"large forced acceptance {rates}: {tps:6.2f} tok/s = {tps / plain_tps:4.2f}x plain", flush=True)
    return {"load_average": os.getloadavg(), "plain_step_s": plain_s, "plain_tps": plain_tps,
            "verify_cost_vs_plain": verify_cost, "draft_step_cost_vs_plain": draft_cost,
            "blas_rows_vs_one_row": floor, "forced_acceptance": curve}


def head_pass_costs(model, prompt: list[int], repeats: int) -> dict[str, dict[int, float]]:
    """Seconds of one MTP head pass over M = 1..6 pending (token, hidden) pairs and its draft logits, over a warm head
    cache: "last_pair" as the stepper's catch-up runs it (`mtp_hidden(last=True)`: every pair's keys, the rest for
    the last pair alone; M = 1 is a draft step), "every_pair" the whole pass (what the catch-up ran before). Each
    call gets fresh random pairs, so its tokens reach other experts than the call before."""
    batch = Forced(model, (0.0,), np.random.default_rng(0))
    cache = batch.join(prompt, Sampler(SamplingParams()), 10**6, set(), 1).decoder.mtp_cache
    rng, width = np.random.default_rng(1), model.hidden_width
    out: dict[str, dict[int, float]] = {"last_pair": {}, "every_pair": {}}
    for m in range(1, 7):
        pairs = [(mx.array(rng.integers(3, model.args.vocab_size, (1, m))), mx.array(rng.standard_normal((1, m, width)),
                                                                                   mx.float32)) for _ in range(8)]
        mx.eval(pairs)
        for form, last in (("last_pair", True), ("every_pair", False)):
            calls = itertools.count()

            def head_pass() -> None:
                tokens, hidden = pairs[next(calls) % len(pairs)]
                z = model.mtp_hidden(tokens, hidden, cache, last=last)
                mx.eval(model.draft_logits(z[:, -1:]))
                for c in cache:
                    c.trim_to(c.offset - m)

            out[form][m] = median_seconds(head_pass, repeats)
    return out


class Timed(Batch):
    """The stepper with each MTP round's phases timed (`phases`: name -> seconds per round): "head" (the catch-up and
    draft steps, built and evaluated), "verify build" (the pass's graph, made on the host while the model idles: the
    PLE hashes the drafts there), "verify pass" (its evaluation and the acceptance), "commit". Evaluating the drafts
    before the pass is what the round does anyway: the PLE needs their values."""

    def __init__(self, model):
        super().__init__(model, max_batch=1)
        self.phases: dict[str, list[float]] = {"head": [], "verify build": [], "verify pass": [], "commit": []}
        self._t = 0.0

    def _lap(self, name: str) -> None:
        now = time.perf_counter()
        self.phases[name].append(now - self._t)
        self._t = now

    def _propose(self, rows, plans):
        self._t = time.perf_counter()
        rnd = super()._propose(rows, plans)
        mx.eval([d for ds in rnd.drafts for d in ds if isinstance(d, mx.array)])
        self._lap("head")
        return rnd

    def _verify(self, rows, rnd, tokens=None):
        out = super()._verify(rows, rnd, tokens)
        if tokens is None:
            self._lap("verify build")
        return out

    def _accept(self, rows, rnd, target):
        super()._accept(rows, rnd, target)
        self._lap("verify pass")

    def _commit_rows(self, rows, rnd, hidden):
        super()._commit_rows(rows, rnd, hidden)
        if rnd.mtp_ran(0):
            self._lap("commit")


def round_phases(model, prompt: list[int], depth: int, tokens: int) -> dict[str, float]:
    """Median milliseconds of each phase of an MTP round at `depth` (`Timed`), over a greedy decode of `tokens`."""
    batch = Timed(model)
    row = batch.join(prompt, Sampler(SamplingParams()), tokens, set(), depth)
    while not row.done:
        batch.step()
    return {name: statistics.median(t) * 1e3 for name, t in batch.phases.items() if t}


QWEN4_AGREEING_ALPHA = 0.06  # the backbone's blocks scaled by this: the constructed head's drafts are mostly kept


def extended_rates(published: tuple[float, ...], depth: int) -> tuple[float, ...]:
    """Cumulative acceptance by position up to `depth`: the published rates, then each further position kept with
    the last published conditional rate (0.80 / 0.88 for the 27B head)."""
    rates, fall = list(published), published[-1] / published[-2]
    while len(rates) < depth:
        rates.append(rates[-1] * fall)
    return tuple(rates[:depth])


def qwen4_part(args: argparse.Namespace) -> dict:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from test_qwen4_mtp import agreeing

    from hetero.checkpoint.loader import load_model
    from hetero.decode.records import MTPStats

    model = load_model(checkpoint("qwen4", Path(args.workdir)), dtype=mx.float32)[0]  # no tokenizer: token ids in
    sampler = Sampler(SamplingParams())
    depths = (1, 2, 3, 4, 5)
    prompt = np.random.default_rng(0).integers(3, model.args.vocab_size, 256).tolist()

    plain_tps = statistics.median(_plain_decode_tps(model, prompt, sampler) for _ in range(args.repeats + 1))
    plain_s = 1.0 / plain_tps
    verify_cost = {}
    for k in depths:  # one stepper round over [x, k fixed drafts], none kept: a verify pass and its commit
        batch = Forced(model, (0.0,) * k, np.random.default_rng(0), drafts=[3] * k)
        batch.join(prompt, sampler, 10**6, set(), k)
        batch.step(), batch.step()  # warm-up: the first rounds of a shape compile it
        verify_cost[k + 1] = median_seconds(batch.step, args.repeats * 3) / plain_s
    print(f"qwen4: plain step {plain_s * 1e3:.1f} ms; verify cost vs plain step "
          f"{json.dumps({k: round(v, 3) for k, v in verify_cost.items()})}", flush=True)
    head_cost = head_pass_costs(model, prompt, args.repeats * 5)
    head_cost = {form: {m: t / plain_s for m, t in costs.items()} for form, costs in head_cost.items()}
    print(f"qwen4: the head over M pending pairs with its draft logits vs plain step (M = 1: a draft step): "
          f"last pair alone {json.dumps({k: round(v, 3) for k, v in head_cost['last_pair'].items()})}; "
          f"every pair {json.dumps({k: round(v, 3) for k, v in head_cost['every_pair'].items()})}", flush=True)
    forced = {}
    rng = np.random.default_rng(0)
    for depth in depths:
        rates = extended_rates(PUBLISHED_RATES, depth)
        forced_tps(model, prompt, depth, rates, 2, rng)  # warm-up: a depth's first rounds compile its shapes
        tps = forced_tps(model, prompt, depth, rates, args.forced_rounds, rng)
        forced[depth] = {"rates": rates, "mean_accepted_length": 1 + sum(rates), "tps": tps, "speedup": tps / plain_tps}
        print(f"qwen4 forced depth {depth} {[round(r, 3) for r in rates]}: {tps:6.2f} tok/s = {tps / plain_tps:4.2f}x",
              flush=True)

    # a fresh model: the decode above compiled its steps around the original weights (`hetero.models.compiled`)
    model = agreeing(load_model(checkpoint("qwen4", Path(args.workdir)), dtype=mx.float32)[0], QWEN4_AGREEING_ALPHA)
    settings = ["plain"] + [f"depth {d}" for d in depths]
    samples: dict[str, list[dict]] = {s: [] for s in settings}
    outputs: dict[str, list[list[int]]] = {s: [] for s in settings}
    prompts = [np.random.default_rng(i + 1).integers(3, model.args.vocab_size, 256).tolist() for i in range(2)]
    def generate(p: list[int], n: int, depth: int) -> tuple[list[int], dict]:
        times, stats = DecodeTimes(), MTPStats(depth) if depth else None
        tokens = list(decode_tokens(model, p, sampler, n, set(), depth=depth, copy=False, times=times, stats=stats))
        return tokens, {"decode_tps": times.decode_tps, **({"mtp": stats.to_dict()} if stats else {})}

    for depth in (0, *depths):  # warm-up: each depth's first rounds compile its shapes
        generate(prompts[0], 16, depth)
    for _ in range(args.repeats):
        for p in prompts:
            for s in settings:  # alternate the contenders on the same prompt
                tokens, stats = generate(p, args.tokens, 0 if s == "plain" else int(s.split()[1]))
                samples[s].append(stats)
                outputs[s].append(tokens)
    differ = [s for s in settings if outputs[s] != outputs["plain"]]
    round_phases(model, prompts[0], 3, 16)  # warm-up
    phases = round_phases(model, prompts[0], 3, args.tokens)
    print(f"qwen4 agreeing head, a depth-3 round's phases (ms, median): "
          f"{json.dumps({k: round(v, 2) for k, v in phases.items()})}", flush=True)
    real = {}
    head_plain = statistics.median(r["decode_tps"] for r in samples["plain"])
    for s in settings:
        tps = statistics.median(r["decode_tps"] for r in samples[s])
        row = {"decode_tps": tps, "speedup": tps / head_plain}
        if s != "plain":
            mtp = [r["mtp"] for r in samples[s]]
            row["acceptance_by_depth"] = [statistics.mean(m["acceptance_by_depth"][i] for m in mtp)
                                          for i in range(mtp[0]["depth"])]
            row["mean_accepted_length"] = statistics.mean(m["mean_accepted_length"] for m in mtp)
        real[s] = row
        extra = (f"  accepted length {row['mean_accepted_length']:.2f}  by depth "
                 f"{[round(a, 2) for a in row['acceptance_by_depth']]}" if s != "plain" else "")
        print(f"qwen4 agreeing head {s:8s} {tps:7.1f} tok/s  {row['speedup']:5.2f}x{extra}", flush=True)
    return {"load_average": os.getloadavg(), "plain_step_s": plain_s, "plain_tps": plain_tps,
            "verify_cost_vs_plain": verify_cost,
            "head_pass_vs_plain": head_cost,
            "forced_acceptance": forced,
            "forced_rates_note": "depths 1-3: the published 27B Qwen3.5 rates; 4 and 5 continue their last fall",
            "agreeing_head": {"alpha": QWEN4_AGREEING_ALPHA, "settings": real, "depth3_round_phases_ms": phases,
                              "prompt_tokens": 256,
                              "decode_tokens": args.tokens, "greedy_identical_to_plain": not differ,
                              "differing_settings": differ}}


def plot(result: dict, out_dir: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    if "bundled" in result:
        rows = result["bundled"]["settings"]
        fig, ax = plt.subplots(1, 2, figsize=(10, 4))
        ax[0].bar(list(rows), [r["decode_tps"] for r in rows.values()], color=["grey"] + ["tab:blue"] * 4)
        ax[0].set_ylabel("decode tok/s")
        ax[0].set_title("bundled model: MTP depth vs plain")
        for s, r in rows.items():
            if "acceptance_by_depth" in r:
                ax[1].plot(range(1, len(r["acceptance_by_depth"]) + 1), r["acceptance_by_depth"], marker="o", label=s)
        ax[1].set_xlabel("draft position")
        ax[1].set_ylabel("acceptance (positions 0..i all kept)")
        ax[1].set_ylim(0, 1)
        ax[1].legend()
        fig.tight_layout()
        fig.savefig(out_dir / "mtp_bundled.png", dpi=100)
        written.append(str(out_dir / "mtp_bundled.png"))
    if "large" in result:
        curve = result["large"]["forced_acceptance"]
        fig, ax = plt.subplots(figsize=(5, 4))
        ax.plot([c["mean_accepted_length"] for c in curve], [c["speedup"] for c in curve], marker="o")
        ax.axhline(1.0, color="grey", linestyle="--")
        ax.set_xlabel("mean accepted length (tokens per verify pass)")
        ax.set_ylabel("speed vs plain decoding")
        ax.set_title("large random model, depth 3, forced acceptance")
        fig.tight_layout()
        fig.savefig(out_dir / "mtp_large.png", dpi=100)
        written.append(str(out_dir / "mtp_large.png"))
    return written


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--part", choices=["bundled", "large", "qwen4", "both"], default="both")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=192, help="tokens decoded per run")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--contexts", nargs="+", type=int, default=[1024, 4096, 8192])
    ap.add_argument("--forced-rounds", type=int, default=24)
    ap.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(), "hetero-bench"))
    ap.add_argument("--out", default="bench/results/mtp.json")
    args = ap.parse_args()
    reexec_with_fast_blas()
    result: dict = {"environment": environment(), "args": vars(args)}
    if args.part in ("bundled", "both"):
        result["bundled"] = bundled_part(args)
    if args.part in ("large", "both"):
        result["large"] = large_part(args)
    if args.part == "qwen4":
        result["qwen4"] = qwen4_part(args)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    result["plots"] = plot(result, out.parent)
    out.write_text(json.dumps(result, indent=1))
    print(f"wrote {', '.join([str(out), *result['plots']])}")
    for part in ("bundled", "qwen4"):  # a speed of wrong output is no result
        checked = result.get(part, {}).get("agreeing_head", result.get(part, {}))
        if part in result and not checked["greedy_identical_to_plain"]:
            sys.exit(f"FAILED: greedy output differs from plain decoding at {', '.join(checked['differing_settings'])}")


if __name__ == "__main__":
    main()
