"""HTTP errors: one exception, three wire shapes (OpenAI's, Ollama's and Anthropic's).

Every failure a handler can meet becomes an `HttpError` at the point where it
happens, so the status is chosen once: client mistakes are 4xx and name the
field, a gone worker is 503, a timeout 504. A 500 means a bug in mlxrt.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import msgspec

from ..errors import MlxrtError, MlxrtTimeout, RequestError, WorkerDied

#: Worker-side exception types caused by the request itself (bad ids, a chat
#: template that rejects the conversation); anything else is our bug: 500.
CLIENT_ERROR_TYPES = frozenset(
    {
        "PromptTooLongError",
        "NoChatTemplateError",
        "ModelKindError",
        "GrammarError",
        "ValueError",
        "TemplateError",
        "TemplateSyntaxError",
        "TemplateRuntimeError",
        "UndefinedError",
    }
)

#: Runtime errors that mean "cannot serve this model now" (by class name: some come with the
#: supervisor). With `WorkerDied`, they are 503s.
UNAVAILABLE_TYPES = frozenset({"ModelFailedError", "MemoryPressureError", "ModelLoadError"})

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


_FIELD = re.compile(r"invalid ([\w.\[\]]+?)(?=[=: ]|$)")


def from_value_error(exc: ValueError, names: Mapping[str, str]) -> HttpError:
    """A `ValueError` from request validation; `names` maps mlxrt field names to the API's."""
    text = str(exc)
    m = _FIELD.search(text)
    param = None
    if m:
        param = names.get(m.group(1), m.group(1))
        text = text[: m.start(1)] + param + text[m.end(1) :]
    return HttpError(400, text, param=param)


def from_runtime_error(exc: MlxrtError) -> HttpError:
    """Map the runtime's errors: the worker is gone (503), too slow (504), or the request failed."""
    if isinstance(exc, RequestError):
        if exc.error_type == "PromptTooLongError":
            return HttpError(400, exc.message, param="prompt", code="context_length_exceeded")
        if exc.error_type in CLIENT_ERROR_TYPES:
            return HttpError(400, f"{exc.error_type}: {exc.message}")
        return HttpError(500, f"generation failed: {exc}", code="generation_failed")
    if isinstance(exc, WorkerDied) or UNAVAILABLE_TYPES & {c.__name__ for c in type(exc).__mro__}:
        return HttpError(503, f"no worker can serve this request: {exc}", code="worker_unavailable")
    if isinstance(exc, MlxrtTimeout):
        return HttpError(504, str(exc), code="timeout")
    return HttpError(500, str(exc))
