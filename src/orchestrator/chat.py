"""Chat requests checked at the edge: tools, tool choice, thinking, and tool turns in the messages.

Both HTTP APIs and the Python API come through here (`runtime.build_request`),
so a tool without a name or a tool choice naming an unknown function is one
`ValueError` naming the field, in every API, before anything reaches a worker.
What the model can do (`Capabilities`, from the worker's `Ready`) is checked
by `missing_capability`; the worker refuses too, for requests sent before
any worker of the model was ready.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

import msgspec

from ..ipc.protocol import (
    FORCED_TOOL_FORMATS,
    REASONING_EFFORTS,
    Capabilities,
    ChatMessage,
    ChatOptions,
    Grammar,
    InvalidField,
    ToolCall,
)
from .images import check_count, check_image, image_bytes
from .structured import grammar_problem

#: Keyword arguments of `Runtime.generate`/`stream` that shape a chat, beside the sampling ones.
CHAT_KEYWORDS = ("tools", "tool_choice", "think")
Think = bool | str | None


def chat_options(tools: Any = None, tool_choice: Any = None, think: Think = None) -> ChatOptions | None:
    """Validated `ChatOptions`, or None when the request asks for nothing beyond the template's defaults.

    `tools`: OpenAI-shaped function tools. `tool_choice`: "auto", "none" (the tools are dropped),
    "required", a function name as ``{"type": "function", "function": {"name": ...}}``, or None.
    `think`: True, False (the template's ``enable_thinking=False``), "low"/"medium"/"high"
    (its ``reasoning_effort``, thinking on), or None (the template's default).
    """
    if tools is not None and not isinstance(tools, list):
        raise InvalidField("tools", f"={tools!r}: a list of function tools")
    tools = [_builtins(t) for t in tools or []]
    choice, name = _tool_choice(tool_choice)
    if choice == "none":
        tools, choice = [], "auto"
    enable, effort = _think(think)
    opts = ChatOptions(tools=tools, tool_choice=choice, tool_name=name, enable_thinking=enable,
                       reasoning_effort=effort).validate()
    if opts.forces_call:
        _check_parameters(opts)
    return None if opts == ChatOptions() else opts


def _check_parameters(opts: ChatOptions) -> None:
    """A forced call's arguments are enforced by their `parameters` schema: llguidance must accept
    each schema the choice can call (``ValueError`` naming ``tools[i].function.parameters``)."""
    for i, tool in enumerate(opts.tools):
        fn = tool["function"]
        params = fn.get("parameters")
        if params is None or (opts.tool_choice == "function" and fn["name"] != opts.tool_name):
            continue
        problem = grammar_problem(Grammar(kind="json_schema", source=json.dumps(params)))
        if problem:
            raise InvalidField(f"tools[{i}].function.parameters", f": {problem} (tool_choice "
                                                                  f"{opts.tool_choice!r} enforces it)")


def _builtins(obj: Any) -> Any:
    return msgspec.to_builtins(obj) if isinstance(obj, msgspec.Struct) else obj


def _tool_choice(value: Any) -> tuple[str, str]:
    if value is None:
        return "auto", ""
    if isinstance(value, str):
        if value not in ("none", "auto", "required"):
            raise InvalidField("tool_choice", f'={value!r}: "none", "auto", "required" or a function')
        return value, ""
    value = _builtins(value)
    fn = value.get("function") if isinstance(value, dict) else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(name, str) or not name:
        raise InvalidField("tool_choice.function.name", f"={name!r}: required, the function to call")
    return "function", name


def _think(think: Think) -> tuple[bool | None, str | None]:
    if think is None or isinstance(think, bool):
        return think, None
    if think in REASONING_EFFORTS:
        return True, str(think)
    raise InvalidField("think", f"={think!r}: true, false, or one of {list(REASONING_EFFORTS)}")


def missing_capability(caps: Capabilities | None, *, thinking: bool, tools: bool,
                       forced: bool = False) -> str | None:
    """"thinking", "tools" or "forced tool calls" when a request needs what the model cannot do
    (`forced`: tool choice "required" or a function); None if it can (or `caps` is unknown: the
    worker checks then)."""
    if caps is None:
        return None
    if thinking and not caps.thinking:
        return "thinking"
    if tools and not caps.tools:
        return "tools"
    if forced and caps.tools not in FORCED_TOOL_FORMATS:
        return "forced tool calls"
    return None


def chat_messages(messages: Sequence[Any]) -> list[ChatMessage]:
    """Messages as dicts (OpenAI's or Ollama's shape) or `ChatMessage`s, as `ChatMessage`s.

    Assistant turns may carry ``tool_calls`` (arguments as JSON text or an object) and their
    reasoning (``reasoning_content``, ``reasoning`` or Ollama's ``thinking``); tool results
    ``tool_call_id`` and ``name`` (Ollama: ``tool_name``), the name found from the call's id
    when left out.
    """
    out: list[ChatMessage] = []
    names: dict[str, str] = {}
    for i, m in enumerate(messages):
        if isinstance(m, ChatMessage):
            for j, data in enumerate(m.images):
                check_image(data, f"messages[{i}].images[{j}]")
            out.append(m)
            continue
        if not isinstance(m, Mapping):
            raise InvalidField(f"messages[{i}]", ": expected an object with role and content")
        msg = _message(i, m)
        for c in msg.tool_calls:
            if c.id:
                names[c.id] = c.name
        if msg.role == "tool" and msg.name is None and msg.tool_call_id in names:
            msg.name = names[msg.tool_call_id]
        out.append(msg)
    check_count([image for m in out for image in m.images])
    return out


def _message(i: int, m: Mapping) -> ChatMessage:
    role, content = m.get("role"), m.get("content")
    if not isinstance(role, str) or not role:
        raise InvalidField(f"messages[{i}].role", f"={role!r}: required, a string")
    if content is None:
        content = ""
    images = [image_bytes(v, f"messages[{i}].images[{j}]") for j, v in enumerate(m.get("images") or [])]
    if isinstance(content, list):
        content, parts = _parts(i, content)
        images = parts + images
    if not isinstance(content, str):
        raise InvalidField(f"messages[{i}].content", ": expected a string or a list of text and image parts")
    calls = [_call(f"messages[{i}].tool_calls[{j}]", c) for j, c in enumerate(m.get("tool_calls") or [])]
    reasoning = next((m[k] for k in ("reasoning_content", "reasoning", "thinking") if m.get(k)), None)
    name = m.get("name") or m.get("tool_name")
    return ChatMessage(role=role, content=content, tool_calls=calls,
                       reasoning=_text(f"messages[{i}].reasoning", reasoning),
                       tool_call_id=_text(f"messages[{i}].tool_call_id", m.get("tool_call_id")),
                       name=_text(f"messages[{i}].name", name), images=images)


#: Content part types that carry an image, and the key of the image in each (as the APIs name them).
IMAGE_PARTS = {"image": "image", "image_url": "image_url", "input_image": "image_url"}


def _parts(i: int, content: list) -> tuple[str, list[bytes]]:
    """A content list's text (its text parts, a line each) and images (bytes, a data URI or base64 in
    an ``image``, ``image_url`` (OpenAI: ``{"url": ...}``) or ``input_image`` part), in order."""
    texts: list[str] = []
    images: list[bytes] = []
    for j, part in enumerate(content):
        field = f"messages[{i}].content[{j}]"
        kind = part.get("type") if isinstance(part, Mapping) else None
        if kind == "text" and isinstance(part.get("text"), str):
            texts.append(part["text"])
        elif kind in IMAGE_PARTS:
            key = IMAGE_PARTS[kind]
            value = part.get(key)
            if isinstance(value, Mapping):  # OpenAI's {"url": ..., "detail": ...}
                value, key = value.get("url"), f"{key}.url"
            images.append(image_bytes(value, f"{field}.{key}"))
        else:
            raise InvalidField(field, f": expected a text or image part, not {kind!r}")
    return "\n".join(texts), images


def _text(field: str, value: Any) -> str | None:
    if value is None or isinstance(value, str):
        return value
    raise InvalidField(field, f"={value!r}: expected a string")


def _call(field: str, call: Any) -> ToolCall:
    if isinstance(call, ToolCall):
        return call
    call = _builtins(call)
    if not isinstance(call, Mapping):
        raise InvalidField(field, ": expected an object")
    fn = call.get("function", call)  # OpenAI and Ollama nest the function; a flat call is taken too
    name = fn.get("name") if isinstance(fn, Mapping) else None
    if not isinstance(name, str) or not name:
        raise InvalidField(f"{field}.function.name", f"={name!r}: required, a non-empty string")
    args = fn.get("arguments")
    if args is None:
        args = "{}"
    elif not isinstance(args, str):
        args = json.dumps(args, ensure_ascii=False)
    call_id = call.get("id")
    return ToolCall(name=name, arguments=args, id=call_id if isinstance(call_id, str) else "")
