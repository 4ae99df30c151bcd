"""The worker's inner loop: load a model with mlx-lm and generate many requests at once, in-process.

`Engine` knows nothing of processes or transports. The worker process
(`mlxrt.worker.main`) runs one behind a pipe or a ring; tests and benchmarks
run one in-process, which is also the native baseline.

::

    submit(req) -> tokenize, check -> waiting -> admit (room in the batch) -> prefill.py  -> BatchGenerator
                   (fails alone)                  prefix cache: the longest      step(): chunks   then one
    cancel(id) ------------------------------>    cached prefix is served,       for ~the budget, decode step
                                                  the rest prefilled in segments shortest first   for each seq
                                                                                       |
                         listener.started / token / done / failed  <-------------------+

Continuous batching is mlx-lm's `BatchGenerator`: a request joins the running
batch at the next step and leaves it as soon as it finishes or is cancelled.
Sampling, logits processors, stop ids and the detokenizer are mlx-lm's, per
sequence; `sequence.py` holds the little that is written here by hand, and
`prompt.py` (`PromptBuilder`) turns a request into prompt ids within its context. A
request that fails a check fails alone, before it reaches the batch; a
failure inside a batch step fails the requests in that batch and the batch
is rebuilt, with MLX's random state reseeded.

A lone request (nothing running, nothing else waiting) skips the batch: it is
prefilled and decoded by `Solo` (`solo.py`), as `mlx_lm.generate_step` does,
one chunk or one token per `step()`, and handed over to the batch (mid-prompt:
to the prefill scheduler), exactly where it is, when a second request arrives
(`_hand_over`).

Prefill (`prefill.py`): an admitted prompt is prefilled outside the batch on a
cache of its own, in chunks sized to `prefill_budget_ms` on this machine,
shortest remaining prompt first, and joins the batch at its last token; each
`step()` runs about the budget of chunks, then one decode step for every
running sequence (and a second where a prompt joined the batch in the first:
its first token then comes in the step that ends its prefill).

Prefix reuse: a finished sequence's cache is kept in `PrefixCache` under its
tokens. Where every layer's cache can be trimmed (`KVCache`), a later prompt
reuses the longest shared prefix of any kept sequence. Where some cannot
(sliding-window `RotatingKVCache`, linear-attention `ArraysCache`), the
prompt is inserted in segments (mlx-lm's `insert_segments`) and a checkpoint
is kept at each boundary a later request can share: the end of the chat's
system prompt and the end of the prompt; a later turn of the same chat
starts from the latter.

A system prompt is prefilled once, however many chats that share it arrive
together: every chat is inserted in segments split at the end of its system
prompt, the first one to need an uncached system prompt leads, and the
others that need the same one wait in the queue until the leader's
checkpoint lands, then start from it (`_leaders`).

In a worker group (`group.py`) every rank runs its own `Engine` over its shard of
the model, fed the same calls in the same order by rank 0, so they step in
lockstep: the engine takes the group for loading (mlx-lm's `sharded_load`),
for its prefix cache's byte count, and to stop the whole group when a step
fails (a rank whose step failed can no longer be trusted to agree with the others).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterator

import mlx.core as mx
import structlog
from mlx_lm.generate import BatchGenerator, StopSequences
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.utils import load

from ..ipc.protocol import (
    DEFAULT_DECODE_CONCURRENCY,
    DEFAULT_PREFILL_BUDGET_MS,
    DEFAULT_PROMPT_CONCURRENCY,
    Embed,
    EngineOptions,
    EngineReport,
    Generate,
    Grammar,
    MemoryReport,
    SamplingParams,
)
from .choices import ChoiceGroup
from .disk_cache import DiskTier, flush_timeout, model_identity
from .draft_policy import DraftPolicy
from .forced import tool_call_grammar
from .grammar import GrammarCache, StepMasks
from .kvcache import KVQuant, always_trimmable, check_quantizable, full_precision, make_cache
from .limits import (
    auto_decode_concurrency,
    auto_prompt_cache_bytes,
    on_cuda,
    out_of_memory,
    prefill_steps,
    prefill_token_cap,
    relieve,
)
from .logprobs import TokenBytes, token_logprobs
from .prefill import ChunkSizer, Prefill, PrefillScheduler, prompt_segments
from .prefix_cache import PrefixCache
from .prompt import DEFAULT_CONTEXT_LENGTH, PromptBuilder, capabilities, check_request, reasoning_open
from .prompt_file import load_prompt_file
from .reply import make_splitter, split_emit
from .sequence import (
    BatchStepError,
    Listener,
    Quiet,
    Sequence,
    TextStream,
    check_sampler,
    make_request_processors,
    make_request_sampler,
    reseed,
)
from .solo import Draft, Solo, warm_decode_graphs

log = structlog.get_logger("mlxrt.worker")

SYNTHETIC_PREFIX = "synthetic:"
WARMUP_PROMPT = "Warm up the kernels."
#: A warm-up prompt between the quantised matmul's 16- and 64-row tiles: its own 32-row kernel,
#: compiled on first use (35 s on an H100 for a 4k-token prompt whose last chunk was 26 tokens).
MID_WARMUP_TOKENS = 24


class ModelKindError(ValueError):
    """A request of the other kind: embeddings from a generative model, or generation from an
    embedding model (`embed.py`)."""


def resolve_model_path(model: str) -> str:
    """Turn ``synthetic:PRESET[:SEED][?noise=X&layers=N&vocab=V&context=C]`` into a made-on-demand directory;
    pass others through."""
    if not model.startswith(SYNTHETIC_PREFIX):
        return model
    from ..synthetic.build import ensure_synthetic
    from ..synthetic.presets import parse_synthetic

    return str(ensure_synthetic(parse_synthetic(model[len(SYNTHETIC_PREFIX) :])))


class Engine(PromptBuilder, PrefillScheduler):
    """One loaded model serving many requests in one batch; every method runs on one thread."""

    def __init__(
        self,
        model: str,
        *,
        cache_limit_bytes: int | None = None,
        options: EngineOptions | None = None,
        group=None,
        prompt_cache_share: int = 1,
    ) -> None:
        """`group`: this process's rank of a worker group (`group.RankGroup`), or None;
        `prompt_cache_share`: how many workers split the auto prompt cache cap (`Hello`'s)."""
        t0 = time.perf_counter()
        if cache_limit_bytes is not None:
            mx.set_cache_limit(cache_limit_bytes)
        self.options = o = (options or EngineOptions()).validate()
        path = resolve_model_path(model)
        self.group = group
        if group is not None:  # sharded by mlx-lm's sharded_load, which takes no adapter, template or draft
            unsupported = [n for n in ("adapter_path", "chat_template", "draft_model", "prompt_cache_file")
                           if getattr(o, n)]
            if unsupported:
                raise ValueError(f"{', '.join(unsupported)}: not supported for a worker group (ranks > 1)")
            self.model, self.tokenizer, config = group.load(path)
        else:
            self.model, self.tokenizer, config = load(
                path, return_config=True, adapter_path=o.adapter_path, trust_remote_code=o.trust_remote_code,
                tokenizer_config={"chat_template": o.chat_template} if o.chat_template is not None else None,
            )
        self.path = path
        text = {**config.get("text_config", {}), **config}  # multimodal configs nest the LM's fields
        #: The model's own context (max_position_embeddings), and the default a request gets.
        self.model_context = int(text.get("max_position_embeddings") or DEFAULT_CONTEXT_LENGTH)
        self.context_length = self._default_context(o.context_length)
        self.vocab_size = int(text.get("vocab_size") or 0)
        self.trimmable = always_trimmable(make_cache(self.model, o.max_kv_size))
        self.capabilities = capabilities(self.tokenizer)
        if o.chat_template is not None:
            self._check_template()
        #: KV-cache quantization of the fast path (kvcache.py), and the draft model it drafts with.
        self.kv = None if o.kv_bits is None else KVQuant(o.kv_bits, o.kv_group_size, o.quantized_kv_start)
        if self.kv is not None:
            check_quantizable(self.model, self.kv)
        self.draft = None if o.draft_model is None else self._load_draft(o.draft_model, o.num_draft_tokens,
                                                                         o.draft_policy)
        #: The prefix cache's byte cap: the options', or this worker's share of the machine's memory.
        self.prompt_cache_bytes = (auto_prompt_cache_bytes(prompt_cache_share) if o.prompt_cache_bytes is None
                                   else o.prompt_cache_bytes)
        self._disk = self._disk_tier()
        self.prefix_cache = self._new_prefix_cache()
        #: Reading the disk tier's newest entries back into the memory tier while idle (`warm_step`,
        #: started by `warmup`); None when there is nothing (more) to read.
        self._warm: Iterator[None] | None = None
        #: A prompt's cache loaded from `prompt_cache_file`: its tokens and its cache, kept to seed
        #: the prefix cache again whenever it is emptied.
        self._pinned = None if o.prompt_cache_file is None else load_prompt_file(self, o.prompt_cache_file)
        self._seed_prefix_cache()
        #: Most sequences decoded together: the options', or what the memory left holds (`limits`); a
        #: worker group's, whose ranks must agree on it, the default.
        self.decode_concurrency = o.decode_concurrency or DEFAULT_DECODE_CONCURRENCY
        if o.decode_concurrency is None and group is None:
            self.decode_concurrency = auto_decode_concurrency(
                self.model, make_cache(self.model, o.max_kv_size), self.context_length,
                share=prompt_cache_share, reserved_bytes=self.prompt_cache_bytes,
                floor=o.prompt_concurrency or DEFAULT_PROMPT_CONCURRENCY)
        self._eos = tuple(self.tokenizer.eos_token_ids)
        self.grammars = GrammarCache(self.tokenizer, self.vocab_size, self._eos)
        self.masks = StepMasks()
        self.token_bytes = TokenBytes(self.tokenizer, self.grammars)
        budget = o.prefill_budget_ms
        if budget is None:  # auto: see EngineOptions.prefill_budget_ms
            budget = DEFAULT_PREFILL_BUDGET_MS
        self.scheduled = budget > 0 and group is None
        # Most prompts prefilled together: the options', or on auto the decode batch under the scheduler
        # (its budget bounds a call's tokens) and mlx-lm's default without it.
        prompts = o.prompt_concurrency or (self.decode_concurrency if self.scheduled
                                           else DEFAULT_PROMPT_CONCURRENCY)
        #: Prompt tokens per prefill step, lone and batched, and those prompts: the options', cut where
        #: the backend cannot take that many tokens through the model's experts in one call (limits.py).
        self.prefill = prefill_steps(o.prefill_step_size, prompts=prompts,
                                     cap=prefill_token_cap(self.model, text), model=path)
        self._batch = self._new_batch()
        self._waiting: deque[Sequence] = deque()
        self._running: dict[int, Sequence] = {}  # by BatchGenerator uid
        #: uids of the running sequences that asked for log-probabilities (empty: no work for them).
        self._with_logprobs: set[int] = set()
        #: The lone sequence on the batch-size-1 fast path (outside the BatchGenerator), if any.
        self._solo: Solo | None = None
        #: Whether a lone request may take the fast path (off: every request goes through the batch).
        self.solo_enabled = self.options.single_stream
        #: Requests that started on the fast path, and tokens it decoded (for tests and reports).
        self.solo_requests = 0
        self.solo_tokens = 0
        #: Uncached system prompts being prefilled now, each by one leading sequence (its uid).
        self._leaders: dict[tuple[int, ...], int] = {}
        self._heads: dict[tuple, list[int]] = {}  # system messages, chat options -> templated tokens
        #: Admitted prompts being prefilled outside the batch, chunk by chunk (`prefill.py`); the
        #: scheduler is off (mlx-lm prefills, as before) with no budget and in a worker group, whose
        #: ranks must step alike (a chunk sized by each rank's own clock would differ between them).
        self._prefills: list[Prefill] = []
        self._admitted = 0
        #: Prompt tokens prefilled outside the batch (the scheduler's chunks and the fast path's).
        self.prefill_tokens = 0
        #: The scheduler's model calls, and the prompts prefilled in calls that carried several (a burst).
        self.prefill_calls = 0
        self.prefill_batched = 0
        self.sizer = ChunkSizer(budget if self.scheduled else 0, self.prefill.solo, grid=on_cuda())
        self.load_s = time.perf_counter() - t0
        self.warmup_s = 0.0

    # -- the public surface ---------------------------------------------------
    @property
    def busy(self) -> bool:
        """Whether any request is waiting or running."""
        return bool(self._waiting or self._running or self._solo or self._prefills)

    def submit(self, req: Generate, listener: Listener, *, queued_at: float | None = None) -> None:
        """Check and tokenize `req` and queue it for the batch; a bad request fails at once, alone."""
        try:
            if isinstance(req, Embed):
                raise ModelKindError(f"model {self.path} is not an embedding model: it has no embeddings")
            seqs = self._sequences(req, listener, queued_at or time.perf_counter())
        except Exception as exc:
            listener.failed(req.id, exc)
            return
        for seq in seqs:
            if seq.ended:  # resumed where its reply had already ended: the worker that died missed its end
                seq.listener.started(req.id)
                self._send_done(seq, seq.ended)
            else:
                self._waiting.append(seq)

    def prepare(self, req: Generate) -> None:
        """What can be done for `req` off the MLX thread, before `submit` (any thread): compile its
        grammar; for a forced tool call, whose grammar follows the templated prompt, build
        llguidance's view of the tokenizer so that admission only compiles."""
        if req.params.grammar is not None:
            self.grammars.prepare(req.params.grammar)
        elif req.chat is not None and req.chat.forces_call:
            self.grammars.warm()
        if req.params.logprobs is not None:
            self.token_bytes.warm()

    def cancel(self, req_id: int) -> bool:
        """End `req_id` (each of its choices) as cancelled, wherever it is; False if it is not here."""
        found = False
        while self._cancel_one(req_id):
            found = True
        return found

    def _cancel_one(self, req_id: int) -> bool:
        for seq in self._waiting:
            if seq.req.id == req_id:
                self._waiting.remove(seq)
                self._end_forks(seq)
                seq.listener.done(req_id, seq.stats("cancelled"), "")
                return True
        if self._solo is not None and self._solo.seq.req.id == req_id:
            self._finish(self._solo.seq, "cancelled")
            return True
        for p in self._prefills:
            if p.seq.req.id == req_id:
                self._finish(p.seq, "cancelled")
                return True
        for seq in list(self._running.values()):
            if seq.req.id == req_id:
                self._batch.remove([seq.uid])
                self._finish(seq, "cancelled")
                return True
        return False

    def cancel_all(self) -> None:
        """End every request, waiting or running, as cancelled."""
        solo = [self._solo.seq] if self._solo is not None else []
        for seq in [*self._waiting, *solo, *(p.seq for p in self._prefills), *self._running.values()]:
            self.cancel(seq.req.id)

    def close(self) -> None:
        """The worker is stopping: queue the prefixes not on disk yet, and write what the disk tier has
        queued (at most its flush timeout)."""
        self._warm = None
        if self._disk is not None:  # both within one MLXRT_DISK_CACHE_FLUSH_S
            budget = flush_timeout()
            deadline = time.monotonic() + budget
            self.prefix_cache.spill(budget)
            self._disk.close(max(0.0, deadline - time.monotonic()))

    def step(self) -> None:
        """Admit waiting requests, then run one step: a prefill chunk or one token on the fast path, else
        the prefill budget's chunks (`prefill.py`) and a batch step (one token for every decoding
        sequence), a second batch step on the scheduler's path where a prompt ended in the first, and
        the buffers a long prompt outgrew handed back (`_end_step`)."""
        if self._solo is not None and self._waiting:
            self._hand_over()
        self._admit()
        if self._solo is not None:
            self._solo_step()
            return
        if self._prefills:
            self._prefill_step()
        # A sequence that joined the batch at its last token decodes its first token in the call after
        # the one that takes it in: on the scheduler's path that call comes now, not after the next
        # step's prefill (a budget's worth later). mlx-lm's own prefill has its next prompts' work there.
        if self._running and self._batch_step() and self.scheduled and self._running:
            self._batch_step()
        self._end_step()

    def _batch_step(self) -> bool:
        """One step of the batch (`BatchGenerator.next`): a token for every decoding sequence, its
        checkpoints, mlx-lm's prompt work; whether a sequence's prompt ended in it (its first token
        comes in the next call). A failure fails the batch's sequences (`_fail_batch`)."""
        self._plan_masks()
        try:
            prompt_responses, gen_responses = self._batch.next()
        except Exception as exc:
            reseed()
            self._fail_batch(exc)
            return False
        finally:
            self.masks.clear()
        for r in prompt_responses:
            if r.end_of_segment and not r.end_of_prompt:
                self._checkpoint(self._running[r.uid])
        self._deliver(gen_responses)
        return any(r.end_of_prompt for r in prompt_responses)

    def report(self) -> EngineReport:
        """The queue, the batch and the prefix cache, now (safe to read from another thread)."""
        running = len(self._running) + (self._solo is not None) + len(self._prefills)
        report = EngineReport(queued=len(self._waiting), batch_size=running, prefill_calls=self.prefill_calls,
                              prefill_batched=self.prefill_batched)
        return self.prefix_cache.report(report)

    def memory(self) -> MemoryReport:
        """MLX's allocator counters and this process's RSS, bytes."""
        import psutil

        return MemoryReport(
            active_bytes=int(mx.get_active_memory()),
            peak_bytes=int(mx.get_peak_memory()),
            cache_bytes=int(mx.get_cache_memory()),
            rss_bytes=int(psutil.Process().memory_info().rss),
        )

    def clear_cache(self) -> None:
        """Drop the prefix cache (but for a loaded prompt-cache file), then return MLX's cached buffers
        to the system."""
        self._warm = None  # memory pressure: reading more into memory would undo the relief
        self.prefix_cache.clear()
        mx.clear_cache()
        self._seed_prefix_cache()

    # -- loading: what the options ask for beyond the model ----------------------
    def _load_draft(self, ref: str, num_draft_tokens: int, policy: str) -> Draft:
        """The draft model, checked against the target: one vocabulary, caches that can be rewound."""
        draft, tokenizer, config = load(resolve_model_path(ref), return_config=True)
        text = {**config.get("text_config", {}), **config}
        vocab = int(text.get("vocab_size") or 0)
        if tokenizer.get_vocab() != self.tokenizer.get_vocab():
            raise ValueError(f"invalid draft_model={ref!r}: its tokenizer ({len(tokenizer.get_vocab())} "
                             f"tokens) is not the target's ({len(self.tokenizer.get_vocab())}); a draft "
                             "must share the target's vocabulary")
        if vocab > self.vocab_size:
            raise ValueError(f"invalid draft_model={ref!r}: it scores {vocab} token ids, more than the "
                             f"target's {self.vocab_size}")
        for name, net in (("the target", self.model), ("the draft", draft)):
            if not always_trimmable(make_prompt_cache(net)):
                kinds = sorted({type(c).__name__ for c in make_prompt_cache(net)})
                raise ValueError(f"invalid draft_model={ref!r}: speculative decoding rewinds the cache, "
                                 f"which {name}'s {kinds} cannot")
        return Draft(draft, num_draft_tokens, DraftPolicy(adaptive=policy == "adaptive"))

    def _seed_prefix_cache(self) -> None:
        if self._pinned is not None:
            tokens, cache = self._pinned
            self.prefix_cache.insert(tokens, cache, "system")

    def warmup(self, tokens: int) -> None:
        """Compile kernels before the first request: one sequence, a long prompt, a full decode batch.

        A batch of `decode_concurrency` sequences runs other kernels than one
        sequence (quantised matmuls switch from vector to matrix kernels), and
        so do prompt chunks of `prefill_step_size` tokens; on CUDA the first
        use of each costs seconds (38 s for the first long prompts seen on an
        H200), so a full batch and, on a GPU, a prompt past two prefill steps
        and a 24-token one (the matmul's tile follows the rows of a chunk)
        warm them, on the single-stream fast path and through the batch; on
        CUDA, one sequence's decode steps at the cache lengths whose attention
        graphs cost most to build (`solo.warm_decode_graphs`);
        `benchmarks/first_use.py` shows what is left. The CPU compiles
        nothing, so it skips the GPU's prompts. Then, with a disk tier, warming
        starts: the worker reads its newest prefixes back while idle (`warm_step`).
        """
        if tokens > 0:
            self._compile_kernels(tokens)
        self._warm = self._start_warm()

    def _compile_kernels(self, tokens: int) -> None:
        """Warm-up's prompts, through the paths a request takes (`warmup`)."""
        t0 = time.perf_counter()
        self.prefix_cache = self._new_prefix_cache(disk=False)  # warm-up prompts are no prefix to keep
        params = SamplingParams(max_tokens=tokens, ignore_eos=True)
        # With a draft, long enough for a full round: the target scores num_draft_tokens + 1 tokens.
        lone = SamplingParams(max_tokens=tokens + (self.draft.num_draft_tokens + 1 if self.draft else 0),
                              ignore_eos=True)
        self._run_to_end([Generate(id=-1, prompt=WARMUP_PROMPT, params=lone)])
        if mx.default_device().type == mx.DeviceType.gpu:
            long = self._long_warmup_ids(tokens)
            solo = self.solo_enabled
            try:
                for mode in dict.fromkeys((solo, False)):  # a lone prompt's cache and the batch's differ
                    self.solo_enabled = mode
                    for ids in (long, long[:MID_WARMUP_TOKENS]):
                        if ids:  # a context too small for them leaves nothing to warm
                            self._run_to_end([Generate(id=-1, prompt_ids=ids, params=params)])
            finally:
                self.solo_enabled = solo
        if on_cuda() and self.kv is None and self.options.max_kv_size is None:  # the caches it builds
            warm_decode_graphs(self.model, self.context_length)
        batch = range(self.decode_concurrency)
        self._run_to_end([Generate(id=-2 - i, prompt=f"{WARMUP_PROMPT} {i}", params=params) for i in batch])
        self.prefix_cache = self._new_prefix_cache()  # warm-up is no hit
        self._seed_prefix_cache()
        if self.draft is not None:  # its rounds compiled: not the draft's speed
            self.draft.policy.reset()
        self.warmup_s = time.perf_counter() - t0

    def _start_warm(self) -> Iterator[None] | None:
        """Warming's generator (`PrefixCache.warm`) for the options' budget: prompt_cache_warm_bytes,
        else half the memory tier's cap; None without a disk tier or a budget."""
        o = self.options
        budget = o.prompt_cache_warm_bytes
        if budget is None:
            budget = self.prompt_cache_bytes // 2
        if self.prefix_cache.disk is None or budget <= 0:
            return None
        return self.prefix_cache.warm(budget)

    @property
    def warming(self) -> bool:
        """Whether disk entries are still to be read back into memory while the engine is idle."""
        return self._warm is not None

    def warm_step(self) -> None:
        """Read one more layer of the entry being warmed (on the MLX thread, while idle); the last step
        ends warming. A failure ends it with a warning: warming is never worth a worker."""
        try:
            next(self._warm)
        except StopIteration:
            self._warm = None
        except Exception as exc:
            log.warning("disk_cache.warm_failed", error=f"{type(exc).__name__}: {exc}")
            self._warm = None

    def _new_prefix_cache(self, *, disk: bool = True) -> PrefixCache:
        """An empty prefix cache over the disk tier (`disk`: a warm-up's has none: it is no prefix to
        keep). A worker group keeps no disk tier: every rank holds its own shard."""
        total = self.group.total if self.group is not None and self.group.size > 1 else None
        tier = self._disk if disk and total is None else None
        return PrefixCache(self.prompt_cache_bytes, total, tier)

    def _disk_tier(self) -> DiskTier | None:
        """The prefix cache's disk tier the options ask for, keyed by what makes a cache valid here."""
        o = self.options
        if o.prompt_cache_dir is None or not o.prompt_cache_disk_bytes or not self.prompt_cache_bytes:
            return None
        extra = {k: getattr(o, k) for k in ("adapter_path", "chat_template", "kv_bits", "kv_group_size",
                                             "quantized_kv_start", "max_kv_size")}
        kinds = [type(c).__name__ for c in make_cache(self.model, o.max_kv_size)]
        return DiskTier(o.prompt_cache_dir, model_identity(self.path, extra), o.prompt_cache_disk_bytes,
                        kinds=kinds)

    def _long_warmup_ids(self, tokens: int) -> list[int]:
        """A prompt two prefill steps and a bit long, within the context.

        Three chunk shapes: a full one from the start, a full one over a
        cache as long (its own attention kernels: one step and a bit was
        seen to leave a 46 s compile to the first 4k-token prompt on an
        H100), and a short tail.
        """
        n = max(0, min(2 * self.options.prefill_step_size + 64, self.context_length - tokens - 1))
        unit = self.tokenizer.encode(WARMUP_PROMPT)
        return (unit * (n // len(unit) + 1))[:n]

    def _run_to_end(self, reqs: list[Generate]) -> None:
        """Run `reqs` together until every one has ended; raise the first failure."""
        box = Quiet()
        for req in reqs:
            self.submit(req, box)
        while self.busy:
            self.step()
        if box.error is not None:
            raise box.error

    # -- a request's way in ----------------------------------------------------
    def _sequences(self, req: Generate, listener: Listener, queued_at: float) -> list[Sequence]:
        """Check and tokenize `req`: its first choice's sequence, the other choices (n > 1) its `forks`;
        a resumed request's choices that had not ended, each on its own (their replies differ)."""
        p = req.params
        p.check_vocabulary(self.vocab_size)
        check_request(req.chat, self.capabilities, self.path)
        ids = self.prompt_ids(req)
        grammar = self._grammar(req, ids)
        reuse = self.prefix_cache.enabled and req.messages
        system_end = self.system_end(req, ids) if reuse else 0
        turn_end = self._turn_end(req, ids) if reuse else 0
        resume = req.resume
        choices = [i for i in range(p.n) if resume is None or i not in resume.ended]
        # Only requests that ask for log-probabilities or several choices get the choices' listeners.
        group = ChoiceGroup(listener, p.n) if p.n > 1 or p.logprobs is not None else None
        if group is not None:
            group.left = len(choices)
        seqs = [self._choice(req, ids, i, grammar=grammar, system_end=system_end, turn_end=turn_end,
                             queued_at=queued_at, listener=listener if group is None else group.choices[i])
                for i in choices]
        if resume is not None:
            for seq, i in zip(seqs, choices, strict=True):
                seq.replay(resume.tokens[i] if i < len(resume.tokens) else [], resume.count)
            return seqs
        seqs[0].forks = seqs[1:]
        return seqs[:1]

    def _choice(self, req: Generate, ids: list[int], index: int, *, grammar: Grammar | None,
                system_end: int, turn_end: int, queued_at: float, listener: Listener) -> Sequence:
        """One choice's sequence: its own sampler (a key of its own when seeded), processors and
        grammar matcher, text stream and reply splitter."""
        p = req.params
        sampler = make_request_sampler(p, index)
        check_sampler(sampler, self.vocab_size)
        processors = make_request_processors(p)
        constraint = None
        if grammar is not None:  # last, so its -inf mask is what the sampler sees
            constraint = self.grammars.constraint(grammar)
            processors.append(constraint)
        stop_ids = set(p.stop_token_ids) | (set() if p.ignore_eos else set(self._eos))
        # Only a chat reply has reasoning and tool calls to split out.
        reply = None if req.messages is None else make_splitter(
            self.tokenizer, self.capabilities, req.chat, ids)
        return Sequence(
            req=req,
            ids=ids,
            system_end=system_end,
            turn_end=turn_end,
            max_tokens=min(p.max_tokens, self.request_context(req) - len(ids)),
            stop=StopSequences([(t,) for t in sorted(stop_ids)]),
            sampler=sampler,
            processors=processors,
            constraint=constraint,
            text=TextStream(self.tokenizer.detokenizer, p.stop, split_emit(reply, listener, req.id)),
            queued_at=queued_at,
            listener=listener,
            reply=reply,
            logprobs=p.logprobs,
        )

    def _grammar(self, req: Generate, ids: list[int]) -> Grammar | None:
        """The reply's grammar: a forced tool call's (it wins over `response_format`), else the request's."""
        if req.messages is not None and req.chat is not None and req.chat.forces_call:
            opened = reasoning_open(self.tokenizer, self.capabilities, ids)
            return tool_call_grammar(self.tokenizer, self.capabilities, req.chat, reasoning_open=opened)
        return req.params.grammar

    def _admit(self) -> None:
        # n > 1 is a batch from the start, and a forked choice starts from its fork's cache (`_insert`).
        lone = len(self._waiting) == 1 and not self._waiting[0].forks and self._waiting[0].start is None
        if self._solo is None and not self._running and not self._prefills and lone and self.solo_enabled:
            self._start_solo(self._waiting.popleft())
            return
        room = (self.decode_concurrency - len(self._running) - (self._solo is not None)
                - len(self._prefills))
        following: list[Sequence] = []
        while room > 0 and self._waiting:
            seq = self._waiting.popleft()
            if seq.start is None and seq.system_end and tuple(seq.ids[: seq.system_end]) in self._leaders:
                following.append(seq)  # its system prompt is being prefilled: wait for the checkpoint
                continue
            room -= 1
            if not self._running and not self._prefills:
                mx.reset_peak_memory()
            try:
                self._insert(seq)
            except Exception as exc:
                self._failed(seq, exc)
        self._waiting.extendleft(reversed(following))

    def _failed(self, seq: Sequence, exc: BaseException) -> None:
        """`seq` failed: its request fails (once), and the request's other choices are cancelled. Where an
        allocation failed, the engine's caches go back (`limits.relieve`)."""
        seq.forks = []
        seq.listener.failed(seq.req.id, exc)
        if seq.req.params.n > 1:
            self.cancel(seq.req.id)  # their ends are dropped: the request already failed
        cause = exc.__cause__ if isinstance(exc, BatchStepError) and exc.__cause__ else exc
        if self.group is None and out_of_memory(cause) and not getattr(cause, "relieved", False):
            # Once for all the requests it fails, kept on the error (holding it here would keep its
            # frames' arrays); a group ends instead.
            cause.relieved = True  # type: ignore[attr-defined]
            relieve(cause, self.clear_cache, kept_bytes=self.prefix_cache.nbytes,
                    what="the failed step's requests failed; the prefix cache and MLX's cached buffers "
                         "were dropped")

    # -- the batch-size-1 fast path ---------------------------------------------
    def _start_solo(self, seq: Sequence) -> None:
        """Run a lone request outside the batch: its prefix from the cache, the rest prefilled alone."""
        mx.reset_peak_memory()
        try:
            cache, n = self.prefix_cache.fetch(seq.ids)
            seq.cached_tokens = n
            segments, seq.checkpoint_kinds = prompt_segments(seq.ids, n, seq.system_end,
                                                             trimmable=self.trimmable, turn_end=seq.turn_end)
            o = self.options
            self._solo = Solo(self.model, seq, cache, segments, prefill_step_size=self.prefill.solo,
                              stream=self._batch.stream, kv=self.kv, max_kv_size=o.max_kv_size,
                              draft=self.draft)
        except Exception as exc:
            self._failed(seq, exc)
            return
        seq.admitted_at = time.perf_counter()
        self.solo_requests += 1
        seq.listener.started(seq.req.id)

    def _solo_step(self, *, lookahead: bool = True) -> None:
        """One prefill chunk or one token of the lone sequence; a failure fails it alone."""
        solo = self._solo
        assert solo is not None
        seq = solo.seq
        try:
            if solo.prefilling:
                if self._solo_prefill(solo) and seq.checkpoint_kinds:
                    kind = seq.checkpoint_kinds.pop()  # the cache goes on: the prefix cache keeps a copy
                    if kind is not None:
                        self.prefix_cache.insert(list(solo.tokens), solo.cache, kind)
                return
            token, mlx_reason = solo.decode(lookahead=lookahead)
            if seq.logprobs is not None:
                self._attach_logprobs([(seq, token, solo.logprobs)])
        except Exception as exc:
            if self.group is not None:
                self.group.abort(exc)
            reseed()
            solo.end()
            self._solo = None
            error = BatchStepError(f"single-stream step failed: {exc!r}")
            error.__cause__ = exc
            self._failed(seq, error)
            return
        self.solo_tokens += 1
        reason = self._advance(seq, token, mlx_reason, 1, time.perf_counter())
        if reason is not None:
            self._finish(seq, reason, solo.cache, solo.tokens)

    def _solo_prefill(self, solo: Solo) -> bool:
        """One prefill chunk of the lone sequence, sized to the budget as the scheduler's are (but with
        KV-cache quantization, whose cache depends on where chunks end: `prefill_step_size` then, as
        mlx-lm's); whether it ended an inner segment."""
        sized = self.scheduled and self.kv is None
        before, t0 = len(solo.tokens), time.perf_counter()
        rest = len(solo.segments[0]) if solo.segments else None
        size = self.sizer.size(cached=before, rest=rest) if sized else None
        # On CUDA, MLX's freed buffers kept between the chunks as between the scheduler's calls.
        boundary = solo.prefill(size, keep=sized and self.sizer.grid)
        # The prompt's last token, queued once the prompt is in, is the first decode step's input.
        seconds, n = time.perf_counter() - t0, len(solo.tokens) - before - (not solo.prefilling)
        if n > 0:
            self.prefill_tokens += n
            solo.seq.prefill_s += seconds
            if sized:
                self.sizer.record(n, seconds, (1, n, before + n))
        return boundary

    def _hand_over(self) -> None:
        """Another request arrived: move the lone sequence into the batch, to go on exactly where it is.

        A token already queued is delivered first (its sampler and processors have run for it),
        without queueing the next, so the batch's next step starts from it.
        """
        solo = self._solo
        assert solo is not None
        seq = solo.seq
        if not solo.prefilling:
            self._solo_step(lookahead=False)
            if self._solo is None:  # it ended (or failed) on that token
                return
        self._solo = None
        if self.scheduled and solo.prefilling:  # its prompt goes on in the scheduler's chunks
            self._add_prefill(seq, full_precision(solo.cache), solo.segments, list(solo.tokens))
            self._prefills[-1].pieces = solo.pieces
            return
        try:
            args = solo.handoff()
            (seq.uid,) = self._batch.insert_segments(args.pop("segments"), **args)
        except Exception as exc:
            self._failed(seq, exc)
            return
        self._running[seq.uid] = seq
        if seq.logprobs is not None:
            self._with_logprobs.add(seq.uid)
        if "system" in seq.checkpoint_kinds:  # its system prompt is still to come: others may follow it
            seq.leads = tuple(seq.ids[: seq.system_end])
            self._leaders[seq.leads] = seq.uid

    # -- a step's results ------------------------------------------------------
    def _plan_masks(self) -> None:
        """Name the decoding rows whose grammar consumes the token sampled last step, with those tokens
        (not yet read), so that the step's first grammar row advances and masks them all at once."""
        gen = getattr(self._batch, "_generation_batch", None)  # mlx-lm's decoding rows, in step order
        pending = getattr(gen, "_next_tokens", None)
        uids = getattr(gen, "uids", None)
        if not isinstance(pending, mx.array) or uids is None or pending.shape[:1] != (len(uids),):
            return  # no decoding rows (or an mlx-lm that keeps them otherwise): each row masks itself
        rows, where = [], []
        for i, uid in enumerate(uids):
            seq = self._running.get(uid)
            if seq is not None and seq.constraint is not None and seq.constraint.batchable:
                rows.append(seq.constraint)
                where.append(i)
        if rows:
            self.masks.plan(rows, pending[mx.array(where)])

    def _deliver(self, responses: list) -> None:
        if self._with_logprobs:
            self._attach_logprobs([(self._running[r.uid], r.token, r.logprobs) for r in responses
                                   if r.uid in self._with_logprobs])
        now, size = time.perf_counter(), len(responses)
        ended: list[tuple[Sequence, str]] = []  # ended here while mlx-lm would go on: taken out below
        for r in responses:
            seq = self._running[r.uid]
            reason = self._advance(seq, r.token, r.finish_reason, size, now)
            if reason is None:
                continue
            if r.finish_reason is None:
                ended.append((seq, reason))
            else:
                self._finish(seq, reason, r.prompt_cache, r.all_tokens)
        if ended:  # stop strings and grammars: mlx-lm does not know them, so take these out of the batch
            caches = self._batch.remove(
                [s.uid for s, _ in ended], return_prompt_caches=self.prefix_cache.enabled
            )
            for seq, reason in ended:
                self._finish(seq, reason, *caches.get(seq.uid, (None, None)))

    def _attach_logprobs(self, items: list) -> None:
        """(sequence, token, the log-probabilities it was sampled from) for the sequences that asked:
        each one's `TokenLogprob`, in one evaluation, handed to its listener for the token's event."""
        if not items:  # those that asked are still prefilling
            return
        entries = token_logprobs([lp for _, _, lp in items], [t for _, t, _ in items],
                                 [seq.logprobs for seq, _, _ in items], self.token_bytes)
        for (seq, _, _), entry in zip(items, entries, strict=True):
            seq.listener.logprob = entry  # type: ignore[attr-defined]  # a `choices.Choice`: they ask

    def _advance(self, seq: Sequence, token: int, mlx_reason: str | None, size: int,
                 now: float) -> str | None:
        """Send one generated token (unless it ends the reply unsent); why `seq` ends here, or None.

        mlx_reason is mlx-lm's: "stop" for a stop id (not part of the reply), "length" at max_tokens.
        """
        if seq.last_at:
            seq.longest_gap_s = max(seq.longest_gap_s, now - seq.last_at)
        seq.first_at = seq.first_at or now
        seq.last_at = now
        seq.steps += 1
        seq.batch_size_sum += size
        if mlx_reason == "stop":
            return "stop"
        con = seq.constraint
        if con is not None and (con.rejected or (token in self._eos and con.finish_reason == "stop")):
            return con.finish_reason  # a token the grammar refused, or its EOS under ignore_eos: unsent
        seq.generated += 1
        if seq.text.add(token):
            return "stop"
        reason = con.finish_reason if con is not None else None
        return reason or ("length" if mlx_reason == "length" else None)

    def _finish(self, seq: Sequence, reason: str, cache=None, tokens=None) -> None:
        prefill = next((p for p in self._prefills if p.seq is seq), None)
        if self._solo is not None and self._solo.seq is seq:
            self._solo.end()
            self._solo = None
        elif prefill is not None:
            self._drop(prefill)
        else:
            del self._running[seq.uid]
            self._with_logprobs.discard(seq.uid)
        self._unlead(seq)
        self._end_forks(seq)
        if cache is not None and reason != "cancelled":
            self.prefix_cache.insert(tokens, cache, "assistant")
        if seq.first_at and seq.admitted_at and seq.first_at > seq.admitted_at:
            prefilled = len(seq.ids) - seq.cached_tokens
            self.prefix_cache.note_prefill(prefilled, prefilled / (seq.first_at - seq.admitted_at))
        self._send_done(seq, reason)

    def _send_done(self, seq: Sequence, reason: str) -> None:
        """The reply's last text (held back until now) and its stats, to its listener."""
        rest = seq.text.finish()
        if seq.reply is None:
            seq.listener.done(seq.req.id, seq.stats(reason), rest)
            return
        parts = seq.reply.feed(rest).extend(seq.reply.finish())
        if parts.reasoning or parts.calls:
            seq.listener.done(seq.req.id, seq.stats(reason), parts.content, parts.reasoning, parts.calls)
        else:
            seq.listener.done(seq.req.id, seq.stats(reason), parts.content)

    def _fail_batch(self, exc: Exception) -> None:
        """A step raised: the batch's caches can no longer be trusted; fail its requests, rebuild it.

        In a group the whole group stops instead (the orchestrator's `WorkerDied`).
        """
        if self.group is not None:
            self.group.abort(exc)
        error = BatchStepError(f"batch step failed: {exc!r}")
        error.__cause__ = exc
        running, self._running = list(self._running.values()), {}
        self._with_logprobs.clear()
        self._leaders.clear()
        self._batch.close()
        self._batch = self._new_batch()
        for seq in running:
            self._failed(seq, error)

    def _new_batch(self) -> BatchGenerator:
        """mlx-lm's batch. On the scheduler's path a prompt reaches it at its last token (`_join`), so its
        prompt batch is only the joins' one-token step: every ready prompt joins in one call. Off that path
        (no budget, a worker group) mlx-lm prefills, `prefill.batch_prompts` prompts a call."""
        o = self.options
        return BatchGenerator(
            self.model,
            completion_batch_size=self.decode_concurrency,
            prefill_batch_size=self.decode_concurrency if self.scheduled else self.prefill.batch_prompts,
            prefill_step_size=self.prefill.batch,
            max_kv_size=o.max_kv_size,
        )


def device_name() -> str:
    """The MLX default device, e.g. ``gpu`` or ``cpu``."""
    return str(mx.default_device())
