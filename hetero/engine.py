"""The library entry point: `hetero.load(...)` returns an `Engine` that computes logits and generates text."""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable, Generator
from dataclasses import dataclass, field
from pathlib import Path

import mlx.core as mx
import numpy as np

from hetero.caches.mlx_lm import check_layout, from_mlx_lm
from hetero.caches.prefix import PrefixCache
from hetero.checkpoint.chat_contract import chat_contract
from hetero.checkpoint.fingerprint import checkpoint_identity, weights_fingerprint
from hetero.checkpoint.loader import load_model
from hetero.checkpoint.tokenizer import Tokenizer
from hetero.decode import wavefront
from hetero.decode.depth import decode_depth
from hetero.decode.depth_calibration import calibrate
from hetero.decode.logprobs import LogprobRecorder, TokenLogprob
from hetero.decode.prefill import prefill
from hetero.decode.records import DecodeTimes, MTPStats, Trace
from hetero.decode.request import STOP, Event, Finished, GenerationRequest, Prefilled, Token
from hetero.decode.sampling import Sampler, SamplingParams
from hetero.decode.solo import decode_tokens
from hetero.decode.state import Decoder
from hetero.errors import HeteroError
from hetero.host import kernels
from hetero.host.settings import DEFAULT_DRAFT_DEPTH, tuned_depth
from hetero.host.wired import wire_working_set
from hetero.models.interface import CausalLM
from hetero.models.kv_quant import kv_quant, use_kv_quant
from hetero.planner import check_prompt_fits
from hetero.tools.constrained import ANY_OBJECT, Constraint, grammar_tokenizer, json_schema_grammar
from hetero.tools.reasoning import opens_reasoning
from hetero.tools.thinking_budget import ThinkingBudget
from hetero.vision.input import ImageInput, Vision
from hetero.vision.prompt import ImagePrompt


@dataclass
class GenerationResult:
    """What `Engine.generate` returns; `stats` has the keys `hetero run --json` prints."""

    text: str
    tokens: list[int]
    stats: dict = field(default_factory=dict)
    logprobs: list[TokenLogprob] | None = None  # one per token when asked for (`logprobs=N`)


class Engine:
    """A loaded model with its tokenizer.

    Set `prefix_cache` to a `PrefixCache` and `generate` restores the longest cached prefix of each prompt,
    checkpoints prefill chunk edges and the end of every turn, and reports `cached_tokens`.
    """

    def __init__(self, model: CausalLM, tokenizer: Tokenizer, config: dict, path: Path, name: str):
        self.model = model
        self.tokenizer = tokenizer
        self.config = config
        self.path = path
        self.name = name
        self.eos_ids = _eos_ids(model, tokenizer, path)
        self.weights_fingerprint = weights_fingerprint(path)  # taken at load: the files' state as loaded
        self.prefix_cache: PrefixCache | None = None
        self.memory_gb: float | None = None  # RAM the memory governor budgets (None: this machine's)
        self._grammar_tokenizer = None  # llguidance's tokenizer, built on the first constrained request
        # the vision tower and image processor of a checkpoint that has them (None: it reads text only)
        self.vision = Vision.of(path, config, tokenizer, model.model.norm.weight.dtype)

    @property
    def identity(self) -> str:
        """Names this checkpoint in per-machine settings: its name plus a hash of its config."""
        return checkpoint_identity(self.name, self.config)

    def default_depth(self) -> int | str | None:
        """How this model decodes here when the caller does not say: the depth `hetero tune` saved, PLAIN ("off"),
        or, for a model with an MTP head never measured on this machine, the result of a short calibration run
        now (`hetero.decode.depth_calibration`, once: it is saved). None for a model without an MTP head."""
        if not self.model.has_mtp:
            return None
        tuned = tuned_depth(self.identity)
        if tuned is None:
            tuned = calibrate(self, DEFAULT_DRAFT_DEPTH, report=lambda line: print(line, file=sys.stderr, flush=True))
        return tuned

    @property
    def cache_key(self) -> str:
        """Keys every cached state of this engine (prefix cache, session cache): its identity, the fingerprint of
        the weights it loaded, its compute dtype and its KV storage (`--kv-bits`). New weights under the same name
        and config get a new key."""
        quant = getattr(self.model, "kv_quant", None)  # a quantized-KV entry never restores into full KV, nor back
        return f"{self.identity}#{self.weights_fingerprint}#{self.model.model.norm.weight.dtype}" + (
            f"#{quant.key}" if quant is not None else "")

    @property
    def max_context(self) -> int:
        return self.model.args.max_position_embeddings

    def encode_prompt(self, prompt: str | list[int], chat: bool = False, held: int = 0, images: int = 0) -> list[int]:
        """Text (optionally wrapped in the chat template as one user turn, after its `images` when it has some) or
        token ids -> token ids; `held` tokens already in a cache count against the context window."""
        if isinstance(prompt, str):
            if chat:
                content = self.image_marker * images + prompt if images else prompt
                prompt = self.tokenizer.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True)
            ids = self.tokenizer.encode(prompt)
        else:
            ids = [int(t) for t in prompt]
        if not ids:
            raise HeteroError("the prompt is empty: give at least one token")
        vocab = self.model.args.vocab_size
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise HeteroError(f"token id {bad} is outside the model's vocabulary (0..{vocab - 1})")
        self._check_room(len(ids), held)
        return ids

    def _check_room(self, n: int, held: int = 0) -> None:
        if held + n >= self.max_context:
            cached = f" after {held} cached tokens" if held else ""
            raise HeteroError(
                f"the prompt has {n} tokens{cached} but the model's context window is {self.max_context}; shorten it"
            )
        check_prompt_fits(self.model, held + n, self.memory_gb, wavefront.chunks_in_flight())

    @property
    def image_marker(self) -> str:
        """The text that stands for one image in a prompt (the chat template's vision start, image, vision end)."""
        if self.vision is None:
            raise HeteroError(f"{self.name} has no vision tower (no vision_config): it reads text only")
        return self.vision.marker

    def image_prompt(self, ids: list[int], images: list[ImageInput], held: int = 0) -> ImagePrompt:
        """Token ids with one image token per image (`image_marker` in the text) and the images (file bytes or PIL
        images) -> the prompt with each placeholder expanded to the image's tokens, its 3-D positions and pixel
        digests; the tower runs later, on the images the prefix cache does not hold. One-line HeteroError for a
        text-only checkpoint, a damaged or unsupported image, or a prompt that no longer fits."""
        if self.vision is None:
            raise HeteroError(f"{self.name} has no vision tower (no vision_config): it reads text only; send text")
        prompt = self.vision.plan(ids, images)
        self._check_room(len(prompt.tokens), held)
        return prompt

    def json_grammar(self, schema: dict | None) -> str:
        """Compile a JSON Schema (None: any JSON object) for `generate(json_schema=...)`; a schema the grammar
        library rejects raises HeteroError, so a server can refuse it before it streams anything."""
        return json_schema_grammar(ANY_OBJECT if schema is None else schema, self.grammar_tokenizer())

    def thinking_budget(self, budget: int, ids: list[int]) -> ThinkingBudget:
        """The mask that closes the think block of a generation after prompt `ids` once it has taken `budget`
        tokens, with the closing text of this checkpoint's chat template (HeteroError when it has none)."""
        close = chat_contract(self.tokenizer).think_close
        if close is None:
            raise HeteroError(f"{self.name}'s chat template has no think block to close; leave the thinking budget out")
        opened = opens_reasoning(self.tokenizer.decode(ids[-8:]))  # Qwen3.5 / 3.6 / 3.8 open the block in the prompt
        return ThinkingBudget(budget, self.tokenizer.encode(close), close.strip(), opened, self.tokenizer.decode,
                              self.eos_ids, self.model.args.vocab_size)

    def token_bytes(self, token: int) -> bytes:
        """The raw bytes of one token (a piece of a UTF-8 character for byte-level tokens), as logprobs report it."""
        return self.grammar_tokenizer().decode_bytes([token])

    def grammar_tokenizer(self):
        """llguidance's view of this checkpoint's vocabulary, which every grammar of its constraints is built for."""
        if self._grammar_tokenizer is None:  # about 1 s for a 250K vocabulary: once per engine
            self._grammar_tokenizer = grammar_tokenizer(self.path / "tokenizer.json", self.model.args.vocab_size,
                                                        self.eos_ids)
        return self._grammar_tokenizer

    def logits(self, token_ids: list[int], chunk: int = 512, images: list[ImageInput] = ()) -> np.ndarray:
        """float32 logits [len, vocab] for every position, from one (chunked) prefill; with `images`, `token_ids`
        hold one image token per image and the rows are those of the expanded prompt (`image_prompt`)."""
        ids = self.encode_prompt(list(token_ids))
        vision = self.image_prompt(ids, images) if images else None
        if vision is not None:
            self.vision.encode(vision)
            ids = vision.tokens
        logits, _ = prefill(self.model, ids, self.model.make_cache(), chunk, all_logits=True, images=vision)
        return np.array(logits.astype(mx.float32))

    def generate(self, prompt: str | list[int], max_tokens: int = 256, temperature: float = 0.0, top_k: int = 0,
                 top_p: float = 1.0, min_p: float = 0.0, on_text: Callable[[str], None] | None = None,
                 on_logprob: Callable[[TokenLogprob], None] | None = None,
                 should_stop: Callable[[], bool] | None = None, **options) -> GenerationResult:
        """Generate up to `max_tokens` tokens (temperature 0 is greedy): `stream` run to its end, for callers that
        want one result. `on_text` receives text as it streams, `on_logprob` each token's logprobs (with
        `logprobs=N`) just before its text; `should_stop()` is polled after every token: True ends the generation
        there (finish_reason "stop"). Other keyword arguments are `GenerationRequest`'s fields.

        The output distribution is the same with and without MTP; greedy output is identical token for token.
        With `self.prefix_cache` set (and `use_prefix_cache`), the prompt resumes from its longest cached prefix,
        and the output is the cold run's.
        """
        request = make_request(prompt, max_tokens, temperature, top_k, top_p, min_p, **options)
        return collect(self.stream(request), request, on_text, on_logprob, should_stop)

    def stream(self, request: GenerationRequest) -> Generator[Event, str | None, None]:
        """Run `request`: yields `Prefilled` once the prompt is in the cache, a `Token` per generated token, then
        `Finished`. `stream.send(STOP)` (in place of `next`) ends it at the token just yielded and returns its
        `Finished`; closing it ends it too, keeping every cache consistent.

        The prompt resumes from the prefix cache (`self.prefix_cache`, unless `request.use_prefix_cache` is False),
        or from `request.prompt_cache`; `request.split` may prefill it instead of the GPU-only path, and
        `request.batch` decodes it in a shared batch: the same tokens either way.
        """
        r = request
        held = 0
        if getattr(self.model, "kv_quant", None) is not None and (r.prompt_cache is not None or r.split is not None):
            what = "an mlx-lm prompt cache" if r.prompt_cache is not None else "the split prefill"
            raise HeteroError(f"{what} holds full-precision KV only; load the engine without kv_bits to use it")
        if r.prompt_cache is not None:
            held = check_layout(r.prompt_cache, [layer.is_linear for layer in self.model.layers])
        vision = self._images(r, held)
        ids = vision.tokens if vision is not None else self.encode_prompt(r.prompt, r.chat, held)
        keys = vision.cache_keys() if vision is not None else ids  # what the prefix cache keys: images by content
        max_tokens = min(r.max_tokens, self.max_context - held - len(ids))
        sampler = Sampler(r.sampling, r.seed)
        penalties = r.penalties
        penalties.check_vocab(self.model.args.vocab_size)
        recorder = LogprobRecorder(r.logprobs) if r.logprobs is not None else None
        constraint = None
        if r.json_schema is not None or r.json_object:
            constraint = Constraint(self.grammar_tokenizer(), self.json_grammar(r.json_schema), self.eos_ids)
        elif r.grammar is not None:
            constraint = Constraint(self.grammar_tokenizer(), r.grammar, self.eos_ids)
        elif r.thinking_budget is not None:
            constraint = self.thinking_budget(r.thinking_budget, ids)
        depth = self.depth_for(r)  # 0: plain decoding
        times = DecodeTimes(start=time.perf_counter())  # TTFT includes restoring the prefix
        mx.reset_peak_memory()
        mtp_stats = MTPStats(depth) if depth else None
        pc = self.prefix_cache if r.use_prefix_cache and r.prompt_cache is None else None
        key, model = self.cache_key, self.model
        cache, skip, carry = model.make_cache(), 0, None
        if r.prompt_cache is not None:  # prefill continues at its offset: chunk edges stay those of a cold run
            cache = from_mlx_lm(r.prompt_cache, [layer.is_linear for layer in model.layers], len(cache.mtp))
        if pc is not None:
            restored = pc.restore(model, key, keys, limit=len(ids) - 1)  # the last prompt token must run: its logits
            if restored is not None:
                cache, skip, carry = restored.cache, restored.n, restored.hidden
        cached = skip + held  # what `cached_tokens` reports: only tokens read from a cache, never ones prefilled here
        split = r.split is not None and skip == 0 and r.prompt_cache is None

        def on_edge(n: int, at: list, hidden: mx.array) -> None:  # a chunk edge n, the cache as it stood there
            pc.capture(model, key, keys[:n], at, hidden)  # images keyed by their pixels

        if split:  # its ANE lane encodes the images while its GPU lane prefills the text before them
            cache, skip, carry = r.split.prefill(ids, on_chunk=on_edge if pc is not None else None, images=vision)
        if vision is not None:  # the images that came back from the cache are not encoded again (nor the split's)
            self.vision.encode(vision, start=skip)

        trace = Trace() if pc is not None else None  # what the end-of-turn checkpoint needs; nothing without one
        committed = list(keys)
        state: list[Decoder] = []
        last_mark = [len(ids) // r.prefill_chunk]

        def on_commit(decoder: Decoder, new: list[int]) -> None:
            committed.extend(new)
            state[:] = [decoder]
            mark = decoder.length // r.prefill_chunk
            if pc is not None and mark > last_mark[0]:  # a checkpoint every prefill_chunk decoded tokens
                last_mark[0] = mark
                pc.capture(model, key, committed[: decoder.length], decoder.cache, decoder.pending_hidden)

        decode = r.batch.decode_tokens if r.batch is not None else decode_tokens
        tokens = decode(
            model, ids, sampler, max_tokens, self.eos_ids, depth=depth, copy=r.copy, chunk=r.prefill_chunk,
            progress=r.progress, times=times, stats=mtp_stats, cache=cache, max_context=self.max_context, skip=skip,
            carry=carry, on_chunk=on_edge if pc is not None else None, on_commit=on_commit if depth else None,
            constraint=constraint, logprobs=recorder, marks=() if r.mark is None else (r.mark,), trace=trace,
            mtp_prefill=pc is not None and model.has_mtp, penalties=penalties if penalties.active else None,
            images=vision,
        )
        detok = self.tokenizer.detokenizer()
        generated, consistent = 0, False  # consistent: ended or stopped here, or closed by the consumer
        try:
            for tid in tokens:
                if generated == 0:
                    yield Prefilled(len(ids), cached)
                logprob = recorder.items[generated] if recorder is not None else None
                generated += 1
                if (yield Token(tid, detok.add(tid), logprob)) == STOP:
                    times.finish_reason = "stop"
                    break
            consistent = True
        except GeneratorExit:
            consistent = True
            raise
        finally:
            tokens.close()  # the decoder's caches hold the committed state from here on
            if pc is not None and consistent:  # (a failure midway checkpoints nothing)
                self._checkpoint_turn(pc, keys, cache, trace, state[0] if state else None, committed, r.prefill_chunk,
                                      r.mark)
        if generated == 0:
            yield Prefilled(len(ids), cached)
        stats = {
            "model": self.name,
            "prompt_tokens": len(ids),
            "cached_tokens": cached,
            "generated_tokens": generated,
            "finish_reason": times.finish_reason,
            "ttft_s": round(times.ttft_s, 6),
            "prefill_tps": round(times.prefill_tps, 3),
            "decode_tps": round(times.decode_tps, 3),
            "peak_memory_bytes": int(mx.get_peak_memory()),
        }
        if mtp_stats is not None:
            stats["mtp"] = mtp_stats.to_dict()
        yield Finished(detok.finalize(), times.finish_reason, stats)

    def _images(self, r: GenerationRequest, held: int) -> ImagePrompt | None:
        """The request's images as an `ImagePrompt` over its prompt (None without images); what cannot carry
        images yet is refused in one line."""
        if not r.images:
            return None
        if r.prompt_cache is not None:
            raise HeteroError("images cannot follow an mlx-lm prompt_cache (it holds no image positions): leave "
                              "prompt_cache out and send the whole conversation with its images; to reuse its "
                              "prefix, set engine.prefix_cache = hetero.caches.prefix.PrefixCache() (images included)")
        if isinstance(r.images, ImagePrompt):  # planned already (the server checks the images while parsing)
            if not isinstance(r.prompt, list) or list(r.prompt) != r.images.tokens:
                raise HeteroError("an ImagePrompt's request must carry its expanded tokens as the prompt")
            return r.images
        ids = self.encode_prompt(r.prompt, r.chat, held, images=len(r.images))
        return self.image_prompt(ids, list(r.images), held)

    def depth_for(self, request: GenerationRequest) -> int:
        """The draft depth `request` decodes at (0: plain), by the one depth policy (`depth.decode_depth`)."""
        if request.mtp and not self.model.has_mtp:
            raise HeteroError(f"{self.name} has no MTP head (no mtp.* tensors); run with --no-mtp")
        tuned = None  # what was measured here: a depth, PLAIN, or None
        if request.draft_depth is None and request.mtp is not False:  # None: calibrate on first use
            tuned = self.default_depth() if request.mtp is None else tuned_depth(self.identity)
        return decode_depth(self.model.has_mtp, request.mtp, request.draft_depth, tuned)

    def _checkpoint_turn(
        self, pc: PrefixCache, ids: list[int], cache: list, trace: Trace, decoder: Decoder | None, committed: list[int],
        chunk: int, mark: int | None = None,
    ) -> None:
        """Checkpoint the committed end state of a turn (never a speculative one), then persist it.

        The disk gets the checkpoints from the last chunk edge before the prompt's end (or the `mark`, when
        earlier) onward: the same prompt sent again must still run its last token, so it resumes from that edge;
        the conversation's next turn resumes from the mark.
        """
        key = self.cache_key
        if decoder is not None:  # MTP: the state after the last round; x is committed but not yet run
            run = committed[: decoder.length]
            pc.capture(self.model, key, run, decoder.cache, decoder.pending_hidden)
        elif trace.hidden:  # plain: the prompt, then every token a decode step ran
            run = list(ids) + [int(t.item()) for t in trace.tokens]
            pending = mx.concatenate(trace.hidden, axis=0)  # [1 + steps, H]
            pc.capture(self.model, key, run, cache, pending)
        else:
            return
        since = (len(ids) - 1) // chunk * chunk
        pc.persist(self.model, key, run, since=since if mark is None else min(since, mark))


def collect(events: Generator[Event, str | None, None], request: GenerationRequest,
            on_text: Callable[[str], None] | None = None, on_logprob: Callable[[TokenLogprob], None] | None = None,
            should_stop: Callable[[], bool] | None = None) -> GenerationResult:
    """A generation's events run to their end as one result (any engine's `generate`): each event is answered with
    `send` (STOP once `should_stop()` says so); `on_logprob` and `on_text` see each token as it comes. The stream is
    closed on the way out, also when a callback raises, so the engine's state is consistent before the error goes on."""
    text, tokens, logprobs = [], [], []
    try:
        event = next(events)
        while not isinstance(event, Finished):
            reply = None
            if isinstance(event, Token):
                tokens.append(event.id)
                if event.logprob is not None:
                    logprobs.append(event.logprob)
                    if on_logprob is not None:
                        on_logprob(event.logprob)
                text.append(event.text)
                if on_text is not None and event.text:
                    on_text(event.text)
                if should_stop is not None and should_stop():
                    reply = STOP
            event = events.send(reply)
    finally:
        events.close()
    text.append(event.text)
    if on_text is not None and event.text:
        on_text(event.text)
    return GenerationResult("".join(text), tokens, event.stats, logprobs if request.logprobs is not None else None)


def make_request(prompt: str | list[int], max_tokens: int = 256, temperature: float = 0.0, top_k: int = 0,
                 top_p: float = 1.0, min_p: float = 0.0, **options) -> GenerationRequest:
    """A `GenerationRequest` from `Engine.generate`'s flat keyword arguments (sampling fields by name)."""
    unknown = sorted(set(options) - set(GenerationRequest.__dataclass_fields__))
    if unknown:
        raise HeteroError(f"unknown generation argument {unknown[0]!r}; see hetero.GenerationRequest for the fields")
    return GenerationRequest(prompt, max_tokens, SamplingParams(temperature, top_k, top_p, min_p), **options)


def _eos_ids(model: CausalLM, tokenizer: Tokenizer, path: Path) -> set[int]:
    """EOS ids from config.json, generation_config.json and the tokenizer, merged."""
    ids = set(model.args.eos_token_id) | set(tokenizer.eos_token_ids)
    gen = path / "generation_config.json"
    if gen.is_file():
        try:
            eos = json.loads(gen.read_text()).get("eos_token_id")
        except json.JSONDecodeError:
            eos = None
        ids |= {eos} if isinstance(eos, int) else set(eos or [])
    return ids


def load(model: str | os.PathLike | None = None, dtype: mx.Dtype | None = None,
         fuse_projections: bool = True, kv_bits: int | None = None, kv_group_size: int | None = None) -> Engine:
    """Load a checkpoint directory or hub id (None: the bundled model) after the pre-flight check; on Metal the
    model may stay wired up to the GPU's recommended working set. `fuse_projections=False` keeps each layer's
    input projections as separate products (for comparisons; see `hetero.models.fused`). `kv_bits` 8 or 4 stores
    the attention layers' KV quantized in groups of `kv_group_size` (default 64) along head_dim
    (`hetero.models.kv_quant`); None keeps it in the compute dtype."""
    quant = kv_quant(kv_bits, kv_group_size)  # a bad value fails before the weights load
    wire_working_set()
    net, path, config = load_model(model, dtype, fuse_projections)
    use_kv_quant(net, quant)
    if mx.default_device() == mx.cpu:  # the CPU kernels, built on a machine's first load before any request's clock
        kernels.few_rows(), kernels.delta_step()
    tokenizer = Tokenizer.from_dir(path)
    name = "bundled" if model is None else str(model)
    return Engine(net, tokenizer, config, path, name)
