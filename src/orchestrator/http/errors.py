"""HTTP errors: one exception, three wire shapes (OpenAI's, Ollama's and Anthropic's).

Every failure a handler can meet becomes an `HttpError` at the point where it
happens, so the status is chosen once: client mistakes are 4xx and name the
field, a gone worker is 503, a timeout 504. A 500 means a bug in mlxrt.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import msgspec

from ...ipc.protocol import InvalidField
from ..errors import (
    MemoryPressureError,
    MlxrtError,
    MlxrtTimeout,
    ModelFailedError,
    ModelLoadError,
    RequestError,
    WorkerDied,
)

_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    501: "not_implemented",
    503: "server_error",
    504: "timeout",
}


class HttpError(Exception):
    """A request that ends with `status`; `param` names the offending field, if one does."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code

    @property
    def type(self) -> str:
        return _ERROR_TYPES.get(self.status, "server_error")


class OpenAIErrorBody(msgspec.Struct):
    message: str
    type: str
    param: str | None
    code: str | None


class OpenAIError(msgspec.Struct):
    error: OpenAIErrorBody


class OllamaError(msgspec.Struct):
    error: str


class AnthropicErrorBody(msgspec.Struct):
    type: str
    message: str


class AnthropicError(msgspec.Struct, tag="error", tag_field="type"):
    """``{"type": "error", "error": {"type", "message"}}``: the body, and the stream's error event."""

    error: AnthropicErrorBody


#: Anthropic's error types by status (its API has no `param` or `code`: the message names the field).
_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    504: "timeout_error",
}


def openai_body(err: HttpError) -> bytes:
    """``{"error": {"message", "type", "param", "code"}}`` as OpenAI sends it."""
    return msgspec.json.encode(OpenAIError(OpenAIErrorBody(err.message, err.type, err.param, err.code)))


def ollama_body(err: HttpError) -> bytes:
    """``{"error": "message"}`` as Ollama sends it."""
    return msgspec.json.encode(OllamaError(err.message))


def anthropic_error(err: HttpError) -> AnthropicError:
    """Anthropic's error for `err`; the field it names leads the message, as Anthropic writes it."""
    message = err.message
    if err.param and err.param not in message:
        message = f"{err.param}: {message}"
    return AnthropicError(AnthropicErrorBody(_ANTHROPIC_TYPES.get(err.status, "api_error"), message))


def anthropic_body(err: HttpError) -> bytes:
    """``{"type": "error", "error": {"type", "message"}}`` as Anthropic sends it."""
    return msgspec.json.encode(anthropic_error(err))


def is_ollama_path(path: str) -> bool:
    return path.startswith("/api/")


def is_anthropic_path(path: str) -> bool:
    return path == "/v1/messages" or path.startswith("/v1/messages/")


def body_for(path: str, err: HttpError) -> bytes:
    """The error body in the shape the endpoint's clients expect."""
    if is_ollama_path(path):
        return ollama_body(err)
    return anthropic_body(err) if is_anthropic_path(path) else openai_body(err)


_AT = re.compile(r"at `\$\.?([^`]*)`")
_UNKNOWN = re.compile(r"(?:unknown|missing required) field `([^`]*)`")


def from_decode_error(exc: msgspec.DecodeError, prefix: str = "") -> HttpError:
    """A body msgspec could not parse or validate; the message keeps msgspec's field path."""
    text = str(exc)
    if not isinstance(exc, msgspec.ValidationError):
        return HttpError(400, f"malformed JSON body: {text}", code="invalid_json")
    m = _UNKNOWN.search(text)
    at = _AT.search(text)
    param = None
    if m:
        parent = at.group(1) if at else ""
        param = f"{parent}.{m.group(1)}" if parent else m.group(1)
    elif at:
        param = at.group(1) or None
    if param and prefix:
        param = f"{prefix}.{param}"
    return HttpError(400, f"invalid request body: {text}", param=param)


def from_invalid_field(exc: InvalidField, names: Mapping[str, str]) -> HttpError:
    """A request field with a bad value: 400 naming it as the API does (`names` maps mlxrt's field names
    to the API's). A capability the model lacks (code "unsupported") says so in OpenAI's words."""
    name = names.get(exc.field, exc.field)
    if exc.code == "unsupported":
        why = " (mlx-lm has no tool-call parser for its format)" if exc.capability == "tools" else ""
        return HttpError(400, f"{name}{exc.detail}{why}", param=name, code="unsupported_parameter")
    return HttpError(400, exc.named(name), param=name)


def from_runtime_error(exc: MlxrtError, names: Mapping[str, str] | None = None) -> HttpError:
    """Map the runtime's errors by type: the worker is gone or the model cannot be served (503), too
    slow (504), or the request failed in the worker, by how the worker classed it (`RequestError.kind`):
    the request's fault (400, naming the field as `names` calls it), a prompt beyond the context (400),
    else a bug (500)."""
    if isinstance(exc, RequestError):
        if exc.kind == "too_long":
            return HttpError(400, exc.message, param="prompt", code="context_length_exceeded")
        if exc.kind == "invalid":
            param = names.get(exc.field, exc.field) if names and exc.field else exc.field
            message = exc.message
            if exc.field and param != exc.field:  # the worker's message names the field as mlxrt does
                message = message.replace(f"invalid {exc.field}", f"invalid {param}", 1)
            return HttpError(400, f"{exc.error_type}: {message}", param=param)
        return HttpError(500, f"generation failed: {exc}", code="generation_failed")
    if isinstance(exc, (WorkerDied, ModelFailedError, MemoryPressureError, ModelLoadError)):
        return HttpError(503, f"no worker can serve this request: {exc}", code="worker_unavailable")
    if isinstance(exc, MlxrtTimeout):
        return HttpError(504, str(exc), code="timeout")
    return HttpError(500, str(exc))
