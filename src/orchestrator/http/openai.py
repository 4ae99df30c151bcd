"""OpenAI-compatible endpoints: /v1/chat/completions, /v1/completions, /v1/models.

Streaming is server-sent events, one ``data: {json}`` event per chunk the
worker sends (a chunk may carry several tokens), then ``data: [DONE]``. The
chunk Struct is built once per request and mutated per chunk: the hot loop
allocates the encoded bytes and nothing else it can avoid.

Extensions, spelt as vLLM spells them: ``top_k``, ``min_p``,
``repetition_penalty``, ``repetition_context_size``, ``ignore_eos``,
``stop_token_ids``, and ``return_token_ids`` (adds ``token_ids`` to each choice).

``response_format`` (``json_object``, ``json_schema``) is enforced in the
worker by a grammar, on /v1/completions too (as vLLM does).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Iterator, Mapping
from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from ...ipc.protocol import TokenLogprob
from ..errors import MlxrtError
from ..images import image_bytes
from ..request import Request as RtRequest
from ..structured import ANY_JSON_OBJECT, json_schema_grammar
from .errors import HttpError, from_runtime_error, openai_body
from .schemas import (
    ENCODER,
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatLogprobs,
    Completion,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    ContentPart,
    Delta,
    FunctionOut,
    LogprobOut,
    ModelCard,
    ModelList,
    OpenAISampling,
    PromptTokensDetails,
    ResponseFormat,
    ToolCallDelta,
    ToolCallOut,
    TopLogprobOut,
    Usage,
)
from .service import DEFAULT_MAX_TOKENS, Generation, Reply, Service, json_response, new_id
from .streaming import SSE_HEADERS, EventStream

#: OpenAI's documented defaults where they differ from mlxrt's.
DEFAULT_TEMPERATURE = 1.0
DEFAULT_COMPLETION_MAX_TOKENS = 16

_chat_decoder = msgspec.json.Decoder(ChatCompletionRequest)
_completion_decoder = msgspec.json.Decoder(CompletionRequest)

_DONE = b"data: [DONE]\n\n"


def routes(svc: Service) -> list[Route]:
    api = OpenAIApi(svc)
    return [
        Route("/v1/chat/completions", api.chat, methods=["POST"]),
        Route("/v1/completions", api.completions, methods=["POST"]),
        Route("/v1/models", api.list_models, methods=["GET"]),
        Route("/v1/models/{model:path}", api.get_model, methods=["GET"]),
    ]


def _unsupported(param: str, what: str) -> HttpError:
    return HttpError(400, f"{param}: {what} is not supported by this server", param=param,
                     code="unsupported_parameter")


#: What the APIs default to where the request and the model's defaults leave a value out.
CHAT_DEFAULTS = {"temperature": DEFAULT_TEMPERATURE, "max_tokens": DEFAULT_MAX_TOKENS}
COMPLETION_DEFAULTS = {"temperature": DEFAULT_TEMPERATURE, "max_tokens": DEFAULT_COMPLETION_MAX_TOKENS}


def sampling_params(req: OpenAISampling, max_tokens: int | None) -> dict[str, Any]:
    """The runtime's sampling keywords `req` sets (its defaults come in `Request.build`); refuses what
    mlxrt cannot honour."""
    for name in ("frequency_penalty", "presence_penalty"):
        if getattr(req, name):
            raise _unsupported(name, "a non-zero value (use repetition_penalty)")
    if req.logit_bias:
        raise _unsupported("logit_bias", "a bias")
    params: dict[str, Any] = {"ignore_eos": req.ignore_eos}
    if max_tokens is not None:
        params["max_tokens"] = max_tokens
    if req.n != 1:  # checked by the runtime: 1 <= n <= MAX_CHOICES
        params["n"] = req.n
    for name in ("temperature", "top_p", "seed", "top_k", "min_p", "repetition_penalty",
                 "repetition_context_size", "stop_token_ids"):
        value = getattr(req, name, None)
        if value is not None:
            params[name] = value
    if req.stop is not None:
        params["stop"] = [req.stop] if isinstance(req.stop, str) else req.stop
    return params


def constrain(params: dict[str, Any], fmt: ResponseFormat | None) -> dict[str, Any]:
    """Add the grammar `response_format` asks for to `params`; 400 naming the field if it is bad."""
    if fmt is None or fmt.type == "text":
        return params
    if fmt.type == "json_object":
        schema: Any = ANY_JSON_OBJECT
        field = "response_format"
    else:
        if fmt.json_schema is None:
            raise HttpError(400, "response_format.json_schema: required with type 'json_schema'",
                            param="response_format.json_schema")
        schema = ANY_JSON_OBJECT if fmt.json_schema.schema is None else fmt.json_schema.schema
        field = "response_format.json_schema.schema"
    try:
        params["grammar"] = json_schema_grammar(schema, field)
    except ValueError as exc:
        raise HttpError(400, str(exc), param=field, code="invalid_json_schema") from None
    return params


def chat_logprobs_param(req: ChatCompletionRequest) -> dict[str, Any]:
    """``logprobs: true`` (and ``top_logprobs: k``) as the runtime's ``logprobs=k``; as OpenAI,
    ``top_logprobs`` needs ``logprobs: true``."""
    if req.top_logprobs is not None and not req.logprobs:
        raise HttpError(400, "top_logprobs: requires logprobs: true", param="top_logprobs")
    return {"logprobs": req.top_logprobs or 0} if req.logprobs else {}


def chat_prompt(req: ChatCompletionRequest) -> list[dict[str, Any]]:
    """The messages as the worker's chat template takes them (text parts only), tool turns included."""
    out = []
    for i, m in enumerate(req.messages):
        content = m.content
        if content is None and not m.tool_calls:  # an assistant turn of only calls has none
            raise HttpError(400, f"messages[{i}].content: required", param=f"messages[{i}].content")
        if isinstance(content, list):
            content = [_part(i, j, part) for j, part in enumerate(content)]
        role = "system" if m.role == "developer" else m.role
        msg: dict[str, Any] = {"role": role, "content": content or ""}
        if m.tool_calls:
            msg["tool_calls"] = [msgspec.to_builtins(c) for c in m.tool_calls]
        if m.tool_call_id is not None:
            msg["tool_call_id"] = m.tool_call_id
        if m.role == "tool" and m.name:  # on other roles `name` is a participant's, not a function's
            msg["name"] = m.name
        if m.reasoning_content or m.reasoning:
            msg["reasoning_content"] = m.reasoning_content or m.reasoning
        out.append(msg)
    return out


def _part(i: int, j: int, part: ContentPart) -> dict[str, Any]:
    """A content part as the runtime takes it: text, or an ``image_url``'s image as its bytes (a data URI,
    checked here; an http(s) URL is refused)."""
    field = f"messages[{i}].content[{j}]"
    if part.type == "text" and part.text is not None:
        return {"type": "text", "text": part.text}
    if part.type == "image_url" and part.image_url is not None:
        url = part.image_url if isinstance(part.image_url, str) else part.image_url.url
        return {"type": "image", "image": image_bytes(url, f"{field}.image_url.url")}
    raise _unsupported(field, f"a content part of type {part.type!r}")


def chat_params(req: ChatCompletionRequest) -> dict[str, Any]:
    """The runtime's chat keywords (tools, tool_choice, think) for `req`; none when it sets none."""
    params: dict[str, Any] = {}
    if req.tools is not None:
        params["tools"] = [msgspec.to_builtins(t) for t in req.tools]
    if req.tool_choice is not None:
        params["tool_choice"] = msgspec.to_builtins(req.tool_choice)
    kwargs = req.chat_template_kwargs
    effort = req.reasoning_effort or (kwargs.reasoning_effort if kwargs else None)
    enable = kwargs.enable_thinking if kwargs else None
    think = effort if effort is not None and enable is not False else enable
    if think is not None:
        params["think"] = think
    return params


#: The runtime's chat keywords, as this API names them in errors.
CHAT_NAMES = {"think": "reasoning_effort", "logprobs": "top_logprobs"}


def completion_prompt(req: CompletionRequest) -> str | list[int]:
    """Text or token ids; a batch of one is unwrapped, larger batches are refused."""
    if req.echo:
        raise _unsupported("echo", "echoing the prompt")
    if req.best_of not in (None, 1):
        raise _unsupported("best_of", "best_of > 1")
    if req.suffix:
        raise _unsupported("suffix", "a suffix")
    prompt = req.prompt
    if isinstance(prompt, str):
        return prompt
    if all(type(t) is int for t in prompt):
        return prompt  # type: ignore[return-value]
    if len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        return prompt[0]  # type: ignore[return-value]
    raise HttpError(400, "prompt: expected a string, a list of token ids, or a batch of exactly one "
                         "(send one prompt per request)", param="prompt")


def chat_request(req: ChatCompletionRequest, model: str, defaults: Mapping[str, Any]) -> RtRequest:
    """The runtime's `Request` for a chat completion; `defaults`: the model's default sampling."""
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    params = constrain(sampling_params(req, max_tokens), req.response_format)
    prompt = chat_prompt(req)
    params.update(chat_params(req))
    params.update(chat_logprobs_param(req))
    return RtRequest.build(prompt, params, defaults={**CHAT_DEFAULTS, **defaults}, model=model)


def chat_names(req: ChatCompletionRequest) -> dict[str, str]:
    """The runtime's field names as a chat completion calls them."""
    return {"max_tokens": "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens",
            **CHAT_NAMES}


def completion_request(req: CompletionRequest, model: str, defaults: Mapping[str, Any]) -> RtRequest:
    """The runtime's `Request` for a completion; `defaults`: the model's default sampling."""
    params = constrain(sampling_params(req, req.max_tokens), req.response_format)
    if req.logprobs is not None:
        params["logprobs"] = req.logprobs
    return RtRequest.build(completion_prompt(req), params, defaults={**COMPLETION_DEFAULTS, **defaults},
                           model=model)


def usage_of(gen: Generation) -> Usage:
    cached = gen.stream.stats.cached_tokens if gen.stream.stats else 0
    return Usage(gen.prompt_tokens, gen.tokens, gen.prompt_tokens + gen.tokens, PromptTokensDetails(cached))


def _error_event(exc: MlxrtError) -> bytes:
    return b"data: " + openai_body(from_runtime_error(exc)) + b"\n\n"


class OpenAIApi:
    def __init__(self, svc: Service) -> None:
        self.svc = svc

    async def list_models(self, request: Request) -> Response:
        cards = [ModelCard(id=name, created=self.svc.created) for name in self.svc.rt.models]
        return json_response(ModelList(data=cards))

    async def get_model(self, request: Request) -> Response:
        name = self.svc.model(request.path_params["model"])
        return json_response(ModelCard(id=name, created=self.svc.created))

    async def chat(self, request: Request) -> Response | EventStream:
        t0 = time.perf_counter()
        req: ChatCompletionRequest = await self.svc.read(request, _chat_decoder)
        model, names = self.svc.model(req.model), chat_names(req)
        rt_req = self.svc.build(names, chat_request, req, model, self.svc.sampling_defaults(model))
        gen = await self.svc.start(request, "/v1/chat/completions", rt_req, names, t0)
        rid, created = new_id("chatcmpl"), int(time.time())
        if req.stream:
            usage = req.stream_options is not None and req.stream_options.include_usage
            events = chat_events(gen, rid, created, usage=usage, token_ids=req.return_token_ids, n=req.n)
            return EventStream(events, headers=SSE_HEADERS, on_close=gen.on_close)
        await gen.collect(request.receive)
        choices = []
        for r in gen.replies:
            choice = ChatChoice(index=r.index, message=assistant_message(r),
                                finish_reason=chat_finish_reason(r), logprobs=chat_logprobs(r.logprobs))
            if req.return_token_ids:
                choice.token_ids = r.ids
            choices.append(choice)
        return json_response(ChatCompletion(id=rid, created=created, model=req.model, choices=choices,
                                            usage=usage_of(gen)))

    async def completions(self, request: Request) -> Response | EventStream:
        t0 = time.perf_counter()
        req: CompletionRequest = await self.svc.read(request, _completion_decoder)
        model = self.svc.model(req.model)
        rt_req = self.svc.build({}, completion_request, req, model, self.svc.sampling_defaults(model))
        gen = await self.svc.start(request, "/v1/completions", rt_req, {}, t0)
        rid, created = new_id("cmpl"), int(time.time())
        if req.stream:
            usage = req.stream_options is not None and req.stream_options.include_usage
            events = completion_events(gen, rid, created, usage=usage, token_ids=req.return_token_ids,
                                       n=req.n)
            return EventStream(events, headers=SSE_HEADERS, on_close=gen.on_close)
        await gen.collect(request.receive)
        choices = []
        for r in gen.replies:
            choice = CompletionChoice(index=r.index, text=r.text, finish_reason=r.finish_reason,
                                      logprobs=completion_logprobs(r.logprobs))
            if req.return_token_ids:
                choice.token_ids = r.ids
            choices.append(choice)
        return json_response(Completion(id=rid, created=created, model=req.model, choices=choices,
                                        usage=usage_of(gen)))



def assistant_message(reply: Reply) -> AssistantMessage:
    """The reply: its text (null when it is only calls, as OpenAI sends it), reasoning and calls."""
    text = reply.text
    msg = AssistantMessage(content=text if text or not reply.tool_calls else None)
    if reply.reasoning:
        msg.reasoning_content = msg.reasoning = reply.reasoning
    if reply.tool_calls:
        msg.tool_calls = [ToolCallOut(id=c.id, function=FunctionOut(name=c.name, arguments=c.arguments))
                          for c in reply.tool_calls]
    return msg


def chat_finish_reason(reply: Reply, calls: int | None = None) -> str:
    """OpenAI's "tool_calls" when the reply called tools and stopped by itself."""
    made = len(reply.tool_calls) if calls is None else calls
    return "tool_calls" if made and reply.finish_reason == "stop" else reply.finish_reason


def chat_logprobs(entries: list[TokenLogprob] | None) -> ChatLogprobs | None:
    """Chat's ``logprobs``: per token, its text, log-probability, bytes and ``top_logprobs``."""
    if entries is None:
        return None
    return ChatLogprobs(content=[
        LogprobOut(token=e.token, logprob=e.logprob, bytes=list(e.token_bytes),
                   top_logprobs=[TopLogprobOut(token=t.token, logprob=t.logprob, bytes=list(t.token_bytes))
                                 for t in e.top])
        for e in entries])


def completion_logprobs(entries: list[TokenLogprob] | None, offset: int = 0) -> CompletionLogprobs | None:
    """/v1/completions' ``logprobs``; `offset`: the tokens' text length before these (streaming).

    Each ``top_logprobs`` entry holds the most likely tokens and the sampled one, as OpenAI's does;
    ``text_offset`` counts the tokens' own text (as vLLM does), which is the completion's text
    except where the detokenizer dropped a leading space or replaced broken UTF-8.
    """
    if entries is None:
        return None
    out = CompletionLogprobs(tokens=[], token_logprobs=[], top_logprobs=[], text_offset=[])
    for e in entries:
        token = e.token
        out.tokens.append(token)
        out.token_logprobs.append(e.logprob)
        out.top_logprobs.append({**{t.token: t.logprob for t in e.top}, token: e.logprob})
        out.text_offset.append(offset)
        offset += len(token)
    return out


def _sse(obj: object) -> bytes:
    return b"data: " + ENCODER.encode(obj) + b"\n\n"


async def completion_events(
    gen: Generation, rid: str, created: int, *, usage: bool, token_ids: bool, n: int = 1
) -> AsyncIterator[bytes]:
    """SSE events of a streamed /v1/completions; the same Struct is re-encoded per chunk."""
    choice = CompletionChoice(text="")
    chunk = Completion(id=rid, created=created, model=gen.model, choices=[choice],
                       usage=None if usage else msgspec.UNSET)
    offsets = [0] * n  # each choice's token text so far, for its log-probabilities' text_offset
    try:
        async for c in gen.chunks():
            choice.index = c.index
            choice.text = c.text
            choice.logprobs = completion_logprobs(c.logprobs, offsets[c.index])
            offsets[c.index] += sum(len(e.token) for e in c.logprobs or ())
            if token_ids:
                choice.token_ids = c.tokens
            yield _sse(chunk)
    except MlxrtError as exc:
        yield _error_event(exc)
        return
    choice.text = ""
    choice.logprobs = None
    for event in _final_events(gen, chunk, choice, usage=usage, token_ids=token_ids, n=n):
        yield event


async def chat_events(
    gen: Generation, rid: str, created: int, *, usage: bool, token_ids: bool, n: int = 1
) -> AsyncIterator[bytes]:
    """SSE events of a streamed /v1/chat/completions: role first (per choice), then content, reasoning
    and tool-call deltas (each call whole, with its index, id, name and arguments), log-probabilities
    with the tokens they belong to; with n > 1 each chunk's choice has its `index`."""
    delta = Delta(role="assistant", content="")
    choice = ChatChunkChoice(delta=delta)
    chunk = ChatCompletionChunk(id=rid, created=created, model=gen.model, choices=[choice],
                                usage=None if usage else msgspec.UNSET)
    calls = [0] * n  # calls streamed so far, per choice
    try:
        if token_ids:
            choice.token_ids = []
        for i in range(n):
            choice.index = i
            yield _sse(chunk)
        delta.role = None
        async for c in gen.chunks():
            choice.index = c.index
            delta.content = c.text if c.text or not (c.reasoning or c.tool_calls) else None
            delta.reasoning_content = delta.reasoning = c.reasoning or None
            delta.tool_calls = None
            if c.tool_calls:
                first = calls[c.index]
                delta.tool_calls = [
                    ToolCallDelta(index=first + k, id=t.id,
                                  function=FunctionOut(name=t.name, arguments=t.arguments))
                    for k, t in enumerate(c.tool_calls)]
                calls[c.index] += len(c.tool_calls)
            choice.logprobs = chat_logprobs(c.logprobs)
            if token_ids:
                choice.token_ids = c.tokens
            yield _sse(chunk)
    except MlxrtError as exc:
        yield _error_event(exc)
        return
    finally:
        gen.stream.close()  # also when the role chunk was the last thing sent
    delta.content = delta.reasoning_content = delta.reasoning = None
    delta.tool_calls = None
    choice.logprobs = None
    for event in _final_events(gen, chunk, choice, usage=usage, token_ids=token_ids, n=n, calls=calls):
        yield event


def _final_events(
    gen: Generation, chunk: Any, choice: Any, *, usage: bool, token_ids: bool, n: int = 1,
    calls: list[int] | None = None,
) -> Iterator[bytes]:
    """A stream's end: each choice's chunk with its finish reason, the usage chunk if asked, [DONE].

    `calls`: the tool calls each choice streamed (chat: "tool_calls" when it made some and stopped).
    """
    if token_ids:
        choice.token_ids = []
    stats = gen.stream.choice_stats
    for i in range(n):
        choice.index = i
        reason = stats[i].finish_reason if i in stats else gen.finish_reason
        choice.finish_reason = "tool_calls" if calls and calls[i] and reason == "stop" else reason
        yield _sse(chunk)
    if usage:
        chunk.choices = []
        chunk.usage = usage_of(gen)
        yield _sse(chunk)
    yield _DONE
