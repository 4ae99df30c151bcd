"""Every message between orchestrator and worker, in one place.

Two tagged unions, one per direction: `Down` (orchestrator -> worker, on the
worker's stdin) and `Up` (worker -> orchestrator, on stdout or the ring).
Messages are ``array_like`` (msgspec requires one layout per union, and it
keeps token frames small); the nested `SamplingParams` and `Stats` are maps.
New fields get defaults and go last, so an older peer still decodes a newer
one's frames;
`PROTOCOL_VERSION` is checked in the handshake for everything else.

Build one `Codec` per channel end and reuse it: msgspec encoders and decoders
are cheap to call and costly to build. No pickle anywhere.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec

from .ring import RingSpec

PROTOCOL_VERSION = 2

#: Largest repetition-penalty window: the penalty gathers this many past tokens
#: on every step, so its cost grows with the window.
MAX_REPETITION_CONTEXT = 1024
DEFAULT_MAX_TOKENS = 256
DEFAULT_REPETITION_CONTEXT = 20

FinishReason = Literal["stop", "length", "cancelled", "error", "grammar_dead_end"]
#: The finish reason of a constrained request whose grammar allowed no next token.
GRAMMAR_DEAD_END = "grammar_dead_end"


class ToolCall(msgspec.Struct, kw_only=True, omit_defaults=True):
    """One function call: in a reply (parsed in the worker) or in an earlier assistant turn."""

    name: str
    #: The arguments as JSON text (an object), as OpenAI sends them.
    arguments: str = "{}"
    id: str = ""


class ChatMessage(msgspec.Struct, forbid_unknown_fields=False, omit_defaults=True):
    role: str
    content: str
    #: An assistant turn's calls, and its reasoning (the template decides whether to render it).
    tool_calls: list[ToolCall] = []
    reasoning: str | None = None
    #: A tool result: the call it answers and the function's name.
    tool_call_id: str | None = None
    name: str | None = None


#: Ollama's `think` levels, the chat templates' `reasoning_effort` (gpt-oss).
REASONING_EFFORTS = ("low", "medium", "high")
TOOL_CHOICES = ("auto", "required", "function")


class ChatOptions(msgspec.Struct, kw_only=True, omit_defaults=True):
    """How a chat is templated and its reply split: tools, tool choice, thinking.

    Validated in the orchestrator; the worker renders `tools`, `enable_thinking`
    and `reasoning_effort` through the model's chat template and parses the
    reply's tool calls only when `tools` is not empty. Tool choice "none" never
    reaches the worker: its tools are dropped at the edge.
    """

    #: OpenAI-shaped function tools: {"type": "function", "function": {"name", "description", "parameters"}}.
    tools: list[dict[str, Any]] = []
    #: "auto", "required", or "function" (call `tool_name`). Rendered and parsed alike for now:
    #: a grammar that forces the call belongs to structured output.
    tool_choice: str = "auto"
    tool_name: str = ""
    #: None: the template's default (a thinking model thinks); False renders enable_thinking=False.
    enable_thinking: bool | None = None
    reasoning_effort: str | None = None

    def validate(self) -> ChatOptions:
        """Raise `ValueError` naming the first bad field (``tools[0].function.name``); return self."""
        names = []
        for i, tool in enumerate(self.tools):
            kind = tool.get("type", "function") if isinstance(tool, dict) else tool
            _check(kind == "function", f"tools[{i}].type", 'must be "function"', kind)
            fn = tool.get("function")
            _check(isinstance(fn, dict), f"tools[{i}].function", "required, an object", fn)
            name = fn.get("name")
            _check(isinstance(name, str) and name.strip() != "", f"tools[{i}].function.name",
                   "required, a non-empty string", name)
            params = fn.get("parameters")
            _check(params is None or isinstance(params, dict), f"tools[{i}].function.parameters",
                   "must be a JSON schema object", params)
            _check(name not in names, f"tools[{i}].function.name", "names a function twice", name)
            names.append(name)
        _check(self.tool_choice in TOOL_CHOICES, "tool_choice", f"must be one of {TOOL_CHOICES}",
               self.tool_choice)
        if self.tool_choice != "auto":
            _check(bool(self.tools), "tool_choice", "needs tools", self.tool_choice)
        if self.tool_choice == "function":
            _check(self.tool_name in names, "tool_choice.function.name",
                   f"names no function among the tools {names}", self.tool_name)
        if self.reasoning_effort is not None:
            _check(self.reasoning_effort in REASONING_EFFORTS, "reasoning_effort",
                   f"must be one of {REASONING_EFFORTS}", self.reasoning_effort)
        return self

    @property
    def wants_thinking(self) -> bool:
        """Whether the request asks for thinking (a model that cannot think must refuse it)."""
        return bool(self.enable_thinking) or self.reasoning_effort is not None


class Grammar(msgspec.Struct, kw_only=True, frozen=True):
    """A constraint on the reply, compiled in the worker by llguidance (see docs/structured-output.md).

    Frozen, so the worker's compiled-grammar cache can key on it.
    """

    kind: Literal["json_schema", "regex", "lark"]
    #: The JSON schema as JSON text, the regular expression, or the Lark grammar.
    source: str


class SamplingParams(msgspec.Struct, kw_only=True):
    """What to generate and how; validated in the orchestrator before sending."""

    max_tokens: int = DEFAULT_MAX_TOKENS
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float | None = None
    repetition_context_size: int = DEFAULT_REPETITION_CONTEXT
    seed: int | None = None
    stop: list[str] = []
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    #: Structured output: the reply must match this grammar (None: unconstrained).
    grammar: Grammar | None = None

    def validate(self) -> SamplingParams:
        """Raise `ValueError` naming the first bad field; return self."""
        _check(self.max_tokens >= 1, "max_tokens", "must be >= 1", self.max_tokens)
        _check(self.temperature >= 0.0, "temperature", "must be >= 0", self.temperature)
        _check(0.0 < self.top_p <= 1.0, "top_p", "must be in (0, 1]", self.top_p)
        _check(self.top_k >= 0, "top_k", "must be >= 0 (0 disables)", self.top_k)
        _check(0.0 <= self.min_p < 1.0, "min_p", "must be in [0, 1)", self.min_p)
        if self.repetition_penalty is not None:
            _check(
                self.repetition_penalty > 0.0,
                "repetition_penalty",
                "must be > 0",
                self.repetition_penalty,
            )
        _check(
            1 <= self.repetition_context_size <= MAX_REPETITION_CONTEXT,
            "repetition_context_size",
            f"must be in [1, {MAX_REPETITION_CONTEXT}]",
            self.repetition_context_size,
        )
        if self.seed is not None:
            _check(0 <= self.seed < 2**63, "seed", "must be in [0, 2**63)", self.seed)
        _check(all(self.stop), "stop", "must not contain empty strings", self.stop)
        _check(
            all(t >= 0 for t in self.stop_token_ids),
            "stop_token_ids",
            "must be >= 0",
            self.stop_token_ids,
        )
        return self


def _check(ok: bool, field: str, rule: str, value: object) -> None:
    if not ok:
        raise ValueError(f"invalid {field}={value!r}: {rule}")


DEFAULT_DECODE_CONCURRENCY = 16
DEFAULT_PROMPT_CONCURRENCY = 8
DEFAULT_PREFILL_STEP_SIZE = 2048
DEFAULT_PROMPT_CACHE_BYTES = 1 << 30  # a laptop's share: ~18k tokens of a 7B model's KV


class EngineOptions(msgspec.Struct, kw_only=True):
    """How a worker batches and caches; names follow `mlx_lm.server`'s flags."""

    #: Most sequences decoded together (mlx_lm.server --decode-concurrency).
    decode_concurrency: int = DEFAULT_DECODE_CONCURRENCY
    #: Most prompts prefilled together (mlx_lm.server --prompt-concurrency).
    prompt_concurrency: int = DEFAULT_PROMPT_CONCURRENCY
    #: Prompt tokens per prefill step (mlx_lm.server --prefill-step-size).
    prefill_step_size: int = DEFAULT_PREFILL_STEP_SIZE
    #: Byte cap of the prefix cache; 0 turns prefix reuse off (mlx_lm.server --prompt-cache-bytes).
    prompt_cache_bytes: int = DEFAULT_PROMPT_CACHE_BYTES
    #: A lone request decodes outside the batch, as `mlx_lm.generate_step` does (docs/engine.md).
    single_stream: bool = True

    def validate(self) -> EngineOptions:
        """Raise `ValueError` naming the first bad field; return self."""
        _check(self.decode_concurrency >= 1, "decode_concurrency", "must be >= 1", self.decode_concurrency)
        _check(self.prompt_concurrency >= 1, "prompt_concurrency", "must be >= 1", self.prompt_concurrency)
        _check(self.prefill_step_size >= 16, "prefill_step_size", "must be >= 16", self.prefill_step_size)
        _check(self.prompt_cache_bytes >= 0, "prompt_cache_bytes", "must be >= 0", self.prompt_cache_bytes)
        return self


class Stats(msgspec.Struct, kw_only=True):
    """One request's figures, measured in the worker."""

    prompt_tokens: int = 0
    prompt_tps: float = 0.0
    ttft_ms: float = 0.0
    generation_tokens: int = 0
    decode_tps: float = 0.0
    decode_ms: float = 0.0
    queue_ms: float = 0.0
    peak_memory_bytes: int = 0
    finish_reason: str = "stop"
    #: Prompt tokens served from the worker's prefix cache (not prefilled again).
    cached_tokens: int = 0
    #: Mean number of sequences decoded together over this request's decode steps.
    mean_batch_size: float = 0.0


# ---- orchestrator -> worker -------------------------------------------------


#: MLX backends a worker group can use; "auto" is `mlx.launch`'s choice: nccl where CUDA is, else ring.
GROUP_BACKENDS = ("auto", "ring", "jaccl", "jaccl-ring", "nccl")
#: How a group splits the model: mlx-lm's `sharded_load` ("auto": tensor parallel where the model
#: has `shard`, else pipeline parallel).
SHARDINGS = ("auto", "tensor", "pipeline")
DEFAULT_COLLECTIVE_TIMEOUT_S = 120.0
#: Connecting waits for every rank's process to start (and ssh to log in): never less than this.
MIN_CONNECT_TIMEOUT_S = 60.0
#: An idle group's rank 0 still steps the group this often, so a rank stuck waiting is told apart
#: from a group with nothing to do.
DEFAULT_HEARTBEAT_S = 1.0
#: How a rank of a worker group ends when it cannot go on; the orchestrator names the cause.
EXIT_COLLECTIVE_TIMEOUT = 5  # it waited on the other ranks past its collective timeout
EXIT_GROUP_FAILED = 6  # a collective failed (a peer is gone) or an engine step failed


class GroupRank(msgspec.Struct, kw_only=True):
    """A worker process's place in a worker group: one logical worker over `mx.distributed`.

    `env` is set, and each of `files` written to a temporary file whose path its variable
    gets, before MLX starts its backend: what `mlx.launch` would have set (MLX_RANK,
    MLX_HOSTFILE, NCCL_HOST_IP, ...), written by the orchestrator (docs/distributed.md).
    """

    rank: int
    size: int
    backend: str = "auto"
    sharding: str = "auto"
    env: dict[str, str] = {}
    files: dict[str, str] = {}
    #: Longest wait of one rank for the others (one engine step); then it exits.
    collective_timeout_s: float = DEFAULT_COLLECTIVE_TIMEOUT_S
    heartbeat_s: float = DEFAULT_HEARTBEAT_S
    #: Longest wait for the other ranks to connect, when the group starts.
    connect_timeout_s: float = MIN_CONNECT_TIMEOUT_S


class Hello(msgspec.Struct, tag="hello", array_like=True, kw_only=True):
    protocol: int
    model: str
    worker_id: str
    transport: Literal["stdio", "ring"] = "stdio"
    warmup_tokens: int = 4
    cache_limit_bytes: int | None = None
    ring: RingSpec | None = None
    engine: EngineOptions | None = None
    #: Set when this process is one rank of a worker group.
    group: GroupRank | None = None


class Generate(msgspec.Struct, tag="gen", array_like=True, kw_only=True):
    id: int
    params: SamplingParams
    prompt: str | None = None
    prompt_ids: list[int] | None = None
    messages: list[ChatMessage] | None = None
    chat: ChatOptions | None = None


class Cancel(msgspec.Struct, tag="cancel", array_like=True):
    id: int


class Shutdown(msgspec.Struct, tag="shutdown", array_like=True):
    pass


class Ping(msgspec.Struct, tag="ping", array_like=True):
    """Ask for a `Pong` with the worker's memory figures."""

    seq: int


class ClearCache(msgspec.Struct, tag="clear_cache", array_like=True):
    """Free MLX's buffer cache between two requests (memory pressure policy)."""


Down = Hello | Generate | Cancel | Shutdown | Ping | ClearCache


# ---- rank 0 -> the other ranks of a worker group (over mx.distributed) ---------


class Step(msgspec.Struct, tag="step", array_like=True, kw_only=True):
    """What rank 0's engine does before its next step, for every rank to do the same.

    In this order: clear the prefix cache, submit, cancel, then step (or stop).
    """

    generate: list[Generate] = []
    cancel: list[int] = []
    clear_cache: bool = False
    stop: bool = False


# ---- worker -> orchestrator -------------------------------------------------


class Attached(msgspec.Struct, tag="attached", array_like=True):
    """The worker mapped the ring: the orchestrator may unlink its name now."""

    pid: int


class Capabilities(msgspec.Struct, kw_only=True, omit_defaults=True):
    """What the loaded model's tokenizer and chat template support, found by the worker and sent in
    `Ready`, so the orchestrator refuses what the model cannot do before a request is sent."""

    chat_template: bool = False
    #: How the reply marks its reasoning: "" (it does not), "think" (<think> tags, mlx-lm's
    #: `has_thinking`), "harmony" (gpt-oss's analysis channel).
    thinking: str = ""
    #: The chat template takes `enable_thinking`, so thinking can be turned off.
    thinking_switch: bool = False
    #: How tool calls are written and parsed: "" (no parser: tools are refused), the name of
    #: mlx-lm's tool parser (``json_tools``, ...), or "harmony".
    tools: str = ""


class Ready(msgspec.Struct, tag="ready", array_like=True, kw_only=True):
    protocol: int
    pid: int
    model: str
    context_length: int
    vocab_size: int
    load_s: float
    warmup_s: float
    mlx_version: str
    mlx_lm_version: str
    device: str
    capabilities: Capabilities | None = None


class Started(msgspec.Struct, tag="started", array_like=True):
    """The worker began this request (prefill): if it dies now, the request is not replayed."""

    id: int


class Tokens(msgspec.Struct, tag="t", array_like=True):
    """Tokens produced since the last frame for one request, with their text.

    In a chat reply `text` is the answer only: its reasoning and its tool calls
    (parsed as each one ends) come apart, in `reasoning` and `tool_calls`.
    """

    id: int
    token_ids: list[int]
    text: str
    reasoning: str = ""
    tool_calls: list[ToolCall] = []


class Done(msgspec.Struct, tag="done", array_like=True, kw_only=True):
    id: int
    stats: Stats
    text: str = ""
    token_ids: list[int] = []
    reasoning: str = ""
    tool_calls: list[ToolCall] = []


class Failed(msgspec.Struct, tag="err", array_like=True, kw_only=True):
    """One request failed; the worker lives on."""

    id: int
    error_type: str
    message: str
    traceback: str = ""


class Fatal(msgspec.Struct, tag="fatal", array_like=True, kw_only=True):
    """The worker cannot go on (bad handshake, model failed to load)."""

    error_type: str
    message: str
    traceback: str = ""


class MemoryReport(msgspec.Struct, kw_only=True):
    """A worker's memory, bytes: MLX's allocator counters and the process RSS."""

    active_bytes: int = 0
    peak_bytes: int = 0
    cache_bytes: int = 0
    rss_bytes: int = 0


class EngineReport(msgspec.Struct, kw_only=True):
    """A worker's engine at one instant: its queue, its batch and its prefix cache."""

    queued: int = 0
    batch_size: int = 0
    prompt_cache_bytes: int = 0
    prompt_cache_entries: int = 0
    prompt_cache_hits: int = 0
    prompt_cache_misses: int = 0
    cached_tokens_total: int = 0


class Pong(msgspec.Struct, tag="pong", array_like=True, kw_only=True):
    seq: int
    memory: MemoryReport
    engine: EngineReport | None = None


Up = Attached | Ready | Started | Tokens | Done | Failed | Fatal | Pong


class Codec:
    """One encoder and one decoder for one channel end."""

    def __init__(self, incoming: object) -> None:
        self._enc = msgspec.msgpack.Encoder()
        self._dec = msgspec.msgpack.Decoder(incoming)  # type: ignore[call-overload]

    def encode(self, msg: msgspec.Struct) -> bytes:
        return self._enc.encode(msg)

    def decode(self, frame: bytes | memoryview) -> object:
        """Decode one frame; raises `msgspec.DecodeError` (incl. ValidationError) on garbage."""
        return self._dec.decode(frame)


def worker_codec() -> Codec:
    """The worker's end: decodes `Down`, encodes `Up`."""
    return Codec(Down)


def step_codec() -> Codec:
    """A worker group's ranks: rank 0 encodes `Step`s, the others decode them."""
    return Codec(Step)


def orchestrator_codec() -> Codec:
    """The orchestrator's end: decodes `Up`, encodes `Down`."""
    return Codec(Up)
