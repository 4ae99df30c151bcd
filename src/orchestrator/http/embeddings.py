"""Embedding endpoints: OpenAI's /v1/embeddings, Ollama's /api/embed and its older /api/embeddings.

Each handler reads its body, resolves the model, and awaits
`AsyncRuntime.embed_result` (inputs checked and tokenized in this process,
then one worker request: `orchestrator/embeddings.py`) unless the client
disconnects first, which cancels it in the worker. Everything a client can
get wrong (no inputs, an input over the context, `dimensions` beyond the
model's vectors, a model that does not embed) is a 400 in the endpoint's own
error shape before any worker sees the request.
"""

from __future__ import annotations

import asyncio
import base64
import math
import time
from typing import Any

import msgspec
import structlog
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from ...ipc.protocol import InvalidField
from ..embeddings import ContextLengthError, EmbedResult
from ..errors import MlxrtError
from .embedding_schemas import (
    EmbeddingData,
    EmbeddingList,
    EmbeddingRequest,
    EmbeddingUsage,
    OllamaEmbeddingsRequest,
    OllamaEmbeddingsResponse,
    OllamaEmbedRequest,
    OllamaEmbedResponse,
)
from .errors import from_invalid_field, from_runtime_error
from .ollama import parse_keep_alive
from .service import Service, json_response
from .streaming import until_disconnect

log = structlog.get_logger("mlxrt.http")

_openai_decoder = msgspec.json.Decoder(EmbeddingRequest)
_embed_decoder = msgspec.json.Decoder(OllamaEmbedRequest)
_embeddings_decoder = msgspec.json.Decoder(OllamaEmbeddingsRequest)


def routes(svc: Service) -> list[Route]:
    api = EmbeddingsApi(svc)
    return [
        Route("/v1/embeddings", api.openai, methods=["POST"]),
        Route("/api/embed", api.embed, methods=["POST"]),
        Route("/api/embeddings", api.embeddings, methods=["POST"]),
    ]


def _base64(row: Any) -> str:
    """A vector as OpenAI's ``encoding_format: "base64"`` sends it: little-endian float32 bytes."""
    return base64.b64encode(row.astype("<f4").tobytes()).decode("ascii")


def _keep_alive_s(value: Any) -> float | None:
    """Ollama's keep_alive as the runtime's seconds (negative: forever)."""
    seconds = parse_keep_alive(value)
    return None if seconds is None else (math.inf if seconds < 0 else seconds)


class EmbeddingsApi:
    def __init__(self, svc: Service) -> None:
        self.svc = svc

    async def openai(self, request: Request) -> Response:
        t0 = time.perf_counter()
        req: EmbeddingRequest = await self.svc.read(request, _openai_decoder)
        model = self.svc.model(req.model)
        found = await self._embed(request, "/v1/embeddings", model, req.input, t0,
                                  dimensions=req.dimensions, truncate=False)
        rows = found.vectors if found.vectors.ndim == 2 else found.vectors[None]
        encode = _base64 if req.encoding_format == "base64" else (lambda r: r.tolist())
        data = [EmbeddingData(index=i, embedding=encode(r)) for i, r in enumerate(rows)]
        usage = EmbeddingUsage(prompt_tokens=found.prompt_tokens, total_tokens=found.prompt_tokens)
        return json_response(EmbeddingList(data=data, model=req.model, usage=usage))

    async def embed(self, request: Request) -> Response:
        t0 = time.perf_counter()
        req: OllamaEmbedRequest = await self.svc.read(request, _embed_decoder)
        model = self.svc.model(req.model, ollama=True)
        keep_alive = _keep_alive_s(req.keep_alive)
        if req.input is None or req.input == "":  # Ollama's way to load (keep_alive 0: unload) a model
            await self._load_or_unload(model, keep_alive)
            return json_response(OllamaEmbedResponse(model=req.model, embeddings=[], total_duration=0,
                                                     load_duration=0, prompt_eval_count=0))
        found = await self._embed(request, "/api/embed", model, req.input, t0, dimensions=req.dimensions,
                                  truncate=req.truncate, keep_alive=keep_alive)
        rows = found.vectors if found.vectors.ndim == 2 else found.vectors[None]
        return json_response(OllamaEmbedResponse(
            model=req.model, embeddings=rows.tolist(), load_duration=0,
            total_duration=int((time.perf_counter() - t0) * 1e9), prompt_eval_count=found.prompt_tokens))

    async def embeddings(self, request: Request) -> Response:
        t0 = time.perf_counter()
        req: OllamaEmbeddingsRequest = await self.svc.read(request, _embeddings_decoder)
        model = self.svc.model(req.model, ollama=True)
        keep_alive = _keep_alive_s(req.keep_alive)
        if not req.prompt:  # as Ollama: nothing to embed, the model is loaded
            await self._load_or_unload(model, keep_alive)
            return json_response(OllamaEmbeddingsResponse(embedding=[]))
        found = await self._embed(request, "/api/embeddings", model, req.prompt, t0, dimensions=None,
                                  truncate=False, keep_alive=keep_alive, names={"input": "prompt"})
        return json_response(OllamaEmbeddingsResponse(embedding=found.vectors.tolist()))

    async def _embed(self, request: Request, endpoint: str, model: str, inputs: Any, t0: float, *,
                     dimensions: int | None, truncate: bool, keep_alive: float | None = None,
                     names: dict[str, str] | None = None) -> EmbedResult:
        """The vectors of `inputs`, unless the client goes first (the request is then cancelled)."""
        work = self.svc.rt.embed_result(inputs, model=model, dimensions=dimensions, truncate=truncate,
                                        keep_alive=keep_alive)
        try:
            found = await until_disconnect(request.receive, work)
        except InvalidField as exc:
            err = from_invalid_field(exc, names or {})
            if isinstance(exc, ContextLengthError):
                err.code = "context_length_exceeded"
            raise err from None
        except MlxrtError as exc:
            raise from_runtime_error(exc, names) from None
        m = self.svc.metrics
        m.embedded_inputs.labels(model).inc(len(found.vectors) if found.vectors.ndim == 2 else 1)
        m.embedded_tokens.labels(model).inc(found.prompt_tokens)
        log.info("http.embeddings", endpoint=endpoint, model=model, tokens=found.prompt_tokens,
                 inputs=len(found.vectors) if found.vectors.ndim == 2 else 1,
                 worker_ms=round(found.stats.ttft_ms, 2), worker_queue_ms=round(found.stats.queue_ms, 2),
                 total_ms=round((time.perf_counter() - t0) * 1e3, 2))
        return found

    async def _load_or_unload(self, model: str, keep_alive: float | None) -> None:
        if keep_alive == 0:
            await asyncio.to_thread(self.svc.rt.unload, model)
        else:
            self.svc.rt.load(model, keep_alive)
