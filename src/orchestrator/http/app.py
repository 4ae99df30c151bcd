"""The ASGI app: routes of both APIs over one `AsyncRuntime`, plus /health and /metrics.

    client --HTTP--> Gate (auth, body limit, metrics) --> openai.py / ollama.py
                        |                                     | Service.start(): rt.stream(), first chunk
                        |                                     v
                        |                              AsyncRuntime --frames--> worker processes
                        +-- /health, /metrics read rt.workers

Handlers turn every failure into an `HttpError` where it happens; the
exception handlers render it in the API's own shape. A generation is awaited
up to its first chunk before the response starts, so an error the worker
reports at once (prompt too long) is a 4xx status, not a broken stream.
"""

from __future__ import annotations

import hmac
import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, TypeVar

import msgspec
import structlog
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from ..errors import MlxrtError
from ..runtime import AsyncRuntime, AsyncStream, Chunk
from .config import ServerConfig
from .errors import HttpError, body_for, from_decode_error, from_runtime_error, from_value_error
from .metrics import Metrics
from .schemas import ENCODER, Health, ModelHealth
from .streaming import ClientGone, until_disconnect

log = structlog.get_logger("mlxrt.http")

T = TypeVar("T")

#: Paths served without the API key: load balancers probe health unauthenticated.
OPEN_PATHS = frozenset({"/health"})
#: Worker states that can take a request now ("unloaded" reloads on demand).
SERVING_STATES = frozenset({"ready", "busy", "unloaded"})
#: "Until the context is full": the worker clamps max_tokens to context minus prompt.
UNLIMITED_TOKENS = 1 << 30
JSON = "application/json"


@dataclass(frozen=True)
class ModelFacts:
    """What /api/show, /api/tags and /api/ps report, read from the model's config.json when local."""

    ref: str
    family: str = ""
    quantization: str = ""
    context_length: int = 0
    size_bytes: int = 0
    modified_at: str = ""
    config: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def read(cls, ref: str) -> ModelFacts:
        path = Path(ref).expanduser()
        cfg_path = path / "config.json"
        try:
            config = json.loads(cfg_path.read_text())
        except (OSError, ValueError):
            return cls(ref=ref, modified_at=iso_now())
        quant = config.get("quantization") or {}
        bits = quant.get("bits") if isinstance(quant, dict) else None
        weights = list(path.glob("*.safetensors"))
        mtime = max((p.stat().st_mtime for p in [cfg_path, *weights]), default=time.time())
        return cls(
            ref=ref,
            family=str(config.get("model_type", "")),
            quantization=f"Q{bits}" if bits else str(config.get("torch_dtype", config.get("dtype", ""))),
            context_length=int(config.get("max_position_embeddings") or 0),
            size_bytes=sum(p.stat().st_size for p in weights),
            modified_at=iso(mtime),
            config=config,
        )


def iso(ts: float) -> str:
    """RFC 3339 in UTC with a ``Z``, as Ollama writes timestamps."""
    return datetime.fromtimestamp(ts, timezone.utc).isoformat().replace("+00:00", "Z")


def iso_now() -> str:
    return iso(time.time())


class Generation:
    """One generation in flight: its stream, its first chunk and what the client received.

    `finish(reason)` records it once: metrics and one log line.
    """

    __slots__ = ("svc", "endpoint", "model", "stream", "first", "t0", "ttft_s", "tokens", "_finished")

    def __init__(self, svc: Service, endpoint: str, model: str, stream: AsyncStream, t0: float) -> None:
        self.svc = svc
        self.endpoint = endpoint
        self.model = model
        self.stream = stream
        self.first: Chunk | None = None
        self.t0 = t0
        self.ttft_s = 0.0
        self.tokens = 0
        self._finished = False

    @property
    def prompt_tokens(self) -> int:
        return self.stream.stats.prompt_tokens if self.stream.stats else 0

    @property
    def finish_reason(self) -> str:
        return self.stream.finish_reason or "stop"

    async def collect(self, receive) -> tuple[str, list[int]]:
        """The whole completion (text, ids); the generation stops if the client disconnects."""
        texts: list[str] = []
        ids: list[int] = []
        if self.first is not None:
            texts.append(self.first.text)
            ids.extend(self.first.tokens)

        async def drain() -> None:
            async for c in self.stream:
                texts.append(c.text)
                ids.extend(c.tokens)

        await self.unless_gone(receive, drain())
        self.tokens = len(ids)
        self.finish(self.finish_reason)
        return "".join(texts), ids

    async def unless_gone(self, receive, work: Awaitable[T]) -> T:
        """Await `work` unless the client disconnects first; a disconnect or a runtime error
        is recorded as this generation's outcome and re-raised (as an HTTP error)."""
        try:
            return await until_disconnect(receive, work)
        except ClientGone:
            self.finish("disconnected")
            raise
        except MlxrtError as exc:
            self.finish("error")
            raise from_runtime_error(exc) from exc

    async def chunks(self) -> AsyncIterator[Chunk]:
        """The first chunk (awaited before the response began), then the rest, counting
        tokens sent; the stream is closed at the end (and by `on_close` if the client goes)."""
        try:
            if self.first is not None:
                self.tokens += len(self.first.tokens)
                yield self.first
            async for c in self.stream:
                self.tokens += len(c.tokens)
                yield c
        finally:
            self.stream.close()

    def on_close(self, gone: bool) -> None:
        """`EventStream`'s end: disconnected, failed (no stats), or finished as the worker said."""
        self.finish("disconnected" if gone else (self.finish_reason if self.stream.stats else "error"))

    def finish(self, reason: str) -> None:
        """Close the stream (a no-op once it ended) and record the outcome; idempotent."""
        if self._finished:
            return
        self._finished = True
        self.stream.close()
        m = self.svc.metrics
        m.finished.labels(self.model, reason).inc()
        if self.tokens:
            m.tokens.labels(self.model).inc(self.tokens)
            m.ttft.labels(self.model).observe(self.ttft_s)
        stats = self.stream.stats
        if stats is not None and stats.decode_tps > 0:
            m.decode_rate.labels(self.model).observe(stats.decode_tps)
        log.info("http.generation", endpoint=self.endpoint, model=self.model, reason=reason,
                 prompt_tokens=self.prompt_tokens, tokens=self.tokens,
                 ttft_ms=round(self.ttft_s * 1e3, 2),
                 total_ms=round((time.perf_counter() - self.t0) * 1e3, 2))


class Service:
    """What the handlers share: the runtime, the config, the metrics, the models' facts."""

    def __init__(self, rt: AsyncRuntime, config: ServerConfig, model_refs: Mapping[str, str]) -> None:
        self.rt = rt
        self.config = config
        self.metrics = Metrics(lambda: rt.workers)
        self.created = int(time.time())
        self.model_refs = dict(model_refs)
        self._facts: dict[str, ModelFacts] = {}

    def facts(self, name: str) -> ModelFacts:
        if name not in self._facts:
            self._facts[name] = ModelFacts.read(self.model_refs.get(name, name))
        return self._facts[name]

    def model(self, requested: str, *, ollama: bool = False) -> str:
        """The served model called `requested` (Ollama's ``:latest`` tag optional); 404 otherwise."""
        served = self.rt.models
        if requested in served:
            return requested
        if ollama and requested.endswith(":latest") and requested[: -len(":latest")] in served:
            return requested[: -len(":latest")]
        if not requested:
            raise HttpError(400, f"model: required; this server serves {served}", param="model")
        raise HttpError(404, f"model {requested!r} not found; this server serves {served}",
                        param="model", code="model_not_found")

    async def read(self, request: Request, decoder: msgspec.json.Decoder, prefix: str = "") -> Any:
        """Read the body (at most `max_body_bytes`, else 413) and decode it strictly (else 400)."""
        limit = self.config.max_body_bytes
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise _too_large(limit)
        body = bytearray()
        async for part in request.stream():
            body += part
            if len(body) > limit:
                raise _too_large(limit)
        if not body:
            raise HttpError(400, "request body is empty: expected a JSON object", code="invalid_json")
        try:
            return decoder.decode(body)
        except msgspec.DecodeError as exc:
            raise from_decode_error(exc, prefix) from None

    async def start(
        self,
        request: Request,
        endpoint: str,
        prompt: Any,
        model: str,
        params: dict[str, Any],
        names: Mapping[str, str],
        t0: float,
    ) -> Generation:
        """Start a generation and wait for its first chunk (or its end, or its error)."""
        try:
            stream = self.rt.stream(prompt, model=model, **params)
        except ValueError as exc:
            raise from_value_error(exc, names) from None
        except MlxrtError as exc:
            raise from_runtime_error(exc) from None
        gen = Generation(self, endpoint, model, stream, t0)
        gen.first = await gen.unless_gone(request.receive, _first(stream))
        gen.ttft_s = time.perf_counter() - t0
        return gen


async def _first(stream: AsyncStream) -> Chunk | None:
    try:
        return await stream.__anext__()
    except StopAsyncIteration:
        return None


def _too_large(limit: int) -> HttpError:
    return HttpError(413, f"request body is larger than {limit} bytes (server option --max-body-bytes)",
                     code="body_too_large")


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def json_response(obj: object, status: int = 200) -> Response:
    return Response(ENCODER.encode(obj), status_code=status, media_type=JSON)


# ---- /health and /metrics ----------------------------------------------------


def health_of(rt: AsyncRuntime) -> tuple[bool, Health]:
    """Ready when every model has at least one worker that can take a request."""
    models: dict[str, ModelHealth] = {name: ModelHealth(ready=0, workers=[]) for name in rt.models}
    for w in rt.workers:
        entry = models.setdefault(w.model, ModelHealth(ready=0, workers=[]))
        entry.workers.append(w)
        if w.state in SERVING_STATES:
            entry.ready += 1
    ok = bool(models) and all(m.ready for m in models.values())
    return ok, Health(status="ok" if ok else "unavailable", models=models)


# ---- the gate: auth, size limit, request metrics -----------------------------


ENDPOINTS = frozenset(
    {
        "/v1/chat/completions", "/v1/completions", "/v1/models",
        "/api/generate", "/api/chat", "/api/tags", "/api/ps", "/api/show", "/api/version",
        "/health", "/metrics",
    }
)


class Gate:
    """Pure ASGI middleware: API key, declared body size, request counts by endpoint and status."""

    def __init__(self, app, svc: Service) -> None:
        self.app = app
        self.svc = svc
        key = svc.config.api_key
        self._expected = f"Bearer {key}".encode() if key else None

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        endpoint = path if path in ENDPOINTS else ("/v1/models/{model}" if path.startswith("/v1/models/")
                                                   else "other")
        status = 500
        metrics = self.svc.metrics

        async def send_status(message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        metrics.in_progress.inc()
        try:
            denied = self._denied(scope)
            if denied is not None:
                await _send_error(path, denied, send_status)
                return
            await self.app(scope, receive, send_status)
        finally:
            metrics.in_progress.dec()
            metrics.requests.labels(endpoint, str(status)).inc()

    def _denied(self, scope) -> HttpError | None:
        if self._expected is None or scope["path"] in OPEN_PATHS:
            return None
        for name, value in scope["headers"]:
            if name == b"authorization":
                if hmac.compare_digest(value, self._expected):
                    return None
                break
        return HttpError(401, "missing or wrong API key: send 'Authorization: Bearer <key>'",
                         code="invalid_api_key")


async def _send_error(path: str, err: HttpError, send) -> None:
    headers = [(b"content-type", JSON.encode())]
    if err.status == 401:
        headers.append((b"www-authenticate", b"Bearer"))
    await send({"type": "http.response.start", "status": err.status, "headers": headers})
    await send({"type": "http.response.body", "body": body_for(path, err)})


# ---- the app -----------------------------------------------------------------


def create_app(
    rt: AsyncRuntime,
    config: ServerConfig | None = None,
    *,
    model_refs: Mapping[str, str] | None = None,
) -> Gate:
    """The server's ASGI app over a started `rt`; `model_refs` maps names to paths for /api/show."""
    from . import ollama, openai

    config = config or ServerConfig()
    svc = Service(rt, config, model_refs or {})

    async def health(request: Request) -> Response:
        ok, body = health_of(rt)
        return json_response(body, 200 if ok else 503)

    async def metrics(request: Request) -> Response:
        return Response(svc.metrics.render(), media_type=svc.metrics.content_type)

    routes = [
        Route("/health", health, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
        *openai.routes(svc),
        *ollama.routes(svc),
    ]
    app = Starlette(
        routes=routes,
        exception_handlers={HttpError: _render_http_error, HTTPException: _render_starlette_error,
                            ClientGone: _client_gone},
    )
    app.state.service = svc
    return Gate(app, svc)


async def _render_http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HttpError)
    if exc.status >= 500:
        log.error("http.error", path=request.url.path, status=exc.status, error=exc.message)
    headers = {"www-authenticate": "Bearer"} if exc.status == 401 else None
    return Response(body_for(request.url.path, exc), status_code=exc.status, media_type=JSON,
                    headers=headers)


async def _render_starlette_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    message = {404: f"no such endpoint: {request.method} {request.url.path}",
               405: f"method {request.method} not allowed on {request.url.path}"}.get(
        exc.status_code, str(exc.detail))
    return await _render_http_error(request, HttpError(exc.status_code, message))


async def _client_gone(request: Request, exc: Exception) -> Response:
    return Response(status_code=499)  # nginx's "client closed request"; nobody reads it
