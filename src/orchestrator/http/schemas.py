"""Request and response bodies of both APIs, as msgspec Structs: decoded strictly, encoded fast.

Request Structs derive from `Strict`: a field they do not declare fails
msgspec's fast decode, and `body.decode` then drops it and the server names it
in its log (vLLM's rule: a client's new field never breaks a request, and a
misspelt `temprature` shows in the log). Declared fields are checked strictly.
Numbers are bounded at decode time so nothing non-finite or wider than 64
bits reaches the worker. Responses use ``UNSET`` for fields that appear only
sometimes (the ``token_ids`` extension, Ollama's final-chunk timings).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import UNSET, Meta, Struct, UnsetType

from ..handle import WorkerInfo

#: Bounds checked while decoding; the sampling rules themselves live in `SamplingParams.validate`.
Int = Annotated[int, Meta(ge=-(2**63), le=2**63 - 1)]
Float = Annotated[float, Meta(ge=-1e6, le=1e6)]
TokenId = Annotated[int, Meta(ge=0, le=2**31 - 1)]


class Strict(Struct, kw_only=True, forbid_unknown_fields=True):
    """Base of every request Struct, nested ones too: unknown fields are dropped and logged
    (`body.decode`), never decoded silently."""


# ---- OpenAI requests --------------------------------------------------------


class StreamOptions(Strict, kw_only=True):
    include_usage: bool = False


class ImageURL(Strict, kw_only=True):
    """An ``image_url`` part's image: a data URI (remote URLs are refused); `detail` is taken, unused."""

    url: str
    detail: str | None = None


class ContentPart(Strict, kw_only=True):
    """One part of a message's content: ``{"type": "text"}``, or ``{"type": "image_url"}`` for a vision
    model."""

    type: str
    text: str | None = None
    image_url: ImageURL | str | None = None


class FunctionCall(Strict, kw_only=True, omit_defaults=True):
    name: str = ""
    arguments: str | dict[str, Any] = "{}"  # OpenAI sends JSON text; an object is taken too


class MessageToolCall(Strict, kw_only=True):
    """A call in an earlier assistant turn, as the API returned it."""

    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall
    index: Int | None = None  # a streamed call's, when a client sends it back as it came


class OpenAIMessage(Strict, kw_only=True):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None
    tool_call_id: str | None = None
    #: An earlier turn's reasoning, as this server returned it (the template decides whether it is kept).
    reasoning_content: str | None = None
    reasoning: str | None = None
    # What the openai client sends back with an assistant message it received: only nulls are served.
    refusal: None = None
    annotations: list[Any] | None = None
    audio: None = None
    function_call: None = None


class FunctionDef(Strict, kw_only=True, omit_defaults=True):
    name: str = ""  # checked with the tool choice (`ChatOptions.validate`), so the message names the field
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class FunctionTool(Strict, kw_only=True):
    type: Literal["function"] = "function"
    function: FunctionDef


class ToolChoiceFunction(Strict, kw_only=True):
    name: str = ""


class NamedToolChoice(Strict, kw_only=True):
    type: Literal["function"] = "function"
    function: ToolChoiceFunction


class ChatTemplateKwargs(Strict, kw_only=True):
    """The chat template's switches a request may set (vLLM's and mlx_lm.server's field)."""

    enable_thinking: bool | None = None
    reasoning_effort: str | None = None


class JsonSchemaFormat(Strict, kw_only=True):
    """``response_format.json_schema``: enforced in full, whatever ``strict`` says."""

    name: str = ""
    description: str | None = None
    #: The JSON schema the reply must match; absent: any JSON object.
    schema: dict[str, Any] | None = None
    strict: bool | None = None


class ResponseFormat(Strict, kw_only=True):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class OpenAISampling(Strict, kw_only=True):
    """Fields shared by /v1/completions and /v1/chat/completions, extensions last."""

    model: str
    max_tokens: Int | None = None
    temperature: Float | None = None
    top_p: Float | None = None
    n: Int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: Int | None = None
    frequency_penalty: Float | None = None
    presence_penalty: Float | None = None
    logit_bias: dict[str, Float] | None = None
    user: str | None = None
    # Extensions (vLLM spells them the same way).
    top_k: Int | None = None
    min_p: Float | None = None
    repetition_penalty: Float | None = None
    repetition_context_size: Int | None = None
    ignore_eos: bool = False
    stop_token_ids: list[TokenId] | None = None
    return_token_ids: bool = False


class ChatCompletionRequest(OpenAISampling, kw_only=True):
    messages: Annotated[list[OpenAIMessage], Meta(min_length=1)]
    max_completion_tokens: Int | None = None
    logprobs: bool = False
    top_logprobs: Int | None = None
    response_format: ResponseFormat | None = None
    parallel_tool_calls: bool | None = None
    store: bool | None = None
    metadata: dict[str, str] | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    #: gpt-oss's "low", "medium", "high" (thinking on); the template's `reasoning_effort`.
    reasoning_effort: str | None = None
    chat_template_kwargs: ChatTemplateKwargs | None = None


class CompletionRequest(OpenAISampling, kw_only=True):
    #: text, token ids, or a batch of one of either (batches of more are refused)
    prompt: str | list[str | Int | list[Int]]
    echo: bool = False
    best_of: Int | None = None
    logprobs: Int | None = None
    suffix: str | None = None
    response_format: ResponseFormat | None = None  # as vLLM: structured output for completions too


# ---- OpenAI responses -------------------------------------------------------


class PromptTokensDetails(Struct):
    cached_tokens: int = 0  #: prompt tokens served from the worker's prefix cache


class Usage(Struct):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | UnsetType = UNSET


class TopLogprobOut(Struct, kw_only=True):
    """One of the most likely tokens at a position (chat ``top_logprobs``)."""

    token: str
    logprob: float
    bytes: list[int]


class LogprobOut(Struct, kw_only=True):
    """A generated token's log-probability (chat ``logprobs.content``)."""

    token: str
    logprob: float
    bytes: list[int]
    top_logprobs: list[TopLogprobOut]


class ChatLogprobs(Struct, kw_only=True):
    content: list[LogprobOut]
    refusal: None = None


class CompletionLogprobs(Struct, kw_only=True):
    """/v1/completions' (legacy) log-probabilities: parallel lists, one entry per token."""

    tokens: list[str]
    token_logprobs: list[float]
    #: Per token, the most likely tokens and the sampled one, text -> log-probability.
    top_logprobs: list[dict[str, float]]
    #: Each token's character offset in the completion's text.
    text_offset: list[int]


class CompletionChoice(Struct, kw_only=True):
    index: int = 0
    text: str
    finish_reason: str | None = None
    logprobs: CompletionLogprobs | None = None
    token_ids: list[int] | UnsetType = UNSET  # extension, with ``return_token_ids: true``


class Completion(Struct, kw_only=True):
    id: str
    object: str = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None | UnsetType = UNSET


class FunctionOut(Struct, kw_only=True):
    name: str
    arguments: str


class ToolCallOut(Struct, kw_only=True):
    id: str
    type: str = "function"
    function: FunctionOut


class ToolCallDelta(Struct, kw_only=True):
    """A whole call in one streamed delta, in the form the openai client accumulates by `index`."""

    index: int
    id: str
    type: str = "function"
    function: FunctionOut


class AssistantMessage(Struct, kw_only=True):
    role: str = "assistant"
    content: str | None
    #: The reply's reasoning: vLLM's and DeepSeek's field, and `reasoning`, which newer clients read.
    reasoning_content: str | UnsetType = UNSET
    reasoning: str | UnsetType = UNSET
    tool_calls: list[ToolCallOut] | UnsetType = UNSET


class ChatChoice(Struct, kw_only=True):
    index: int = 0
    message: AssistantMessage
    finish_reason: str | None = None
    logprobs: ChatLogprobs | None = None
    token_ids: list[int] | UnsetType = UNSET


class ChatCompletion(Struct, kw_only=True):
    id: str
    object: str = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class Delta(Struct, kw_only=True, omit_defaults=True):
    role: str | None = None
    content: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChatChunkChoice(Struct, kw_only=True):
    index: int = 0
    delta: Delta
    finish_reason: str | None = None
    logprobs: ChatLogprobs | None = None
    token_ids: list[int] | UnsetType = UNSET


class ChatCompletionChunk(Struct, kw_only=True):
    id: str
    object: str = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None | UnsetType = UNSET


class ModelCard(Struct, kw_only=True):
    id: str
    object: str = "model"
    created: int
    owned_by: str = "mlxrt"


class ModelList(Struct, kw_only=True):
    object: str = "list"
    data: list[ModelCard]


# ---- Ollama requests --------------------------------------------------------


class OllamaOptions(Strict, kw_only=True):
    temperature: Float | None = None
    top_p: Float | None = None
    top_k: Int | None = None
    num_predict: Int | None = None
    seed: Int | None = None
    stop: str | list[str] | None = None
    repeat_penalty: Float | None = None
    repeat_last_n: Int | None = None
    min_p: Float | None = None
    # Load-time options of llama.cpp: accepted so existing clients work, no effect here.
    num_ctx: Int | None = None
    num_batch: Int | None = None
    num_gpu: Int | None = None
    main_gpu: Int | None = None
    num_thread: Int | None = None
    num_keep: Int | None = None
    numa: bool | None = None
    low_vram: bool | None = None
    f16_kv: bool | None = None
    use_mmap: bool | None = None
    use_mlock: bool | None = None
    vocab_only: bool | None = None
    logits_all: bool | None = None
    embedding_only: bool | None = None


KeepAlive = str | Float | None


class OllamaMessage(Strict, kw_only=True):
    role: Literal["system", "user", "assistant", "tool"]
    content: str = ""
    images: list[str] | None = None
    thinking: str | None = None
    tool_calls: list[Any] | None = None
    tool_name: str | None = None


class OllamaGenerateRequest(Strict, kw_only=True):
    model: str
    prompt: str = ""
    suffix: str | None = None
    system: str | None = None
    template: str | None = None
    context: list[Int] | None = None
    stream: bool = True
    raw: bool = False
    format: str | dict[str, Any] | None = None
    images: list[str] | None = None
    options: OllamaOptions | None = None
    keep_alive: KeepAlive = None
    think: bool | str | None = None
    logprobs: bool | None = None
    top_logprobs: Int | None = None


class OllamaChatRequest(Strict, kw_only=True):
    model: str
    messages: list[OllamaMessage] = []
    tools: list[Any] | None = None
    format: str | dict[str, Any] | None = None
    options: OllamaOptions | None = None
    stream: bool = True
    keep_alive: KeepAlive = None
    think: bool | str | None = None
    logprobs: bool | None = None
    top_logprobs: Int | None = None


class OllamaShowRequest(Strict, kw_only=True):
    model: str = ""
    name: str = ""  # older clients send the model here
    verbose: bool = False


# ---- Ollama responses -------------------------------------------------------


class OllamaTokenLogprob(Struct, kw_only=True):
    token: str
    logprob: float
    bytes: list[int] | UnsetType = UNSET


class OllamaLogprob(OllamaTokenLogprob, kw_only=True):
    """A generated token's log-probability and, with ``top_logprobs``, the most likely tokens."""

    top_logprobs: list[OllamaTokenLogprob] | UnsetType = UNSET


class OllamaChunk(Struct, kw_only=True):
    """Fields of every Ollama chunk; the timings appear on the final one (``done: true``) only."""

    model: str
    created_at: str
    done: bool = False
    done_reason: str | UnsetType = UNSET
    total_duration: int | UnsetType = UNSET
    load_duration: int | UnsetType = UNSET
    prompt_eval_count: int | UnsetType = UNSET
    prompt_eval_duration: int | UnsetType = UNSET
    eval_count: int | UnsetType = UNSET
    eval_duration: int | UnsetType = UNSET
    #: With ``logprobs: true``: one entry per token of this chunk.
    logprobs: list[OllamaLogprob] | UnsetType = UNSET


class OllamaGenerateChunk(OllamaChunk, kw_only=True):
    response: str
    thinking: str | UnsetType = UNSET


class OllamaFunctionOut(Struct, kw_only=True):
    index: int
    name: str
    arguments: dict[str, Any]


class OllamaToolCallOut(Struct, kw_only=True):
    id: str
    function: OllamaFunctionOut


class OllamaMessageOut(Struct, kw_only=True):
    role: str = "assistant"
    content: str
    thinking: str | UnsetType = UNSET
    tool_calls: list[OllamaToolCallOut] | UnsetType = UNSET


class OllamaChatChunk(OllamaChunk, kw_only=True):
    message: OllamaMessageOut


class OllamaDetails(Struct, kw_only=True):
    parent_model: str = ""
    format: str = "mlx"
    family: str = ""
    families: list[str] = []
    parameter_size: str = ""
    quantization_level: str = ""


class OllamaModel(Struct, kw_only=True):
    name: str
    model: str
    modified_at: str
    size: int
    digest: str
    details: OllamaDetails


class OllamaTags(Struct):
    models: list[OllamaModel]


class OllamaRunningModel(Struct, kw_only=True):
    name: str
    model: str
    size: int
    digest: str
    details: OllamaDetails
    expires_at: str
    size_vram: int
    context_length: int


class OllamaPs(Struct):
    models: list[OllamaRunningModel]


class OllamaShow(Struct, kw_only=True):
    modelfile: str = ""
    parameters: str = ""
    template: str = ""
    details: OllamaDetails
    model_info: dict[str, Any]
    capabilities: list[str]
    modified_at: str


class OllamaVersion(Struct):
    version: str


# ---- health -----------------------------------------------------------------




class ModelHealth(Struct, kw_only=True):
    ready: int
    workers: list[WorkerInfo]  # msgspec encodes the runtime's dataclass as is


class Health(Struct, kw_only=True):
    status: Literal["ok", "unavailable"]
    models: dict[str, ModelHealth]


ENCODER = msgspec.json.Encoder()
