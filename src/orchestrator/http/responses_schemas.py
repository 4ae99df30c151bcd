"""OpenAI Responses bodies as msgspec Structs: requests decoded strictly, responses and events encoded fast.

A request's top level refuses unknown fields, as the rest of the OpenAI API
here does. ``input`` items are decoded one by one (`responses.input_messages`)
by their ``type`` (a message may leave it out), so an unknown type is a 400
naming ``input[i].type``; within an item, fields mlxrt does not use
(``id``, ``status``, ``annotations``, ...) are ignored: clients send back the
items they received.
"""

from __future__ import annotations

from typing import Any, Literal

from msgspec import Struct

from .schemas import Float, Int, Strict

# ---- input items ---------------------------------------------------------------------


class InputText(Struct, tag="input_text", tag_field="type"):
    text: str


class OutputText(Struct, tag="output_text", tag_field="type", kw_only=True):
    text: str
    annotations: list[Any] = []
    logprobs: list[Any] = []


class Refusal(Struct, tag="refusal", tag_field="type"):
    refusal: str


class InputImage(Struct, tag="input_image", tag_field="type"):
    """Decoded so that it is refused by name ("not supported"), not as an unknown type."""


class InputFile(Struct, tag="input_file", tag_field="type"):
    pass


class InputAudio(Struct, tag="input_audio", tag_field="type"):
    pass


Content = InputText | OutputText | Refusal | InputImage | InputFile | InputAudio


class MessageItem(Struct, kw_only=True):
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[Content]


class FunctionCallItem(Struct, kw_only=True):
    call_id: str
    name: str
    arguments: str


class FunctionCallOutputItem(Struct, kw_only=True):
    call_id: str
    output: str | list[Content]


class ReasoningText(Struct, tag="reasoning_text", tag_field="type"):
    text: str


class SummaryText(Struct, tag="summary_text", tag_field="type"):
    text: str


class ReasoningItem(Struct, kw_only=True):
    """Reasoning sent back: its text (``content``, else its ``summary``) goes back to the template
    with the assistant turn that follows; ``encrypted_content`` means nothing here."""

    summary: list[SummaryText] = []
    content: list[ReasoningText] | None = None


#: Input items by ``type``; a message may leave ``type`` out.
ITEM_TYPES: dict[str, type] = {
    "message": MessageItem,
    "function_call": FunctionCallItem,
    "function_call_output": FunctionCallOutputItem,
    "reasoning": ReasoningItem,
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


class ToolChoiceFunction(Strict, kw_only=True):
    type: Literal["function"]
    name: str


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
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | ToolChoiceFunction | None = None
    parallel_tool_calls: bool | None = None  #: accepted, no effect (as for chat completions)
    text: TextConfig | None = None
    reasoning: Reasoning | None = None
    # Accepted, no effect here.
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


OutputItem = ReasoningOut | MessageOut | FunctionCallOut


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
    tools: list[FunctionTool] = []
    tool_choice: Any = "auto"
    parallel_tool_calls: bool = True
    text: TextConfig | None = None
    reasoning: Reasoning | None = None
    store: bool = True
    metadata: dict[str, str] = {}
    truncation: str = "disabled"
    user: str | None = None


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

