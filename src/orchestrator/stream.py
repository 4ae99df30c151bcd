"""A request's stream of chunks: `Stream` (threads), `AsyncStream` (asyncio), and what they collect
(`Chunk`, `Completion`).

Events come back from the worker through a sink: a queue the caller's thread reads, or an asyncio
queue fed with ``call_soon_threadsafe``; a stream dropped mid-way is cancelled by the pool's monitor.
"""

from __future__ import annotations

import asyncio
import queue
import time
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ..ipc.protocol import (
    DetailedTokens,
    Done,
    Failed,
    Stats,
    TokenLogprob,
    Tokens,
    ToolCall,
)
from .errors import MlxrtError, MlxrtTimeout, RequestError
from .handle import WorkerInfo

if TYPE_CHECKING:
    from .pool import Pool
    from .request import Request

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
        raise RequestError(event.error_type, event.message, event.traceback, kind=event.kind,
                           field=event.field)
    if isinstance(event, BaseException):
        raise event
    raise MlxrtError(f"unexpected event {event!r}")


class _StreamBase:
    stats: Stats | None

    def __init__(self, pool: Pool, request: Request, sink) -> None:
        req = pool.admit(request)
        self.model = request.model or pool.default_model
        self.id = req.id
        self.stats = None
        #: Each choice's stats as it ends (n > 1); `stats` is the first choice's.
        self.choice_stats: dict[int, Stats] = {}
        self._done = False
        self._token_timeout = pool.timeouts.token_s
        self._dropped = pool.dropped
        self._slot = pool.submit(request.model, req, sink, request.keep_alive)

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

    def __init__(self, pool: Pool, request: Request) -> None:
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        super().__init__(pool, request, self._q.put)

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

    def __init__(self, pool: Pool, request: Request) -> None:
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

        super().__init__(pool, request, sink)

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


def collect(chunks: list[Chunk], stream: _StreamBase) -> Completion:
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
