"""The pipelined engine: rank 0 takes requests (`PipelineEngine`), every other rank serves them (`serve`).

Each request is one `Request` (`request.py`), sent as JSON from rank 0 to all ranks; then every rank runs its side
(`rounds`), and at the end the ranks report their peak memory and the last rank its MTP counters. Requests run one
at a time (a lock), and a request always runs to its DONE on every rank: rank 0's stream of events
(`PipelineEngine.stream`, as `Engine.stream`) may be stopped or closed by its consumer, and its progress hook may
raise, but rank 0 keeps following the last rank until DONE, so the ranks stay in step for the next request (a
progress hook's exception is raised after). A stoppable request has rank 0 tell the last rank after each commit
whether to go on, so a stopped output ends the request there.
"""

from __future__ import annotations

import os
import random
import threading
import time
from collections.abc import Callable, Generator, Iterator
from contextlib import contextmanager
from pathlib import Path

import mlx.core as mx
import numpy as np

from hetero.caches.prefix import PrefixCache
from hetero.checkpoint.dtypes import default_dtype
from hetero.checkpoint.preflight import preflight
from hetero.checkpoint.source import read_config, resolve
from hetero.checkpoint.tokenizer import Tokenizer
from hetero.decode.depth import decode_depth
from hetero.decode.logprobs import TokenLogprob
from hetero.decode.records import DecodeTimes
from hetero.decode.request import STOP, Event, Finished, GenerationRequest, Prefilled, Token
from hetero.distributed.group import Link
from hetero.distributed.request import Request
from hetero.distributed.rounds import follow, lead, logits_follow, logits_lead, restore
from hetero.distributed.shard import load_share
from hetero.distributed.stage import Stage
from hetero.engine import Engine, GenerationResult, _eos_ids, collect, make_request
from hetero.errors import HeteroError
from hetero.host.settings import DEFAULT_DRAFT_DEPTH
from hetero.models.architectures import architecture
from hetero.planner.hosts import split_layers


def load_stage(link: Link, model: str | os.PathLike | None, dtype: mx.Dtype | None = None) -> tuple[Stage, Path, dict]:
    """This rank's stage of `model` (None: the bundled one), split by the planner: (stage, directory, config)."""
    report = preflight(model, dtype)  # headers only, as the single-process load checks first
    if not report.ok:
        raise HeteroError(report.first_problem())
    path = resolve(model, weights=True)
    config = read_config(path)
    arch = architecture(config.get("model_type"))
    if not arch.across_hosts:
        raise HeteroError(f"--hosts: the pipeline across hosts does not run {arch.name} checkpoints yet; run it on "
                          "one host")
    args = arch.parse(config)
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

    def generate(self, prompt: str | list[int], max_tokens: int = 256, temperature: float = 0.0, top_k: int = 0,
                 top_p: float = 1.0, min_p: float = 0.0, on_text: Callable[[str], None] | None = None,
                 on_logprob: Callable[[TokenLogprob], None] | None = None,
                 should_stop: Callable[[], bool] | None = None, **options) -> GenerationResult:
        """As `Engine.generate`, across the ranks (`stream` run to its end); with `should_stop` the request is
        stoppable (see `stream`)."""
        request = make_request(prompt, max_tokens, temperature, top_k, top_p, min_p, **options)
        return collect(self.stream(request, stoppable=should_stop is not None), request, on_text, on_logprob,
                       should_stop)

    def stream(self, r: GenerationRequest, stoppable: bool = True) -> Generator[Event, str | None, None]:
        """As `Engine.stream`, across the ranks. MTP is on whenever the checkpoint has a head (unless `mtp` is False)
        at `draft_depth` (default DEFAULT_DRAFT_DEPTH: no per-machine tuning across hosts; the policy and its check
        are one process's, `decode.depth.decode_depth`). The stats add `seed` (drawn here when not given, so a rerun
        can reproduce a sampled output) and `pipeline` (split, per-rank memory); `r.progress` sees rank 0's prefill
        chunks. JSON constraints, grammars, logprobs, the penalties and `logit_bias` are applied on the last rank, by
        the same stepper.

        A `stoppable` request can end early: once the consumer sends STOP (or closes the stream, or `r.progress`
        raised), rank 0 tells the last rank at its next commit and the ranks end the request there (tokens committed
        meanwhile are dropped). Rank 0 follows every request to its end, so the ranks stay in step whatever the
        consumer does; an exception from `r.progress` is raised once they have. A request that is not stoppable
        runs to EOS or `max_tokens` with no answer per commit (decoding as fast as it can); stopping it drops what
        follows. `split` (the ANE + GPU split), `batch` (a shared decode loop) and `prompt_cache` have no pipelined
        form and are refused."""
        if r.split is not None or r.batch is not None or r.prompt_cache is not None:
            raise HeteroError("a pipelined (mlx.launch) run has no ANE split (--ane-fraction), batched decoding "
                              "(--max-batch) or prompt_cache; leave them out")
        if r.thinking_budget is not None:
            raise HeteroError("a pipelined (mlx.launch) run has no thinking budget yet; leave it out")
        if r.images:
            raise HeteroError("a pipelined (mlx.launch) run reads no images yet; run the model in one process")
        ids = self.encode_prompt(r.prompt, r.chat)
        max_tokens = min(r.max_tokens, self.max_context - len(ids))
        if r.mtp and not self.stage.has_mtp:
            raise HeteroError(f"{self.name} has no MTP head (no mtp.* tensors); run with --no-mtp")
        depth = decode_depth(self.stage.has_mtp, r.mtp, r.draft_depth)  # 0: plain decoding
        grammar = self.json_grammar(r.json_schema) if r.json_schema is not None or r.json_object else r.grammar
        penalties = r.penalties
        penalties.check_vocab(self.stage.args.vocab_size)
        seed = r.seed if r.seed is not None else random.getrandbits(31)
        pc = self.prefix_cache if r.use_prefix_cache else None
        request = Request(
            "generate", ids, chunk=r.prefill_chunk, max_tokens=max_tokens, depth=depth, copy=r.copy, seed=seed,
            eos=sorted(self.eos_ids), max_context=self.max_context, sampling=r.sampling,
            prefix_cache=pc.max_bytes if pc is not None else None, marks=[] if r.mark is None else [r.mark],
            grammar=grammar, logprobs=r.logprobs, stoppable=stoppable, penalties=penalties,
        )
        link = self.stage.link
        times = DecodeTimes(start=time.perf_counter(), prompt_tokens=len(ids))
        detok = self.tokenizer.detokenizer()
        tokens: list[int] = []
        rows: list[TokenLogprob] = []  # every committed token's logprobs, when asked for
        held: list[BaseException] = []  # r.progress raised: raised again once the ranks are done
        ended = cut = closed = False  # nothing more for the consumer; ended early (the ranks may stop); stream closed

        def progress(done: int, total: int) -> None:
            nonlocal ended, cut
            if r.progress is None or held:
                return
            try:
                r.progress(done, total)
            except Exception as e:  # (a client gone: the server's Cancelled) held until the ranks are back in step
                held.append(e)
                ended = cut = True

        with self._request(request):
            mx.reset_peak_memory()
            if pc is not None:
                self.stage.prefix = pc
            cache, skip, _ = restore(self.stage, request)
            for tid in follow(self.stage, request, cache, skip, progress, rows if r.logprobs is not None else None,
                              lambda: not cut):
                if ended:  # (past EOS, max_tokens or a stop: the ranks run the request to its DONE)
                    continue
                if not times.first_token:
                    times.first_token = time.perf_counter()
                    if not closed:
                        try:
                            yield Prefilled(len(ids), skip)
                        except GeneratorExit:
                            closed = ended = cut = True
                            continue
                if tid in self.eos_ids:
                    times.finish_reason, ended = "stop", True
                    continue
                tokens.append(tid)
                times.generated, times.end = len(tokens), time.perf_counter()
                try:
                    reply = yield Token(tid, detok.add(tid), rows[len(tokens) - 1] if r.logprobs is not None else None)
                except GeneratorExit:  # the consumer is gone: follow the ranks to the request's end, yield nothing
                    closed = ended = cut = True
                    continue
                if reply == STOP:
                    times.finish_reason, ended, cut = "stop", True, True
                elif len(tokens) >= max_tokens:
                    ended = True
            end = report(self.stage, None)
        if held:
            raise held[0]
        if closed:
            return
        if not times.first_token:
            yield Prefilled(len(ids), skip)
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
        yield Finished(detok.finalize(), times.finish_reason, stats)

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
