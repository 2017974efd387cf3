"""The ASGI app (routes, the access log), the server's settings and `hetero serve` (bind, load, serve)."""

from __future__ import annotations

import contextlib
import errno
import ipaddress
import logging
import socket
import time
import uuid
from dataclasses import dataclass, fields
from pathlib import Path

import anyio.to_thread
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

import hetero
from hetero.caches.prefix import PrefixCache
from hetero.caches.session import SessionStore, default_dir
from hetero.coreml.export import check_weight_form
from hetero.decode.depth import check_depth
from hetero.decode.turns import DECODE_SHARE
from hetero.engine import Engine
from hetero.errors import HeteroError
from hetero.models.kv_quant import kv_quant
from hetero.pipeline import split_for
from hetero.server import anthropic, openai
from hetero.server.common import USAGE, State, check_key, endpoint, failure, wants_anthropic
from hetero.server.idle_tuning import IdleTuning
from hetero.server.metrics import CONTENT_TYPE, Metrics
from hetero.server.requests import DEFAULT_MAX_TOKENS, Parser
from hetero.server.refusals import RequestError
from hetero.server.responses import ResponseStore, parse_responses
from hetero.server.responses_output import ResponsesOutput
from hetero.server.runner import Runner
from hetero.validate import GPU_ONLY, NONNEG, PORT, POSITIVE, POSITIVE_INT, AneSplit, Bound, check_text

log = logging.getLogger("hetero.server")
access = logging.getLogger("hetero.access")

SERVE_MAX_BATCH = 4  # `hetero serve`'s default --max-batch: a lone request in the batch decodes at its solo speed
DEFAULT_MAX_BODY_MB = 32.0  # a 256K-token transcript is ~1 MB of text; 32 MB leaves room for token-id prompts


@dataclass(frozen=True)
class ServerSettings:
    """`hetero serve`'s settings, built once (`from_args` from the command line, or by keyword from Python) and
    checked when built: a bad value is one HeteroError line naming its flag. The defaults are the CLI's."""

    model: str | None = None  # checkpoint directory or hub id (None: the bundled model)
    host: str = "127.0.0.1"
    port: int = 8080
    api_key: str | None = None  # /v1 routes need `Authorization: Bearer KEY` (or `x-api-key`)
    served_name: str | None = None  # another name clients may send in `model`
    prefix_cache_max_gb: float = 2.0
    session_cache: str | None = None  # the on-disk session cache's directory (None: the default place)
    session_cache_max_gb: float = 16.0
    no_session_cache: bool = False
    ane: AneSplit = GPU_ONLY  # the prefill split (a number or "auto" is parsed by `AneSplit.parse`)
    ane_weights: str = "lut"  # `--ane-weights`: the Core ML form of quantized weights (hetero.coreml.export.WEIGHT_FORMS)
    draft_depth: int | None = None  # every request's MTP draft depth (None: the tuned or calibrated one)
    prefill_chunk: int = 512
    max_concurrent: int = 4  # requests generating at once, taking turns on the model
    default_max_tokens: int = DEFAULT_MAX_TOKENS  # an OpenAI request without max_tokens
    max_body_mb: float = DEFAULT_MAX_BODY_MB  # a larger body gets a 413
    decode_share: float = DECODE_SHARE  # senior requests' share of the model's time while a later prompt prefills
    max_batch: int = 1  # decoding requests that share each decode pass (`hetero serve`: SERVE_MAX_BATCH, 1 across ranks)
    dist_timeout: float = 60.0  # under mlx.launch: seconds without progress from the other ranks
    model_alias: tuple[str, ...] = ()  # `--model-alias PATTERN=NAME`: request names matching PATTERN get NAME
    reject_images: bool = False  # an image in a text-only model's conversation is a 400 (default: a placeholder)
    allow_local_images: bool = False  # a vision model may read image parts naming local files
    max_image_mb: float = 20.0  # a larger image file is a 400
    metrics_public: bool = False  # GET /metrics without the --api-key (for a scraper that sends none)
    kv_bits: int | None = None  # attention KV stored in 8 or 4 bits (None: full precision)
    kv_group_size: int | None = None  # with kv_bits: values per scale and bias (None: 64)

    def __post_init__(self) -> None:
        object.__setattr__(self, "ane", AneSplit.parse(self.ane))
        check_weight_form(self.ane_weights)
        PORT.check(self.port, "--port")
        for name in ("prefill_chunk", "max_concurrent", "default_max_tokens", "max_batch"):
            POSITIVE_INT.check(getattr(self, name), _flag(name))
        for name in ("max_body_mb", "dist_timeout", "max_image_mb"):
            POSITIVE.check(getattr(self, name), _flag(name))
        for name in ("prefix_cache_max_gb", "session_cache_max_gb"):
            NONNEG.check(getattr(self, name), _flag(name))
        Bound(0, 1, hi_open=True).check(self.decode_share, "--decode-share")
        if self.draft_depth is not None:
            check_depth(self.draft_depth)
        if self.served_name is not None:  # sent back in every response: it must be valid text
            check_text(self.served_name, "--served-model-name")
        kv_quant(self.kv_bits, self.kv_group_size)  # a bad value fails here, before anything loads
        if self.kv_bits is not None and not self.ane.gpu_only:
            raise HeteroError("--kv-bits with --ane-fraction: the split prefill reads full-precision KV only; "
                              "leave one of them out")
        object.__setattr__(self, "model_alias", tuple(self.model_alias or ()))
        self.aliases  # a malformed alias fails here, when the settings are built

    @property
    def aliases(self) -> tuple[tuple[str, str], ...]:
        """(fnmatch pattern, served name) pairs of `--model-alias PATTERN=NAME`."""
        out = []
        for given in self.model_alias:
            pattern, eq, name = given.partition("=") if isinstance(given, str) else ("", "", "")
            if not eq or not pattern.strip() or not name.strip():
                raise HeteroError(f"--model-alias {given!r} must be PATTERN=NAME, e.g. 'claude-*=my-model' (PATTERN "
                                  "in shell wildcards, NAME the served model's name)")
            check_text(pattern, "--model-alias")
            out.append((pattern.strip(), name.strip()))
        return tuple(out)

    @classmethod
    def from_args(cls, args, pipelined: bool = False) -> ServerSettings:
        """The settings of `hetero serve`'s parsed arguments (`--served-model-name` is `served_name`,
        `--ane-fraction` is `ane`); `pipelined` when the ranks of mlx.launch serve, which batch nothing."""
        given = {f.name: getattr(args, f.name) for f in fields(cls) if hasattr(args, f.name)}
        if given.get("max_batch") is None:  # not given: batched in one process; a pipelined server decodes one at a time
            given["max_batch"] = 1 if pipelined else SERVE_MAX_BATCH
        return cls(**given, served_name=args.served_model_name, ane=args.ane_fraction)

    @property
    def model_names(self) -> set[str]:
        """The names clients may use in `model` besides the model's own (`--served-model-name`)."""
        return {self.served_name} if self.served_name else set()


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def server_split(engine: Engine, ane: AneSplit | float | str | None, chunk: int, weights: str = "lut"):
    """The configured split of `--ane-fraction` (a fraction or auto), or None for GPU-only (not given, or 0);
    `weights`: `--ane-weights`."""
    ane = AneSplit.parse(ane)
    if ane.gpu_only:
        return None

    return split_for(engine, ane, chunk, weights)


def create_app(engine: Engine, settings: ServerSettings | None = None, split=None, **options) -> Starlette:
    """The ASGI app serving `engine` with `settings` (default: `ServerSettings(**options)`, e.g.
    `create_app(engine, api_key="k", max_batch=4)`); with an `api_key`, /v1 routes need `Authorization: Bearer KEY`
    or `x-api-key`.

    `split` (a `hetero.pipeline.PipelineRun`) prefills prompts through the ANE + GPU pipeline; up to
    `max_concurrent` requests generate at once, taking turns on the model. An OpenAI request without
    `max_tokens` gets `default_max_tokens`; a body over `max_body_mb` gets a 413. While senior requests wait
    (decoding, or sent earlier), a prompt prefills in `1 - decode_share` of the model's time (`hetero.decode.turns`).
    With `max_batch` > 1, up to that many decoding requests share each decode pass (`hetero.decode.loop`). A
    `draft_depth` is every MTP request's.
    """
    if settings is not None and options:
        raise TypeError("create_app takes settings or keyword options, not both")
    s = settings if settings is not None else ServerSettings(**options)
    names = served_names(engine, s)
    runner = Runner(engine, split, s.max_concurrent, s.prefill_chunk, s.decode_share, s.max_batch, s.draft_depth)
    parser = Parser(engine, names, split.requested_fraction if split is not None else 0.0, s.default_max_tokens,
                    s.aliases, s.reject_images, s.allow_local_images, int(s.max_image_mb * 2**20))
    state = State(engine, runner, parser, names, s.api_key, int(s.max_body_mb * 2**20))
    metrics = Metrics(engine, runner, state.model)
    runner.on_outcome = metrics.observe

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette):
        yield
        await anyio.to_thread.run_sync(runner.close)  # the server stopped: its worker threads end now

    app = Starlette(lifespan=lifespan, routes=generation_routes(state) + info_routes(state, s, metrics),
                    exception_handlers={Exception: _unhandled, 404: _no_route, 405: _no_route},
                    middleware=[Middleware(AccessLog)])
    app.state.runner = runner  # `run_app` stops it on SIGTERM / SIGINT
    return app


def served_names(engine: Engine, s: ServerSettings) -> set[str]:
    """The model names requests may send (the engine's and `--served-model-name`), once `s` is checked against the
    engine: a `draft_depth` needs an MTP head, and each `--model-alias` must name a served model."""
    if s.draft_depth is not None and not engine.model.has_mtp:
        raise HeteroError(f"--draft-depth {s.draft_depth}: {engine.name} has no MTP head (no mtp.* tensors) to "
                          "draft with; leave it out")
    names = {engine.name} | s.model_names
    for pattern, name in s.aliases:
        if name not in names:
            raise HeteroError(f"--model-alias {pattern}={name}: {name!r} is not served here; use one of "
                              f"{sorted(names)}")
    return names


def generation_routes(state: State) -> list[Route]:
    """The POST routes that generate or count tokens, in OpenAI's and Anthropic's APIs."""
    return [
        Route("/v1/chat/completions", endpoint(state, openai.parse_chat, openai.ChatOutput), methods=["POST"]),
        Route("/v1/completions", endpoint(state, openai.parse_completion, openai.CompletionOutput), methods=["POST"]),
        Route("/v1/messages", endpoint(state, anthropic.parse_messages, anthropic.MessagesOutput), methods=["POST"]),
        Route("/v1/messages/count_tokens", anthropic.count_tokens(state), methods=["POST"]),
        Route("/v1/responses", endpoint(state, parse_responses(ResponseStore()), ResponsesOutput), methods=["POST"]),
    ]


def info_routes(state: State, s: ServerSettings, metrics: Metrics) -> list[Route]:
    """The GET routes that describe the server: the served models, /health and the Prometheus /metrics."""
    engine, runner, names = state.engine, state.runner, state.names

    async def models(request: Request) -> Response:
        """The served names, in Anthropic's shape when the request carries Anthropic headers, else OpenAI's."""
        api = anthropic.MessagesOutput if wants_anthropic(request) else openai.ChatOutput
        try:
            check_key(state, request)
        except RequestError as e:
            return api.error(e)
        if api is anthropic.MessagesOutput:
            return JSONResponse(anthropic.models_page(sorted(names)))
        return JSONResponse({"object": "list", "data": [openai_model(n) for n in sorted(names)]})

    async def model(request: Request) -> Response:
        """One served name (GET /v1/models/{id}), in the API's shape; 404 for another."""
        api = anthropic.MessagesOutput if wants_anthropic(request) else openai.ChatOutput
        name = request.path_params["model_id"]
        try:
            check_key(state, request)
            if name not in names:
                raise RequestError(404, f"model {name!r} is not served here; GET /v1/models lists {sorted(names)}",
                                   "model", "model_not_found")
        except RequestError as e:
            return api.error(e)
        if api is anthropic.MessagesOutput:
            return JSONResponse(anthropic.models_page([name])["data"][0])
        return JSONResponse(openai_model(name))

    async def health(request: Request) -> Response:
        pc = engine.prefix_cache
        return JSONResponse({"status": "ok", "model": state.model, "max_context": engine.max_context,
                             "prefix_cache": pc.stats() if pc is not None else None,
                             "requests": {"finished": runner.finished, "cancelled": runner.cancelled,
                                          "split_prefills": runner.split_prefills, "turn_handovers": runner.turns.handovers},
                             "batch": runner.loop.health() if runner.loop is not None else None,
                             "draft_depth": s.draft_depth,  # --draft-depth (None: the tuned or calibrated one)
                             "ane": runner.split.ane_block() if runner.split is not None else None})

    async def metrics_page(request: Request) -> Response:
        """The Prometheus text of `hetero.server.metrics`; behind the API key unless `metrics_public`."""
        if not s.metrics_public:
            try:
                check_key(state, request)
            except RequestError as e:
                return openai.ChatOutput.error(e)
        return Response(metrics.text(), media_type=CONTENT_TYPE)

    return [
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/models/{model_id:path}", model, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/metrics", metrics_page, methods=["GET"]),
    ]


def openai_model(name: str) -> dict:
    return {"id": name, "object": "model", "created": 0, "owned_by": "hetero"}


async def _unhandled(request: Request, e: Exception) -> Response:
    """Starlette's last resort: a JSON 500 in the API's own error shape, naming a request id for the log."""
    error = failure(e, "req_" + uuid.uuid4().hex[:24])
    api = anthropic.MessagesOutput if wants_anthropic(request) else openai.ChatOutput
    return api.error(error)


async def _no_route(request: Request, e: Exception) -> Response:
    """An unknown route (404) or method (405), in the error shape of the API the request speaks."""
    api = anthropic.MessagesOutput if wants_anthropic(request) else openai.ChatOutput
    status = getattr(e, "status_code", 404)
    path, method = request.url.path, request.method
    if status == 405:
        allowed = getattr(e, "headers", None) or {}
        message = f"{method} is not allowed on {path}; use {allowed.get('Allow', 'another method')}"
    else:
        message = f"there is no route {method} {path} on this server; the API routes are under /v1 (see GET /v1/models)"
    response = api.error(RequestError(status, message, None, "not_found" if status == 404 else "method_not_allowed"))
    if status == 405 and getattr(e, "headers", None):
        response.headers["allow"] = e.headers.get("Allow", "")
    return response


class AccessLog:
    """One `hetero.access` log line per request, once its response has ended: client, method, path, status,
    prompt, cached prompt and completion tokens and the time to the first token (when it generated), seconds."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        t0, status = time.perf_counter(), [500]  # an exception that escapes becomes Starlette's 500

        async def send_status(message: Message) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        finally:
            outcome = scope.get(USAGE)
            tokens = ""
            if outcome is not None:
                prompt, cached, completion = outcome.usage
                tokens = (f" prompt_tokens={prompt} cached_tokens={cached} completion_tokens={completion} "
                          f"ttft={outcome.stats['ttft_s']:.3f}s")
            client = scope.get("client")
            access.info('%s "%s %s" %d%s %.3fs', f"{client[0]}:{client[1]}" if client else "-", scope["method"],
                        scope["path"], status[0], tokens, time.perf_counter() - t0)


def serve(settings: ServerSettings | None = None) -> None:
    """Load the model, attach the RAM prefix cache (and the disk session cache), and serve until interrupted.

    `settings.ane` prefills through the ANE + GPU split, as `hetero run --ane-fraction` does; `settings.draft_depth`
    is every MTP request's draft depth (else the tuned one, calibrated now for a model never measured here; a verdict
    left inside the noise is measured again in idle time, `hetero.server.idle_tuning`).
    Requests and their times are logged to stderr (`hetero.access`); an address other than loopback without an
    `api_key` gets a warning there.
    """

    s = settings if settings is not None else ServerSettings()
    sock = listen(s.host, s.port, s.api_key)  # before the model loads: a port in use fails at once, not after a minute
    try:
        store = None if s.no_session_cache else open_session_store(s.session_cache, s.session_cache_max_gb)
        engine = hetero.load(s.model, kv_bits=s.kv_bits, kv_group_size=s.kv_group_size)
        if s.draft_depth is None:
            engine.default_depth()  # a model never measured here is calibrated now, not inside the first request
        engine.prefix_cache = PrefixCache(int(s.prefix_cache_max_gb * 1024**3), store=store)
        split = server_split(engine, s.ane, s.prefill_chunk, s.ane_weights)
        app = create_app(engine, s, split)
        if s.draft_depth is None:  # a verdict inside the noise is measured again while no request runs
            IdleTuning(engine, app.state.runner).start()
    except BaseException:
        sock.close()
        raise
    names = {engine.name} | s.model_names
    where = f"session cache {store.root} ({len(store.entries)} entries)" if store else "no session cache"
    run_app(app, sock, f"serving {sorted(names)} on http://{s.host}:{s.port} ({where})")


def listen(host: str, port: int, api_key: str | None) -> socket.socket:
    """Set up the log and bind (host, port) (`bind`); an address other than loopback without `api_key` gets a
    warning."""
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    sock = bind(host, port)
    if api_key is None and not loopback(sock):
        log.warning("listening on %s:%d without --api-key: anyone who can reach this address can use the model; "
                    "pass --api-key KEY (or set HETERO_API_KEY)", host, sock.getsockname()[1])
    return sock


def run_app(app: Starlette, sock: socket.socket, banner: str) -> None:
    """Print `hetero: <banner>` and serve `app` on `sock` until SIGTERM or SIGINT (`hetero.server.stopping`)."""
    import uvicorn

    from hetero.server.stopping import StoppingServer

    print(f"hetero: {banner}", flush=True)
    host, port = sock.getsockname()[:2]
    config = uvicorn.Config(app, host=host, port=port, log_level="warning")
    StoppingServer(config, app.state.runner.stop).run(sockets=[sock])


def bind(host: str, port: int) -> socket.socket:
    """A TCP socket bound to (host, port), or a one-line HeteroError saying why not (port in use, bad address)."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except (socket.gaierror, UnicodeError) as e:
        raise HeteroError(f"--host {host!r} is not an address this machine can bind ({e}); try 127.0.0.1 or 0.0.0.0") from None
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn does: a port in TIME_WAIT is free
    try:
        sock.bind(address)
    except OSError as e:
        sock.close()
        if e.errno == errno.EADDRINUSE:
            raise HeteroError(f"port {port} on {host} is in use (another server running?); stop it or pass --port N") from None
        raise HeteroError(f"cannot listen on {host}:{port}: {e.strerror}; pass another --host or --port") from None
    sock.set_inheritable(True)
    return sock


def loopback(sock: socket.socket) -> bool:
    """Whether `sock` is bound to a loopback address (reachable from this machine only)."""
    host = sock.getsockname()[0].split("%")[0]  # an IPv6 address may carry a %zone
    return ipaddress.ip_address(host).is_loopback


def open_session_store(root: str | None, max_gb: float):
    """The on-disk session cache at `root` (None: the default place), refused in one line when it cannot be a directory."""

    path = Path(root).expanduser() if root is not None else default_dir()
    if path.exists() and not path.is_dir():
        raise HeteroError(f"--session-cache {path} is a file, not a directory; pass a directory (created when missing) "
                          "or --no-session-cache")
    try:
        return SessionStore(path, int(max_gb * 1024**3))
    except OSError as e:
        raise HeteroError(f"cannot use {path} as the session cache ({e.strerror or e}); pass another --session-cache DIR "
                          "or --no-session-cache") from None
