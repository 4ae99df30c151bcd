"""The HTTP server: OpenAI-, Ollama- and Anthropic-compatible APIs over an `AsyncRuntime`.

`app.create_app` builds the ASGI app over a started runtime; `server.serve`
runs it with uvicorn for ``mlxrt serve``. This package's top level imports
only the configuration, so the CLI stays quick to start. See docs/http.md.
"""

from .config import DEFAULT_HOST, DEFAULT_MAX_BODY_BYTES, DEFAULT_PORT, ServerConfig

__all__ = ["DEFAULT_HOST", "DEFAULT_MAX_BODY_BYTES", "DEFAULT_PORT", "ServerConfig"]
