"""OpenAI Responses bodies as msgspec Structs: requests decoded strictly, responses and events encoded fast.

Request Structs derive from `Strict`: a field they do not declare is dropped
and named in the server's log, never a 400 (`body.decode`). ``input`` items
and ``tools`` are decoded one by one (`responses.input_messages`,
`responses_tools.ToolSet`) by their ``type`` (a message may leave it out), so
an unknown item type is a 400 naming ``input[i].type`` and a tool type this
server cannot run is left out with a warning. Fields clients send back with
the items they received (``id``, ``status``, ``annotations``,
``encrypted_content``, ...) are declared and ignored.
"""

from __future__ import annotations

from typing import Any, Literal

from msgspec import UNSET, Struct, UnsetType

from .schemas import Float, Int, Strict

# ---- input items ---------------------------------------------------------------------


class InputText(Strict, tag="input_text", tag_field="type"):
    text: str


class OutputText(Strict, tag="output_text", tag_field="type", kw_only=True):
    text: str
    annotations: list[Any] = []
    logprobs: list[Any] = []


class Refusal(Strict, tag="refusal", tag_field="type"):
    refusal: str


class InputImage(Strict, tag="input_image", tag_field="type", kw_only=True):
    """An image for a vision model: `image_url` a data URI (remote URLs and uploaded files' `file_id`
    are refused by name); `detail` is taken, unused."""

    image_url: str | None = None
    file_id: str | None = None
    detail: str | None = None


class InputFile(Struct, tag="input_file", tag_field="type"):
    pass


class InputAudio(Struct, tag="input_audio", tag_field="type"):
    pass


Content = InputText | OutputText | Refusal | InputImage | InputFile | InputAudio


class Item(Strict, kw_only=True):
    """Fields every input item may carry back: the id and status it was returned with."""

    id: str | None = None
    status: str | None = None


class MessageItem(Item, kw_only=True):
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[Content]
    phase: Any = None  # Codex's, on assistant messages: no effect


class FunctionCallItem(Item, kw_only=True):
    call_id: str
    name: str
    arguments: str
    #: The namespace of a namespaced function (`responses_tools`): the call's name is ``namespace__name``.
    namespace: str | None = None


class FunctionCallOutputItem(Item, kw_only=True):
    call_id: str
    output: str | list[Content]


class CustomToolCallItem(Item, kw_only=True):
    """A call of a ``custom`` (free-form) tool: its `input` is text."""

    call_id: str
    name: str
    input: str
    namespace: str | None = None


class CustomToolCallOutputItem(Item, kw_only=True):
    call_id: str
    output: str | list[Content]


class ReasoningText(Strict, tag="reasoning_text", tag_field="type"):
    text: str


class SummaryText(Strict, tag="summary_text", tag_field="type"):
    text: str


class ReasoningItem(Item, kw_only=True):
    """Reasoning sent back: its text (``content``, else its ``summary``) goes back to the template
    with the assistant turn that follows; ``encrypted_content`` means nothing here."""

    summary: list[SummaryText] = []
    content: list[ReasoningText] | None = None
    encrypted_content: str | None = None


class HostedCallItem(Struct):
    """A call of a hosted tool (``web_search_call``, ...) a client replays: this server ran none, and
    it is left out of the prompt."""


#: Input items by ``type``; a message may leave ``type`` out.
ITEM_TYPES: dict[str, type] = {
    "message": MessageItem,
    "function_call": FunctionCallItem,
    "function_call_output": FunctionCallOutputItem,
    "custom_tool_call": CustomToolCallItem,
    "custom_tool_call_output": CustomToolCallOutputItem,
    "reasoning": ReasoningItem,
    **{t: HostedCallItem for t in ("web_search_call", "file_search_call", "code_interpreter_call",
                                   "image_generation_call", "mcp_call", "mcp_list_tools", "local_shell_call",
                                   "tool_search_call", "tool_search_output")},
}


# ---- requests ------------------------------------------------------------------------


class FormatText(Struct, tag="text", tag_field="type"):
    pass


class FormatJsonObject(Struct, tag="json_object", tag_field="type"):
    pass


class FormatJsonSchema(Struct, tag="json_schema", tag_field="type", kw_only=True, omit_defaults=True):
    """Enforced in full, whatever ``strict`` says (docs/structured-output.md)."""

    name: str = ""
    schema: dict[str, Any] | None = None
    description: str | None = None
    strict: bool | None = None


Format = FormatText | FormatJsonObject | FormatJsonSchema


class TextConfig(Strict, kw_only=True, omit_defaults=True):
    format: Format | None = None
    verbosity: str | None = None  #: accepted, no effect


class Reasoning(Strict, kw_only=True, omit_defaults=True):
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    summary: str | None = None  #: accepted; the reasoning comes back whole, never summarised
    generate_summary: str | None = None


class FunctionTool(Strict, kw_only=True, omit_defaults=True):
    type: Literal["function"]
    name: str
    parameters: dict[str, Any] | None = None
    description: str | None = None
    strict: bool | None = None
    defer_loading: bool | None = None  #: accepted, no effect: every tool is in the prompt


class CustomFormat(Strict, kw_only=True):
    """A custom tool's input: free text, or text a grammar (Lark or a regex) describes."""

    type: Literal["text", "grammar"] = "text"
    syntax: Literal["lark", "regex"] | None = None
    definition: str | None = None


class CustomTool(Strict, kw_only=True):
    """A free-form tool: the model writes its input as text (Codex's ``apply_patch``)."""

    type: Literal["custom"]
    name: str
    description: str | None = None
    format: CustomFormat | None = None
    defer_loading: bool | None = None


class NamespaceTool(Strict, kw_only=True):
    """A group of tools (Codex's MCP servers and agent tools): functions and custom tools the model
    sees as ``namespace__name``, returned as ``name`` with ``namespace``."""

    type: Literal["namespace"]
    name: str
    description: str = ""
    tools: list[dict[str, Any]]


class ToolChoiceFunction(Strict, kw_only=True, omit_defaults=True):
    type: Literal["function", "custom"]
    name: str
    namespace: str | None = None  #: a namespaced tool's (or name it ``namespace__name``)


class ResponsesRequest(Strict, kw_only=True):
    model: str
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    previous_response_id: str | None = None
    max_output_tokens: Int | None = None
    temperature: Float | None = None
    top_p: Float | None = None
    stream: bool = False
    store: bool = True
    #: Decoded one by one (`responses_tools.ToolSet`): function, namespace and custom tools; hosted
    #: tools (web_search, ...) are left out, with a warning.
    tools: list[dict[str, Any]] | None = None
    tool_choice: Literal["none", "auto", "required"] | ToolChoiceFunction | None = None
    parallel_tool_calls: bool | None = None  #: accepted, no effect (as for chat completions)
    text: TextConfig | None = None
    reasoning: Reasoning | None = None
    # Accepted, no effect here.
    client_metadata: dict[str, Any] | None = None  # Codex's (trace context)
    include: list[str] | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    service_tier: str | None = None
    truncation: Literal["auto", "disabled"] | None = None
    stream_options: dict[str, Any] | None = None
    background: Literal[False] | None = None
    top_logprobs: Literal[0] | None = None


# ---- responses -----------------------------------------------------------------------


class ReasoningOut(Struct, tag="reasoning", tag_field="type", kw_only=True):
    id: str
    summary: list[SummaryText] = []
    content: list[ReasoningText] = []
    status: str = "completed"


class MessageOut(Struct, tag="message", tag_field="type", kw_only=True):
    id: str
    status: str = "completed"
    role: str = "assistant"
    content: list[OutputText] = []


class FunctionCallOut(Struct, tag="function_call", tag_field="type", kw_only=True):
    id: str
    call_id: str
    name: str
    arguments: str
    status: str = "completed"
    namespace: str | UnsetType = UNSET  #: a namespaced function's namespace; `name` is its own name


class CustomToolCallOut(Struct, tag="custom_tool_call", tag_field="type", kw_only=True):
    id: str
    call_id: str
    name: str
    input: str
    status: str = "completed"
    namespace: str | UnsetType = UNSET


OutputItem = ReasoningOut | MessageOut | FunctionCallOut | CustomToolCallOut


class InputTokensDetails(Struct):
    cached_tokens: int = 0  #: prompt tokens served from the worker's prefix cache


class OutputTokensDetails(Struct):
    reasoning_tokens: int = 0


class ResponseUsage(Struct, kw_only=True):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class IncompleteDetails(Struct):
    reason: str


class ResponseError(Struct):
    code: str
    message: str


class Response(Struct, kw_only=True):
    id: str
    object: str = "response"
    created_at: int
    status: str
    model: str
    output: list[OutputItem] = []
    usage: ResponseUsage | None = None
    error: ResponseError | None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None = None
    previous_response_id: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[dict[str, Any]] = []  #: as the request sent them
    tool_choice: Any = "auto"
    parallel_tool_calls: bool = True
    text: TextConfig | None = None
    reasoning: Reasoning | None = None
    store: bool = True
    metadata: dict[str, str] = {}
    truncation: str = "disabled"
    user: str | None = None
    #: What the server ignored or left out of the request (hosted tools it cannot run); an extension.
    warnings: list[str] | UnsetType = UNSET


class Deleted(Struct, kw_only=True):
    id: str
    object: str = "response"
    deleted: bool = True


# ---- stream events -------------------------------------------------------------------


class Event(Struct, tag_field="type", kw_only=True):
    sequence_number: int = 0


class ResponseCreated(Event, tag="response.created", kw_only=True):
    response: Response


class ResponseInProgress(Event, tag="response.in_progress", kw_only=True):
    response: Response


class ResponseCompleted(Event, tag="response.completed", kw_only=True):
    response: Response


class ResponseIncomplete(Event, tag="response.incomplete", kw_only=True):
    response: Response


class ResponseFailed(Event, tag="response.failed", kw_only=True):
    response: Response


class OutputItemAdded(Event, tag="response.output_item.added", kw_only=True):
    output_index: int
    item: OutputItem


class OutputItemDone(Event, tag="response.output_item.done", kw_only=True):
    output_index: int
    item: OutputItem


class ContentPartAdded(Event, tag="response.content_part.added", kw_only=True):
    item_id: str
    output_index: int
    content_index: int = 0
    part: OutputText | ReasoningText


class ContentPartDone(Event, tag="response.content_part.done", kw_only=True):
    item_id: str
    output_index: int
    content_index: int = 0
    part: OutputText | ReasoningText


class OutputTextDelta(Event, tag="response.output_text.delta", kw_only=True):
    item_id: str
    output_index: int
    content_index: int = 0
    delta: str
    logprobs: list[Any] = []


class OutputTextDone(Event, tag="response.output_text.done", kw_only=True):
    item_id: str
    output_index: int
    content_index: int = 0
    text: str
    logprobs: list[Any] = []


class ReasoningTextDelta(Event, tag="response.reasoning_text.delta", kw_only=True):
    item_id: str
    output_index: int
    content_index: int = 0
    delta: str


class ReasoningTextDone(Event, tag="response.reasoning_text.done", kw_only=True):
    item_id: str
    output_index: int
    content_index: int = 0
    text: str


class FunctionCallArgumentsDelta(Event, tag="response.function_call_arguments.delta", kw_only=True):
    item_id: str
    output_index: int
    delta: str


class FunctionCallArgumentsDone(Event, tag="response.function_call_arguments.done", kw_only=True):
    item_id: str
    output_index: int
    name: str
    arguments: str



class CustomToolCallInputDelta(Event, tag="response.custom_tool_call_input.delta", kw_only=True):
    item_id: str
    output_index: int
    delta: str


class CustomToolCallInputDone(Event, tag="response.custom_tool_call_input.done", kw_only=True):
    item_id: str
    output_index: int
    input: str
