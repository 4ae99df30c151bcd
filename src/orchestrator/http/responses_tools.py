"""Responses ``tools`` as the chat template's function tools, and the model's calls back as output items.

The model sees function tools only, each by one name:

- ``function``: as it is;
- ``namespace`` (Codex's MCP servers and agent tools): each tool in it, as
  ``namespace__name`` (``mcp__docs__search``; a namespace ending in ``__`` is
  not doubled), the namespace's description ahead of its first tool's. A call
  goes back as ``function_call`` with ``name`` and ``namespace`` apart, as
  Codex resolves it; a call the client replays with its ``namespace`` is
  renamed to match;
- ``custom`` (free-form, Codex's ``apply_patch``): a function of one string,
  ``input``; a regex grammar constrains it (a JSON schema ``pattern``) when
  the call is forced; a Lark grammar is not enforced (it describes raw text,
  the call writes a JSON string). A call goes back as ``custom_tool_call``
  with its ``input``;
- hosted tools (``web_search``, ``file_search``, ``code_interpreter``,
  ``image_generation``, ``mcp``, ``local_shell``, ...), which only OpenAI's
  servers run: left out, named in the log and the response's ``warnings``.

A tool that cannot be flattened (no name, a name twice, a namespace's tool
that is neither function nor custom, a bad schema) is a 400 naming it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import msgspec

from ..structured import check_tool_schema
from .blocks import Block
from .body import convert
from .errors import HttpError
from .responses_schemas import CustomTool, CustomToolCallOut, FunctionCallOut, FunctionTool, NamespaceTool
from .service import new_id

#: A custom tool's one parameter: the text the tool takes.
INPUT = "input"


def flat_name(namespace: str | None, name: str) -> str:
    """The name the model sees for `name` in `namespace` (vLLM's ``namespace__name``)."""
    if not namespace:
        return name
    return f"{namespace}{name}" if namespace.endswith("__") else f"{namespace}__{name}"


@dataclass(frozen=True, slots=True)
class Callee:
    """What a name the model sees stands for: the client's name, namespace and kind."""

    name: str
    namespace: str | None = None
    custom: bool = False


class ToolSet:
    """A request's tools: the function tools the model sees, the client's names behind them, and
    what was left out."""

    def __init__(self, tools: list[dict[str, Any]] | None, ignored: list[str]) -> None:
        """Decode `tools` (fields no tool declares are appended to `ignored`); 400 naming a tool that
        cannot be flattened."""
        self.functions: list[dict[str, Any]] = []
        self.callees: dict[str, Callee] = {}
        self.dropped: list[str] = []
        for i, raw in enumerate(tools or ()):
            kind = raw.get("type") if isinstance(raw, dict) else None
            field = f"tools[{i}]"
            if kind == "function":
                self._function(convert(raw, FunctionTool, field, ignored), field)
            elif kind == "custom":
                self._custom(convert(raw, CustomTool, field, ignored), field)
            elif kind == "namespace":
                self._namespace(convert(raw, NamespaceTool, field, ignored), field, ignored)
            elif isinstance(kind, str):
                self.dropped.append(f"{field} ({kind}: a hosted tool this server cannot run)")
            else:
                raise HttpError(400, f"{field}.type: required, a string (function, custom, namespace)",
                                param=f"{field}.type")

    @property
    def names(self) -> list[str]:
        return list(self.callees)

    def _add(self, flat: str, callee: Callee, fn: dict[str, Any], field: str) -> None:
        if not flat.strip() or flat in self.callees:
            why = "names a tool twice" if flat in self.callees else "required, a non-empty string"
            raise HttpError(400, f"{field}.name: {why}" + (f" ({flat!r})" if flat.strip() else ""),
                            param=f"{field}.name")
        self.callees[flat] = callee
        self.functions.append({"type": "function", "function": {"name": flat, **fn}})

    def _function(self, tool: FunctionTool, field: str, namespace: str | None = None,
                  lead: str = "") -> None:
        fn: dict[str, Any] = {}
        description = "\n\n".join(t for t in (lead, tool.description or "") if t)
        if description:
            fn["description"] = description
        if tool.parameters is not None:
            try:
                check_tool_schema(tool.parameters, f"{field}.parameters")
            except ValueError as exc:
                raise HttpError(400, str(exc), param=f"{field}.parameters",
                                code="invalid_function_parameters") from None
            fn["parameters"] = tool.parameters
        self._add(flat_name(namespace, tool.name), Callee(tool.name, namespace), fn, field)

    def _custom(self, tool: CustomTool, field: str, namespace: str | None = None, lead: str = "") -> None:
        text: dict[str, Any] = {"type": "string"}
        fmt = tool.format
        if fmt is not None and fmt.type == "grammar":
            if not fmt.definition or fmt.syntax is None:
                raise HttpError(400, f"{field}.format: a grammar needs syntax (lark, regex) and definition",
                                param=f"{field}.format")
            if fmt.syntax == "regex":
                text["pattern"] = f"^(?:{fmt.definition})$"
        parameters = {"type": "object", "properties": {INPUT: text}, "required": [INPUT],
                      "additionalProperties": False}
        fn: dict[str, Any] = {"parameters": parameters}
        description = "\n\n".join(t for t in (lead, tool.description or "") if t)
        if description:
            fn["description"] = description
        self._add(flat_name(namespace, tool.name), Callee(tool.name, namespace, custom=True), fn, field)

    def _namespace(self, ns: NamespaceTool, field: str, ignored: list[str]) -> None:
        if not ns.name.strip():
            raise HttpError(400, f"{field}.name: required, a non-empty string", param=f"{field}.name")
        for j, raw in enumerate(ns.tools):
            inner = f"{field}.tools[{j}]"
            kind = raw.get("type") if isinstance(raw, dict) else None
            lead = ns.description if j == 0 else ""  # said once, ahead of the namespace's first tool
            if kind == "function":
                self._function(convert(raw, FunctionTool, inner, ignored), inner, ns.name, lead)
            elif kind == "custom":
                self._custom(convert(raw, CustomTool, inner, ignored), inner, ns.name, lead)
            else:
                raise HttpError(400, f"{inner}.type: {kind!r} cannot be in a namespace (function or custom)",
                                param=f"{inner}.type")

    # ---- calls, both ways -----------------------------------------------------------------

    def call_item(self, block: Block, *, status: str = "completed") -> FunctionCallOut | CustomToolCallOut:
        """The model's call as the client expects it back (a name it does not know: as written)."""
        call = block.call
        assert call is not None
        callee = self.callees.get(call.name) or Callee(call.name)
        ns = msgspec.UNSET if callee.namespace is None else callee.namespace
        if callee.custom:
            return CustomToolCallOut(id=new_id("ctc", "_"), call_id=call.id, name=callee.name,
                                     input=custom_input(call.arguments), status=status, namespace=ns)
        return FunctionCallOut(id=new_id("fc", "_"), call_id=call.id, name=callee.name,
                               arguments=call.arguments, status=status, namespace=ns)


def custom_input(arguments: str) -> str:
    """A custom tool's text from the call's JSON arguments (``{"input": text}``; else the JSON as is)."""
    try:
        value = json.loads(arguments)
    except ValueError:
        return arguments
    text = value.get(INPUT) if isinstance(value, dict) else None
    return text if isinstance(text, str) else arguments


def chat_call(call_id: str, name: str, namespace: str | None, arguments: str) -> dict[str, Any]:
    """A replayed call as the chat template's tool call, under the name the model sees."""
    return {"id": call_id, "type": "function", "function": {"name": flat_name(namespace, name),
                                                            "arguments": arguments}}


def custom_arguments(text: str) -> str:
    """A custom tool's text as the function arguments the model wrote it in."""
    return json.dumps({INPUT: text}, ensure_ascii=False)
