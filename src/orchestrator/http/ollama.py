"""Ollama-compatible endpoints: /api/generate, /api/chat, /api/tags, /api/ps, /api/show, /api/version.

Ollama streams by default: newline-delimited JSON, one object per chunk,
the last with ``done: true`` and the timings in nanoseconds (prompt eval =
the worker's time to first token, eval = its decode time, total = the
request's wall time in this server, load = 0: models are loaded at start-up).
Sampling defaults are Ollama's (temperature 0.8, top_k 40, top_p 0.9,
repeat_penalty 1.1 over the last 64 tokens), not mlxrt's greedy ones.
``format`` (``"json"`` or a JSON schema) is enforced in the worker by a grammar.

``keep_alive`` goes to the supervisor: after the request the model stays
loaded that long once idle (negative: forever), ``0`` unloads it when the
request is done, and a request with no prompt loads (or, with ``0``,
unloads) the model at once. An unloaded model reloads on its next request.
"""

from __future__ import annotations

import asyncio
import json
import math
import re
import time
from collections.abc import AsyncIterator, Mapping
from importlib.metadata import version
from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from ...ipc.protocol import (
    MAX_REPETITION_CONTEXT,
    MAX_TOP_LOGPROBS,
    REASONING_EFFORTS,
    InvalidField,
    TokenLogprob,
    ToolCall,
)
from ..chat import missing_capability
from ..errors import MlxrtError
from ..images import image_bytes
from ..request import Request as RtRequest
from ..structured import ANY_JSON_OBJECT, json_schema_grammar
from .errors import HttpError, from_invalid_field, from_runtime_error, ollama_body
from .schemas import (
    ENCODER,
    KeepAlive,
    OllamaChatChunk,
    OllamaChatRequest,
    OllamaChunk,
    OllamaDetails,
    OllamaFunctionOut,
    OllamaGenerateChunk,
    OllamaGenerateRequest,
    OllamaLogprob,
    OllamaMessageOut,
    OllamaModel,
    OllamaOptions,
    OllamaPs,
    OllamaRunningModel,
    OllamaShow,
    OllamaShowRequest,
    OllamaTags,
    OllamaTokenLogprob,
    OllamaToolCallOut,
    OllamaVersion,
)
from .service import DEFAULT_MAX_TOKENS, UNLIMITED_TOKENS, Generation, Service, iso_now, json_response
from .streaming import NDJSON_HEADERS, EventStream

#: Ollama's own defaults (api.DefaultOptions), used when a request leaves an option out.
DEFAULT_OPTIONS: dict[str, Any] = {
    "temperature": 0.8,
    "top_k": 40,
    "top_p": 0.9,
    "repetition_penalty": 1.1,
    "repetition_context_size": 64,
    "min_p": 0.0,
}
#: Ollama's names for mlxrt's sampling fields, for error messages.
OPTION_NAMES = {
    "max_tokens": "options.num_predict",
    "temperature": "options.temperature",
    "top_p": "options.top_p",
    "top_k": "options.top_k",
    "min_p": "options.min_p",
    "repetition_penalty": "options.repeat_penalty",
    "repetition_context_size": "options.repeat_last_n",
    "seed": "options.seed",
    "stop": "options.stop",
    "logprobs": "top_logprobs",
    "num_ctx": "options.num_ctx",
}
NS_PER_MS = 1_000_000

_generate_decoder = msgspec.json.Decoder(OllamaGenerateRequest)
_chat_decoder = msgspec.json.Decoder(OllamaChatRequest)
_show_decoder = msgspec.json.Decoder(OllamaShowRequest)


def routes(svc: Service) -> list[Route]:
    api = OllamaApi(svc)
    return [
        Route("/api/generate", api.generate, methods=["POST"]),
        Route("/api/chat", api.chat, methods=["POST"]),
        Route("/api/tags", api.tags, methods=["GET"]),
        Route("/api/ps", api.ps, methods=["GET"]),
        Route("/api/show", api.show, methods=["POST"]),
        Route("/api/version", api.version, methods=["GET"]),
    ]


# Go's time.ParseDuration syntax, which Ollama uses for keep_alive strings: "5m", "1h30m", "-1s", "0".
_DURATION = re.compile(r"[-+]?((\d+(\.\d*)?|\.\d+)(ns|us|µs|ms|s|m|h))+")
_UNIT_S = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
_PART = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ns|us|µs|ms|s|m|h)")


def parse_keep_alive(value: KeepAlive) -> float | None:
    """Seconds to keep the model loaded (negative: forever, 0: unload now); None when absent."""
    if value is None:
        return None
    if isinstance(value, (int, float)):
        return float(value)
    text = value.strip()
    if text in ("0", "-0", "+0"):
        return 0.0
    if not _DURATION.fullmatch(text):
        raise HttpError(400, f"keep_alive: invalid duration {value!r} (e.g. \"5m\", \"1h30m\", \"-1\", 0)",
                        param="keep_alive")
    seconds = sum(float(n) * _UNIT_S[u] for n, u in _PART.findall(text))
    return -seconds if text.startswith("-") else seconds


#: Ollama's defaults where the request and the model's defaults leave a value out.
API_DEFAULTS = {**DEFAULT_OPTIONS, "max_tokens": DEFAULT_MAX_TOKENS}


def ollama_params(options: OllamaOptions | None) -> dict[str, Any]:
    """The runtime's sampling keywords Ollama `options` set (the defaults come in `Request.build`)."""
    p: dict[str, Any] = {}
    if options is None:
        return p
    o = options
    for ours, theirs in (("temperature", o.temperature), ("top_p", o.top_p), ("top_k", o.top_k),
                         ("min_p", o.min_p), ("repetition_penalty", o.repeat_penalty)):
        if theirs is not None:
            p[ours] = theirs
    if o.num_predict in (-1, -2):  # Ollama's "no limit" and "fill the context"
        p["max_tokens"] = UNLIMITED_TOKENS
    elif o.num_predict is not None:
        if o.num_predict < 1:
            raise HttpError(400, f"options.num_predict: must be >= 1, or -1 (no limit) or -2 (fill the "
                                 f"context); got {o.num_predict}", param="options.num_predict")
        p["max_tokens"] = o.num_predict
    if o.seed is not None and o.seed != -1:  # -1: a random seed
        p["seed"] = o.seed
    if o.num_ctx is not None:
        p["num_ctx"] = o.num_ctx
    if o.stop is not None:
        p["stop"] = [o.stop] if isinstance(o.stop, str) else o.stop
    if o.repeat_last_n is not None:
        if o.repeat_last_n == 0:  # 0 disables the penalty
            p["repetition_penalty"] = None
        else:
            last_n = MAX_REPETITION_CONTEXT if o.repeat_last_n == -1 else o.repeat_last_n
            p["repetition_context_size"] = last_n
    return p


def _unsupported(param: str, what: str) -> HttpError:
    return HttpError(400, f"{param}: {what} is not supported by this server", param=param)


def logprobs_param(req: OllamaGenerateRequest | OllamaChatRequest) -> dict[str, Any]:
    """``logprobs: true`` (with ``top_logprobs``, 0 to 20 alternatives) as the runtime's ``logprobs=k``."""
    top = req.top_logprobs
    if top is not None and not 0 <= top <= MAX_TOP_LOGPROBS:
        raise HttpError(400, f"top_logprobs: must be between 0 and {MAX_TOP_LOGPROBS}, got {top}",
                        param="top_logprobs")
    return {"logprobs": top or 0} if req.logprobs else {}


def logprobs_out(entries: list[TokenLogprob] | None) -> list[OllamaLogprob] | msgspec.UnsetType:
    """Ollama's ``logprobs``: per token its text, log-probability, bytes and ``top_logprobs``."""
    if entries is None:
        return msgspec.UNSET
    return [OllamaLogprob(token=e.token, logprob=e.logprob, bytes=list(e.token_bytes),
                          top_logprobs=[OllamaTokenLogprob(token=t.token, logprob=t.logprob,
                                                           bytes=list(t.token_bytes)) for t in e.top]
                          if e.top else msgspec.UNSET)
            for e in entries]


def think_param(req: OllamaGenerateRequest | OllamaChatRequest) -> dict[str, Any]:
    """The runtime's `think` keyword: true, false, or gpt-oss's "low", "medium", "high"."""
    think = req.think
    if think is None:
        return {}
    if isinstance(think, str) and think not in REASONING_EFFORTS:
        raise HttpError(400, f'think: must be true, false, "low", "medium" or "high"; got {think!r}',
                        param="think")
    return {"think": think}


def refusal(requested: str):
    """Ollama's words for what the model cannot do: `"name" does not support thinking`, `... tools`
    (`requested`: the model as the client named it)."""

    def word(exc: InvalidField) -> HttpError:
        if exc.capability == "thinking":
            return HttpError(400, f"{json.dumps(requested)} does not support thinking", param="think")
        if exc.capability == "tools":
            return HttpError(400, f"{requested} does not support tools", param="tools")
        return from_invalid_field(exc, OPTION_NAMES)

    return word


def refuse_lacking(svc: Service, model: str, requested: str, *, think: object, tools: bool) -> None:
    """Ollama's 400 for thinking or tools the model lacks, where no request reaches the runtime to
    check it (a load with no prompt, a raw prompt asked to think), as Ollama checks those too."""
    missing = missing_capability(svc.capabilities(model), thinking=think not in (None, False), tools=tools)
    if missing is not None:
        raise refusal(requested)(InvalidField(missing, "", code="unsupported", capability=missing))


def generate_request(req: OllamaGenerateRequest, model: str, defaults: Mapping[str, Any],
                     keep_alive: float | None) -> RtRequest:
    """The runtime's `Request` for /api/generate; `defaults`: the model's default sampling."""
    params = {**constrain(ollama_params(req.options), req.format), **logprobs_param(req)}
    think = think_param(req)
    if not req.raw:  # a raw prompt has no template to think through
        params.update(think)
    return RtRequest.build(generate_prompt(req), params, defaults={**API_DEFAULTS, **defaults}, model=model,
                           keep_alive=None if keep_alive is None else _runtime_keep_alive(keep_alive))


def chat_request(req: OllamaChatRequest, model: str, defaults: Mapping[str, Any],
                 keep_alive: float | None) -> RtRequest:
    """The runtime's `Request` for /api/chat; `defaults`: the model's default sampling."""
    params = {**constrain(ollama_params(req.options), req.format), **chat_params(req), **logprobs_param(req)}
    return RtRequest.build(chat_prompt(req), params, defaults={**API_DEFAULTS, **defaults}, model=model,
                           keep_alive=None if keep_alive is None else _runtime_keep_alive(keep_alive))


def constrain(params: dict[str, Any], fmt: str | dict[str, Any] | None) -> dict[str, Any]:
    """Add the grammar `format` asks for (``"json"`` or a JSON schema) to `params`; 400 if it is bad."""
    if not fmt:
        return params
    if isinstance(fmt, str) and fmt != "json":
        raise HttpError(400, f'format: expected "json" or a JSON schema object, got {fmt!r}', param="format")
    try:
        params["grammar"] = json_schema_grammar(ANY_JSON_OBJECT if fmt == "json" else fmt, "format")
    except ValueError as exc:
        raise HttpError(400, str(exc), param="format") from None
    return params


def generate_prompt(req: OllamaGenerateRequest) -> str | list[dict[str, str]]:
    """Raw text with ``raw: true``, else the prompt as a user message under the model's chat template,
    with its `images` (base64), each checked as `images[i]`."""
    if req.images and req.raw:
        raise HttpError(400, "images: a raw prompt has no chat template to place images in (leave raw off)",
                        param="images")
    if req.suffix:
        raise _unsupported("suffix", "a suffix (fill-in-the-middle)")
    if req.template:
        raise _unsupported("template", "a Go template (the model's own chat template is used)")
    if req.context:
        raise _unsupported("context", "resuming from a context")
    if req.raw:
        return req.prompt
    messages = [{"role": "system", "content": req.system}] if req.system else []
    user: dict[str, Any] = {"role": "user", "content": req.prompt}
    if req.images:
        user["images"] = [image_bytes(v, f"images[{j}]") for j, v in enumerate(req.images)]
    messages.append(user)
    return messages


def chat_prompt(req: OllamaChatRequest) -> list[dict[str, Any]]:
    """The messages as the runtime takes them: tool calls, tool results (`tool_name`) and an earlier
    turn's `thinking` included."""
    out = []
    for i, m in enumerate(req.messages):
        msg: dict[str, Any] = {"role": m.role, "content": m.content}
        if m.images:  # base64, as Ollama sends them
            msg["images"] = [image_bytes(v, f"messages[{i}].images[{j}]") for j, v in enumerate(m.images)]
        if m.tool_calls:
            msg["tool_calls"] = m.tool_calls
        if m.tool_name:
            msg["tool_name"] = m.tool_name
        if m.thinking:
            msg["thinking"] = m.thinking
        out.append(msg)
    return out


def chat_params(req: OllamaChatRequest) -> dict[str, Any]:
    """The runtime's chat keywords for `req`: tools and think."""
    params = think_param(req)
    if req.tools:
        params["tools"] = req.tools
    return params


def tool_calls_out(calls: list[ToolCall], first: int = 0) -> list[OllamaToolCallOut]:
    """Calls as Ollama returns them, numbered from `first`: arguments as an object (the worker
    made them JSON objects)."""
    return [OllamaToolCallOut(id=c.id, function=OllamaFunctionOut(
        index=first + i, name=c.name, arguments=msgspec.json.decode(c.arguments)))
        for i, c in enumerate(calls)]


def _set_message(message: OllamaMessageOut, text: str, reasoning: str, calls: list[ToolCall],
                 *, think: bool, first_call: int = 0) -> None:
    """One chunk's message: thinking left out with ``think: false``, calls only when there are some."""
    message.content = text
    message.thinking = reasoning if reasoning and think else msgspec.UNSET
    message.tool_calls = tool_calls_out(calls, first_call) if calls else msgspec.UNSET


def _timings(chunk: OllamaChunk, gen: Generation) -> None:
    """Fill the final chunk's fields from the worker's stats."""
    s = gen.stream.stats
    chunk.done = True
    chunk.done_reason = gen.finish_reason
    chunk.total_duration = int((time.perf_counter() - gen.t0) * 1e9)
    chunk.load_duration = 0
    chunk.prompt_eval_count = s.prompt_tokens if s else 0
    chunk.prompt_eval_duration = int(s.ttft_ms * NS_PER_MS) if s else 0
    chunk.eval_count = s.generation_tokens if s else gen.tokens
    chunk.eval_duration = int(s.decode_ms * NS_PER_MS) if s else 0


def _line(obj: object) -> bytes:
    return ENCODER.encode(obj) + b"\n"


def _error_line(exc: MlxrtError) -> bytes:
    return ollama_body(from_runtime_error(exc)) + b"\n"


class OllamaApi:
    def __init__(self, svc: Service) -> None:
        self.svc = svc

    async def generate(self, request: Request) -> Response | EventStream:
        t0 = time.perf_counter()
        req: OllamaGenerateRequest = await self.svc.read(request, _generate_decoder)
        model = self.svc.model(req.model, ollama=True)
        keep_alive = parse_keep_alive(req.keep_alive)
        think = req.think is not False
        if not req.prompt or req.raw:  # no chat template: the runtime sees no thinking to check
            think_param(req)  # a bad think is refused even here
            refuse_lacking(self.svc, model, req.model, think=req.think, tools=False)
        if not req.prompt:
            return await self._load_or_unload(model, keep_alive, OllamaGenerateChunk(
                model=req.model, created_at=iso_now(), response=""))
        rt_req = self.svc.build(OPTION_NAMES, generate_request, req, model, self.svc.sampling_defaults(model),
                                keep_alive)
        gen = await self.svc.start(request, "/api/generate", rt_req, OPTION_NAMES, t0,
                                   refusal=refusal(req.model))
        chunk = OllamaGenerateChunk(model=req.model, created_at="", response="")
        if req.stream:
            return EventStream(generate_events(gen, chunk, think=think), headers=NDJSON_HEADERS,
                               on_close=gen.on_close)
        text, _ = await gen.collect(request.receive)
        chunk.response = text
        if gen.reasoning and think:
            chunk.thinking = gen.reasoning
        chunk.logprobs = logprobs_out(gen.replies[0].logprobs)
        chunk.created_at = iso_now()
        _timings(chunk, gen)
        return json_response(chunk)

    async def chat(self, request: Request) -> Response | EventStream:
        t0 = time.perf_counter()
        req: OllamaChatRequest = await self.svc.read(request, _chat_decoder)
        model = self.svc.model(req.model, ollama=True)
        keep_alive = parse_keep_alive(req.keep_alive)
        think = req.think is not False  # false: a model that cannot stop thinking keeps it to itself
        if not req.messages:  # a load or an unload: no prompt
            think_param(req)
            refuse_lacking(self.svc, model, req.model, think=req.think, tools=bool(req.tools))
            message = OllamaMessageOut(content="")
            return await self._load_or_unload(model, keep_alive, OllamaChatChunk(
                model=req.model, created_at=iso_now(), message=message))
        rt_req = self.svc.build(OPTION_NAMES, chat_request, req, model, self.svc.sampling_defaults(model),
                                keep_alive)
        gen = await self.svc.start(request, "/api/chat", rt_req, OPTION_NAMES, t0, refusal=refusal(req.model))
        chunk = OllamaChatChunk(model=req.model, created_at="", message=OllamaMessageOut(content=""))
        if req.stream:
            return EventStream(chat_events(gen, chunk, think=think), headers=NDJSON_HEADERS,
                               on_close=gen.on_close)
        text, _ = await gen.collect(request.receive)
        _set_message(chunk.message, text, gen.reasoning, gen.tool_calls, think=think)
        chunk.logprobs = logprobs_out(gen.replies[0].logprobs)
        chunk.created_at = iso_now()
        _timings(chunk, gen)
        return json_response(chunk)

    async def _load_or_unload(self, model: str, keep_alive: float | None, chunk: OllamaChunk) -> Response:
        """Ollama's request with nothing to generate: load the model, or unload it (keep_alive 0)."""
        if keep_alive == 0:
            await asyncio.to_thread(self.svc.rt.unload, model)
            chunk.done_reason = "unload"
        else:
            keep = None if keep_alive is None else _runtime_keep_alive(keep_alive)
            self.svc.rt.load(model, keep)
            chunk.done_reason = "load"
        chunk.done = True
        return json_response(chunk)

    async def tags(self, request: Request) -> Response:
        return json_response(OllamaTags([self._model_entry(name) for name in self.svc.rt.models]))

    async def ps(self, request: Request) -> Response:
        running = []
        for name in self.svc.rt.models:
            m = self._model_entry(name)
            running.append(OllamaRunningModel(
                name=m.name, model=m.model, size=m.size, digest=m.digest, details=m.details,
                expires_at="9999-12-31T23:59:59Z",  # loaded until the server stops
                size_vram=m.size, context_length=self.svc.facts(name).context_length,
            ))
        return json_response(OllamaPs(running))

    async def show(self, request: Request) -> Response:
        req: OllamaShowRequest = await self.svc.read(request, _show_decoder)
        name = self.svc.model(req.model or req.name, ollama=True)
        facts = self.svc.facts(name)
        info: dict[str, Any] = {"general.architecture": facts.family}
        if facts.context_length:
            info[f"{facts.family or 'model'}.context_length"] = facts.context_length
        if req.verbose:
            info.update({f"config.{k}": v for k, v in facts.config.items()})
        caps = self.svc.capabilities(name)
        capabilities = ["completion"]
        if caps is not None and caps.embedding:  # an embedding model only embeds
            capabilities = ["embedding"]
        elif caps is not None:
            capabilities += [c for c, on in (("tools", caps.tools), ("thinking", caps.thinking)) if on]
        return json_response(OllamaShow(details=self._details(name), model_info=info,
                                        capabilities=capabilities, modified_at=facts.modified_at))

    async def version(self, request: Request) -> Response:
        return json_response(OllamaVersion(version("mlxrt")))

    def _details(self, name: str) -> OllamaDetails:
        facts = self.svc.facts(name)
        return OllamaDetails(family=facts.family, families=[facts.family] if facts.family else [],
                             quantization_level=facts.quantization)

    def _model_entry(self, name: str) -> OllamaModel:
        facts = self.svc.facts(name)
        return OllamaModel(name=name, model=name, modified_at=facts.modified_at, size=facts.size_bytes,
                           digest="", details=self._details(name))


def _runtime_keep_alive(seconds: float) -> float:
    """Ollama's negative keep_alive (forever) as the runtime's infinity."""
    return math.inf if seconds < 0 else seconds


async def generate_events(gen: Generation, chunk: OllamaGenerateChunk, *, think: bool = True
                          ) -> AsyncIterator[bytes]:
    """NDJSON lines of a streamed /api/generate; the same Struct is re-encoded per chunk."""
    try:
        async for c in gen.chunks():
            chunk.response = c.text
            chunk.thinking = c.reasoning if c.reasoning and think else msgspec.UNSET
            chunk.logprobs = logprobs_out(c.logprobs)
            chunk.created_at = iso_now()
            yield _line(chunk)
    except MlxrtError as exc:
        yield _error_line(exc)
        return
    chunk.response = ""
    chunk.thinking = msgspec.UNSET
    chunk.logprobs = msgspec.UNSET
    chunk.created_at = iso_now()
    _timings(chunk, gen)
    yield _line(chunk)


async def chat_events(gen: Generation, chunk: OllamaChatChunk, *, think: bool = True) -> AsyncIterator[bytes]:
    """NDJSON lines of a streamed /api/chat: content and thinking deltas, each tool call whole."""
    message = chunk.message
    calls = 0
    try:
        async for c in gen.chunks():
            _set_message(message, c.text, c.reasoning, c.tool_calls, think=think, first_call=calls)
            calls += len(c.tool_calls)
            chunk.logprobs = logprobs_out(c.logprobs)
            chunk.created_at = iso_now()
            yield _line(chunk)
    except MlxrtError as exc:
        yield _error_line(exc)
        return
    _set_message(message, "", "", [], think=think)
    chunk.logprobs = msgspec.UNSET
    chunk.created_at = iso_now()
    _timings(chunk, gen)
    yield _line(chunk)
