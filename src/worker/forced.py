"""Forced tool calls: tool choice "required" or a named function, as a grammar on the reply.

With tool choice "auto" the model may answer or call. With "required" (any
of the tools, one call or more) or a named function (that one, once) the
reply must be a call whose arguments validate against the function's
`parameters` JSON schema. That is structured output's job: the call is
written as an llguidance Lark grammar, the family's tool-call markup around
a ``%json`` schema, and applied as the sequence's `Constraint`
(`grammar.py`), so what the model writes is always a call that mlx-lm's
parser (or the harmony one) reads and the arguments always validate.

Three tool formats can be written as a grammar (`FORCED_TOOL_FORMATS`):

- ``json_tools`` (Qwen2.5, Qwen3, Qwen3 MoE, Qwen3.5 as the synthetic presets write it):
  ``<tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>``, calls
  separated by a newline;
- ``harmony`` (gpt-oss): ``<|channel|>commentary to=functions.f <|constrain|>json<|message|>{...}``,
  then ``<|call|>``, an end-of-turn token, so one call per turn;
- ``llama3_json`` (Llama 3.1/3.2/3.3): the bare ``{"name": "f", "parameters": {...}}``, one call,
  as Meta's templates render one per assistant turn (they raise "This model only supports single
  tool-calls at once!" for more), so "required" is one call too.

Thinking is left to the model, as vLLM does (its grammar starts where the
reasoning ends): a model that thinks may think first, in free text up to its
end marker, then must call. ``think: false`` (``enable_thinking=False``)
renders a closed think block in the prompt, and the grammar then starts with
the call; a template that opens ``<think>`` in the prompt starts the grammar
inside the reasoning. gpt-oss may write analysis messages before the call.
"""

from __future__ import annotations

import json
from typing import Any

from ..ipc.protocol import FORCED_TOOL_FORMATS, Capabilities, ChatOptions, Grammar
from .grammar import closed_schema

#: Whitespace between the end of the reasoning and the call (the templates write "\n\n").
GAP = r"/[ \t\n]{0,4}/"
#: Whitespace inside a call's JSON: none or one space. Models write calls on one line; a weak model
#: allowed structured output's newlines and indents spends its tokens on them.
CALL_WHITESPACE = r" ?"
#: Free text of the reasoning: anything but a special token (the end marker is one).
REASONING = r"/(.|\n)*/"


def forced_tools(chat: ChatOptions | None) -> list[dict[str, Any]]:
    """The functions a forced tool choice allows (their ``function`` objects); [] when nothing is forced."""
    if chat is None or chat.tool_choice == "auto" or not chat.tools:
        return []
    fns = [t["function"] for t in chat.tools]
    return [f for f in fns if f["name"] == chat.tool_name] if chat.tool_choice == "function" else fns


def tool_call_grammar(tokenizer, caps: Capabilities, chat: ChatOptions | None, *,
                      reasoning_open: bool) -> Grammar | None:
    """The grammar a forced tool choice puts on the reply; None when the choice forces nothing.

    `reasoning_open`: the prompt opened the reasoning (the reply starts inside ``<think>``).
    Raises `ValueError` for a tool format no grammar is written for.
    """
    fns = forced_tools(chat)
    if not fns:
        return None
    assert chat is not None
    many = chat.tool_choice == "required"
    if caps.tools == "harmony":
        return Grammar(kind="lark", source=_harmony(fns))
    if caps.tools == "json_tools":
        think = None
        if caps.thinking == "think" and chat.enable_thinking is not False:
            think = (_token(tokenizer, tokenizer.think_start), _token(tokenizer, tokenizer.think_end))
        start, end = _token(tokenizer, tokenizer.tool_call_start), _token(tokenizer, tokenizer.tool_call_end)
        return Grammar(kind="lark", source=_tagged(fns, start, end, think, reasoning_open=reasoning_open,
                                                   many=many))
    if caps.tools == "llama3_json":
        return Grammar(kind="lark", source=_llama3(fns))
    raise ValueError(f"tool_choice {chat.tool_choice!r} cannot be enforced for the tool format "
                     f"{caps.tools or 'none'!r} (enforced: {list(FORCED_TOOL_FORMATS)})")


def _tagged(fns: list[dict], start: str, end: str, think: tuple[str, str] | None, *,
            reasoning_open: bool, many: bool) -> str:
    """``<tool_call>`` JSON calls, after an optional think block (or the rest of an opened one)."""
    calls = " | ".join(f"call_{i}" for i in range(len(fns)))
    lines = [f"start: reasoning {GAP} calls",
             'calls: call ("\\n" call)*' if many else "calls: call",
             f"call: {calls}"]
    if think is None:
        lines.append('reasoning: ""')
    elif reasoning_open:
        lines.append(f"reasoning: {REASONING} {think[1]}")
    else:
        lines.append(f'reasoning: "" | {think[0]} {REASONING} {think[1]}')
    for i, fn in enumerate(fns):
        lines.append(f'call_{i}: {start} "\\n" %json {_json(_call_schema(fn, "arguments"))} "\\n" {end}')
    return "\n".join(lines) + "\n"


def _harmony(fns: list[dict]) -> str:
    """gpt-oss: analysis messages, then one commentary message addressed to a function; <|call|> is
    an end-of-turn token, which the grammar allows once the call's JSON is complete."""
    lines = ["start: analysis* call",
             f'analysis: <|channel|> "analysis" <|message|> {REASONING} <|end|> <|start|> "assistant"',
             "call: " + " | ".join(f"call_{i}" for i in range(len(fns)))]
    for i, fn in enumerate(fns):
        head = json.dumps(f"commentary to=functions.{fn['name']} ")
        lines.append(f'call_{i}: <|channel|> {head} <|constrain|> "json" <|message|> %json '
                     f"{_json(_parameters(fn))}")
    return "\n".join(lines) + "\n"


def _llama3(fns: list[dict]) -> str:
    """Llama 3.x: the whole reply is one bare JSON call; the end-of-turn token follows it."""
    lines = ["start: " + " | ".join(f"call_{i}" for i in range(len(fns)))]
    for i, fn in enumerate(fns):
        lines.append(f"call_{i}: %json {_json(_call_schema(fn, 'parameters'))}")
    return "\n".join(lines) + "\n"


def _call_schema(fn: dict, key: str) -> dict:
    """``{"name": <fn's name>, <key>: <fn's parameters>}``, nothing else."""
    properties = {"name": {"const": fn["name"]}, key: _nested(_parameters(fn), key)}
    return {"type": "object", "properties": properties, "required": ["name", key],
            "additionalProperties": False}


def _parameters(fn: dict) -> dict:
    params = fn.get("parameters")
    return params if isinstance(params, dict) and params else {"type": "object"}


def _json(schema: dict) -> str:
    """The schema as ``%json`` takes it: closed as the strict engines close it (`closed_schema`: no
    property it does not declare), with the calls' whitespace rule."""
    closed = closed_schema(schema)
    assert isinstance(closed, dict)
    return json.dumps({**closed, "x-guidance": {"whitespace_pattern": CALL_WHITESPACE}})


def _nested(schema: Any, key: str) -> Any:
    """`schema` moved under ``properties.<key>`` of a wrapper: its local ``$ref``s rebased to match."""
    if isinstance(schema, dict):
        out = {k: _nested(v, key) for k, v in schema.items()}
        ref = schema.get("$ref")
        if isinstance(ref, str) and (ref == "#" or ref.startswith("#/")):
            out["$ref"] = f"#/properties/{key}" + ref[1:]
        return out
    if isinstance(schema, list):
        return [_nested(v, key) for v in schema]
    return schema


def _token(tokenizer, text: str | None) -> str:
    """A marker as Lark writes it: its token id when it is one token of the vocabulary (added tokens
    are special to llguidance), else the literal text."""
    if not text:
        raise ValueError("the tokenizer has no tool-call or think marker")
    ids = tokenizer.encode(text, add_special_tokens=False)
    return f"<[{ids[0]}]>" if len(ids) == 1 else json.dumps(text)
