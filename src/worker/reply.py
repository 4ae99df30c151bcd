"""A chat reply split as it streams: the answer, the reasoning and the tool calls.

The engine's `TextStream` emits a reply's text deltas; a `ReplySplitter`
turns each into `Parts`. Two formats, both matched on decoded text (a marker
split over two deltas is held back until it is whole):

- tag markup, mlx-lm's own: ``<think>``…``</think>`` around the reasoning
  (Qwen3 and others, `TokenizerWrapper.has_thinking`; a template that opens
  ``<think>`` in the prompt starts the reply in the reasoning, as
  `mlx_lm.server` detects) and ``<tool_call>``…``</tool_call>`` around each
  call, read by the family's mlx-lm tool parser. The state machine is
  mlx-lm's `TextStateMachine`, as in its server.
- gpt-oss's harmony format: messages ``<|channel|>NAME<|message|>BODY<|end|>``,
  the analysis channel being the reasoning, final the answer, and a
  commentary message addressed ``to=functions.NAME`` a call whose body is its
  JSON arguments (it ends with ``<|call|>``, an end-of-turn token, so at the
  end of the reply). mlx-lm 0.32 has no harmony parser, and `openai-harmony`
  parses token ids of its own o200k encoding (not a checkpoint's tokenizer,
  nor the synthetic one), so this is a small text-level parser.
- Llama 3.1/3.2/3.3's bare JSON (``llama3_json``): the whole reply is a call,
  ``{"name": "f", "parameters": {...}}``, maybe after ``<|python_tag|>``, with
  no markup around it. mlx-lm 0.32 has no parser for it (its `json_tools`
  reads ``<tool_call>`` markup), so `Llama3JsonSplitter` reads it by hand, as
  vLLM's ``llama3_json`` parser does: a reply that starts with ``{`` is held
  to its end and parsed, any other streams as text at once.

A call that does not parse (cut off by ``max_tokens``, not JSON) is kept as
answer text, markup included, rather than dropped.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from mlx_lm.generate import TextStateMachine

from ..ipc.protocol import Capabilities, ChatOptions, ToolCall
from .prompt import LLAMA3_JSON, PYTHON_TAG, reasoning_open

#: A harmony header longer than this is not one: the model is not writing harmony.
MAX_HARMONY_HEADER = 160
_RECIPIENT = re.compile(r"to=([^\s<]+)")
#: Between two calls of one reply: a ";" or a newline, with any whitespace around.
_LLAMA3_SEPARATOR = re.compile(r"\s*[;\n]\s*")


@dataclass
class Parts:
    """What one text delta (or the end of the reply) adds to the answer, the reasoning and the calls."""

    content: str = ""
    reasoning: str = ""
    calls: list[ToolCall] = field(default_factory=list)

    def add(self, kind: str, text: str) -> None:
        if kind == "reasoning":
            self.reasoning += text
        else:
            self.content += text

    def extend(self, other: Parts) -> Parts:
        self.content += other.content
        self.reasoning += other.reasoning
        self.calls.extend(other.calls)
        return self


def make_splitter(tokenizer, caps: Capabilities, chat: ChatOptions | None, prompt: list[int]):
    """The splitter for a chat reply to `prompt`, or None when there is nothing to split."""
    tools = chat.tools if chat is not None else []
    if caps.thinking == "harmony":
        return HarmonySplitter(parse_tools=bool(tools), prompt_tail=tokenizer.decode(prompt[-32:]))
    if not caps.thinking and not (tools and caps.tools):
        return None
    if caps.tools == LLAMA3_JSON:  # set only for a model without thinking (`capabilities`)
        return Llama3JsonSplitter()
    think = (tokenizer.think_start, tokenizer.think_end) if caps.thinking else None
    call = (tokenizer.tool_call_start, tokenizer.tool_call_end) if tools and caps.tools else None
    initial = "reasoning" if reasoning_open(tokenizer, caps, prompt) else "normal"
    return TagSplitter(think=think, call=call, parser=tokenizer.tool_parser, tools=tools, initial=initial)


def split_emit(reply, listener, req_id: int):
    """TextStream's emit: text as it is, or split into answer, reasoning and calls by `reply`."""
    if reply is None:
        return lambda token, text: listener.token(req_id, token, text)

    def emit(token: int, text: str) -> None:
        parts = reply.feed(text)
        if parts.reasoning or parts.calls:
            listener.token(req_id, token, parts.content, parts.reasoning, parts.calls)
        else:
            listener.token(req_id, token, parts.content)

    return emit


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def make_call(name: Any, arguments: Any, call_id: Any = None) -> ToolCall | None:
    """A `ToolCall` with JSON-object arguments, or None when the parsed call is not one."""
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except ValueError:
            return None
    if not isinstance(name, str) or not name or not isinstance(arguments, dict):
        return None
    return ToolCall(name=name, arguments=json.dumps(arguments, ensure_ascii=False),
                    id=call_id if isinstance(call_id, str) and call_id else new_call_id())


class _Edges:
    """Whitespace at the edges of a part (the newlines a template puts around its tags) is dropped;
    inside a part it is kept. Trailing whitespace waits for the next text to know which it is."""

    def __init__(self) -> None:
        self.fresh = False
        self.pending = ""

    def begin(self) -> None:
        """A new part begins: what the last one held back was its end."""
        self.fresh = True
        self.pending = ""

    def text(self, text: str) -> str:
        if self.fresh:
            text = text.lstrip()
            self.fresh = not text
        body = text.rstrip()
        if not body:
            self.pending += text
            return ""
        out, self.pending = self.pending + body, text[len(body):]
        return out

    def flush(self) -> str:
        """The reply ended: trailing whitespace of its last part is kept."""
        out, self.pending = self.pending, ""
        return out


class TagSplitter:
    """``<think>`` and ``<tool_call>`` markup, through mlx-lm's `TextStateMachine`.

    The transitions are `mlx_lm.generate.make_text_state_machine`'s (a call may also start
    inside the reasoning; a parser without an end marker calls to the end of the reply), with
    the call markup left out when the request has no tools, so it stays answer text.
    """

    def __init__(self, *, think: tuple[str, str] | None, call: tuple[str, str | None] | None, parser,
                 tools: list, initial: str = "normal") -> None:
        transitions: dict[str, list[tuple[str, str]]] = {}
        if think is not None:
            transitions["normal"] = [(think[0], "reasoning")]
            transitions["reasoning"] = [(think[1], "normal")]
        if call is not None:
            transitions.setdefault("normal", []).append((call[0], "tool"))
            if think is not None:
                transitions["reasoning"].append((call[0], "tool"))
            transitions["tool"] = [(call[1], "normal")] if call[1] else []
        self._call_markup = call
        self._parser = parser
        self._tools = tools
        self._sm = TextStateMachine(transitions)
        self._state = self._sm.make_state(initial)
        self._last = initial
        self._tool_text = ""
        self._edges = _Edges()

    def feed(self, text: str) -> Parts:
        self._state, segments = TextStateMachine.split(self._state, text)
        return self._collect(segments)

    def finish(self) -> Parts:
        self._state, rest, state = TextStateMachine.flush(self._state)
        parts = self._collect([(state, rest)])
        if self._last == "tool":  # cut off inside a call
            parts.extend(self._end_call(closed=False))
        else:
            parts.add(self._last, self._edges.flush())
        return parts

    def _collect(self, segments: list[tuple[str | None, str]]) -> Parts:
        parts = Parts()
        for state, text in segments:
            state = state or "normal"
            if state != self._last:
                if self._last == "tool":
                    parts.extend(self._end_call(closed=True))
                self._last = state
                self._edges.begin()
            if state == "tool":
                self._tool_text += text
            else:
                parts.add(state, self._edges.text(text))
        return parts

    def _end_call(self, *, closed: bool) -> Parts:
        text, self._tool_text = self._tool_text, ""
        parts = Parts()
        try:
            parsed = self._parser(text, self._tools)
        except Exception:  # any parser's failure: the text is kept as the answer
            parsed = None
        found = parsed if isinstance(parsed, list) else [parsed]
        calls = [make_call(c.get("name"), c.get("arguments", {}), c.get("id"))
                 if isinstance(c, dict) else None for c in found]
        if parsed is not None and calls and all(c is not None for c in calls):
            parts.calls.extend(c for c in calls if c is not None)
        else:
            start, end = self._call_markup or ("", "")
            parts.content = start + text + (end or "" if closed else "")
        return parts


class HarmonySplitter:
    """gpt-oss's harmony messages: analysis -> reasoning, final -> answer, ``to=functions.X`` -> a call.

    Text that is not harmony (no header where one must be) is all answer from there on.
    """

    def __init__(self, *, parse_tools: bool, prompt_tail: str = "") -> None:
        self._sm = TextStateMachine({
            "between": [("<|start|>", "header"), ("<|channel|>", "channel")],
            "header": [("<|channel|>", "channel"), ("<|message|>", "body")],
            "channel": [("<|message|>", "body"), ("<|constrain|>", "channel")],
            "body": [("<|end|>", "between"), ("<|call|>", "between"), ("<|return|>", "between")],
        })
        self._parse_tools = parse_tools
        self._header = ""  # role and recipient, before the channel
        self._channel = ""  # channel name, recipient, content type
        self._from_prompt = self._channel_from_prompt = 0  # leading characters the prompt wrote
        self._kind = "content"
        self._recipient = ""
        self._body = ""
        self._plain = False
        self._edges = _Edges()
        # The prompt ends inside the reply's first header ("<|start|>assistant"): begin there.
        _, start, header = prompt_tail.rpartition("<|start|>")
        self._last = "header" if start and "<|message|>" not in header else "between"
        if self._last == "header":
            header, opened, self._channel = header.partition("<|channel|>")
            self._last = "channel" if opened else "header"
            self._header = header.split("<|constrain|>")[0]
            self._from_prompt = len(self._header)
            self._channel_from_prompt = len(self._channel)
        self._state = self._sm.make_state(self._last)

    def feed(self, text: str) -> Parts:
        if self._plain:
            return Parts(content=text)
        self._state, segments = TextStateMachine.split(self._state, text)
        return self._collect(segments)

    def finish(self) -> Parts:
        if self._plain:
            return Parts()
        self._state, rest, state = TextStateMachine.flush(self._state)
        parts = self._collect([(state, rest)])
        if self._plain:
            return parts
        if self._last == "body":  # <|call|> and <|return|> end the turn: they never reach the text
            if self._kind != "tool":
                parts.add(self._kind, self._edges.flush())
            parts.extend(self._end_body())
        else:
            parts.content += self._held()
        return parts

    def _collect(self, segments: list[tuple[str | None, str]]) -> Parts:
        parts = Parts()
        for state, text in segments:
            state = state or "between"
            if self._plain:
                parts.content += text
                continue
            if state != self._last:
                if self._last == "body":
                    parts.extend(self._end_body())
                if state == "body":
                    self._begin_body()
                self._last = state
            if state == "body":
                self._body_text(text, parts)
                continue
            if state == "channel":
                self._channel += text
            else:
                self._header += text
            if self._not_harmony(state):
                self._plain = True  # what was held as a header is answer text
                parts.content += self._held()
        return parts

    def _held(self) -> str:
        """Header text the model wrote that no message body followed."""
        return self._header[self._from_prompt:] + self._channel[self._channel_from_prompt:]

    def _not_harmony(self, state: str) -> bool:
        if len(self._header) + len(self._channel) > MAX_HARMONY_HEADER:
            return True
        return state != "channel" and not _could_be_header(self._header)

    def _begin_body(self) -> None:
        words = self._channel.split()
        channel = words[0] if words else ""
        found = _RECIPIENT.search(self._header + " " + self._channel)
        self._recipient = found.group(1) if found else ""
        self._header = self._channel = ""
        self._from_prompt = self._channel_from_prompt = 0
        self._body = ""
        self._edges.begin()
        if self._recipient and self._parse_tools:
            self._kind = "tool"
        elif channel == "analysis":
            self._kind = "reasoning"
        else:  # final, a commentary preamble, or a call when no tools were given
            self._kind = "content"

    def _body_text(self, text: str, parts: Parts) -> None:
        if self._kind == "tool":
            self._body += text
        else:
            parts.add(self._kind, self._edges.text(text))

    def _end_body(self) -> Parts:
        parts = Parts()
        if self._kind == "tool":
            call = make_call(self._recipient.removeprefix("functions."), self._body)
            if call is not None:
                parts.calls.append(call)
            else:
                parts.content = self._body
        self._kind = "content"
        self._body = ""
        return parts


def _could_be_header(header: str) -> bool:
    """Whether `header` (so far) is what comes before a harmony channel: "assistant to=functions.f"."""
    words = header.split()
    return all(w.startswith("to=") or "assistant".startswith(w) or "to=".startswith(w) for w in words)


class Llama3JsonSplitter:
    """Llama 3.x's bare-JSON calls: the reply is a call when, after leading whitespace and an optional
    ``<|python_tag|>``, it starts with ``{``; then it is held to the end and parsed. Any other reply
    is answer text from its first character on, streamed as it comes.

    The held reply is one JSON object or several separated by ``;`` or newlines (vLLM's
    ``llama3_json`` reads the same), each with a ``name`` and its ``parameters`` (or ``arguments``).
    A reply that does not parse so (cut off, not JSON, an answer that happens to be JSON) is
    returned as answer text, unchanged.
    """

    def __init__(self) -> None:
        self._held = ""
        self._mode = ""  # "" undecided, "text", "call"

    def feed(self, text: str) -> Parts:
        if self._mode == "text":
            return Parts(content=text)
        self._held += text
        if self._mode == "":
            self._mode = _llama3_opening(self._held)
            if self._mode == "text":
                out, self._held = self._held, ""
                return Parts(content=out)
        return Parts()

    def finish(self) -> Parts:
        held, self._held = self._held, ""
        calls = parse_llama3_calls(held) if self._mode == "call" else None
        return Parts(calls=calls) if calls else Parts(content=held)


def _llama3_opening(held: str) -> str:
    """"call" when `held` opens a call, "text" when it cannot, "" while it is too short to tell."""
    rest = held.lstrip()
    if PYTHON_TAG.startswith(rest):
        return ""  # whitespace, or part of the tag
    rest = rest.removeprefix(PYTHON_TAG).lstrip()
    if not rest:
        return ""
    return "call" if rest.startswith("{") else "text"


def parse_llama3_calls(text: str) -> list[ToolCall] | None:
    """The calls in a whole Llama 3.x reply (one or more JSON objects, ``;`` or newline apart, after an
    optional ``<|python_tag|>``), or None when any part of it is not a call."""
    rest = text.strip().removeprefix(PYTHON_TAG).strip()
    decoder = json.JSONDecoder()
    calls: list[ToolCall] = []
    pos = 0
    while True:
        try:
            obj, pos = decoder.raw_decode(rest, pos)
        except ValueError:
            return None
        call = make_call(obj.get("name"), obj.get("parameters", obj.get("arguments"))) \
            if isinstance(obj, dict) else None
        if call is None:
            return None
        calls.append(call)
        gap = _LLAMA3_SEPARATOR.match(rest, pos)
        if pos == len(rest) or gap is not None and gap.end() == len(rest):  # a trailing ";" is no call
            return calls
        if gap is None:
            return None
        pos = gap.end()
