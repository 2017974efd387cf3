"""The pipelined engine: rank 0 takes requests (`PipelineEngine`), every other rank serves them (`serve`).

Each request is one `Request` (`request.py`), sent as JSON from rank 0 to all ranks; then every rank runs its side
(`rounds`), and at the end the ranks report their peak memory and the last rank its MTP counters. Requests run one
at a time (a lock), and a request always runs to its DONE on every rank: rank 0's callbacks (text, logprobs,
progress, should_stop) may end its output early or raise, but rank 0 keeps following the last rank until DONE, so
the ranks stay in step for the next request, and re-raises the callback's exception after. With `should_stop` the request is stoppable: rank 0
tells the last rank after each commit whether to go on, and an ended output ends the request there.
"""

from __future__ import annotations

import os
import random
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import mlx.core as mx
import numpy as np

from hetero.distributed.group import Link
from hetero.distributed.request import Request
from hetero.distributed.rounds import follow, lead, logits_follow, logits_lead, restore
from hetero.distributed.shard import load_share
from hetero.distributed.stage import Stage
from hetero.engine import Engine, GenerationResult, _eos_ids
from hetero.errors import HeteroError
from hetero.decode.penalties import Penalties
from hetero.decode.prefill import ProgressFn
from hetero.decode.records import DecodeTimes
from hetero.logprobs import TokenLogprob, check_top
from hetero.loader import default_dtype, preflight, read_config, resolve
from hetero.models.qwen3_5 import ModelArgs
from hetero.planner.hosts import split_layers
from hetero.prefix_cache import PrefixCache
from hetero.sampling import SamplingParams
from hetero.settings import DEFAULT_DRAFT_DEPTH
from hetero.decode.depth import decode_depth
from hetero.tokenizer import Tokenizer


def load_stage(link: Link, model: str | os.PathLike | None, dtype: mx.Dtype | None = None) -> tuple[Stage, Path, dict]:
    """This rank's stage of `model` (None: the bundled one), split by the planner: (stage, directory, config)."""
    report = preflight(model, dtype)  # headers only, as the single-process load checks first
    if not report.ok:
        raise HeteroError(report.first_problem())
    path = resolve(model, weights=True)
    config = read_config(path)
    args = ModelArgs.from_config(config)
    split = split_layers(args, link.size)
    dtype = dtype or default_dtype()
    net, share, nbytes = load_share(path, args, split[link.rank], link.first, link.last, dtype)
    return Stage(net, share, link, dtype, nbytes, path), path, config


def run_request(stage: Stage, request: Request) -> dict:
    """A non-zero rank's side of one request (rank 0's is in `PipelineEngine`); returns the end-of-request report."""
    link = stage.link
    with link.request():
        mx.reset_peak_memory()
        if request.kind == "logits":
            (logits_lead if link.last else logits_follow)(stage, request)
            return {}
        cache, skip, carry = restore(stage, request)
        stats = lead(stage, request, cache, skip, carry) if link.last else None
        if not link.last:
            for _ in follow(stage, request, cache, skip):
                pass
        return report(stage, stats)


def report(stage: Stage, stats: dict | None) -> dict:
    """Every rank: peak memory and weight bytes per rank, and the last rank's stats, on every rank."""
    link = stage.link
    peaks = link.gather_ints(int(mx.get_peak_memory()))
    weights = link.gather_ints(stage.weight_bytes)
    starts, stops = link.gather_ints(stage.share.layers.start), link.gather_ints(stage.share.layers.stop)
    out = link.broadcast_json(stats, link.size - 1)
    return {**out, "ranks": [{"layers": [a, b - 1], "peak_memory_bytes": p, "weight_bytes": w}
                             for a, b, p, w in zip(starts, stops, peaks, weights)]}


def serve(stage: Stage) -> None:
    """Every rank but 0: run the requests rank 0 broadcasts until it says stop."""
    link = stage.link
    while True:
        request = Request.from_json(link.broadcast_json(None, 0))  # waiting for rank 0 is idle time: no watchdog
        if request.kind == "stop":
            return
        run_request(stage, request)


class PipelineEngine:
    """Rank 0's handle on the pipelined model: what `Engine` offers a caller (`hetero run`, the HTTP server):
    `generate` (JSON constraints and logprobs included), `logits`, `encode_prompt`, `json_grammar`, `token_bytes`.

    Set `prefix_cache` to a `PrefixCache` (rank 0's own; its `max_bytes` is every rank's budget) and every rank
    keeps a prefix cache of its own layers' states (captured at prefill chunk edges and at the end of each MTP
    turn); a prompt resumes from the longest prefix all ranks hold."""

    # Engine's own: they read path, eos_ids, model.args and the lazily built llguidance tokenizer
    json_grammar = Engine.json_grammar
    token_bytes = Engine.token_bytes
    grammar_tokenizer = Engine.grammar_tokenizer

    def __init__(self, stage: Stage, path: Path, config: dict, name: str):
        self.stage, self.path, self.config, self.name = stage, path, config, name
        self.tokenizer = Tokenizer.from_dir(path)
        self.eos_ids = _eos_ids(stage, self.tokenizer, path)  # reads only .args
        self.closed = False
        self.prefix_cache: PrefixCache | None = None
        self._grammar_tokenizer = None
        self._lock = threading.Lock()  # one request at a time goes down the pipeline

    @property
    def model(self) -> Stage:
        """Rank 0's stage, where a caller of `Engine` reads `engine.model` (`has_mtp`, `args`)."""
        return self.stage

    @property
    def max_context(self) -> int:
        return self.stage.args.max_position_embeddings

    def default_depth(self) -> int | None:
        """The draft depth `generate` uses when not told (no per-machine tuning across hosts); None without MTP."""
        return DEFAULT_DRAFT_DEPTH if self.stage.has_mtp else None

    def encode_prompt(self, prompt: str | list[int], chat: bool = False) -> list[int]:
        """As `Engine.encode_prompt` (the memory governor aside: each rank holds a different share)."""
        if isinstance(prompt, str):
            if chat:
                prompt = self.tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True)
            ids = self.tokenizer.encode(prompt)
        else:
            ids = [int(t) for t in prompt]
        if not ids:
            raise HeteroError("the prompt is empty: give at least one token")
        vocab = self.stage.args.vocab_size
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise HeteroError(f"token id {bad} is outside the model's vocabulary (0..{vocab - 1})")
        if len(ids) >= self.max_context:
            raise HeteroError(f"the prompt has {len(ids)} tokens but the model's context window is {self.max_context}; shorten it")
        return ids

    def logits(self, token_ids: list[int], chunk: int = 512) -> np.ndarray:
        """float32 logits [len, vocab] for every position, computed across the ranks."""
        request = Request("logits", self.encode_prompt(list(token_ids)), chunk=chunk)
        with self._request(request):
            return np.array(logits_follow(self.stage, request))

    @contextmanager
    def _request(self, request: Request) -> Iterator[None]:
        """Send `request` to every rank and run rank 0's side under the watchdog, one request at a time. A request
        that fails midway leaves the ranks out of step: the engine is closed without a word to them (their launcher
        ends them)."""
        with self._lock:
            if self.closed:
                raise HeteroError("the pipeline is closed (an earlier request failed midway); restart the ranks")
            link = self.stage.link
            try:
                link.broadcast_json(request.to_json(), 0)
                with link.request():
                    yield
            except BaseException:
                self.closed = True
                raise

    def generate(
        self,
        prompt: str | list[int],
        max_tokens: int = 256,
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 1.0,
        min_p: float = 0.0,
        seed: int | None = None,
        chat: bool = False,
        prefill_chunk: int = 512,
        mtp: bool | None = None,
        draft_depth: int | None = None,
        copy: bool = True,
        on_text: Callable[[str], None] | None = None,
        progress: ProgressFn | None = None,
        use_prefix_cache: bool = True,
        should_stop: Callable[[], bool] | None = None,
        logprobs: int | None = None,
        on_logprob: Callable[[TokenLogprob], None] | None = None,
        json_schema: dict | None = None,
        json_object: bool = False,
        grammar: str | None = None,
        presence_penalty: float = 0.0,
        frequency_penalty: float = 0.0,
        repetition_penalty: float = 1.0,
        logit_bias: dict[int, float] | None = None,
        mark: int | None = None,
        split: object | None = None,
        batch: object | None = None,
    ) -> GenerationResult:
        """As `Engine.generate`, across the ranks. MTP is on whenever the checkpoint has a head (unless `mtp` is
        False) at `draft_depth` (default DEFAULT_DRAFT_DEPTH: no per-machine tuning across hosts; the policy and its
        check are one process's, `decode.depth.decode_depth`, so 0 is refused as there). The result's stats add `seed`
        (drawn here when not given, so a rerun can reproduce a sampled output) and `pipeline` (split, per-rank
        memory). `progress` sees rank 0's prefill chunks.

        `json_schema` / `json_object` and `logprobs` / `on_logprob` as in `Engine.generate`: the constraint masks
        and the logprobs are computed on the last rank, which samples. `should_stop` (polled after every token)
        makes the request stoppable: once the output has ended (`should_stop`, or a callback raised), rank 0 tells
        the last rank at its next commit and the ranks end the request there (tokens committed meanwhile are
        dropped); an exception from a callback is raised once they have. Without it the ranks run to EOS or
        `max_tokens` and rank 0 drops what follows its end (no answer per commit: decoding as fast as before).
        The penalties and `logit_bias` are applied on the last rank, by the same stepper. `split` (the ANE + GPU
        split) and `batch` (a shared decode loop) have no pipelined form and are refused."""
        if split is not None or batch is not None:
            raise HeteroError("a pipelined (mlx.launch) run has no ANE split (--ane-fraction) or batched decoding "
                              "(--max-batch); leave them out")
        if prefill_chunk <= 0:
            raise HeteroError(f"--prefill-chunk must be positive, got {prefill_chunk}")
        ids = self.encode_prompt(prompt, chat)
        max_tokens = min(max_tokens, self.max_context - len(ids))
        if mtp and not self.stage.has_mtp:
            raise HeteroError(f"{self.name} has no MTP head (no mtp.* tensors); run with --no-mtp")
        depth = decode_depth(self.stage.has_mtp, mtp, draft_depth)  # 0: plain decoding
        if logprobs is not None:
            check_top(logprobs)
        if json_schema is not None or json_object:
            grammar = self.json_grammar(json_schema)
        penalties = Penalties(presence_penalty, frequency_penalty, repetition_penalty, logit_bias)
        penalties.check_vocab(self.stage.args.vocab_size)
        seed = seed if seed is not None else random.getrandbits(31)
        pc = self.prefix_cache if use_prefix_cache else None
        request = Request(
            "generate", ids, chunk=prefill_chunk, max_tokens=max_tokens, depth=depth, copy=copy, seed=seed,
            eos=sorted(self.eos_ids), max_context=self.max_context,
            sampling=SamplingParams(temperature, top_k, top_p, min_p),
            prefix_cache=pc.max_bytes if pc is not None else None, marks=[] if mark is None else [mark],
            grammar=grammar, logprobs=logprobs, stoppable=should_stop is not None, penalties=penalties,
        )
        link = self.stage.link
        times = DecodeTimes(start=time.perf_counter(), prompt_tokens=len(ids))
        detok = self.tokenizer.detokenizer()
        tokens: list[int] = []
        rows: list[TokenLogprob] = []  # every committed token's logprobs, when asked for
        out = Output(on_text, on_logprob, progress, should_stop)
        with self._request(request):
            mx.reset_peak_memory()
            if pc is not None:
                self.stage.prefix = pc
            cache, skip, _ = restore(self.stage, request)
            for tid in follow(self.stage, request, cache, skip, out.progress, rows if logprobs is not None else None,
                              lambda: not out.cut):
                if out.ended:  # (past EOS, max_tokens or a stop: the ranks run the request to its DONE)
                    continue
                if not times.first_token:
                    times.first_token = time.perf_counter()
                if tid in self.eos_ids:
                    times.finish_reason, out.ended = "stop", True
                    continue
                tokens.append(tid)
                times.generated, times.end = len(tokens), time.perf_counter()
                if logprobs is not None:
                    out.logprob(rows[len(tokens) - 1])
                out.text(detok.add(tid))
                if out.stop():
                    times.finish_reason, out.ended = "stop", True
                elif len(tokens) >= max_tokens:
                    out.ended = True
            end = report(self.stage, None)
        out.text(detok.finalize(), tail=True)
        out.raise_held()
        stats = {
            "model": self.name,
            "prompt_tokens": len(ids),
            "cached_tokens": skip,
            "generated_tokens": len(tokens),
            "finish_reason": times.finish_reason,
            "ttft_s": round(times.ttft_s, 6),
            "prefill_tps": round(times.prefill_tps, 3),
            "decode_tps": round(times.decode_tps, 3),
            "peak_memory_bytes": end["ranks"][0]["peak_memory_bytes"],
            "seed": seed,
            "pipeline": {"ranks": link.size, "backend": "ring", "per_rank": end["ranks"]},
        }
        if end.get("mtp") is not None:
            stats["mtp"] = end["mtp"]
        return GenerationResult(detok.text, tokens, stats, rows[: len(tokens)] if logprobs is not None else None)

    def close(self) -> None:
        """Tell the other ranks to stop serving (once), after the request in flight, if any (a server's worker
        thread); one still running after --dist-timeout leaves them to their launcher."""
        if not self._lock.acquire(timeout=self.stage.link.timeout):
            self.closed = True
            return
        try:
            if not self.closed:
                self.closed = True
                self.stage.link.broadcast_json(Request("stop").to_json(), 0)
        finally:
            self._lock.release()


class Output:
    """Rank 0's callbacks for one request. The first exception one raises is held (and `ended` set) instead of
    leaving the ranks mid-request; `raise_held` raises it once the request is done everywhere."""

    def __init__(self, on_text: Callable[[str], None] | None, on_logprob: Callable[[TokenLogprob], None] | None,
                 progress: ProgressFn | None, should_stop: Callable[[], bool] | None):
        self.on_text, self.on_logprob, self.on_progress, self.should_stop = on_text, on_logprob, progress, should_stop
        self.ended = False  # nothing more reaches the caller
        self.cut = False  # ended before EOS or max_tokens (should_stop, a callback raised): the ranks may stop
        self.held: BaseException | None = None

    def _call(self, fn: Callable | None, *args) -> object:
        if fn is None or self.held is not None:
            return None
        try:
            return fn(*args)
        except Exception as e:  # (a client gone: the server's Cancelled) held until the ranks are back in step
            self.held, self.ended, self.cut = e, True, True
            return None

    def progress(self, done: int, total: int) -> None:
        self._call(self.on_progress, done, total)

    def text(self, piece: str, tail: bool = False) -> None:
        if piece and (tail or not self.ended):
            self._call(self.on_text, piece)

    def logprob(self, item: TokenLogprob) -> None:
        self._call(self.on_logprob, item)

    def stop(self) -> bool:
        if self._call(self.should_stop):
            self.cut = True
        return self.cut

    def raise_held(self) -> None:
        if self.held is not None:
            raise self.held
