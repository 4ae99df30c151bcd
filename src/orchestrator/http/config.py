"""The server's settings, parsed once at the edge (``mlxrt serve``), with their defaults.

Kept free of heavy imports so the CLI can build its parser without loading the server.
"""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8000
DEFAULT_MAX_BODY_BYTES = 8 * 1024 * 1024
DEFAULT_RESPONSES_STORE = 1000


@dataclass(frozen=True, kw_only=True)
class ServerConfig:
    """What `mlxrt serve` was asked for."""

    host: str = DEFAULT_HOST
    port: int = DEFAULT_PORT
    #: When set, every endpoint but /health needs ``Authorization: Bearer KEY`` (or ``x-api-key: KEY``).
    api_key: str | None = None
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES  #: larger request bodies are refused with 413
    #: Responses kept in memory for GET /v1/responses/{id} and `previous_response_id` (the oldest go first)
    responses_store: int = DEFAULT_RESPONSES_STORE
    #: Fetch http(s) image URLs that requests carry (docs/vision.md); off: such an image is a 400.
    allow_image_urls: bool = False
