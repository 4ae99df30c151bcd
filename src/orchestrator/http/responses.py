"""OpenAI Responses: POST /v1/responses, GET and DELETE /v1/responses/{id}.

A request becomes the same runtime request the chat completions route builds:
``instructions`` a system message, ``input`` items chat turns (a
``function_call`` an assistant's call, ``function_call_output`` a tool turn,
a ``reasoning`` item the next assistant turn's reasoning), ``text.format``
a grammar (`structured.py`), ``reasoning.effort`` the template's thinking,
``tools``/``tool_choice`` the chat keywords `chat.chat_options` checks. The
reply comes back as output items (`blocks.py`): ``reasoning`` (its text in
``content``, as open-weight servers return it), ``message`` and
``function_call``, in the order the model wrote them.

Streaming is server-sent events named by their ``type``, numbered by
``sequence_number``: ``response.created``, ``response.in_progress``, then per
item ``response.output_item.added``, ``response.content_part.added``, the
deltas (``response.output_text.delta``, ``response.reasoning_text.delta``,
``response.function_call_arguments.delta``: a call's arguments whole, as the
worker parses each call whole), their ``.done`` events and
``response.output_item.done``; last ``response.completed`` (or
``response.incomplete`` when ``max_output_tokens`` cut it, or
``response.failed``) with the whole response and its usage.

``previous_response_id`` continues a stored response: the server keeps the
last ``--responses-store`` responses (``store: false`` keeps none) with the
conversation that led to each, in memory; a restart forgets them. As with
OpenAI, the earlier ``instructions`` are not carried over.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import Response as HttpResponse
from starlette.routing import Route

from ...ipc.protocol import InvalidField
from ..errors import MlxrtError
from ..images import image_bytes
from ..request import Request as RtRequest
from ..structured import ANY_JSON_OBJECT, json_schema_grammar
from .blocks import Block, BlockEvents, collect, reasoning_tokens
from .body import convert
from .errors import HttpError, from_invalid_field, from_runtime_error
from .responses_schemas import (
    ITEM_TYPES,
    ContentPartAdded,
    ContentPartDone,
    CustomToolCallInputDelta,
    CustomToolCallInputDone,
    CustomToolCallItem,
    CustomToolCallOut,
    CustomToolCallOutputItem,
    Deleted,
    FormatJsonObject,
    FormatJsonSchema,
    FormatText,
    FunctionCallArgumentsDelta,
    FunctionCallArgumentsDone,
    FunctionCallItem,
    FunctionCallOut,
    FunctionCallOutputItem,
    HostedCallItem,
    IncompleteDetails,
    InputImage,
    InputText,
    InputTokensDetails,
    MessageOut,
    OutputItem,
    OutputItemAdded,
    OutputItemDone,
    OutputText,
    OutputTextDelta,
    OutputTextDone,
    OutputTokensDetails,
    ReasoningItem,
    ReasoningOut,
    ReasoningText,
    ReasoningTextDelta,
    ReasoningTextDone,
    Refusal,
    Response,
    ResponseCompleted,
    ResponseCreated,
    ResponseError,
    ResponseFailed,
    ResponseIncomplete,
    ResponseInProgress,
    ResponsesRequest,
    ResponseUsage,
    TextConfig,
)
from .responses_tools import ToolSet, chat_call, custom_arguments, custom_input, flat_name
from .schemas import ENCODER
from .service import DEFAULT_MAX_TOKENS, Generation, Service, json_response, log_ignored, new_id
from .streaming import SSE_HEADERS, EventStream

#: OpenAI's default temperature; mlxrt's own is greedy.
DEFAULT_TEMPERATURE = 1.0
#: The runtime's field names as this API names them in errors.
NAMES = {"max_tokens": "max_output_tokens", "think": "reasoning.effort", "grammar": "text.format"}
#: ``reasoning.effort`` as the templates' ``think``: none turns thinking off, the rest set its level.
EFFORTS: dict[str, bool | str] = {"none": False, "minimal": "low", "low": "low", "medium": "medium",
                                  "high": "high", "xhigh": "high"}

_decoder = msgspec.json.Decoder(ResponsesRequest)


def routes(svc: Service) -> list[Route]:
    api = ResponsesApi(svc)
    return [
        Route("/v1/responses", api.create, methods=["POST"]),
        Route("/v1/responses/{response_id}", api.get, methods=["GET"]),
        Route("/v1/responses/{response_id}", api.delete, methods=["DELETE"]),
    ]


def _unsupported(param: str, what: str) -> HttpError:
    return HttpError(400, f"{param}: {what} is not supported by this server", param=param,
                     code="unsupported_parameter")


# ---- the store ---------------------------------------------------------------------------


@dataclass(slots=True)
class Stored:
    """A stored response and the conversation it ends: its input turns and its reply as chat
    messages, instructions left out."""

    response: Response
    history: list[dict[str, Any]]


class ResponseStore:
    """The last `capacity` responses by id; the least recently used goes first."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._items: OrderedDict[str, Stored] = OrderedDict()

    def get(self, rid: str) -> Stored | None:
        stored = self._items.get(rid)
        if stored is not None:
            self._items.move_to_end(rid)
        return stored

    def put(self, stored: Stored) -> None:
        if self.capacity <= 0:
            return
        self._items[stored.response.id] = stored
        while len(self._items) > self.capacity:
            self._items.popitem(last=False)

    def delete(self, rid: str) -> bool:
        return self._items.pop(rid, None) is not None


# ---- the request -------------------------------------------------------------------------


def input_messages(items: str | list[dict[str, Any]], history: list[dict[str, Any]],
                   ignored: list[str] | None = None) -> list[dict[str, Any]]:
    """`items` as chat messages (OpenAI's shape), following `history`. An assistant turn gathers the
    reasoning, message and function calls that come in a row; a ``function_call_output`` must
    answer a call made earlier (400 naming it otherwise). A namespaced or custom tool's call takes
    the name the model sees (`responses_tools`); a hosted tool's call is left out. Fields no item
    declares are appended to `ignored`."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    ignored = [] if ignored is None else ignored
    calls = {c["id"] for m in history for c in m.get("tool_calls", ())}
    out: list[dict[str, Any]] = []
    turn: dict[str, Any] | None = None  # the assistant turn being gathered
    for i, raw in enumerate(items):
        item = _item(i, raw, ignored)
        if isinstance(item, HostedCallItem):
            continue
        if isinstance(item, ReasoningItem):
            parts = item.content if item.content is not None else item.summary
            turn = {"role": "assistant", "content": "", "reasoning_content": "".join(p.text for p in parts)}
            out.append(turn)
        elif isinstance(item, (FunctionCallItem, CustomToolCallItem)):
            if turn is None:
                turn = {"role": "assistant", "content": ""}
                out.append(turn)
            calls.add(item.call_id)
            arguments = item.arguments if isinstance(item, FunctionCallItem) else custom_arguments(item.input)
            turn.setdefault("tool_calls", []).append(chat_call(item.call_id, item.name, item.namespace,
                                                               arguments))
        elif isinstance(item, (FunctionCallOutputItem, CustomToolCallOutputItem)):
            turn = None
            if item.call_id not in calls:
                raise HttpError(400, f"input[{i}].call_id: no function_call with call_id {item.call_id!r} "
                                     f"before it", param=f"input[{i}].call_id")
            result = _text(i, item.output, "output")
            out.append({"role": "tool", "tool_call_id": item.call_id, "content": result})
        elif item.role == "assistant":
            text = _text(i, item.content, "content", sep="")
            if turn is None or turn["content"] or "tool_calls" in turn:
                turn = {"role": "assistant", "content": text}
                out.append(turn)
            else:
                turn["content"] = text
        else:
            turn = None
            role = "system" if item.role == "developer" else item.role
            out.append({"role": role, "content": _user_content(i, item.content)})
    return out


def _user_content(i: int, content: str | list[Any]) -> str | list[dict[str, Any]]:
    """A user or system message's content: its text, or with ``input_image`` parts, text and image
    parts in order (each image's bytes checked here, named ``input[i].content[j].image_url``)."""
    if isinstance(content, str) or not any(isinstance(p, InputImage) for p in content):
        return _text(i, content, "content")
    parts: list[dict[str, Any]] = []
    for j, part in enumerate(content):
        field = f"input[{i}].content[{j}]"
        if isinstance(part, InputImage):
            if part.image_url is None:
                raise _unsupported(f"{field}.file_id", "an uploaded file (send image_url as a data URI)")
            try:  # read outside `Service.build`: its 400 is made here
                parts.append({"type": "image", "image": image_bytes(part.image_url, f"{field}.image_url")})
            except InvalidField as exc:
                raise from_invalid_field(exc, {}) from None
        elif isinstance(part, (InputText, OutputText, Refusal)):
            parts.append({"type": "text", "text": part.refusal if isinstance(part, Refusal) else part.text})
        else:
            raise _unsupported(field, f"a content part of type {type(part).__struct_config__.tag!r}")
    return parts


def _item(i: int, raw: Any, ignored: list[str]) -> Any:
    """Input item `i`, decoded by its ``type`` (a message may leave it out); fields it does not
    declare are appended to `ignored`."""
    kind = raw.get("type", "message") if isinstance(raw, dict) else None
    cls = ITEM_TYPES.get(kind) if isinstance(kind, str) else None
    if cls is None:
        known = ", ".join(ITEM_TYPES)
        raise HttpError(400, f"input[{i}].type: unknown or unsupported item type {kind!r} (this server takes "
                             f"{known})", param=f"input[{i}].type")
    if cls is not HostedCallItem:
        raw = {k: v for k, v in raw.items() if k != "type"}  # the item classes are not tagged
    return convert(raw, cls, f"input[{i}]", ignored)


def _text(i: int, content: str | list[Any], field: str, sep: str = "\n") -> str:
    if isinstance(content, str):
        return content
    texts = []
    for j, part in enumerate(content):
        if isinstance(part, (InputText, OutputText)):
            texts.append(part.text)
        elif isinstance(part, Refusal):
            texts.append(part.refusal)
        else:
            kind = type(part).__struct_config__.tag
            raise _unsupported(f"input[{i}].{field}[{j}]", f"a content part of type {kind!r}")
    return sep.join(texts)


#: OpenAI's defaults where the request and the model's defaults leave a value out.
API_DEFAULTS = {"temperature": DEFAULT_TEMPERATURE, "max_tokens": DEFAULT_MAX_TOKENS}


def sampling_params(req: ResponsesRequest) -> dict[str, Any]:
    """The runtime's sampling keywords the request sets (its defaults come in `Request.build`)."""
    params: dict[str, Any] = {}
    if req.max_output_tokens is not None:
        params["max_tokens"] = req.max_output_tokens
    for name in ("temperature", "top_p"):
        if getattr(req, name) is not None:
            params[name] = getattr(req, name)
    fmt = req.text.format if req.text else None
    if isinstance(fmt, (FormatJsonObject, FormatJsonSchema)):
        named = isinstance(fmt, FormatJsonSchema) and fmt.schema is not None
        field = "text.format.schema" if named else "text.format"
        schema = fmt.schema if named else ANY_JSON_OBJECT  # type: ignore[union-attr]
        try:
            params["grammar"] = json_schema_grammar(schema, field)
        except ValueError as exc:
            raise HttpError(400, str(exc), param=field, code="invalid_json_schema") from None
    return params


def chat_params(req: ResponsesRequest, tools: ToolSet | None = None) -> dict[str, Any]:
    """The runtime's chat keywords: tools (as chat completions' function tools, `responses_tools`),
    tool_choice, think; 400 naming the field for a tool that cannot be flattened or a choice naming
    no tool."""
    params: dict[str, Any] = {}
    tools = ToolSet(req.tools, []) if tools is None else tools
    names = tools.names
    if tools.functions:
        params["tools"] = tools.functions
    choice = req.tool_choice
    if isinstance(choice, str):
        if choice != "auto" and (choice == "none" or names):
            params["tool_choice"] = choice
        elif choice == "required":
            raise HttpError(400, "tool_choice: 'required' needs tools", param="tool_choice")
    elif choice is not None:
        name = flat_name(choice.namespace, choice.name)
        if name not in names:
            raise HttpError(400, f"tool_choice.name: {name!r} is not among the tools {names}",
                            param="tool_choice.name")
        params["tool_choice"] = {"type": "function", "function": {"name": name}}
    effort = req.reasoning.effort if req.reasoning else None
    if effort is not None:
        params["think"] = EFFORTS[effort]
    return params


# ---- the reply ---------------------------------------------------------------------------


def output_item(block: Block, *, status: str = "completed", tools: ToolSet | None = None) -> OutputItem:
    """A block as an output item; a call as `tools` names it to the client (namespace, custom)."""
    if block.kind == "reasoning":
        return ReasoningOut(id=new_id("rs", "_"), content=[ReasoningText(block.text)], status=status)
    if block.kind == "text":
        return MessageOut(id=new_id("msg", "_"), content=[OutputText(text=block.text)], status=status)
    return (tools or NO_TOOLS).call_item(block, status=status)


NO_TOOLS = ToolSet(None, [])


def assistant_turn(output: Iterable[OutputItem]) -> dict[str, Any]:
    """The reply as the chat message a later turn continues from (calls under the names the model saw)."""
    turn: dict[str, Any] = {"role": "assistant", "content": ""}
    for item in output:
        if isinstance(item, ReasoningOut):
            turn["reasoning_content"] = turn.get("reasoning_content", "") + item.content[0].text
        elif isinstance(item, MessageOut):
            turn["content"] += item.content[0].text
        else:
            ns = item.namespace if isinstance(item.namespace, str) else None
            arguments = item.arguments if isinstance(item, FunctionCallOut) else custom_arguments(item.input)
            turn.setdefault("tool_calls", []).append(chat_call(item.call_id, item.name, ns, arguments))
    return turn


class Turn:
    """One request's response as it is built: the `Response` echoing the request, the conversation
    before it, and how it ends (status, usage, the store)."""

    def __init__(self, req: ResponsesRequest, history: list[dict[str, Any]], store: ResponseStore,
                 warnings: list[str] | None = None) -> None:
        self.history = history
        self.store = store if req.store else None
        fmt = req.text.format if req.text and req.text.format else FormatText()
        self.response = Response(
            id=new_id("resp", "_"), created_at=int(time.time()), status="in_progress", model=req.model,
            instructions=req.instructions, previous_response_id=req.previous_response_id,
            max_output_tokens=req.max_output_tokens, temperature=req.temperature, top_p=req.top_p,
            tools=req.tools or [], tool_choice=msgspec.to_builtins(req.tool_choice or "auto"),
            parallel_tool_calls=req.parallel_tool_calls is not False, text=TextConfig(format=fmt),
            reasoning=req.reasoning, store=req.store, metadata=req.metadata or {}, truncation=req.truncation
            or "disabled", user=req.user)
        if warnings:
            self.response.warnings = warnings

    def finish(self, gen: Generation, output: list[OutputItem], reasoning: int) -> Response:
        """Complete the response (or mark it incomplete, cut by max_output_tokens) and store it."""
        r = self.response
        if not output:  # as chat completions' content "": an empty message
            output = [MessageOut(id=new_id("msg", "_"), content=[OutputText(text="")])]
        r.output = output
        if gen.finish_reason == "length":
            r.status, r.incomplete_details = "incomplete", IncompleteDetails("max_output_tokens")
            last = output[-1]
            last.status = "incomplete"
        else:
            r.status = "completed"
        stats = gen.stream.stats
        r.usage = ResponseUsage(
            input_tokens=gen.prompt_tokens,
            input_tokens_details=InputTokensDetails(stats.cached_tokens if stats else 0),
            output_tokens=gen.tokens, output_tokens_details=OutputTokensDetails(reasoning),
            total_tokens=gen.prompt_tokens + gen.tokens)
        if self.store is not None:
            self.store.put(Stored(r, [*self.history, assistant_turn(output)]))
        return r

    def fail(self, exc: MlxrtError) -> Response:
        err = from_runtime_error(exc)
        self.response.status = "failed"
        self.response.error = ResponseError(err.code or err.type, err.message)
        return self.response


def _sse(event: Any) -> bytes:
    return b"event: " + event.__struct_config__.tag.encode() + b"\ndata: " + ENCODER.encode(event) + b"\n\n"


class Sequencer:
    """Numbers the events of one stream (`sequence_number`) and frames them."""

    def __init__(self) -> None:
        self.n = -1

    def __call__(self, event: Any) -> bytes:
        self.n += 1
        event.sequence_number = self.n
        return _sse(event)


async def response_events(gen: Generation, turn: Turn, tools: ToolSet) -> AsyncIterator[bytes]:
    """The SSE events of a streamed response; the delta events are built once and mutated."""
    sse = Sequencer()
    yield sse(ResponseCreated(response=turn.response))
    yield sse(ResponseInProgress(response=turn.response))
    output: list[OutputItem] = []
    text = OutputTextDelta(item_id="", output_index=0, delta="")
    thought = ReasoningTextDelta(item_id="", output_index=0, delta="")
    blocks = BlockEvents(gen.chunks())
    try:
        async for e in blocks:
            if e.type == "delta":
                delta = text if e.block.kind == "text" else thought
                delta.delta = e.text
                yield sse(delta)
            elif e.type == "start":
                item = output_item(e.block, status="in_progress", tools=tools)
                output.append(item)
                for event in _item_start(e.index, item, e.block):
                    yield sse(event)
                text.item_id = thought.item_id = item.id
                text.output_index = thought.output_index = e.index
            else:
                item = output[e.index]
                for event in _item_stop(e.index, item, e.block):
                    yield sse(event)
    except MlxrtError as exc:
        yield sse(ResponseFailed(response=turn.fail(exc)))
        return
    if not output:
        empty = Block("text")
        output.append(item := output_item(empty, status="in_progress"))
        for event in [*_item_start(0, item, empty), *_item_stop(0, item, empty)]:
            yield sse(event)
    response = turn.finish(gen, output, blocks.reasoning_tokens)
    end = ResponseIncomplete if response.status == "incomplete" else ResponseCompleted
    yield sse(end(response=response))


def _item_start(index: int, item: OutputItem, block: Block) -> list[Any]:
    if isinstance(item, FunctionCallOut):
        item.arguments = ""
        return [OutputItemAdded(output_index=index, item=item),
                FunctionCallArgumentsDelta(item_id=item.id, output_index=index, delta=block.call.arguments)]
    if isinstance(item, CustomToolCallOut):
        text, item.input = item.input, ""
        return [OutputItemAdded(output_index=index, item=item),
                CustomToolCallInputDelta(item_id=item.id, output_index=index, delta=text)]
    if isinstance(item, MessageOut):
        item.content = []
        part: Any = OutputText(text="")
    else:
        item.content = []
        part = ReasoningText("")
    return [OutputItemAdded(output_index=index, item=item),
            ContentPartAdded(item_id=item.id, output_index=index, part=part)]


def _item_stop(index: int, item: OutputItem, block: Block) -> list[Any]:
    item.status = "completed"
    if isinstance(item, CustomToolCallOut):
        item.input = custom_input(block.call.arguments)
        return [CustomToolCallInputDone(item_id=item.id, output_index=index, input=item.input),
                OutputItemDone(output_index=index, item=item)]
    if isinstance(item, FunctionCallOut):
        item.arguments = block.call.arguments
        return [FunctionCallArgumentsDone(item_id=item.id, output_index=index, name=item.name,
                                          arguments=item.arguments),
                OutputItemDone(output_index=index, item=item)]
    if isinstance(item, MessageOut):
        part: Any = OutputText(text=block.text)
        item.content = [part]
        done: Any = OutputTextDone(item_id=item.id, output_index=index, text=block.text)
    else:
        part = ReasoningText(block.text)
        item.content = [part]
        done = ReasoningTextDone(item_id=item.id, output_index=index, text=block.text)
    return [done, ContentPartDone(item_id=item.id, output_index=index, part=part),
            OutputItemDone(output_index=index, item=item)]


def responses_request(req: ResponsesRequest, prompt: list[dict[str, Any]], model: str,
                      defaults: Mapping[str, Any], tools: ToolSet | None = None) -> RtRequest:
    """The runtime's `Request` for a Responses request whose conversation is `prompt` (instructions
    and stored history included); `defaults`: the model's default sampling; `tools`: its tools as the
    model sees them (`responses_tools`)."""
    params = {**sampling_params(req), **chat_params(req, tools)}
    return RtRequest.build(prompt, params, defaults={**API_DEFAULTS, **defaults}, model=model)


class ResponsesApi:
    def __init__(self, svc: Service) -> None:
        self.svc = svc
        self.store = ResponseStore(svc.config.responses_store)

    async def create(self, request: Request) -> HttpResponse | EventStream:
        t0 = time.perf_counter()
        ignored: list[str] = []
        req: ResponsesRequest = await self.svc.read(request, _decoder, ignored=ignored)
        model = self.svc.model(req.model)
        history = self._previous(req.previous_response_id)
        history = [*history, *input_messages(req.input, history, ignored)]
        if not history:
            raise HttpError(400, "input: no messages to respond to", param="input")
        prompt = [{"role": "system", "content": req.instructions}] if req.instructions else []
        prompt += history
        tools = ToolSet(req.tools, ignored)
        log_ignored(request, ignored, tools.dropped)
        defaults = self.svc.sampling_defaults(model)
        rt_req = self.svc.build(NAMES, responses_request, req, prompt, model, defaults, tools)
        gen = await self.svc.start(request, "/v1/responses", rt_req, NAMES, t0)
        turn = Turn(req, history, self.store, [f"ignored: {d}" for d in tools.dropped])
        if req.stream:
            return EventStream(response_events(gen, turn, tools), headers=SSE_HEADERS, on_close=gen.on_close)
        chunks = await gen.all_chunks(request.receive)
        output = [output_item(b, tools=tools) for b in collect(chunks)]
        return json_response(turn.finish(gen, output, reasoning_tokens(chunks)))

    def _previous(self, rid: str | None) -> list[dict[str, Any]]:
        if rid is None:
            return []
        stored = self.store.get(rid)
        if stored is None:
            raise HttpError(400, f"previous_response_id: no stored response {rid!r} (responses are kept in "
                                 f"memory, the last {self.store.capacity}, and only with store true)",
                            param="previous_response_id", code="previous_response_not_found")
        return stored.history

    async def get(self, request: Request) -> HttpResponse:
        rid = request.path_params["response_id"]
        stored = self.store.get(rid)
        if stored is None:
            raise _not_found(rid)
        return json_response(stored.response)

    async def delete(self, request: Request) -> HttpResponse:
        rid = request.path_params["response_id"]
        if not self.store.delete(rid):
            raise _not_found(rid)
        return json_response(Deleted(id=rid))


def _not_found(rid: str) -> HttpError:
    return HttpError(404, f"response {rid!r} not found (responses are kept in memory, only with store true)",
                     param="response_id", code="not_found")
