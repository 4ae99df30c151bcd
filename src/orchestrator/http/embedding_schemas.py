"""Bodies of the embedding endpoints, OpenAI's and Ollama's, as msgspec Structs.

``input`` is decoded loosely (msgspec takes one array type per union: a list of
strings, of ids or of id lists is one ``list``) and checked item by item by
`orchestrator.embeddings.embed_inputs`, which names the bad item.
"""

from __future__ import annotations

from typing import Any, Literal

from msgspec import Struct

from .schemas import Int, KeepAlive, OllamaOptions, Strict

# ---- OpenAI: POST /v1/embeddings ---------------------------------------------


class EmbeddingRequest(Strict, kw_only=True):
    input: str | list[Any]
    model: str = ""
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Int | None = None
    user: str | None = None  # accepted, no effect


class EmbeddingData(Struct, kw_only=True):
    object: str = "embedding"
    index: int
    #: Floats, or with ``encoding_format: "base64"`` the little-endian float32 bytes in base64.
    embedding: list[float] | str


class EmbeddingUsage(Struct, kw_only=True):
    prompt_tokens: int
    total_tokens: int


class EmbeddingList(Struct, kw_only=True):
    object: str = "list"
    data: list[EmbeddingData]
    model: str
    usage: EmbeddingUsage


# ---- Ollama: POST /api/embed and the older POST /api/embeddings -------------


class OllamaEmbedRequest(Strict, kw_only=True):
    model: str
    #: None or "" (the ollama client's default): load the model (unload with keep_alive 0), as Ollama
    #: does; an empty list is a 400.
    input: str | list[Any] | None = None
    truncate: bool = True
    dimensions: Int | None = None
    options: OllamaOptions | None = None  # accepted, no effect on embeddings
    keep_alive: KeepAlive = None


class OllamaEmbedResponse(Struct, kw_only=True):
    model: str
    embeddings: list[list[float]]
    total_duration: int  # ns
    load_duration: int  # ns
    prompt_eval_count: int


class OllamaEmbeddingsRequest(Strict, kw_only=True):
    model: str
    #: None or "": load the model, as Ollama does; the answer's embedding is then empty.
    prompt: str | None = None
    options: OllamaOptions | None = None
    keep_alive: KeepAlive = None


class OllamaEmbeddingsResponse(Struct, kw_only=True):
    embedding: list[float]
