"""The ASGI app: routes of every API over one `AsyncRuntime`, plus /health and /metrics.

    client --HTTP--> Gate (auth, metrics) --> openai.py / ollama.py / anthropic.py / responses.py
                                              / embeddings.py
                        |                                     | service.py: Service.read() (body.py),
                        |                                     | Service.start(): rt.submit(), first chunk
                        |                                     v
                        |                              AsyncRuntime --frames--> worker processes
                        +-- /health, /metrics read rt.workers

Handlers turn every failure into an `HttpError` where it happens; the
exception handlers render it in the API's own shape and log it: a 4xx as one
info line (path, status, the message the client got), a 5xx as an error with
its traceback (an exception no handler expected is a 500 in the API's shape). A generation is awaited
up to its first chunk before the response starts, so an error the worker
reports at once (prompt too long) is a 4xx status, not a broken stream.
"""

from __future__ import annotations

import hmac
from collections.abc import Mapping

import structlog
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from ..runtime import AsyncRuntime
from . import anthropic, embeddings, ollama, openai, responses
from .config import ServerConfig
from .errors import HttpError, body_for
from .schemas import Health, ModelHealth
from .service import JSON, Service, json_response
from .streaming import ClientGone

log = structlog.get_logger("mlxrt.http")

#: Paths served without the API key: load balancers probe health unauthenticated.
OPEN_PATHS = frozenset({"/health"})
#: Worker states that can take a request now ("unloaded" reloads on demand).
SERVING_STATES = frozenset({"ready", "busy", "unloaded"})
#: How long /metrics waits for each worker's memory report (its prefix cache and disk tier figures).
METRICS_MEMORY_TIMEOUT_S = 1.0


# ---- /health and /metrics ----------------------------------------------------


def health_of(rt: AsyncRuntime) -> tuple[bool, Health]:
    """Ready when every model has at least one worker that can take a request (a spare cannot)."""
    models: dict[str, ModelHealth] = {name: ModelHealth(ready=0, workers=[]) for name in rt.models}
    for w in rt.workers:
        entry = models.setdefault(w.model, ModelHealth(ready=0, workers=[]))
        entry.workers.append(w)
        if w.state in SERVING_STATES and not w.spare:
            entry.ready += 1
    ok = bool(models) and all(m.ready for m in models.values())
    return ok, Health(status="ok" if ok else "unavailable", models=models)


# ---- the gate: auth, size limit, request metrics -----------------------------


ENDPOINTS = frozenset(
    {
        "/v1/chat/completions", "/v1/completions", "/v1/models",
        "/v1/messages", "/v1/messages/count_tokens", "/v1/responses",
        "/api/generate", "/api/chat", "/api/tags", "/api/ps", "/api/show", "/api/version",
        "/health", "/metrics",
        "/v1/embeddings", "/api/embed", "/api/embeddings",
    }
)


def _endpoint(path: str) -> str:
    """The metrics label of a path with a parameter in it (else "other")."""
    for prefix, label in (("/v1/models/", "/v1/models/{model}"), ("/v1/responses/", "/v1/responses/{id}")):
        if path.startswith(prefix):
            return label
    return "other"


class Gate:
    """Pure ASGI middleware: API key, request counts by endpoint and status."""

    def __init__(self, app, svc: Service) -> None:
        self.app = app
        self.svc = svc
        key = svc.config.api_key
        self._expected = f"Bearer {key}".encode() if key else None
        self._key = key.encode() if key else None

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        endpoint = path if path in ENDPOINTS else _endpoint(path)
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
                log_error(path, denied)
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
            if name == b"authorization" and hmac.compare_digest(value, self._expected):
                return None
            if name == b"x-api-key" and hmac.compare_digest(value, self._key):  # Anthropic's header
                return None
        return HttpError(401, "missing or wrong API key: send 'Authorization: Bearer <key>' "
                              "(or 'x-api-key: <key>')", code="invalid_api_key")


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
    """The server's ASGI app over a started `rt`; `model_refs` maps names to the paths (or refs) they
    are served from: /api/show reads them, and a model also answers to its path."""
    config = config or ServerConfig()
    svc = Service(rt, config, model_refs or {})

    async def health(request: Request) -> Response:
        ok, body = health_of(rt)
        return json_response(body, 200 if ok else 503)

    async def metrics(request: Request) -> Response:
        memory = await rt.memory(timeout=METRICS_MEMORY_TIMEOUT_S)  # a worker that does not answer: left out
        return Response(svc.metrics.render(memory), media_type=svc.metrics.content_type)

    routes = [
        Route("/health", health, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
        *openai.routes(svc),
        *ollama.routes(svc),
        *anthropic.routes(svc),
        *responses.routes(svc),
        *embeddings.routes(svc),
    ]
    app = Starlette(
        routes=routes,
        exception_handlers={HttpError: _render_http_error, HTTPException: _render_starlette_error,
                            ClientGone: _client_gone, Exception: _render_bug},
    )
    app.state.service = svc
    return Gate(app, svc)


def log_error(path: str, err: HttpError) -> None:
    """A 4xx: one info line with what the client was told; a 5xx: an error with the traceback (its
    cause's: the runtime's or the worker's error)."""
    if err.status >= 500:
        log.error("http.error", path=path, status=err.status, error=err.message, exc_info=err)
    else:
        log.info("http.client_error", path=path, status=err.status, error=err.message, param=err.param)


async def _render_http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HttpError)
    log_error(request.url.path, exc)
    headers = {"www-authenticate": "Bearer"} if exc.status == 401 else None
    return Response(body_for(request.url.path, exc), status_code=exc.status, media_type=JSON,
                    headers=headers)


async def _render_starlette_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    message = {404: f"no such endpoint: {request.method} {request.url.path}",
               405: f"method {request.method} not allowed on {request.url.path}"}.get(
        exc.status_code, str(exc.detail))
    return await _render_http_error(request, HttpError(exc.status_code, message))


async def _render_bug(request: Request, exc: Exception) -> Response:
    """An exception no handler expected: a 500 in the API's shape, logged with its traceback."""
    err = HttpError(500, f"internal error: {type(exc).__name__}: {exc}")
    err.__cause__ = exc
    return await _render_http_error(request, err)


async def _client_gone(request: Request, exc: Exception) -> Response:
    return Response(status_code=499)  # nginx's "client closed request"; nobody reads it
