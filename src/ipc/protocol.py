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

#: 14: EngineOptions.prompt_concurrency may be None (auto).
#: 13: EngineOptions.burst_ms.
#: 12: EngineOptions.prompt_cache_warm_bytes, DiskCacheReport.warmed (disk entries read back while idle);
#: GroupRank.wake.
#: 11: DiskCacheReport.evicted_writes and lost (prefixes written, or not, as they left memory).
#: 10: EngineOptions.decode_concurrency may be None (auto), Ready.decode_concurrency,
#: EngineReport.prefill_calls and prefill_batched.
#: 9: ChatMessage.images (a message's images, encoded bytes), Capabilities.vision;
#: 8: Generate.resume, Stats.resumes, DiskCacheReport.skipped.
#: 7: EngineOptions.prefill_budget_ms, Stats.prefill_ms, prefill_wait_ms and longest_gap_ms;
#: 6: InvalidField's field in Failed (kind, field); EngineOptions.prompt_cache_dir and
#: prompt_cache_disk_bytes; EngineReport.disk_cache.
#: 5: Hello.prompt_cache_share, EngineReport.prompt_cache_cap_bytes; 4: EngineOptions.gather_ms;
#: 3: EngineOptions.prompt_cache_bytes may be None
PROTOCOL_VERSION = 14

#: Largest repetition-penalty window: the penalty gathers this many past tokens
#: on every step, so its cost grows with the window.
MAX_REPETITION_CONTEXT = 1024
DEFAULT_MAX_TOKENS = 256
DEFAULT_REPETITION_CONTEXT = 20
#: Most alternatives returned per token (OpenAI's and Ollama's `top_logprobs` limit).
MAX_TOP_LOGPROBS = 20
#: Most choices for one prompt (OpenAI's `n`): each is a sequence of the worker's batch.
MAX_CHOICES = 16

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
    #: The message's images as their files' bytes (PNG, JPEG, GIF, WebP), checked in the orchestrator
    #: by their headers and decoded only in the worker (`worker/vision.py`); rendered before its text.
    images: list[bytes] = []


#: Ollama's `think` levels, the chat templates' `reasoning_effort` (gpt-oss).
REASONING_EFFORTS = ("low", "medium", "high")
TOOL_CHOICES = ("auto", "required", "function")
#: Tool formats whose calls a grammar can force (tool choice "required" or a function): mlx-lm's
#: ``json_tools`` parser's ``<tool_call>`` JSON, gpt-oss's harmony and Llama 3.x's bare JSON
#: (src/worker/forced.py).
FORCED_TOOL_FORMATS = ("json_tools", "harmony", "llama3_json")


class ChatOptions(msgspec.Struct, kw_only=True, omit_defaults=True):
    """How a chat is templated and its reply split: tools, tool choice, thinking.

    Validated in the orchestrator; the worker renders `tools`, `enable_thinking`
    and `reasoning_effort` through the model's chat template and parses the
    reply's tool calls only when `tools` is not empty. Tool choice "none" never
    reaches the worker: its tools are dropped at the edge.
    """

    #: OpenAI-shaped function tools: {"type": "function", "function": {"name", "description", "parameters"}}.
    tools: list[dict[str, Any]] = []
    #: "auto", "required" (a call to any of the tools), or "function" (a call to `tool_name`); the
    #: last two are enforced in the worker by a grammar (src/worker/forced.py).
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

    @property
    def forces_call(self) -> bool:
        """Whether the reply must be a tool call (tool choice "required" or a named function)."""
        return self.tool_choice != "auto" and bool(self.tools)


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
    #: Log-probabilities: None (none), 0 (each generated token's), k (and the k most likely tokens at
    #: each position). Sent in `DetailedTokens` frames; requests without them pay nothing.
    logprobs: int | None = None
    #: Choices for the prompt: n sequences decoded together from one prefill (OpenAI's `n`).
    n: int = 1
    #: The context for this request, prompt and reply, in tokens (Ollama's num_ctx); None: the model's
    #: default (`EngineOptions.context_length`, else its own context).
    num_ctx: int | None = None

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
        if self.logprobs is not None:
            _check(0 <= self.logprobs <= MAX_TOP_LOGPROBS, "logprobs", f"must be in [0, {MAX_TOP_LOGPROBS}]",
                   self.logprobs)
        _check(1 <= self.n <= MAX_CHOICES, "n", f"must be in [1, {MAX_CHOICES}]", self.n)
        if self.num_ctx is not None:
            _check(self.num_ctx >= 2, "num_ctx", "must be >= 2", self.num_ctx)
        return self


    def check_vocabulary(self, vocab_size: int) -> None:
        """Raise `InvalidField` for a top_k or stop token id beyond a model of `vocab_size` ids (0: unknown,
        unchecked). mlx-lm's top-k sampler takes k in (0, vocab_size)."""
        if not vocab_size:
            return
        if self.top_k >= vocab_size:
            raise InvalidField("top_k", f"={self.top_k}: must be < the model's vocabulary size, {vocab_size} "
                                        "(0 disables)")
        bad = [t for t in self.stop_token_ids if t >= vocab_size]
        if bad:
            raise InvalidField("stop_token_ids", f": ids outside the model's vocabulary [0, {vocab_size}): "
                                                 f"{bad[:5]}")


class InvalidField(ValueError):
    """A request's field has a bad value: the field travels as data (`field`), never inside a string to
    parse. The message reads ``invalid <field><detail>``; an API renames the field with `named`.

    `code` says what kind of refusal it is where an API reports one (``unsupported`` for a capability
    the model lacks, with `capability` naming it).
    """

    def __init__(self, field: str, detail: str, *, code: str | None = None, capability: str = "") -> None:
        super().__init__(f"invalid {field}{detail}")
        self.field = field
        self.detail = detail
        self.code = code
        self.capability = capability

    def named(self, name: str) -> str:
        """The message with the field called `name` (the API's own spelling of it)."""
        return f"invalid {name}{self.detail}"


def _check(ok: bool, field: str, rule: str, value: object) -> None:
    if not ok:
        raise InvalidField(field, f"={value!r}: {rule}")


#: The decode batch a worker group takes when none is given: its ranks must agree on it, and each
#: measures its own memory.
DEFAULT_DECODE_CONCURRENCY = 16
#: The most sequences auto (`EngineOptions.decode_concurrency` None) decodes together: mlx_lm.server's
#: --decode-concurrency default; fewer where the memory left after the weights holds fewer whole contexts.
MAX_AUTO_DECODE_CONCURRENCY = 32
#: Most prompts prefilled together where auto (`EngineOptions.prompt_concurrency` None) does not follow the
#: decode batch: mlx_lm.server's --prompt-concurrency default.
DEFAULT_PROMPT_CONCURRENCY = 8
DEFAULT_PREFILL_STEP_SIZE = 2048
#: Prefill time between two decode steps: a decoding stream's longest gap is about this plus one
#: decode step (the issue's goal on a GPU: 0.25 s), wherever the model runs.
DEFAULT_PREFILL_BUDGET_MS = 200
MAX_PREFILL_BUDGET_MS = 60_000
#: The prefix cache's byte cap when none is given ("auto"): this share of the memory MLX may use
#: (`worker.limits.auto_prompt_cache_bytes`), within these bounds. 1 GiB is a 16 GB laptop's share
#: (~18k tokens of a 7B model's KV); an H200 machine's is 16-18 GiB, room for 8 agents' 4k-token chats
#: on an 8B. The workers of one orchestrator that leave the cap on auto split it (`Hello.prompt_cache_share`);
#: separate servers do not know of each other (four 8B servers, an eighth each, ran an H200 out of memory:
#: docs/benchmarks/gpu-h200-families.md#fourth-session-the-gather-ab-and-qwen35-27b).
AUTO_PROMPT_CACHE_SHARE = 8
MIN_AUTO_PROMPT_CACHE_BYTES = 1 << 30
MAX_AUTO_PROMPT_CACHE_BYTES = 64 << 30
#: Padded tokens per embedding pass: 32 inputs of 512 tokens (a 0.6B model's activations: under 1 GB).
DEFAULT_EMBED_BATCH_TOKENS = 16384
#: The disk tier's byte budget when none is given, per model and option set (its directory): about 120k
#: tokens of an 8B model's KV (a few agents' sessions), a small share of a laptop's SSD.
DEFAULT_PROMPT_CACHE_DISK_BYTES = 16 << 30
#: An H200's agents sent their next turns 5-25 ms apart after their replies ended on one step
#: (docs/benchmarks/gpu-h200-families.md#reading-it-2): the window covers that with room.
DEFAULT_GATHER_MS = 50
MAX_GATHER_MS = 1000
#: A burst of requests reaches an idle worker over a few ms (its clients' threads, the HTTP server's
#: parsing): admitted as they come, the first is prefilled alone and the rest in uneven batches, whose
#: new shapes MLX's CUDA backend builds graphs for (docs/benchmarks/gpu-h200-s11.md). A lone
#: request pays this once. The auto value on CUDA; elsewhere auto is 0 (no graphs to build; on 2 CPU
#: cores a 32-stream burst measured slower held).
DEFAULT_BURST_MS = 2
MAX_BURST_MS = 100
#: mlx_lm.server's defaults for the same options.
DEFAULT_NUM_DRAFT_TOKENS = 3
DEFAULT_KV_GROUP_SIZE = 64
DEFAULT_QUANTIZED_KV_START = 5000
#: KV-cache bits and group sizes MLX's affine quantization takes (``mx.quantize``; 7 is refused; 1 works
#: but leaves nothing of the cache, so it is left out).
KV_BITS = (2, 3, 4, 5, 6, 8)
KV_GROUP_SIZES = (32, 64, 128)
#: The most draft tokens per speculative step: each one costs a draft forward pass.
MAX_NUM_DRAFT_TOKENS = 32
#: `EngineOptions.draft_policy`'s values.
DRAFT_POLICIES = ("adaptive", "always")
#: A rotating cache keeps its first 4 tokens (mlx-lm's `make_prompt_cache`): a smaller one holds nothing else.
MIN_MAX_KV_SIZE = 8


class EngineOptions(msgspec.Struct, kw_only=True):
    """How a worker runs its model: batching and caching, and the per-model options (draft model,
    KV cache, adapter, chat template, context, default sampling); names follow `mlx_lm.server`'s and
    `mlx_lm.generate`'s flags.

    One record per model, parsed at the edge (`orchestrator.options.prepare`: paths resolved, the
    chat template read from its file, the draft checked against the target) and sent in `Hello`.
    """

    #: Most sequences decoded together (mlx_lm.server --decode-concurrency). None (auto): as many as
    #: the memory left after the weights and the prefix cache holds, each at its whole context (KV bytes
    #: per token x context_length), within [prompt_concurrency, `MAX_AUTO_DECODE_CONCURRENCY`];
    #: `DEFAULT_DECODE_CONCURRENCY` in a worker group (docs/engine.md, the decode batch).
    decode_concurrency: int | None = None
    #: Most prompts prefilled together (mlx_lm.server --prompt-concurrency). None (auto): with the
    #: prefill scheduler (a budget, not a worker group) as many as the decode batch, whose budget
    #: already bounds a call's tokens, so a burst of short prompts goes in fewer calls; else
    #: `DEFAULT_PROMPT_CONCURRENCY` (docs/engine.md, the prefill scheduler).
    prompt_concurrency: int | None = None
    #: Prompt tokens per prefill step (mlx_lm.server --prefill-step-size).
    prefill_step_size: int = DEFAULT_PREFILL_STEP_SIZE
    #: Byte cap of the prefix cache; 0 turns prefix reuse off (mlx_lm.server --prompt-cache-bytes).
    #: None: an eighth of the memory MLX may use on the worker's machine, 1-64 GiB.
    prompt_cache_bytes: int | None = None
    #: A lone request decodes outside the batch, as `mlx_lm.generate_step` does (docs/engine.md).
    single_stream: bool = True
    #: Speculative decoding: the draft model a lone sequence drafts with (a directory, HF id or
    #: ``synthetic:`` reference; --draft-model), and how many tokens it drafts per step.
    draft_model: str | None = None
    num_draft_tokens: int = DEFAULT_NUM_DRAFT_TOKENS
    #: KV-cache quantization (--kv-bits, --kv-group-size, --quantized-kv-start): None keeps full precision.
    kv_bits: int | None = None
    kv_group_size: int = DEFAULT_KV_GROUP_SIZE
    quantized_kv_start: int = DEFAULT_QUANTIZED_KV_START
    #: A bounded, rotating KV cache of this many tokens per sequence (--max-kv-size); None: unbounded.
    max_kv_size: int | None = None
    #: LoRA adapter directory: adapter_config.json and adapters.safetensors (--adapter-path).
    adapter_path: str | None = None
    #: A chat template (Jinja text) in place of the tokenizer's (--chat-template: the text or a file).
    chat_template: str | None = None
    #: Let the tokenizer run code shipped with the model (--trust-remote-code).
    trust_remote_code: bool = False
    #: The default context, prompt and reply, in tokens (Ollama's num_ctx); None: the model's own.
    context_length: int | None = None
    #: A KV-cache file made by ``mlxrt cache-prompt``, loaded into the prefix cache at start.
    prompt_cache_file: str | None = None
    #: Default sampling, for requests that leave it out (--temp, --top-p, --top-k, --min-p,
    #: --max-tokens); None: the API's own default.
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    max_tokens: int | None = None
    #: Padded tokens per forward pass of an embedding model's inputs (docs/engine.md#embedding-models).
    embed_batch_tokens: int = DEFAULT_EMBED_BATCH_TOKENS
    #: When a lone sequence with a draft model drafts: "adaptive" (while drafting is measured faster than
    #: plain decoding, docs/engine.md) or "always" (as mlx-lm does).
    draft_policy: Literal["adaptive", "always"] = "adaptive"
    #: After several replies end on one step, how long (ms) the worker holds new requests back to
    #: prefill the follow-ups together (docs/engine.md, gathering follow-ups); 0: admit at once.
    gather_ms: int = DEFAULT_GATHER_MS
    #: On an idle worker, how long (ms) no new request must have come before those queued are admitted,
    #: so that a burst is prefilled together (at most the larger of `gather_ms` and this from the first);
    #: 0: at once;
    #: None (auto): `DEFAULT_BURST_MS` on MLX's CUDA backend, else 0.
    burst_ms: int | None = None
    #: The prefix cache's disk tier (docs/engine.md, durable prefixes): its directory (None: no disk
    #: tier) and byte budget, shared by every worker of the model and the next process.
    prompt_cache_dir: str | None = None
    prompt_cache_disk_bytes: int = DEFAULT_PROMPT_CACHE_DISK_BYTES
    #: Prefill time between two decode steps, ms: a long prompt is prefilled in chunks sized to it
    #: on this machine (docs/engine.md, the prefill scheduler); 0: mlx-lm's own prefill, as before.
    #: None (auto): `DEFAULT_PREFILL_BUDGET_MS`. On MLX's CUDA backend, where each new chunk shape costs
    #: an attention graph's build, chunks keep to a grid (`prefill.ChunkSizer`); sized with the build's
    #: cost, agents' turns measured as fast as with 0 on an H200, and a long prompt among streams no
    #: longer stops them (docs/benchmarks/gpu-h200-s11.md).
    prefill_budget_ms: int | None = None
    #: Bytes of the disk tier's most recently used entries a started worker reads back into its memory
    #: tier while idle (docs/engine.md, durable prefixes); None (auto): half the memory tier's cap;
    #: 0: none.
    prompt_cache_warm_bytes: int | None = None

    def validate(self) -> EngineOptions:
        """Raise `ValueError` naming the first bad field; return self."""
        _check(self.decode_concurrency is None or self.decode_concurrency >= 1, "decode_concurrency",
               "must be >= 1", self.decode_concurrency)
        _check(self.prompt_concurrency is None or self.prompt_concurrency >= 1, "prompt_concurrency",
               "must be >= 1", self.prompt_concurrency)
        _check(self.prefill_step_size >= 16, "prefill_step_size", "must be >= 16", self.prefill_step_size)
        _check(self.prompt_cache_bytes is None or self.prompt_cache_bytes >= 0, "prompt_cache_bytes",
               "must be >= 0", self.prompt_cache_bytes)
        _check(self.prompt_cache_disk_bytes >= 0, "prompt_cache_disk_bytes", "must be >= 0",
               self.prompt_cache_disk_bytes)
        _check(self.prompt_cache_warm_bytes is None or self.prompt_cache_warm_bytes >= 0,
               "prompt_cache_warm_bytes", "must be >= 0", self.prompt_cache_warm_bytes)
        _check(self.prefill_budget_ms is None or 0 <= self.prefill_budget_ms <= MAX_PREFILL_BUDGET_MS,
               "prefill_budget_ms",
               f"must be in [0, {MAX_PREFILL_BUDGET_MS}]", self.prefill_budget_ms)
        _check(self.embed_batch_tokens >= 16, "embed_batch_tokens", "must be >= 16", self.embed_batch_tokens)
        _check(0 <= self.gather_ms <= MAX_GATHER_MS, "gather_ms", f"must be in [0, {MAX_GATHER_MS}]",
               self.gather_ms)
        _check(self.burst_ms is None or 0 <= self.burst_ms <= MAX_BURST_MS, "burst_ms",
               f"must be in [0, {MAX_BURST_MS}]", self.burst_ms)
        _check(1 <= self.num_draft_tokens <= MAX_NUM_DRAFT_TOKENS, "num_draft_tokens",
               f"must be in [1, {MAX_NUM_DRAFT_TOKENS}]", self.num_draft_tokens)
        _check(self.draft_policy in DRAFT_POLICIES, "draft_policy", f"must be one of {DRAFT_POLICIES}",
               self.draft_policy)
        if self.kv_bits is not None:
            _check(self.kv_bits in KV_BITS, "kv_bits", f"must be one of {KV_BITS} (MLX's quantization)",
                   self.kv_bits)
            _check(self.max_kv_size is None, "kv_bits", "cannot quantize a rotating cache (max_kv_size)",
                   self.kv_bits)
            _check(self.single_stream, "kv_bits",
                   "quantizes the single-stream fast path: needs single_stream", self.kv_bits)
        _check(self.kv_group_size in KV_GROUP_SIZES, "kv_group_size", f"must be one of {KV_GROUP_SIZES}",
               self.kv_group_size)
        _check(self.quantized_kv_start >= 0, "quantized_kv_start", "must be >= 0", self.quantized_kv_start)
        if self.max_kv_size is not None:
            _check(self.max_kv_size >= MIN_MAX_KV_SIZE, "max_kv_size", f"must be >= {MIN_MAX_KV_SIZE}",
                   self.max_kv_size)
        if self.draft_model is not None:
            _check(bool(self.draft_model), "draft_model", "must not be empty", self.draft_model)
            _check(self.max_kv_size is None, "draft_model",
                   "speculative decoding rewinds the cache, which a rotating one (max_kv_size) cannot",
                   self.draft_model)
            _check(self.single_stream, "draft_model", "drafts on the single-stream fast path: needs "
                   "single_stream", self.draft_model)
        if self.context_length is not None:
            _check(self.context_length >= 2, "context_length", "must be >= 2", self.context_length)
        if self.prompt_cache_file is not None:
            _check(self.prompt_cache_bytes != 0, "prompt_cache_file",
                   "loads into the prefix cache: needs prompt_cache_bytes > 0", self.prompt_cache_file)
        self._sampling().validate()
        return self

    def _sampling(self) -> SamplingParams:
        """The default sampling as a `SamplingParams`, only to check its values."""
        return SamplingParams(**self.sampling_defaults())

    def sampling_defaults(self) -> dict[str, Any]:
        """The default sampling keywords the options set (those left None are left out)."""
        names = ("temperature", "top_p", "top_k", "min_p", "max_tokens")
        return {k: getattr(self, k) for k in names if getattr(self, k) is not None}


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
    #: The stop string that ended the reply ("" when none did), as Anthropic's `stop_sequence` reports it.
    stop_sequence: str = ""
    #: Speculative decoding: tokens the draft model proposed for this request, and those the target
    #: accepted (0 and 0 when it decoded without a draft, e.g. in a batch).
    draft_tokens: int = 0
    draft_accepted: int = 0
    #: Time spent prefilling this prompt's own chunks, and waiting while admitted behind other
    #: prompts' prefill chunks, ms (docs/engine.md, the prefill scheduler).
    prefill_ms: float = 0.0
    prefill_wait_ms: float = 0.0
    #: The longest time between two consecutive tokens of the reply, ms (a decode stall's length).
    longest_gap_ms: float = 0.0
    #: How many times the request went on after its worker died (`Generate.resume`).
    resumes: int = 0

    @property
    def acceptance_rate(self) -> float:
        """Accepted draft tokens per drafted token (0.0 when nothing was drafted)."""
        return self.draft_accepted / self.draft_tokens if self.draft_tokens else 0.0


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
    #: The group's wake-up semaphore (`ipc/wake.py`), where every rank runs on this machine: rank 0
    #: posts it as it shares a step, the others wait on it instead of polling in MLX's collective.
    wake: str | None = None


class RingSpec(msgspec.Struct, frozen=True):
    """What a worker needs to attach to a ring; travels inside the Hello message."""

    name: str
    capacity: int
    nonce: int
    #: The doorbell pipe's write end, as numbered in the worker (passed with pass_fds).
    doorbell_fd: int


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
    #: How many of the orchestrator's workers share the auto prompt cache cap (those whose model leaves
    #: `EngineOptions.prompt_cache_bytes` at None): each takes this fraction of it.
    prompt_cache_share: int = 1


class Resume(msgspec.Struct, array_like=True, kw_only=True):
    """How far a request got on a worker that died, as the supervisor saw it: the new worker
    goes on from there (docs/supervision.md, streams that outlive their worker)."""

    #: Each choice's tokens the caller received, by choice index.
    tokens: list[list[int]]
    #: The choices that had ended (n > 1): not generated again.
    ended: list[int] = []
    #: Which resume this is: 1 for the first.
    count: int = 1


class Generate(msgspec.Struct, tag="gen", array_like=True, kw_only=True):
    id: int
    params: SamplingParams
    prompt: str | None = None
    prompt_ids: list[int] | None = None
    messages: list[ChatMessage] | None = None
    chat: ChatOptions | None = None
    #: Set when the worker serving this request died mid-way and it goes on here.
    resume: Resume | None = None


class Embed(msgspec.Struct, tag="embed", array_like=True, kw_only=True):
    """Embed each input, as token ids (tokenized in the orchestrator); answered by one `Embeddings`."""

    id: int
    inputs: list[list[int]]
    #: Keep each vector's first `dimensions` components, L2-normalised again (Matryoshka);
    #: 0: the model's whole vector.
    dimensions: int = 0


class Cancel(msgspec.Struct, tag="cancel", array_like=True):
    id: int


class Shutdown(msgspec.Struct, tag="shutdown", array_like=True):
    pass


class Ping(msgspec.Struct, tag="ping", array_like=True):
    """Ask for a `Pong` with the worker's memory figures."""

    seq: int


class ClearCache(msgspec.Struct, tag="clear_cache", array_like=True):
    """Free MLX's buffer cache between two requests (memory pressure policy)."""


Down = Hello | Generate | Cancel | Shutdown | Ping | ClearCache | Embed


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
    #: mlx-lm's tool parser (``json_tools``, ...), "harmony" or "llama3_json" (src/worker/reply.py).
    tools: str = ""
    #: An embedding model (src/worker/embed.py) and how it pools its last hidden states: "last",
    #: "mean" or "cls"; "" for a generative model. Either kind refuses the other's requests.
    embedding: str = ""
    #: The length of an embedding model's vectors (its hidden size); 0 for a generative model.
    embedding_dim: int = 0
    #: A vision-language model (mlx-vlm, `worker/vision.py`): it takes images in chat messages.
    vision: bool = False


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
    #: The local directory the model was loaded from (the orchestrator reads an embedding
    #: model's tokenizer from it); "" from older workers.
    path: str = ""
    #: The most sequences the worker decodes together (`EngineOptions.decode_concurrency`, auto
    #: resolved); 0 from older workers and embedding workers.
    decode_concurrency: int = 0


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


class TopLogprob(msgspec.Struct, array_like=True):
    """A candidate token at one position: its id, its log-probability and its bytes."""

    id: int
    logprob: float
    token_bytes: bytes

    @property
    def token(self) -> str:
        """The token as text; bytes that are not whole UTF-8 written ``\\xNN``, as OpenAI does."""
        return self.token_bytes.decode("utf-8", "backslashreplace")


class TokenLogprob(msgspec.Struct, array_like=True):
    """A generated token's log-probability (the log-softmax of the logits it was sampled from, after
    the logits processors, before temperature and top-p/top-k), and the most likely tokens there,
    most likely first (`SamplingParams.logprobs` of them)."""

    id: int
    logprob: float
    token_bytes: bytes
    top: list[TopLogprob] = []

    @property
    def token(self) -> str:
        return self.token_bytes.decode("utf-8", "backslashreplace")


class DetailedTokens(Tokens, tag="td", array_like=True):
    """`Tokens` of a request that asked for log-probabilities or n > 1: with the choice's `index`
    and each token's `TokenLogprob` (None: not asked). Other requests' frames stay plain `Tokens`."""

    index: int = 0
    logprobs: list[TokenLogprob] | None = None


class Done(msgspec.Struct, tag="done", array_like=True, kw_only=True):
    """A request (or, with n > 1, one of its choices) ended; `final` on the last of them."""

    id: int
    stats: Stats
    text: str = ""
    token_ids: list[int] = []
    reasoning: str = ""
    tool_calls: list[ToolCall] = []
    #: With n > 1: the choice that ended, and whether every choice has.
    index: int = 0
    final: bool = True


class Embeddings(msgspec.Struct, tag="emb", array_like=True, kw_only=True):
    """An `Embed` request's vectors: ``len(inputs)`` rows of `dim` little-endian float32, row after row.

    `stats.prompt_tokens` counts the inputs' tokens; `stats.mean_batch_size` the mean number of
    inputs per forward pass that carried this request's.
    """

    id: int
    dim: int
    #: Decoded as a bytearray, so numpy can take it as a writable array without a copy.
    data: bytearray
    stats: Stats


#: `Failed.kind`: the request's own fault (a bad field, a template that refuses it), a prompt beyond the
#: context, or anything else (a bug: the request was fine).
FAILURE_KINDS = ("invalid", "too_long", "internal")


class Failed(msgspec.Struct, tag="err", array_like=True, kw_only=True):
    """One request failed; the worker lives on."""

    id: int
    error_type: str
    message: str
    traceback: str = ""
    #: One of `FAILURE_KINDS`, as the worker classed the exception by its type.
    kind: str = "internal"
    #: The request field at fault (``top_k``, ``messages``, ``prompt``), where one is.
    field: str | None = None


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


class DiskCacheReport(msgspec.Struct, kw_only=True):
    """The prefix cache's disk tier as one worker sees it (shared by the model's workers): bytes on disk,
    its budget, entries, prefixes this worker loaded from it, entries it wrote, and entries it removed
    as corrupt or foreign."""

    nbytes: int = 0
    cap_bytes: int = 0
    entries: int = 0
    hits: int = 0
    writes: int = 0
    removed: int = 0
    #: Write-throughs refused or withdrawn while the writer was behind (those prefixes stayed in memory,
    #: to be written when they leave it).
    skipped: int = 0
    #: Entries written as they left the memory tier (the writer had been behind at their insert).
    evicted_writes: int = 0
    #: Prefixes that left memory while the write queue was full of others that had: on neither tier.
    lost: int = 0
    #: Entries this worker read back into its memory tier while idle after it started (warming).
    warmed: int = 0


class EngineReport(msgspec.Struct, kw_only=True):
    """A worker's engine at one instant: its queue, its batch and its prefix cache."""

    queued: int = 0
    batch_size: int = 0
    prompt_cache_bytes: int = 0
    #: The prefix cache's byte cap in effect (the option's, or auto's share); 0: off, or no prefix cache.
    prompt_cache_cap_bytes: int = 0
    prompt_cache_entries: int = 0
    prompt_cache_hits: int = 0
    prompt_cache_misses: int = 0
    cached_tokens_total: int = 0
    #: The prefix cache's disk tier; None without one.
    disk_cache: DiskCacheReport | None = None
    #: The prefill scheduler's model calls, and the prompts prefilled in calls that carried several
    #: (a burst's short prompts, prefilled together).
    prefill_calls: int = 0
    prefill_batched: int = 0


class Pong(msgspec.Struct, tag="pong", array_like=True, kw_only=True):
    seq: int
    memory: MemoryReport
    engine: EngineReport | None = None


Up = Attached | Ready | Started | Tokens | DetailedTokens | Done | Failed | Fatal | Pong | Embeddings


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
