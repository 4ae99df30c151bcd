"""Anthropic Messages bodies as msgspec Structs: requests decoded strictly, replies and events encoded fast.

A request's top level refuses unknown fields, as Anthropic's API does
("Extra inputs are not permitted"). Content blocks, tools and the like are
decoded by their ``type`` and keep only the fields mlxrt uses: clients send
back what they received (``signature``, ``citations``, ``caller``,
``cache_control``), and it changes nothing here. A block type that is not
listed is a 400 naming its path (``messages[0].content[1].type``).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from msgspec import Meta, Struct

from .schemas import Float, Int, Strict

# ---- content blocks (requests and replies) -------------------------------------------


class TextBlock(Struct, tag="text", tag_field="type", kw_only=True):
    text: str


class ThinkingBlock(Struct, tag="thinking", tag_field="type", kw_only=True):
    thinking: str
    #: Anthropic signs its thinking; mlxrt's is unsigned (""), and a signature sent back is not checked.
    signature: str = ""


class RedactedThinkingBlock(Struct, tag="redacted_thinking", tag_field="type", kw_only=True):
    data: str = ""


class ToolUseBlock(Struct, tag="tool_use", tag_field="type", kw_only=True):
    id: str
    name: str
    input: dict[str, Any]


class ImageBlock(Struct, tag="image", tag_field="type"):
    """Decoded so that it is refused by name ("not supported"), not as an unknown type."""


class DocumentBlock(Struct, tag="document", tag_field="type"):
    """As `ImageBlock`."""


class ToolResultBlock(Struct, tag="tool_result", tag_field="type", kw_only=True):
    tool_use_id: str
    content: str | list[TextBlock | ImageBlock | DocumentBlock] = ""
    is_error: bool = False


Block = (TextBlock | ThinkingBlock | RedactedThinkingBlock | ToolUseBlock | ToolResultBlock | ImageBlock
         | DocumentBlock)


# ---- requests ------------------------------------------------------------------------


class AnthropicMessage(Strict, kw_only=True):
    role: Literal["user", "assistant"]
    content: str | list[Block]


class Tool(Struct, kw_only=True):
    """A client tool; ``cache_control``, ``strict``, ``input_examples`` and the like are ignored."""

    name: str
    input_schema: dict[str, Any]
    description: str | None = None
    type: Literal["custom"] | None = None


class ToolChoiceAuto(Struct, tag="auto", tag_field="type", kw_only=True):
    disable_parallel_tool_use: bool = False  #: accepted, no effect (as OpenAI's parallel_tool_calls)


class ToolChoiceAny(Struct, tag="any", tag_field="type", kw_only=True):
    disable_parallel_tool_use: bool = False


class ToolChoiceTool(Struct, tag="tool", tag_field="type", kw_only=True):
    name: str
    disable_parallel_tool_use: bool = False


class ToolChoiceNone(Struct, tag="none", tag_field="type", kw_only=True):
    pass


ToolChoice = ToolChoiceAuto | ToolChoiceAny | ToolChoiceTool | ToolChoiceNone


class ThinkingEnabled(Struct, tag="enabled", tag_field="type", kw_only=True):
    budget_tokens: Int = 0  #: accepted; the thinking is not cut at the budget (max_tokens bounds it)
    display: Literal["summarized", "omitted"] | None = None


class ThinkingAdaptive(Struct, tag="adaptive", tag_field="type", kw_only=True):
    display: Literal["summarized", "omitted"] | None = None


class ThinkingDisabled(Struct, tag="disabled", tag_field="type", kw_only=True):
    pass


Thinking = ThinkingEnabled | ThinkingAdaptive | ThinkingDisabled


class JsonOutputFormat(Strict, kw_only=True):
    type: Literal["json_schema"]
    schema: dict[str, Any]


class OutputConfig(Strict, kw_only=True):
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None
    format: JsonOutputFormat | None = None


class CountTokensRequest(Strict, kw_only=True):
    """``/v1/messages/count_tokens``: what shapes the prompt."""

    model: str
    messages: Annotated[list[AnthropicMessage], Meta(min_length=1)]
    system: str | list[TextBlock] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None
    output_config: OutputConfig | None = None
    # Accepted, no effect here: the prefix cache is automatic; no context editing.
    cache_control: Any = None
    context_management: Any = None


class MessagesRequest(CountTokensRequest, kw_only=True):
    max_tokens: Annotated[int, Meta(ge=1, le=2**31 - 1)]
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: Float | None = None
    top_p: Float | None = None
    top_k: Int | None = None
    # Accepted, no effect here.
    metadata: dict[str, Any] | None = None
    service_tier: str | None = None
    inference_geo: str | None = None
    speed: str | None = None


# ---- replies -------------------------------------------------------------------------


class Usage(Struct, kw_only=True):
    """Anthropic's counts: `input_tokens` are the prompt tokens prefilled, the rest were
    `cache_read_input_tokens` (the worker's prefix cache); their sum is the prompt."""

    input_tokens: int
    output_tokens: int
    cache_creation_input_tokens: int = 0
    cache_read_input_tokens: int = 0


class Message(Struct, kw_only=True):
    id: str
    type: str = "message"
    role: str = "assistant"
    model: str
    content: list[TextBlock | ThinkingBlock | ToolUseBlock]
    stop_reason: str | None = None
    stop_sequence: str | None = None
    usage: Usage


class CountTokens(Struct):
    input_tokens: int


# ---- stream events -------------------------------------------------------------------


class MessageStart(Struct, tag="message_start", tag_field="type"):
    message: Message


class Ping(Struct, tag="ping", tag_field="type"):
    pass


class ContentBlockStart(Struct, tag="content_block_start", tag_field="type"):
    index: int
    content_block: TextBlock | ThinkingBlock | ToolUseBlock


class TextDelta(Struct, tag="text_delta", tag_field="type"):
    text: str


class ThinkingDelta(Struct, tag="thinking_delta", tag_field="type"):
    thinking: str


class InputJsonDelta(Struct, tag="input_json_delta", tag_field="type"):
    partial_json: str


class ContentBlockDelta(Struct, tag="content_block_delta", tag_field="type"):
    index: int
    delta: TextDelta | ThinkingDelta | InputJsonDelta


class ContentBlockStop(Struct, tag="content_block_stop", tag_field="type"):
    index: int


class StopInfo(Struct):
    stop_reason: str | None
    stop_sequence: str | None = None


class MessageDelta(Struct, tag="message_delta", tag_field="type"):
    """The end of a streamed message; its usage is cumulative, input counts included (they are
    known only once the worker is done: `message_start` carries zeros)."""

    delta: StopInfo
    usage: Usage


class MessageStop(Struct, tag="message_stop", tag_field="type"):
    pass
