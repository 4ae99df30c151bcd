"""The public API: `Runtime` (threads) and `AsyncRuntime` (asyncio) over a pool of workers.

Both share one `Pool`; a request goes to the worker of its model that holds
its prompt's prefix, or the least-loaded ready one (`routing.py`), where it
joins that worker's batch; its events come back through a sink: a queue the
caller's thread reads, or an asyncio queue fed with ``call_soon_threadsafe``.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import queue
import threading
import time
import weakref
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import msgspec
import structlog

from .. import logs
from ..ipc.protocol import (
    DEFAULT_HEARTBEAT_S,
    DetailedTokens,
    Done,
    EngineOptions,
    Failed,
    Generate,
    Ready,
    SamplingParams,
    Stats,
    TokenLogprob,
    Tokens,
    ToolCall,
)
from . import embeddings
from .chat import CHAT_KEYWORDS, chat_messages, chat_options, missing_capability
from .config import DEFAULT_WARMUP_TOKENS, Supervision, Timeouts, engine_from_env
from .errors import MemoryPressureError, MlxrtError, MlxrtTimeout, ModelFailedError, RequestError
from .group import GroupHandle
from .handle import WorkerHandle, WorkerInfo, WorkerMemory
from .launch import Group
from .options import ModelSpec, as_spec, prepare
from .routing import PrefixRouter, block_keys
from .structured import check_grammar, json_schema_grammar
from .supervisor import Slot

if TYPE_CHECKING:
    import numpy as np  # imported by `embeddings` when vectors arrive, not with the runtime

log = structlog.get_logger("mlxrt.orchestrator")

TRANSPORTS = ("auto", "ring", "stdio")
#: With no request waiting for a worker, `Pool._mind_waiting` still looks this often (s).
IDLE_DEADLINE_CHECK_S = 5.0
Prompt = str | Sequence[int] | Sequence[Mapping[str, Any]]


@dataclass(slots=True)
class Chunk:
    """Text and token ids produced since the previous chunk of a stream.

    In a chat reply `text` is the answer; its reasoning and its tool calls (each whole, parsed
    in the worker) come in `reasoning` and `tool_calls`. With ``logprobs=k``, `logprobs` has a
    `TokenLogprob` per token of `tokens`; with ``n > 1``, `index` says which choice the chunk is of.
    """

    text: str
    tokens: list[int]
    reasoning: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)
    index: int = 0
    logprobs: list[TokenLogprob] | None = None


@dataclass(slots=True)
class Completion:
    """A finished request: all its text and token ids, with the worker's stats.

    A chat reply's reasoning and tool calls are apart from its text; `finish_reason` is
    "tool_calls" when the reply called tools and stopped by itself. With ``logprobs=k``,
    `logprobs` has a `TokenLogprob` per token. With ``n > 1`` this is the first choice, and
    `choices` all n of them (each a `Completion` with its own text, stats and `index`).
    """

    text: str
    tokens: list[int]
    stats: Stats
    model: str
    reasoning: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None
    index: int = 0
    #: Choices 1..n-1 of a request with n > 1 (`choices` lists them after this one).
    other_choices: list[Completion] = field(default_factory=list, repr=False)
    finish_reason: str = field(init=False)

    def __post_init__(self) -> None:
        reason = self.stats.finish_reason
        self.finish_reason = "tool_calls" if self.tool_calls and reason == "stop" else reason

    @property
    def choices(self) -> list[Completion]:
        """Every choice, in order: this one, then the others (just ``[self]`` when n is 1)."""
        return [self, *self.other_choices]


def build_request(req_id: int, prompt: Prompt, params: dict[str, Any]) -> Generate:
    """Validate a prompt, sampling and chat keywords into a `Generate`; `ValueError` names the field.

    ``json_schema`` (a schema object or its JSON text) is the short way to say
    ``grammar=Grammar(kind="json_schema", ...)``; either is checked here.
    """
    if params.get("json_schema") is not None:
        params = {**params, "grammar": json_schema_grammar(params["json_schema"])}
    params.pop("json_schema", None)
    unknown = sorted(set(params) - set(SamplingParams.__struct_fields__) - set(CHAT_KEYWORDS))
    if unknown:
        raise TypeError(f"unknown sampling parameter(s) {unknown}; known: {SamplingParams.__struct_fields__}"
                        f" and the chat keywords {CHAT_KEYWORDS}")
    chat = chat_options(**{k: params[k] for k in CHAT_KEYWORDS if k in params})
    params = {k: v for k, v in params.items() if k not in CHAT_KEYWORDS}
    if "stop" in params and isinstance(params["stop"], str):
        params = {**params, "stop": [params["stop"]]}
    try:
        sp = msgspec.convert(params, SamplingParams)
    except msgspec.ValidationError as exc:
        raise ValueError(f"invalid sampling parameter: {exc}") from None
    sp.validate()
    if sp.grammar is not None:
        check_grammar(sp.grammar)
    if isinstance(prompt, str):
        if not prompt:
            raise ValueError("invalid prompt: empty string")
        return _raw(Generate(id=req_id, params=sp, prompt=prompt), chat)
    if not isinstance(prompt, Sequence) or not prompt:
        raise ValueError("invalid prompt: expected a non-empty str, list of token ids or list of messages")
    if all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        if any(t < 0 for t in prompt):  # type: ignore[operator]
            raise ValueError("invalid prompt: token ids must be >= 0")
        return _raw(Generate(id=req_id, params=sp, prompt_ids=list(prompt)), chat)  # type: ignore[arg-type]
    return Generate(id=req_id, params=sp, messages=chat_messages(prompt), chat=chat)


def _raw(req: Generate, chat: object) -> Generate:
    """A text or token-id prompt: no chat template, so nothing for tools or thinking to act on."""
    if chat is not None:
        raise ValueError("invalid prompt: tools, tool_choice and think need chat messages")
    return req


class Pool:
    """Supervised worker slots for one or more models, started together, stopped together.

    Per model: `workers` active slots, which requests are routed to, and `spares`
    standby slots, whose ready workers take a crashed active worker's place. A model
    named in `groups` has worker groups in its slots (`Group`: N rank processes each).
    """

    def __init__(
        self,
        models: Mapping[str, str | ModelSpec],
        *,
        workers: int,
        transport: str,
        timeouts: Timeouts,
        supervision: Supervision,
        warmup_tokens: int,
        cache_limit_bytes: int | None,
        engine: EngineOptions | None = None,
        worker_argv: list[str] | None = None,
        spares: int = 0,
        groups: Mapping[str, Group] | None = None,
    ) -> None:
        if transport not in TRANSPORTS:
            raise ValueError(f"invalid transport={transport!r}: must be one of {TRANSPORTS}")
        if workers < 1:
            raise ValueError(f"invalid workers={workers!r}: must be >= 1")
        if isinstance(spares, bool) or not isinstance(spares, int) or spares < 0:
            raise ValueError(f"invalid spares={spares!r}: must be an integer >= 0")
        if not models:
            raise ValueError("invalid model: name at least one model")
        unknown = sorted(set(groups or {}) - set(models))
        if unknown:
            raise ValueError(f"invalid groups: {unknown} name no model of this runtime ({sorted(models)})")
        # Host files are read and checked here, before any process starts.
        plans = {name: g.plan() for name, g in (groups or {}).items()}
        if any(plans.values()) and timeouts.collective_s <= 2 * DEFAULT_HEARTBEAT_S:
            raise ValueError(f"invalid collective timeout {timeouts.collective_s:g} s: a worker group needs "
                             f"more than {2 * DEFAULT_HEARTBEAT_S:g} s (an idle group steps every "
                             f"{DEFAULT_HEARTBEAT_S:g} s; set MLXRT_COLLECTIVE_TIMEOUT_S)")
        self.timeouts = timeouts
        self.supervision = supervision
        self.engine = (engine or engine_from_env()).validate()
        self.router = PrefixRouter()
        self.transport = _choose_transport(transport)
        self.pressure = "normal"
        self._ids = itertools.count(1)
        self._closed = threading.Event()
        #: Set when a request starts waiting for a worker, or a worker gets ready: wakes `_mind_waiting`.
        self._queued = threading.Event()
        #: (slot, request id) of streams dropped without close(): cancelled by the monitor thread.
        self.dropped: queue.SimpleQueue = queue.SimpleQueue()
        #: Each model's options as its workers get them (paths resolved, checked at the edge).
        self.options: dict[str, EngineOptions] = {}
        targets = {}
        for name, model in models.items():
            targets[name], self.options[name] = prepare(name, as_spec(model), self.engine)
        self.slots: dict[str, list[Slot]] = {}
        self.spares: dict[str, list[Slot]] = {}
        # The workers that leave the prompt cache cap on auto split it: together they stay within the
        # machine's share (a spare takes a dead worker's place, so it counts as that one).
        share = workers * sum(o.prompt_cache_bytes is None for o in self.options.values())
        for name, target in targets.items():
            plan = plans.get(name)
            handle = WorkerHandle if plan is None else functools.partial(GroupHandle, plan=plan)
            spawn = functools.partial(
                handle,
                target,
                model_name=name,
                transport=self.transport,
                timeouts=timeouts,
                warmup_tokens=warmup_tokens,
                cache_limit_bytes=cache_limit_bytes,
                engine=self.options[name],
                argv=worker_argv,
                prompt_cache_share=max(1, share),
            )
            make = functools.partial(
                Slot, name, lambda on_exit, spawn=spawn: spawn(on_exit=on_exit), supervision,
                queue_s=timeouts.queue_s, wake=self._queued.set,
            )
            take = functools.partial(self._take_spare, name)
            self.slots[name] = [make(take_spare=take) for _ in range(workers)]
            self.spares[name] = [make(standby=True) for _ in range(spares)]
        try:
            for slot in self.all():
                slot.begin()
            for slot in self.all():
                slot.finish()
        except BaseException:
            self.close()
            raise
        self.default_model = next(iter(self.slots))
        self._monitor = threading.Thread(target=self._watch, name="mlxrt-monitor", daemon=True)
        self._monitor.start()
        self._waiting = threading.Thread(target=self._mind_waiting, name="mlxrt-waiting", daemon=True)
        self._waiting.start()

    def all(self) -> list[Slot]:
        """Every slot: the active ones, then the spares."""
        return [s for ss in (*self.slots.values(), *self.spares.values()) for s in ss]

    def _take_spare(self, model: str, on_exit) -> WorkerHandle | None:
        """A ready spare worker of `model`, handed over to `on_exit`'s slot; None if none is ready."""
        for spare in self.spares[model]:
            handle = spare.hand_over(on_exit)
            if handle is not None:
                return handle
        return None

    def model_spares(self, model: str | None) -> list[Slot]:
        self.model_slots(model)  # the same error for an unknown model
        return self.spares[model or self.default_model]

    def next_id(self) -> int:
        return next(self._ids)

    def model_slots(self, model: str | None) -> list[Slot]:
        name = model or self.default_model
        slots = self.slots.get(name)
        if slots is None:
            raise ValueError(f"invalid model={name!r}: this runtime serves {sorted(self.slots)}")
        return slots

    def submit(self, model: str | None, req: Generate, sink, keep_alive_s: float | None = None) -> Slot:
        """Send `req` to a live slot of `model`: the one holding its prompt's prefix if its batch
        has room, else the least loaded, ready workers first (`routing.PrefixRouter`)."""
        slots = self.model_slots(model)
        if self.pressure == "critical" and self.supervision.refuse_on_critical:
            raise MemoryPressureError(
                "the machine is under critical memory pressure: request refused rather than "
                "started and killed (policy: Supervision.refuse_on_critical)"
            )
        live = [s for s in slots if not s.failed]
        if not live:
            raise ModelFailedError(slots[0]._failure)
        if len(live) == 1:
            slot = live[0]
        elif not isinstance(req, Generate):  # embeddings: no prefix cache to find, the least loaded
            slot = min(live, key=lambda s: s.routing_key)
        else:
            keys = block_keys(model or self.default_model, req)
            slot = self.router.choose(live, keys)
            self.router.record(slot, keys)
        slot.submit(req, sink, keep_alive_s)
        return slot

    def _mind_waiting(self) -> None:
        """Slots and requests waiting for a worker: a slot in its restart backoff takes a spare that
        got ready; a request moves from a slot without a worker to a sibling with one, and fails
        past its deadline (MLXRT_QUEUE_TIMEOUT_S)."""
        while not self._closed.is_set():
            self._queued.clear()  # before the scan: a request queued during it wakes the next wait
            try:
                for slot in self.all():
                    slot.take_spare_now()
                self._move_waiting()
                nearest = self._expire_waiting()
            except Exception as exc:  # a bug here must not end every later deadline
                log.error("pool.waiting_failed", error=repr(exc))
                nearest = None
            wait_s = IDLE_DEADLINE_CHECK_S if nearest is None else nearest - time.monotonic()
            self._queued.wait(min(max(wait_s, 0.0), IDLE_DEADLINE_CHECK_S))

    def _expire_waiting(self) -> float | None:
        """Fail the requests past their deadline; the nearest deadline still ahead (monotonic s)."""
        now = time.monotonic()
        return min((d for d in (s.expire(now) for s in self.all()) if d is not None), default=None)

    def _move_waiting(self) -> None:
        for slots in self.slots.values():
            live = [s for s in slots if s.serving]
            if not live:
                continue
            for slot in slots:
                for entry in slot.steal_waiting():
                    min(live, key=lambda s: s.routing_key).dispatch(entry)

    def _watch(self) -> None:
        """Cancel dropped streams at once; once a tick, unload idle workers (their spares with
        them) and apply the memory-pressure policy."""
        interval = self.supervision.monitor_interval_s
        last_clear = 0.0
        next_tick = time.monotonic() + interval
        read_level = self.supervision.memory_level or _memory_level
        while not self._closed.is_set():
            try:
                item = self.dropped.get(timeout=max(0.0, next_tick - time.monotonic()))
            except queue.Empty:
                item = None
            if item is not None:
                if item[0] is not None:
                    item[0].cancel(item[1], discard=True)
                continue
            next_tick = time.monotonic() + interval
            for slot in self.all():
                keep = slot.keep_alive_s
                if not slot.standby and keep is not None and slot.idle_for() > keep:
                    slot.unload()
            self.follow_spares()
            level = read_level()
            if level != self.pressure:
                log.warning("memory.pressure", level=level, was=self.pressure)
                self.pressure = level
            now = time.monotonic()
            if level in ("warning", "critical") and self.supervision.clear_cache_on_warning:
                if now - last_clear > 10 * interval:
                    last_clear = now
                    for slot in self.all():
                        if slot.handle is not None:
                            slot.handle.clear_cache()

    def follow_spares(self) -> None:
        """Spares are loaded while their model is: unloaded with its last active worker,
        loaded again with its first."""
        for model, spares in self.spares.items():
            unloaded = all(s.state == "unloaded" for s in self.slots[model])
            for spare in spares:
                if unloaded:
                    spare.unload()
                elif spare.state == "unloaded":
                    spare.load()

    def close(self, drain_s: float = 0.0) -> None:
        """Stop every worker (in parallel); idempotent."""
        self._closed.set()
        self._queued.set()  # wake the deadline thread so it sees the close
        self.dropped.put((None, 0))  # wake the monitor thread so it sees the close
        threads = [threading.Thread(target=s.close, args=(drain_s,)) for s in self.all()]
        for t in threads:
            t.start()
        for t in threads:
            t.join()


def _memory_level() -> str:
    try:
        from .monitor import read_memory
    except ImportError:
        return "unavailable"
    try:
        return read_memory().level
    except Exception as exc:  # a reader bug must not take the pool's monitor down
        log.warning("memory.read_failed", error=repr(exc))
        return "unavailable"


@functools.cache
def _ring_problem() -> str | None:
    """Why the ring cannot be used in this process, or None; runs once per process.

    First sweeps away segments left by orchestrators that died before unlinking.
    """
    try:
        from ..ipc.ring import ring_self_test, sweep_stale_segments
    except ImportError as exc:
        return f"ring module unavailable: {exc}"
    swept = sweep_stale_segments()
    if swept:
        log.warning("ring.swept_stale_segments", names=swept)
    return ring_self_test()


def _choose_transport(transport: str) -> str:
    if transport == "stdio":
        return "stdio"
    reason = _ring_problem()
    if reason is None:
        return "ring"
    if transport == "ring":
        raise MlxrtError(f"transport='ring' requested but the ring self-test failed: {reason}")
    log.warning("transport.fallback", chosen="stdio", reason=reason)
    return "stdio"


def _event_to_chunk(event: object, stream: _StreamBase) -> Chunk | None:
    """Apply one worker event to `stream`; return a chunk to yield, or None when there is none."""
    if type(event) is Tokens:
        return Chunk(event.text, event.token_ids, event.reasoning, event.tool_calls)
    if type(event) is DetailedTokens:
        return Chunk(event.text, event.token_ids, event.reasoning, event.tool_calls, event.index,
                     event.logprobs)
    if isinstance(event, Done):
        stream._done = event.final  # with n > 1 each choice ends with a Done, the last one final
        stream.choice_stats[event.index] = event.stats
        if event.index == 0 or stream.stats is None:
            stream.stats = event.stats
        if event.text or event.token_ids or event.reasoning or event.tool_calls:
            return Chunk(event.text, list(event.token_ids), event.reasoning, event.tool_calls, event.index)
        return None
    stream._done = True
    if isinstance(event, Failed):
        raise RequestError(event.error_type, event.message, event.traceback)
    if isinstance(event, BaseException):
        raise event
    raise MlxrtError(f"unexpected event {event!r}")


class _StreamBase:
    stats: Stats | None

    def __init__(self, pool: Pool, model: str | None, req: Generate, sink, keep_alive_s) -> None:
        self.model = model or pool.default_model
        self.id = req.id
        self.stats = None
        #: Each choice's stats as it ends (n > 1); `stats` is the first choice's.
        self.choice_stats: dict[int, Stats] = {}
        self._done = False
        self._token_timeout = pool.timeouts.token_s
        self._dropped = pool.dropped
        self._slot = pool.submit(model, req, sink, keep_alive_s)

    @property
    def finish_reason(self) -> str | None:
        return self.stats.finish_reason if self.stats else None

    @property
    def worker(self) -> WorkerInfo:
        """The worker serving this request."""
        return self._slot.info()

    def cancel(self) -> None:
        """Ask the worker to stop between two tokens; iterating then ends with
        ``finish_reason == "cancelled"`` and the stats of what was generated."""
        if not self._done:
            self._slot.cancel(self.id, discard=False)

    def close(self) -> None:
        """Cancel and forget: remaining chunks and stats are dropped."""
        if not self._done:
            self._done = True
            self._slot.cancel(self.id, discard=True)

    def _timeout_error(self) -> MlxrtTimeout:
        self.close()
        return MlxrtTimeout(
            f"request {self.id} got nothing from worker {self._slot.name} within "
            f"{self._token_timeout:g} s (set MLXRT_TOKEN_TIMEOUT_S)"
        )

    def __del__(self) -> None:
        # A stream dropped mid-way (e.g. a break out of its loop) is cancelled. Not here:
        # __del__ may run at any allocation, even in a thread holding the locks cancel()
        # needs; SimpleQueue.put is safe there, and the pool's monitor thread does the rest.
        if not getattr(self, "_done", True) and hasattr(self, "_slot"):
            self._dropped.put((self._slot, self.id))


class Stream(_StreamBase):
    """Iterate for `Chunk`s; breaking out (or `close()`) cancels the request in the worker.

    Breaking out relies on the stream being garbage-collected (immediate in
    CPython); call `close()` or use ``with`` to be explicit.
    """

    def __init__(self, pool: Pool, model: str | None, req: Generate, keep_alive_s=None) -> None:
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        super().__init__(pool, model, req, self._q.put, keep_alive_s)

    def __iter__(self) -> Iterator[Chunk]:
        return self

    def __next__(self) -> Chunk:
        while not self._done:
            try:
                event = self._q.get(timeout=self._token_timeout)
            except queue.Empty:
                raise self._timeout_error() from None
            chunk = _event_to_chunk(event, self)
            if chunk is not None:
                return chunk
        raise StopIteration

    def __enter__(self) -> Stream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _Timeout:
    """Queued by an AsyncStream's watchdog when the worker went quiet too long."""


class AsyncStream(_StreamBase):
    """``async for`` over `Chunk`s; leaving the loop early (or `aclose()`) cancels the request.

    The token timeout is one watchdog timer per stream, not a `wait_for` per
    token: a Task and a timer handle per token would be the HTTP path's
    largest per-token cost.
    """

    def __init__(self, pool: Pool, model: str | None, req: Generate, keep_alive_s=None) -> None:
        loop = asyncio.get_running_loop()
        self._loop = loop
        self._q: asyncio.Queue = asyncio.Queue()
        # The sink and the watchdog must not hold the stream itself: an abandoned
        # stream has to be garbage-collected so that __del__ cancels the request.
        self._last = last = [time.monotonic()]
        self._watchdog: asyncio.TimerHandle | None = None
        put = self._q.put_nowait

        def sink(event: object) -> None:
            last[0] = time.monotonic()
            try:
                loop.call_soon_threadsafe(put, event)
            except RuntimeError:  # the loop is closed: nobody is listening any more
                pass

        super().__init__(pool, model, req, sink, keep_alive_s)

    def _check_quiet(self) -> None:
        _check_quiet(weakref.ref(self))


    def __aiter__(self) -> AsyncStream:
        return self

    async def __anext__(self) -> Chunk:
        while not self._done:
            try:
                event = self._q.get_nowait()
            except asyncio.QueueEmpty:
                if self._watchdog is None:
                    self._check_quiet()
                event = await self._q.get()
            if type(event) is _Timeout:
                raise self._timeout_error()
            chunk = _event_to_chunk(event, self)
            if chunk is not None:
                return chunk
        self._disarm()
        raise StopAsyncIteration

    def _disarm(self) -> None:
        if self._watchdog is not None:
            self._watchdog.cancel()
            self._watchdog = None

    def close(self) -> None:
        super().close()
        self._disarm()

    async def aclose(self) -> None:
        self.close()


def _check_quiet(ref: weakref.ref) -> None:
    """The watchdog: queue a timeout if the stream's worker went quiet for too long."""
    self = ref()
    if self is None or self._done:
        if self is not None:
            self._watchdog = None
        return
    quiet = time.monotonic() - self._last[0]
    if quiet >= self._token_timeout:
        self._watchdog = None
        self._q.put_nowait(_Timeout())
    else:
        self._watchdog = self._loop.call_later(self._token_timeout - quiet, _check_quiet, ref)


def _collect(chunks: list[Chunk], stream: _StreamBase) -> Completion:
    """The stream's chunks as its `Completion` (the first choice's, with the others in `choices`)."""
    assert stream.stats is not None
    indices = sorted(stream.choice_stats) or [0]
    done = [_choice(i, [c for c in chunks if c.index == i], stream.choice_stats.get(i, stream.stats),
                    stream.model) for i in indices]
    done[0].other_choices = done[1:]
    return done[0]


def _choice(index: int, chunks: list[Chunk], stats: Stats, model: str) -> Completion:
    logprobs = [e for c in chunks for e in c.logprobs or ()] if any(c.logprobs for c in chunks) else None
    return Completion(text="".join(c.text for c in chunks), tokens=[t for c in chunks for t in c.tokens],
                      stats=stats, model=model, reasoning="".join(c.reasoning for c in chunks),
                      tool_calls=[t for c in chunks for t in c.tool_calls], logprobs=logprobs, index=index)


def new_request(pool: Pool, model: str | None, prompt: Prompt, params: dict[str, Any]) -> Generate:
    """A checked request for `model`: its default sampling under the caller's keywords."""
    name = model or pool.default_model
    pool.model_slots(model)  # an unknown model is named before its sampling is looked at
    req = build_request(pool.next_id(), prompt, {**pool.options[name].sampling_defaults(), **params})
    ready = next((s.ready for s in pool.model_slots(model) if s.ready is not None), None)
    check_capabilities(req, ready, name)
    check_context(req, ready, name)
    return req


def check_context(req: Generate, ready: Ready | None, name: str) -> None:
    """`ValueError` when `req` asks for a context beyond the model's (the worker checks too, for
    requests sent before any worker of the model was ready)."""
    ctx = req.params.num_ctx
    if ctx is not None and ready is not None and ctx > ready.context_length:
        raise ValueError(f"invalid num_ctx={ctx}: model {name!r} has a {ready.context_length}-token context")


def check_capabilities(req: Generate, ready: Ready | None, name: str) -> None:
    """`ValueError` when `req` asks the model for thinking or tools it does not support, or asks an
    embedding model to generate."""
    if ready is not None and ready.capabilities is not None and ready.capabilities.embedding:
        raise ValueError(f"invalid model: {name!r} is an embedding model: it cannot generate "
                         "(ask it for embeddings)")
    if req.chat is None or ready is None:
        return
    chat = req.chat
    missing = missing_capability(ready.capabilities, thinking=chat.wants_thinking, tools=bool(chat.tools),
                                 forced=chat.forces_call)
    if missing is not None:
        field = {"thinking": "think", "tools": "tools"}.get(missing, "tool_choice")
        raise ValueError(f"invalid {field}: model {name!r} does not support {missing}")


def _model_map(model: str | ModelSpec | None,
               models: Mapping[str, str | ModelSpec] | None) -> dict[str, str | ModelSpec]:
    out = dict(models or {})
    if model is not None:
        out.setdefault(model.path if isinstance(model, ModelSpec) else model, model)
    return out


class Runtime:
    """MLX models in worker processes, from synchronous code.

    >>> with Runtime(model="synthetic:tiny") as rt:          # doctest: +SKIP
    ...     rt.generate("Hello", max_tokens=8).text

    `model` is a local directory, a Hugging Face id or ``synthetic:PRESET``;
    `models` maps names to such references to serve several. Sampling keywords
    of `generate`/`stream`: max_tokens, temperature, top_p, top_k, min_p,
    repetition_penalty, repetition_context_size, seed, stop, stop_token_ids,
    ignore_eos, num_ctx (the request's context, prompt and reply, as Ollama's);
    for structured output ``json_schema`` (a JSON schema the
    reply must match, enforced in the worker) or ``grammar`` (a `Grammar`:
    a JSON schema, a regex or a Lark grammar); ``logprobs`` (0: each token's
    log-probability, k <= 20: and the k most likely tokens; `Completion.logprobs`,
    `Chunk.logprobs`); ``n`` (<= 16 choices from one prefill: `Completion.choices`,
    `Chunk.index`). Chat keywords (the prompt a list of messages): tools,
    tool_choice (``required`` or a function force the call), think
    (`chat.chat_options`); the reply's reasoning and tool calls come apart from
    its text (`Completion.reasoning`, `.tool_calls`).

    `embed` turns texts or token ids into vectors, with an embedding model
    (docs/models.md#embeddings); such a model cannot generate.

    `engine` says how each worker batches and caches (`EngineOptions`:
    decode_concurrency, prompt_concurrency, prefill_step_size,
    prompt_cache_bytes); by default the ``MLXRT_*`` variables of the same
    names, else the defaults (the prefix cache sized from the machine's
    memory). A model given as a `ModelSpec` (``models={"q": ModelSpec(path,
    draft_model=..., kv_bits=8)}``) has options of its own: a draft model,
    KV-cache quantization or a bounded cache, a LoRA adapter, a chat template,
    its context length, a prompt-cache file and default sampling
    (docs/options.md), checked before any worker starts; a request's sampling
    keywords win over the model's defaults.

    `spares` hot spares per model (default 0): loaded, warmed-up workers that
    take no requests and take a crashed worker's place at once, a new spare
    loading behind each (docs/supervision.md). Each holds the model in memory.

    `ranks`, `backend`, `hosts`, `sharding`: make each worker a group of rank
    processes sharing the model over `mx.distributed` (`Group`; docs/distributed.md),
    e.g. ``ranks=2, backend="ring"`` on this machine, or ``hosts="hosts.json"``
    (`mlx.launch`'s host file) across machines; `groups` sets them per model
    name instead. `rt.workers` lists each group's ranks (`WorkerInfo.ranks`).
    """

    def __init__(
        self,
        model: str | ModelSpec | None = None,
        *,
        models: Mapping[str, str | ModelSpec] | None = None,
        workers: int = 1,
        transport: str = "auto",
        timeouts: Timeouts | None = None,
        supervision: Supervision | None = None,
        warmup_tokens: int = DEFAULT_WARMUP_TOKENS,
        cache_limit_bytes: int | None = None,
        engine: EngineOptions | None = None,
        spares: int = 0,
        ranks: int | None = None,
        backend: str = "auto",
        hosts: str | None = None,
        sharding: str = "auto",
        groups: Mapping[str, Group] | None = None,
        _worker_argv: list[str] | None = None,
    ) -> None:
        _ensure_logging()
        names = _model_map(model, models)
        every = Group(ranks=ranks, backend=backend, hosts=hosts, sharding=sharding)
        self._pool = Pool(
            names,
            workers=workers,
            transport=transport,
            timeouts=timeouts or Timeouts.from_env(),
            supervision=supervision or Supervision.from_env(),
            warmup_tokens=warmup_tokens,
            cache_limit_bytes=cache_limit_bytes,
            engine=engine,
            worker_argv=_worker_argv,  # tests substitute fake workers here
            spares=spares,
            groups=_groups(names, every, groups),
        )
        # Stop the workers even if the caller forgets: at garbage collection or interpreter exit.
        self._finalizer = weakref.finalize(self, self._pool.close)

    @property
    def transport(self) -> str:
        return self._pool.transport

    @property
    def workers(self) -> list[WorkerInfo]:
        """Every worker, the spares last (``spare=True``)."""
        return [s.info() for s in self._pool.all()]

    @property
    def models(self) -> list[str]:
        return list(self._pool.slots)

    @property
    def memory_pressure(self) -> str:
        """The last system memory-pressure level the monitor read: normal, warning,
        critical or unavailable."""
        return self._pool.pressure

    def stream(
        self, prompt: Prompt, *, model: str | None = None, keep_alive: float | None = None, **params: Any
    ) -> Stream:
        """Start a request and return its `Stream` of chunks.

        `keep_alive` (seconds) sets how long the model stays loaded once idle
        (Ollama's keep_alive; 0 unloads it right after this request).
        """
        req = new_request(self._pool, model, prompt, params)
        return Stream(self._pool, model, req, _keep_alive(keep_alive))

    def generate(
        self, prompt: Prompt, *, model: str | None = None, keep_alive: float | None = None, **params: Any
    ) -> Completion:
        """Run a request to the end and return its `Completion`."""
        stream = self.stream(prompt, model=model, keep_alive=keep_alive, **params)
        return _collect(list(stream), stream)

    def embed(
        self,
        inputs: embeddings.Inputs,
        *,
        model: str | None = None,
        dimensions: int | None = None,
        truncate: bool = False,
        keep_alive: float | None = None,
    ) -> np.ndarray:
        """Embed `inputs` with an embedding model: a float32 numpy array, one row per input, or a
        single vector (1-D) for a bare string or list of token ids.

        `inputs`: a string, a list of strings, a list of token ids or a list of such lists (texts
        are tokenized here, with the model's tokenizer). `dimensions`: keep each vector's first
        components, normalised again (Matryoshka models such as Qwen3-Embedding). `truncate`: cut
        an input longer than the model's context instead of refusing it. `keep_alive` as in
        `stream`. A model that is not an embedding model is a `ValueError`.
        """
        name = model or self._pool.default_model
        prepared = embeddings.prepare(self._pool.next_id(), inputs, self.model_info(model), name,
                                      dimensions=dimensions, truncate=truncate)
        return embeddings.run(self._pool, model, prepared, _keep_alive(keep_alive)).vectors

    def model_info(self, model: str | None = None) -> Ready | None:
        """What a worker of `model` reported when it became ready (context length, vocabulary
        size, versions, device); None until one has."""
        return next((s.ready for s in self._pool.model_slots(model) if s.ready is not None), None)

    def model_options(self, model: str | None = None) -> EngineOptions:
        """The options `model`'s workers run with, as checked at the edge (paths resolved)."""
        self._pool.model_slots(model)
        return self._pool.options[model or self._pool.default_model]

    def memory(self, timeout: float = 5.0) -> list[WorkerMemory]:
        """Each loaded worker's MLX and process memory (one round trip each)."""
        found = (s.memory(timeout) for s in self._pool.all())
        return [m for m in found if m is not None]

    def reset(self, model: str | None = None) -> None:
        """Clear a failed model's crash record and start its workers (and spares) again."""
        for slot in self._pool.model_slots(model) + self._pool.model_spares(model):
            slot.reset()

    def unload(self, model: str | None = None) -> int:
        """Stop the model's idle workers now (they reload on the next request); returns how many,
        its spares not counted (they go too, and come back with the model)."""
        unloaded = sum(slot.unload() for slot in self._pool.model_slots(model))
        self._pool.follow_spares()
        return unloaded

    def load(self, model: str | None = None, keep_alive: float | None = None) -> None:
        """Start the model's unloaded workers (and spares) in the background; `keep_alive` as in
        `stream`."""
        keep = _keep_alive(keep_alive)
        for slot in self._pool.model_slots(model):
            if keep is not None:
                slot.keep_alive_s = keep
            slot.touch()
            slot.load()
        self._pool.follow_spares()

    def close(self, drain_s: float = 0.0) -> None:
        """Stop every worker; idempotent. With `drain_s`, running requests get that long to
        finish before their workers are asked to exit (then SIGTERM, then SIGKILL)."""
        if drain_s > 0 and self._finalizer.alive:
            self._finalizer.detach()
            self._pool.close(drain_s)
        self._finalizer()

    def __enter__(self) -> Runtime:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _groups(models: Mapping[str, str], every: Group, groups: Mapping[str, Group] | None) -> dict[str, Group]:
    """`every` for each model unless it is the default (one process), then `groups`' own."""
    out = {name: every for name in models} if every != Group() else {}
    return {**out, **(groups or {})}


def _keep_alive(value: float | None) -> float | None:
    if value is None:
        return None
    if not isinstance(value, (int, float)) or isinstance(value, bool) or value < 0:
        raise ValueError(f"invalid keep_alive={value!r}: seconds >= 0, or None for the runtime default")
    return float(value)


class AsyncRuntime:
    """The asyncio twin of `Runtime`: ``async with AsyncRuntime(...) as rt``.

    Workers start in a thread so the event loop keeps running meanwhile.
    """

    def __init__(self, model: str | None = None, **kwargs: Any) -> None:
        _ensure_logging()
        self._args = (model, kwargs)
        self._rt: Runtime | None = None

    async def start(self) -> AsyncRuntime:
        model, kwargs = self._args
        self._rt = await asyncio.to_thread(Runtime, model, **kwargs)
        return self

    @property
    def runtime(self) -> Runtime:
        if self._rt is None:
            raise MlxrtError("AsyncRuntime is not started: use `async with` or `await rt.start()`")
        return self._rt

    @property
    def workers(self) -> list[WorkerInfo]:
        return self.runtime.workers

    @property
    def models(self) -> list[str]:
        return self.runtime.models

    @property
    def transport(self) -> str:
        return self.runtime.transport

    @property
    def memory_pressure(self) -> str:
        return self.runtime.memory_pressure

    def stream(
        self, prompt: Prompt, *, model: str | None = None, keep_alive: float | None = None, **params: Any
    ) -> AsyncStream:
        pool = self.runtime._pool
        req = new_request(pool, model, prompt, params)
        return AsyncStream(pool, model, req, _keep_alive(keep_alive))

    async def generate(
        self, prompt: Prompt, *, model: str | None = None, keep_alive: float | None = None, **params: Any
    ) -> Completion:
        stream = self.stream(prompt, model=model, keep_alive=keep_alive, **params)
        chunks = [c async for c in stream]
        return _collect(chunks, stream)

    async def embed(
        self,
        inputs: embeddings.Inputs,
        *,
        model: str | None = None,
        dimensions: int | None = None,
        truncate: bool = False,
        keep_alive: float | None = None,
    ) -> np.ndarray:
        """`Runtime.embed`, awaited; long texts are tokenized on a thread."""
        found = await self.embed_result(inputs, model=model, dimensions=dimensions, truncate=truncate,
                                        keep_alive=keep_alive)
        return found.vectors

    async def embed_result(
        self,
        inputs: embeddings.Inputs,
        *,
        model: str | None = None,
        dimensions: int | None = None,
        truncate: bool = False,
        keep_alive: float | None = None,
    ) -> embeddings.EmbedResult:
        """`embed`, with the inputs' token count and the worker's stats beside the vectors."""
        pool = self.runtime._pool
        name = model or pool.default_model
        prepare = functools.partial(embeddings.prepare, pool.next_id(), inputs, self.model_info(model), name,
                                    dimensions=dimensions, truncate=truncate)
        prepared = await asyncio.to_thread(prepare) if embeddings.needs_thread(inputs) else prepare()
        return await embeddings.run_async(pool, model, prepared, _keep_alive(keep_alive))

    def model_info(self, model: str | None = None) -> Ready | None:
        return self.runtime.model_info(model)

    def model_options(self, model: str | None = None) -> EngineOptions:
        return self.runtime.model_options(model)

    async def memory(self, timeout: float = 5.0) -> list[WorkerMemory]:
        return await asyncio.to_thread(self.runtime.memory, timeout)

    def reset(self, model: str | None = None) -> None:
        self.runtime.reset(model)

    def unload(self, model: str | None = None) -> int:
        return self.runtime.unload(model)

    def load(self, model: str | None = None, keep_alive: float | None = None) -> None:
        self.runtime.load(model, keep_alive)

    async def close(self, drain_s: float = 0.0) -> None:
        if self._rt is not None:
            await asyncio.to_thread(self._rt.close, drain_s)

    async def __aenter__(self) -> AsyncRuntime:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


def _ensure_logging() -> None:
    """A library must not print to the app's stdout: default to warnings on stderr."""
    if not structlog.is_configured():
        import os

        logs.configure(level=os.environ.get("MLXRT_LOG_LEVEL", "warning"))
