"""Anthropic Messages: POST /v1/messages and /v1/messages/count_tokens.

A request becomes the same runtime request the OpenAI chat route builds:
chat messages (a ``tool_result`` block becomes a tool turn, ``tool_use`` an
assistant's call, ``thinking`` its reasoning), sampling keywords, and the
chat keywords `chat.chat_options` checks (``tool_choice`` ``auto``/``any``/
``tool``/``none`` as ``auto``/``required``/a named function/``none``;
``thinking`` as ``think``). The reply comes back as content blocks
(`blocks.py`): ``thinking``, ``text`` and ``tool_use``, in the order the
model wrote them.

Streaming is server-sent events with Anthropic's names: ``message_start``,
``ping``, then per block ``content_block_start``, ``content_block_delta``
(``text_delta``, ``thinking_delta``, ``input_json_delta``: a call's whole
input in one delta, as the worker parses each call whole) and
``content_block_stop``, then ``message_delta`` (stop reason and usage) and
``message_stop``. Errors are Anthropic's ``{"type": "error", ...}``, as a
status before the stream starts and as an ``error`` event after.

``count_tokens`` templates the request in a worker the way /v1/messages
would and generates one token: the worker alone has the tokenizer and the
chat template, and the prefill leaves the prompt in its prefix cache for the
request that usually follows.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Mapping
from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from ..errors import MlxrtError
from ..images import image_bytes
from ..request import Request as RtRequest
from ..structured import check_tool_schema, json_schema_grammar
from .anthropic_schemas import (
    SERVER_BLOCKS,
    AnthropicMessage,
    ContentBlockDelta,
    ContentBlockStart,
    ContentBlockStop,
    CountTokens,
    CountTokensRequest,
    DocumentBlock,
    ImageBlock,
    InputJsonDelta,
    Message,
    MessageDelta,
    MessagesRequest,
    MessageStart,
    MessageStop,
    Ping,
    RedactedThinkingBlock,
    StopInfo,
    TextBlock,
    TextDelta,
    ThinkingAdaptive,
    ThinkingBlock,
    ThinkingDelta,
    ThinkingDisabled,
    ToolChoiceAny,
    ToolChoiceNone,
    ToolChoiceTool,
    ToolReferenceBlock,
    ToolResultBlock,
    ToolUseBlock,
    Usage,
)
from .blocks import Block, BlockEvents, collect
from .errors import HttpError, anthropic_error, from_runtime_error
from .schemas import ENCODER
from .service import Generation, Service, json_response, log_ignored, new_id
from .streaming import SSE_HEADERS, EventStream

#: Anthropic's default temperature; mlxrt's own is greedy.
DEFAULT_TEMPERATURE = 1.0
#: The runtime's field names as this API names them in errors.
NAMES = {"stop": "stop_sequences", "think": "thinking", "reasoning_effort": "output_config.effort"}
#: Anthropic's efforts beyond "high" are the templates' "high".
EFFORTS = {"xhigh": "high", "max": "high"}

_messages_decoder = msgspec.json.Decoder(MessagesRequest)
_count_decoder = msgspec.json.Decoder(CountTokensRequest)


def routes(svc: Service) -> list[Route]:
    api = AnthropicApi(svc)
    return [
        Route("/v1/messages", api.messages, methods=["POST"]),
        Route("/v1/messages/count_tokens", api.count_tokens, methods=["POST"]),
    ]


def _unsupported(param: str, what: str) -> HttpError:
    return HttpError(400, f"{param}: {what} is not supported by this server", param=param)


# ---- the request -----------------------------------------------------------------------


def system_text(system: str | list[TextBlock] | None) -> str:
    if system is None or isinstance(system, str):
        return system or ""
    return "\n".join(b.text for b in system)


def chat_prompt(req: CountTokensRequest) -> list[dict[str, Any]]:
    """The conversation as the runtime's chat messages (OpenAI's shape); 400 for a block this
    server cannot serve, a ``tool_result`` answering no earlier ``tool_use``, or a final
    assistant turn (a prefill, which the chat templates cannot continue).

    ``role: "system"`` turns (Claude Code sends one for a model name it does not know) that come
    before every other turn join the ``system`` text, after it; a later one stays where it is, a
    system turn in the conversation, as chat completions pass it: the template renders it there
    (Qwen, Llama) or refuses it (a 400 with the template's message).
    """
    out: list[dict[str, Any]] = []
    system = [system_text(req.system)] if req.system else []
    lead = next((i for i, m in enumerate(req.messages) if m.role != "system"), len(req.messages))
    system += [_system_text(i, m) for i, m in enumerate(req.messages[:lead])]
    if any(system):
        out.append({"role": "system", "content": "\n\n".join(t for t in system if t)})
    calls: set[str] = set()
    for i, m in enumerate(req.messages[lead:], lead):
        if m.role == "assistant":
            out.append(_assistant(i, m, calls))
        elif m.role == "system":
            out.append({"role": "system", "content": _system_text(i, m)})
        else:
            out.extend(_user(i, m, calls))
    if req.messages[-1].role == "assistant":
        param = f"messages[{len(req.messages) - 1}]"
        raise _unsupported(param, "a final assistant turn to continue (prefill)")
    return out


def late_system_turn(req: CountTokensRequest) -> int | None:
    """The index of the first ``system`` turn that comes after another turn, if any (`chat_prompt`
    leaves it in place)."""
    began = False
    for i, m in enumerate(req.messages):
        if m.role != "system":
            began = True
        elif began:
            return i
    return None


def _system_text(i: int, m: AnthropicMessage) -> str:
    """A system turn's text: its text blocks; 400 naming any other block."""
    if isinstance(m.content, str):
        return m.content
    for j, b in enumerate(m.content):
        if not isinstance(b, TextBlock):
            raise _block_refused(i, j, b, "a system turn")
    return "\n".join(b.text for b in m.content)  # type: ignore[union-attr]


def _assistant(i: int, m: AnthropicMessage, calls: set[str]) -> dict[str, Any]:
    if isinstance(m.content, str):
        return {"role": "assistant", "content": m.content}
    texts, thoughts, tool_calls = [], [], []
    for j, b in enumerate(m.content):
        if isinstance(b, TextBlock):
            texts.append(b.text)
        elif isinstance(b, ThinkingBlock):
            thoughts.append(b.thinking)
        elif isinstance(b, ToolUseBlock):
            calls.add(b.id)
            fn = {"name": b.name, "arguments": b.input}
            tool_calls.append({"id": b.id, "type": "function", "function": fn})
        elif not isinstance(b, (RedactedThinkingBlock, *SERVER_BLOCKS)):  # nothing to show the template
            raise _block_refused(i, j, b, "an assistant turn")
    msg: dict[str, Any] = {"role": "assistant", "content": "".join(texts)}
    if tool_calls:
        msg["tool_calls"] = tool_calls
    if thoughts:
        msg["reasoning_content"] = "".join(thoughts)
    return msg


def _user(i: int, m: AnthropicMessage, calls: set[str]) -> list[dict[str, Any]]:
    """A user turn: its tool results as tool turns (they come first, as Anthropic requires), then
    its text, if any."""
    if isinstance(m.content, str):
        return [{"role": "user", "content": m.content}]
    out: list[dict[str, Any]] = []
    texts: list[dict[str, Any]] = []  # text and image parts, in order
    for j, b in enumerate(m.content):
        if isinstance(b, TextBlock):
            texts.append({"type": "text", "text": b.text})
        elif isinstance(b, ImageBlock):
            texts.append({"type": "image", "image": _image(i, j, b)})
        elif isinstance(b, ToolResultBlock):
            if b.tool_use_id not in calls:
                param = f"messages[{i}].content[{j}].tool_use_id"
                raise HttpError(400, f"{param}: no tool_use block with id {b.tool_use_id!r} in an earlier "
                                     f"assistant turn", param=param)
            out.append({"role": "tool", "tool_call_id": b.tool_use_id, "content": _result_text(i, j, b)})
        elif not isinstance(b, SERVER_BLOCKS):  # a server tool's result: this server ran none
            raise _block_refused(i, j, b, "a user turn")
    if any(p["type"] == "image" for p in texts):
        out.append({"role": "user", "content": texts})
    elif texts or not out:
        out.append({"role": "user", "content": "\n".join(p["text"] for p in texts)})
    return out


def _image(i: int, j: int, b: ImageBlock, tail: str = "") -> bytes:
    """An image block's bytes: a ``base64`` source's data, checked here; other sources are refused."""
    field = f"messages[{i}].content[{j}]{tail}.source"
    src = b.source
    if src.type == "url" and src.url is not None:
        return image_bytes(src.url, f"{field}.url")  # refused by name: remote images are not fetched
    if src.type != "base64" or src.data is None:
        raise _unsupported(f"{field}.type", f"an image source of type {src.type!r} (send base64 data)")
    return image_bytes(src.data, f"{field}.data")


def _result_text(i: int, j: int, b: ToolResultBlock) -> str | list[dict[str, Any]]:
    """A tool result's text; with images (a screenshot tool's), its text and image parts in order."""
    if isinstance(b.content, str):
        return b.content
    parts: list[dict[str, Any]] = []
    for k, part in enumerate(b.content):
        if isinstance(part, TextBlock):
            parts.append({"type": "text", "text": part.text})
        elif isinstance(part, ToolReferenceBlock):
            parts.append({"type": "text", "text": part.tool_name})
        elif isinstance(part, ImageBlock):
            parts.append({"type": "image", "image": _image(i, j, part, f".content[{k}]")})
        else:
            raise _block_refused(i, j, part, "a tool result", f".content[{k}]")
    if any(p["type"] == "image" for p in parts):
        return parts
    return "\n".join(p["text"] for p in parts)


def _block_refused(i: int, j: int, b: object, where: str, tail: str = "") -> HttpError:
    kind = type(b).__struct_config__.tag  # type: ignore[attr-defined]
    param = f"messages[{i}].content[{j}]{tail}"
    if isinstance(b, (ImageBlock, DocumentBlock)):
        return _unsupported(param, f"a content block of type {kind!r}")
    return HttpError(400, f"{param}: a {kind!r} block cannot be in {where}", param=param)


#: Anthropic's default where the request and the model's defaults leave a value out (max_tokens is required).
API_DEFAULTS = {"temperature": DEFAULT_TEMPERATURE}


def sampling_params(req: MessagesRequest) -> dict[str, Any]:
    """The runtime's sampling keywords the request sets (its defaults come in `Request.build`)."""
    params: dict[str, Any] = {"max_tokens": req.max_tokens}
    for name in ("temperature", "top_p", "top_k"):
        if getattr(req, name) is not None:
            params[name] = getattr(req, name)
    if req.stop_sequences:
        params["stop"] = req.stop_sequences
    return params


def messages_request(req: MessagesRequest, model: str, defaults: Mapping[str, Any],
                     dropped: list[str] | None = None) -> RtRequest:
    """The runtime's `Request` for a Messages request; `defaults`: the model's default sampling; server
    tools left out are named in `dropped`."""
    params = {**constrain(sampling_params(req), req), **chat_params(req, dropped)}
    return RtRequest.build(chat_prompt(req), params, defaults={**API_DEFAULTS, **defaults}, model=model)


def count_request(req: CountTokensRequest, model: str, defaults: Mapping[str, Any],
                  dropped: list[str] | None = None) -> RtRequest:
    """The runtime's `Request` that counts `req`'s prompt: one greedy token (the model's defaults
    do not apply)."""
    params = {**chat_params(req, dropped), "max_tokens": 1, "temperature": 0.0}
    return RtRequest.build(chat_prompt(req), params, model=model)


def chat_params(req: CountTokensRequest, dropped: list[str] | None = None) -> dict[str, Any]:
    """The runtime's chat keywords: tools (as OpenAI function tools), tool_choice and think; 400
    naming the field (Anthropic's name for it) for a bad tool or tool choice. Server tools
    (``web_search_20250305``, ...) are left out, each named in `dropped`."""
    params: dict[str, Any] = {}
    names: list[str] = []
    tools = []
    for i, tool in enumerate(req.tools or ()):
        if tool.type not in (None, "custom"):  # Anthropic's servers run these; this one cannot
            if dropped is not None:
                dropped.append(f"tools[{i}] ({tool.type} {tool.name!r}: a server tool, not run here)")
            continue
        if not tool.name.strip() or tool.name in names:
            why = "names a tool twice" if tool.name in names else "required, a non-empty string"
            raise HttpError(400, f"tools[{i}].name: {why}", param=f"tools[{i}].name")
        try:
            check_tool_schema(tool.input_schema, f"tools[{i}].input_schema")
        except ValueError as exc:
            raise HttpError(400, str(exc), param=f"tools[{i}].input_schema") from None
        names.append(tool.name)
        tools.append(tool)
    if tools:
        params["tools"] = [_function(t) for t in tools]
    choice = req.tool_choice
    if isinstance(choice, ToolChoiceNone):
        params["tool_choice"] = "none"
    elif isinstance(choice, (ToolChoiceAny, ToolChoiceTool)):
        if not names:
            raise HttpError(400, f"tool_choice: type {type(choice).__struct_config__.tag!r} needs tools",
                            param="tool_choice")
        if isinstance(choice, ToolChoiceAny):
            params["tool_choice"] = "required"
        elif choice.name not in names:
            raise HttpError(400, f"tool_choice.name: {choice.name!r} is not among the tools {names}",
                            param="tool_choice.name")
        else:
            params["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
    think = thinking_param(req)
    if think is not None:
        params["think"] = think
    return params


def _function(tool) -> dict[str, Any]:
    fn: dict[str, Any] = {"name": tool.name}
    if tool.description is not None:
        fn["description"] = tool.description
    fn["parameters"] = tool.input_schema
    return {"type": "function", "function": fn}


def thinking_param(req: CountTokensRequest) -> bool | str | None:
    """``think``: disabled is False; enabled is True, or the effort `output_config` asks for;
    adaptive or absent leave it to the template (a thinking model thinks)."""
    if isinstance(req.thinking, ThinkingDisabled):
        return False
    effort = req.output_config.effort if req.output_config else None
    if effort is not None:
        return EFFORTS.get(effort, effort)
    if req.thinking is None or isinstance(req.thinking, ThinkingAdaptive):
        return None
    return True


def constrain(params: dict[str, Any], req: CountTokensRequest) -> dict[str, Any]:
    """Add the grammar ``output_config.format`` asks for; 400 naming the field if it is bad."""
    fmt = req.output_config.format if req.output_config else None
    if fmt is not None:
        field = "output_config.format.schema"
        try:
            params["grammar"] = json_schema_grammar(fmt.schema, field)
        except ValueError as exc:
            raise HttpError(400, str(exc), param=field) from None
    return params


def shows_thinking(req: CountTokensRequest) -> bool:
    """Whether thinking text is returned: not when the request turned it off or asked it omitted."""
    display = getattr(req.thinking, "display", None)
    return not isinstance(req.thinking, ThinkingDisabled) and display != "omitted"


# ---- the reply -------------------------------------------------------------------------


def usage_of(gen: Generation) -> Usage:
    """Prompt tokens prefilled, and read from the prefix cache, apart, as Anthropic counts them."""
    stats = gen.stream.stats
    cached = stats.cached_tokens if stats else 0
    return Usage(input_tokens=gen.prompt_tokens - cached, output_tokens=gen.tokens,
                 cache_read_input_tokens=cached)


def stop_info(gen: Generation, calls: int) -> StopInfo:
    """end_turn, max_tokens, stop_sequence (which one), or tool_use when the reply called tools."""
    reason = gen.finish_reason
    stop = gen.stream.stats.stop_sequence if gen.stream.stats else ""
    if reason == "length":
        return StopInfo("max_tokens")
    if stop:
        return StopInfo("stop_sequence", stop)
    return StopInfo("tool_use" if calls else "end_turn")


def content_block(block: Block, *, thinking: bool) -> TextBlock | ThinkingBlock | ToolUseBlock:
    if block.kind == "text":
        return TextBlock(text=block.text)
    if block.kind == "reasoning":
        return ThinkingBlock(thinking=block.text if thinking else "")
    call = block.call
    assert call is not None
    return ToolUseBlock(id=call.id, name=call.name, input=tool_input(call.arguments))


def tool_input(arguments: str) -> dict[str, Any]:
    """A call's arguments (JSON text; the worker's parsers make them an object) as Anthropic's input."""
    value = msgspec.json.decode(arguments)
    return value if isinstance(value, dict) else {"value": value}


def _sse(name: bytes, obj: object) -> bytes:
    return b"event: " + name + b"\ndata: " + ENCODER.encode(obj) + b"\n\n"


def _error_event(exc: MlxrtError) -> bytes:
    return _sse(b"error", anthropic_error(from_runtime_error(exc)))


async def message_events(gen: Generation, message: Message, *, thinking: bool) -> AsyncIterator[bytes]:
    """The SSE events of a streamed message; the delta event is built once and mutated per chunk."""
    yield _sse(b"message_start", MessageStart(message))
    yield _sse(b"ping", Ping())
    calls = opened = 0
    text, thought = TextDelta(""), ThinkingDelta("")
    delta = ContentBlockDelta(0, text)
    try:
        async for e in BlockEvents(gen.chunks()):
            if e.type == "delta":
                if e.block.kind == "text":
                    text.text = e.text
                elif thinking:
                    thought.thinking = e.text
                else:
                    continue
                yield _sse(b"content_block_delta", delta)
            elif e.type == "stop":
                yield _sse(b"content_block_stop", ContentBlockStop(e.index))
            elif e.block.call is not None:  # a call's whole input, in one delta
                calls += 1
                call = e.block.call
                yield _sse(b"content_block_start", ContentBlockStart(e.index, ToolUseBlock(
                    id=call.id, name=call.name, input={})))
                yield _sse(b"content_block_delta", ContentBlockDelta(e.index, InputJsonDelta(call.arguments)))
            else:
                opened += 1
                yield _sse(b"content_block_start", ContentBlockStart(e.index, content_block(e.block,
                                                                                              thinking=False)))
                delta.index = e.index
                delta.delta = text if e.block.kind == "text" else thought
    except MlxrtError as exc:
        yield _error_event(exc)
        return
    if not (opened or calls):  # as the non-streamed reply: one empty text block
        yield _sse(b"content_block_start", ContentBlockStart(0, TextBlock(text="")))
        yield _sse(b"content_block_stop", ContentBlockStop(0))
    yield _sse(b"message_delta", MessageDelta(stop_info(gen, calls), usage_of(gen)))
    yield _sse(b"message_stop", MessageStop())


class AnthropicApi:
    def __init__(self, svc: Service) -> None:
        self.svc = svc

    def _build(self, request: Request, req: CountTokensRequest, ignored: list[str], to_request,
               defaults: bool) -> RtRequest:
        """The runtime's `Request` for `req`, checked; what was ignored or left out is logged, in one
        line."""
        model = self.svc.model(req.model)
        dropped: list[str] = []
        rt_req = self.svc.build(NAMES, to_request, req, model,
                                self.svc.sampling_defaults(model) if defaults else {}, dropped)
        log_ignored(request, ignored, dropped)
        return rt_req

    async def _start(self, request: Request, endpoint: str, req: CountTokensRequest, rt_req: RtRequest,
                     t0: float) -> Generation:
        """`Service.start`; a template that refuses a system turn left in the conversation is a 400
        naming that turn's role."""
        try:
            return await self.svc.start(request, endpoint, rt_req, NAMES, t0)
        except HttpError as exc:
            late = late_system_turn(req)
            if late is None or exc.status != 400 or exc.param != "messages":  # the template refused it
                raise
            param = f"messages[{late}].role"
            raise HttpError(400, f"{param}: the model's chat template cannot take a system turn after the "
                                 f"conversation began ({exc.message})", param=param) from exc

    async def messages(self, request: Request) -> Response | EventStream:
        t0 = time.perf_counter()
        ignored: list[str] = []
        req: MessagesRequest = await self.svc.read(request, _messages_decoder, ignored=ignored)
        rt_req = self._build(request, req, ignored, messages_request, defaults=True)
        gen = await self._start(request, "/v1/messages", req, rt_req, t0)
        message = Message(id=new_id("msg", "_"), model=req.model, content=[], usage=Usage(input_tokens=0,
                                                                                      output_tokens=0))
        thinking = shows_thinking(req)
        if req.stream:
            return EventStream(message_events(gen, message, thinking=thinking), headers=SSE_HEADERS,
                               on_close=gen.on_close)
        blocks = collect(await gen.all_chunks(request.receive))
        message.content = [content_block(b, thinking=thinking) for b in blocks] or [TextBlock(text="")]
        info = stop_info(gen, sum(b.kind == "call" for b in blocks))
        message.stop_reason, message.stop_sequence = info.stop_reason, info.stop_sequence
        message.usage = usage_of(gen)
        return json_response(message)

    async def count_tokens(self, request: Request) -> Response:
        """The request's prompt tokens, counted by the model's worker (see the module's docstring)."""
        t0 = time.perf_counter()
        ignored: list[str] = []
        req: CountTokensRequest = await self.svc.read(request, _count_decoder, ignored=ignored)
        rt_req = self._build(request, req, ignored, count_request, defaults=False)
        gen = await self._start(request, "/v1/messages/count_tokens", req, rt_req, t0)
        await gen.all_chunks(request.receive)
        return json_response(CountTokens(gen.prompt_tokens))

