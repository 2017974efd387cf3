"""The library entry point: `hetero.load(...)` returns an `Engine` that computes logits and generates text."""

from __future__ import annotations

import os
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
from hetero.checkpoint.tokenizer import Tokenizer, eos_ids
from hetero.decode import wavefront
from hetero.decode.depth_calibration import calibrate, stderr_line
from hetero.decode.logprobs import LogprobRecorder, TokenLogprob
from hetero.decode.options import DecodeOptions
from hetero.decode.parts import RowParts
from hetero.decode.prefill import prefill
from hetero.decode.records import DecodeTimes, MTPStats, Trace
from hetero.decode.request import STOP, Event, Finished, GenerationRequest, Prefilled, Token
from hetero.decode.solo import decode_tokens
from hetero.decode.state import Decoder
from hetero.errors import HeteroError
from hetero.host import kernels
from hetero.host.settings import DEFAULT_DRAFT_DEPTH, remeasure_reason, tuned_depth
from hetero.models.cache import ModelCache
from hetero.host.wired import wire_working_set
from hetero.models.interface import CausalLM
from hetero.models.kv_quant import kv_quant, use_kv_quant
from hetero.planner import check_prompt_fits
from hetero.prologue import Opening, check_context, open_request, stream_stats
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
        self.eos_ids = eos_ids(model.args.eos_token_id, tokenizer, path)
        self.weights_fingerprint = weights_fingerprint(path)  # taken at load: the files' state as loaded
        self.prefix_cache: PrefixCache | None = None
        self.memory_gb: float | None = None  # RAM the memory governor budgets (None: this machine's)
        self._grammar_tokenizer = None  # llguidance's tokenizer, built on the first constrained request
        self._depth_checked = False  # whether this engine looked at its draft-depth verdict (measured again if stale)
        # the vision tower and image processor of a checkpoint that has them (None: it reads text only)
        self.vision = Vision.of(path, config, tokenizer, model.model.norm.weight.dtype)

    @property
    def identity(self) -> str:
        """Names this checkpoint in per-machine settings: its name plus a hash of its config."""
        return checkpoint_identity(self.name, self.config)

    def default_depth(self) -> int | str | None:
        """How this model decodes here when the caller does not say: the saved verdict's depth or PLAIN ("off").
        A model with an MTP head never measured on this machine, or whose verdict is stale or was inside the noise
        (`hetero.host.settings.remeasure_reason`), is measured first (`hetero.decode.depth_calibration`, at most
        once per engine: the verdict is saved). None for a model without an MTP head."""
        if not self.model.has_mtp:
            return None
        if not self._depth_checked:
            self._depth_checked = True
            why = remeasure_reason(self.identity)
            if why is not None:
                return calibrate(self, DEFAULT_DRAFT_DEPTH, report=stderr_line, why=why)
        return tuned_depth(self.identity)

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
        """The context window's room, and the memory governor's for the prompt's prefill."""
        check_context(n, held, self.max_context)
        check_prompt_fits(self.model, held + n, self.memory_gb, wavefront.chunks_in_flight())

    @property
    def image_marker(self) -> str:
        """The text that stands for one image in a prompt (the chat template's vision start, image, vision end)."""
        if self.vision is None:
            raise HeteroError(f"{self.name} has no vision tower hetero reads: it reads text only")
        return self.vision.marker

    def image_prompt(self, ids: list[int], images: list[ImageInput], held: int = 0) -> ImagePrompt:
        """Token ids with one image token per image (`image_marker` in the text) and the images (file bytes or PIL
        images) -> the prompt with each placeholder expanded to the image's tokens, its 3-D positions and pixel
        digests; the tower runs later, on the images the prefix cache does not hold. One-line HeteroError for a
        text-only checkpoint, a damaged or unsupported image, or a prompt that no longer fits."""
        if self.vision is None:
            raise HeteroError(f"{self.name} has no vision tower hetero reads: it reads text only; send text")
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

    def generate(self, prompt: str | list[int], max_tokens: int | None = None, temperature: float | None = None,
                 top_k: int | None = None, top_p: float | None = None, min_p: float | None = None,
                 on_text: Callable[[str], None] | None = None, on_logprob: Callable[[TokenLogprob], None] | None = None,
                 should_stop: Callable[[], bool] | None = None, **options) -> GenerationResult:
        """Generate up to `max_tokens` tokens (default 256; temperature 0, the default, is greedy): `stream` run to
        its end, for callers that want one result. `on_text` receives text as it streams, `on_logprob` each token's
        logprobs (with `logprobs=N`) just before its text; `should_stop()` is polled after every token: True ends the
        generation there (finish_reason "stop"). Other keyword arguments are `GenerationRequest`'s (`options=` a
        `DecodeOptions` whole, which the named ones then override).

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
        r, opening = request, self._open(request)
        o, ids, depth = opening.options, opening.ids, opening.depth
        recorder = LogprobRecorder(o.logprobs) if o.logprobs is not None else None
        constraint = self._constraint(o, ids)
        times = DecodeTimes(start=time.perf_counter())  # TTFT includes restoring the prefix
        mx.reset_peak_memory()
        pc = self.prefix_cache if r.use_prefix_cache and r.prompt_cache is None else None
        turn = None if pc is None else TurnCheckpoints(pc, self.model, self.cache_key, opening.keys, o.prefill_chunk)
        cache, skip, carry, cached = self._restore(r, opening, turn)
        parts = RowParts(
            cache=cache, skip=skip, carry=carry, progress=r.progress, marks=() if r.mark is None else (r.mark,),
            images=opening.vision, max_context=self.max_context, constraint=constraint, logprobs=recorder, times=times,
            stats=MTPStats(depth) if depth else None, **(turn.parts(depth) if turn is not None else {}),
        )
        decode = r.batch.decode_tokens if r.batch is not None else decode_tokens
        tokens = decode(self.model, ids, o, self.eos_ids, depth, parts)
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
            if turn is not None and consistent:  # (a failure midway checkpoints nothing)
                turn.close(cache, r.mark)
        if generated == 0:
            yield Prefilled(len(ids), cached)
        mtp = parts.stats.to_dict() if parts.stats is not None else None
        yield Finished(detok.finalize(), times.finish_reason,
                       stream_stats(self.name, opening, cached, generated, times, int(mx.get_peak_memory()), mtp))

    def _open(self, r: GenerationRequest) -> Opening:
        """The prologue (`prologue.open_request`) after this engine's own checks: quantized KV takes neither an mlx-lm
        prompt cache nor the split, a prompt cache's layout must be this model's, images need a tower."""
        if getattr(self.model, "kv_quant", None) is not None and (r.prompt_cache is not None or r.split is not None):
            what = "an mlx-lm prompt cache" if r.prompt_cache is not None else "the split prefill"
            raise HeteroError(f"{what} holds full-precision KV only; load the engine without kv_bits to use it")
        held = 0
        if r.prompt_cache is not None:
            held = check_layout(r.prompt_cache, [layer.is_linear for layer in self.model.layers])
        return open_request(self, r, held, self._images(r, held))

    def _constraint(self, o: DecodeOptions, ids: list[int]) -> Constraint | ThinkingBudget | None:
        """The mask the row samples under: the options' grammar (a JSON Schema compiled by the prologue), else the
        thinking budget, else none."""
        if o.grammar is not None:
            return Constraint(self.grammar_tokenizer(), o.grammar, self.eos_ids)
        if o.thinking_budget is not None:
            return self.thinking_budget(o.thinking_budget, ids)
        return None

    def _restore(self, r: GenerationRequest, opening: Opening,
                 turn: TurnCheckpoints | None) -> tuple[ModelCache, int, mx.array | None, int]:
        """(cache, tokens of the prompt in it, the last one's hidden, tokens read from a cache) to prefill the rest
        over: an mlx-lm prompt cache (prefill continues at its offset: chunk edges stay those of a cold run), the
        prefix cache's longest prefix, or the split's prefill of the whole prompt; then the images the cache does not
        hold are encoded."""
        model, ids, vision = self.model, opening.ids, opening.vision
        cache, skip, carry = model.make_cache(), 0, None
        if r.prompt_cache is not None:
            cache = from_mlx_lm(r.prompt_cache, [layer.is_linear for layer in model.layers], len(cache.mtp))
        if turn is not None:
            restored = turn.pc.restore(model, turn.key, opening.keys, limit=len(ids) - 1)  # the last token must run
            if restored is not None:
                cache, skip, carry = restored.cache, restored.n, restored.hidden
        cached = skip + opening.held  # only tokens read from a cache, never ones prefilled here
        if r.split is not None and skip == 0 and r.prompt_cache is None:  # its ANE lane encodes the images too
            cache, skip, carry = r.split.prefill(ids, on_chunk=None if turn is None else turn.on_chunk, images=vision)
        if vision is not None:  # the images that came back from the cache are not encoded again (nor the split's)
            self.vision.encode(vision, start=skip)
        return cache, skip, carry, cached

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

    def tuned_depth(self, options: DecodeOptions) -> int | str | None:
        """What this machine measured for this model, which the depth policy (`depth.decode_depth`) takes when
        `options` name no depth: the depth `hetero tune` saved or PLAIN; for `mtp` None, calibrated now on first use
        (`default_depth`). None when the options name a depth or turn MTP off."""
        if options.draft_depth is not None or options.mtp is False:
            return None
        return self.default_depth() if options.mtp is None else tuned_depth(self.identity)


class TurnCheckpoints:
    """What the prefix cache `pc` keeps of one generation over `keys` (the prompt as the cache keys it): the cache at
    every prefill chunk edge (`on_chunk`), the committed state every `chunk` decoded tokens (`on_commit`, MTP), and
    the committed end state of the turn (`close`; plain decoding's from what `trace` recorded)."""

    def __init__(self, pc: PrefixCache, model: CausalLM, key: str, keys: list, chunk: int):
        self.pc, self.model, self.key, self.keys, self.chunk = pc, model, key, keys, chunk
        self.trace = Trace()  # plain decoding: what the backbone ran
        self.committed = list(keys)
        self.decoder: Decoder | None = None  # MTP: the state after the latest round
        self.last_mark = len(keys) // chunk

    def parts(self, depth: int) -> dict:
        """The row's parts that keep these checkpoints: its chunk edges, its commits (MTP), its trace (plain), and
        the MTP head's KV filled at depth 0 too, so a checkpoint serves a later MTP request."""
        return dict(on_chunk=self.on_chunk, on_commit=self.on_commit if depth else None, trace=self.trace,
                    mtp_prefill=self.model.has_mtp)

    def on_chunk(self, n: int, at: list, hidden: mx.array) -> None:
        """A chunk edge n, the cache as it stood there (images keyed by their pixels)."""
        self.pc.capture(self.model, self.key, self.keys[:n], at, hidden)

    def on_commit(self, decoder: Decoder, new: list[int]) -> None:
        """An MTP round's commit: a checkpoint every `chunk` decoded tokens."""
        self.committed.extend(new)
        self.decoder = decoder
        mark = decoder.length // self.chunk
        if mark > self.last_mark:
            self.last_mark = mark
            self.pc.capture(self.model, self.key, self.committed[: decoder.length], decoder.cache,
                            decoder.pending_hidden)

    def close(self, cache: ModelCache, mark: int | None = None) -> None:
        """Checkpoint the committed end state of the turn (never a speculative one), then persist it.

        The disk gets the checkpoints from the last chunk edge before the prompt's end (or the `mark`, when
        earlier) onward: the same prompt sent again must still run its last token, so it resumes from that edge;
        the conversation's next turn resumes from the mark.
        """
        decoder, trace = self.decoder, self.trace
        if decoder is not None:  # MTP: the state after the last round; x is committed but not yet run
            run = self.committed[: decoder.length]
            self.pc.capture(self.model, self.key, run, decoder.cache, decoder.pending_hidden)
        elif trace.hidden:  # plain: the prompt, then every token a decode step ran
            run = list(self.keys) + [int(t.item()) for t in trace.tokens]
            pending = mx.concatenate(trace.hidden, axis=0)  # [1 + steps, H]
            self.pc.capture(self.model, self.key, run, cache, pending)
        else:
            return
        since = (len(self.keys) - 1) // self.chunk * self.chunk
        self.pc.persist(self.model, self.key, run, since=since if mark is None else min(since, mark))


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


def make_request(prompt: str | list[int], max_tokens: int | None = None, temperature: float | None = None,
                 top_k: int | None = None, top_p: float | None = None, min_p: float | None = None,
                 **options) -> GenerationRequest:
    """A `GenerationRequest` from `Engine.generate`'s flat keyword arguments (None: not given, the default or the
    `options=` object's value)."""
    given = dict(max_tokens=max_tokens, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    return GenerationRequest(prompt, **{k: v for k, v in given.items() if v is not None}, **options)


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
