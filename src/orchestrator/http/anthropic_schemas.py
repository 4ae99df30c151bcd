"""Anthropic Messages bodies as msgspec Structs: requests decoded strictly, replies and events encoded fast.

Request Structs derive from `Strict`: a field they do not declare is dropped
and named in the server's log, never a 400 (`body.decode`). Fields clients
send back or send for Anthropic's own servers (``signature``, ``citations``,
``cache_control``, ``caller``, ``defer_loading``, ...) are declared and
change nothing here, so they are not logged. Content blocks are decoded by
their ``type``: blocks of Anthropic's server tools (``server_tool_use``,
``web_search_tool_result``, ...) that a client replays are taken and left out
of the prompt (this server runs no server tools); a type that is not listed
is a 400 naming its path (``messages[0].content[1].type``).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from msgspec import Meta, Struct, defstruct

from .schemas import Float, Int, Strict

# ---- content blocks (requests and replies) -------------------------------------------


class TextBlock(Strict, tag="text", tag_field="type", kw_only=True, omit_defaults=True):
    text: str
    # Accepted, no effect here.
    citations: Any = None
    cache_control: Any = None


class ThinkingBlock(Strict, tag="thinking", tag_field="type", kw_only=True):
    thinking: str
    #: Anthropic signs its thinking; mlxrt's is unsigned (""), and a signature sent back is not checked.
    signature: str = ""


class RedactedThinkingBlock(Strict, tag="redacted_thinking", tag_field="type", kw_only=True):
    data: str = ""


class ToolUseBlock(Strict, tag="tool_use", tag_field="type", kw_only=True, omit_defaults=True):
    id: str
    name: str
    input: dict[str, Any]
    # Accepted, no effect here.
    cache_control: Any = None
    caller: Any = None


class ImageSource(Strict, kw_only=True):
    """An image block's source: ``base64`` (`media_type`, `data`) is served; ``url`` and ``file`` are
    refused by name (this server fetches nothing)."""

    type: str
    media_type: str | None = None
    data: str | None = None
    url: str | None = None
    file_id: str | None = None


class ImageBlock(Strict, tag="image", tag_field="type", kw_only=True):
    """An image for a vision model (in a user turn)."""

    source: ImageSource
    cache_control: Any = None


class DocumentBlock(Struct, tag="document", tag_field="type"):
    """As `ImageBlock`."""


class ToolReferenceBlock(Strict, tag="tool_reference", tag_field="type", kw_only=True):
    """A tool a tool search found (Claude Code's deferred tools): every tool is in the prompt here
    already, so it reads as the tool's name."""

    tool_name: str
    cache_control: Any = None


class ToolResultBlock(Strict, tag="tool_result", tag_field="type", kw_only=True):
    tool_use_id: str
    content: str | list[TextBlock | ImageBlock | DocumentBlock | ToolReferenceBlock] = ""
    is_error: bool = False
    cache_control: Any = None


#: Blocks of Anthropic's server tools (web search, code execution, MCP connector, ...): a client that
#: replays a conversation sends them back; this server runs none and leaves them out of the prompt.
SERVER_BLOCK_TYPES = (
    "server_tool_use", "web_search_tool_result", "web_fetch_tool_result", "code_execution_tool_result",
    "bash_code_execution_tool_result", "text_editor_code_execution_tool_result", "tool_search_tool_result",
    "mcp_tool_use", "mcp_tool_result", "container_upload",
)
SERVER_BLOCKS: tuple[type, ...] = tuple(
    defstruct(f"ServerBlock_{t}", [], tag=t, tag_field="type") for t in SERVER_BLOCK_TYPES)

Block = Union[  # noqa: UP007 -- the server blocks are built above, so the union is too
    (TextBlock, ThinkingBlock, RedactedThinkingBlock, ToolUseBlock, ToolResultBlock, ImageBlock,
     DocumentBlock, *SERVER_BLOCKS)]


# ---- requests ------------------------------------------------------------------------


class AnthropicMessage(Strict, kw_only=True):
    #: "system" is not Anthropic's, but Claude Code sends one for a model it does not know
    #: (`anthropic.chat_prompt` says where it goes).
    role: Literal["user", "assistant", "system"]
    content: str | list[Block]  # type: ignore[valid-type]


class Tool(Strict, kw_only=True):
    """A client tool (``type`` absent or ``"custom"``), or a server tool (``web_search_20250305``, ...),
    which this server cannot run: it is left out, with a warning."""

    name: str
    input_schema: dict[str, Any] | None = None  # required of a client tool (`anthropic.chat_params`)
    description: str | None = None
    type: str | None = None
    # Accepted, no effect here: the prefix cache is automatic, every tool is in the prompt, calls are
    # checked only when forced.
    cache_control: Any = None
    defer_loading: bool | None = None
    strict: bool | None = None
    input_examples: Any = None
    eager_input_streaming: bool | None = None


class ToolChoiceAuto(Strict, tag="auto", tag_field="type", kw_only=True):
    disable_parallel_tool_use: bool = False  #: accepted, no effect (as OpenAI's parallel_tool_calls)


class ToolChoiceAny(Strict, tag="any", tag_field="type", kw_only=True):
    disable_parallel_tool_use: bool = False


class ToolChoiceTool(Strict, tag="tool", tag_field="type", kw_only=True):
    name: str
    disable_parallel_tool_use: bool = False


class ToolChoiceNone(Strict, tag="none", tag_field="type", kw_only=True):
    pass


ToolChoice = ToolChoiceAuto | ToolChoiceAny | ToolChoiceTool | ToolChoiceNone


class ThinkingEnabled(Strict, tag="enabled", tag_field="type", kw_only=True):
    #: Accepted, above max_tokens too; the thinking is not cut at the budget (max_tokens bounds it).
    budget_tokens: Int = 0
    display: Literal["summarized", "omitted"] | None = None


class ThinkingAdaptive(Strict, tag="adaptive", tag_field="type", kw_only=True):
    display: Literal["summarized", "omitted"] | None = None


class ThinkingDisabled(Strict, tag="disabled", tag_field="type", kw_only=True):
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
    # Accepted, no effect here: the prefix cache is automatic; no context editing, no MCP connector.
    cache_control: Any = None
    context_management: Any = None
    mcp_servers: Any = None
    container: Any = None


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
