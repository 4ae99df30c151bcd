"""The serve loop: a worker's requests, taken from its reader thread, run in the engine's batch on the
MLX thread (`Server`), and the frames sent back without ever making that thread wait (`Outbox`).

`main.py` is the process around it (handshake, channel, threads); `group.py`'s
`LeaderServer` is the same loop with each engine step shared with the other ranks.
"""

from __future__ import annotations

import os
import sys
import threading
import time
import traceback
from collections import deque

import jinja2
import msgspec

from ..ipc.channel import ChannelClosed, Sender
from ..ipc.protocol import (
    DEFAULT_BURST_MS,
    Cancel,
    ClearCache,
    DetailedTokens,
    Done,
    Embed,
    Embeddings,
    Failed,
    Generate,
    InvalidField,
    Ping,
    Pong,
    Shutdown,
    Started,
    Stats,
    Tokens,
    worker_codec,
)
from .limits import on_cuda
from .prompt import PromptTooLongError


class Outbox:
    """Sends frames without ever making the MLX thread wait on I/O.

    The calling thread sends a frame itself when nothing is queued and the
    channel takes it without waiting (`try_send`): no thread hand-off, whose
    GIL round trip would add up to a switch interval (5 ms) to a token's
    latency. Otherwise the frame is queued for the writer thread, which
    coalesces queued tokens into one frame per request, so under backpressure
    batching follows the consumer's actual speed with no added delay.
    """

    def __init__(self, tx: Sender) -> None:
        self._tx = tx
        self._encode = worker_codec().encode
        self._items: deque = deque()
        self._send_lock = threading.Lock()  # one sender at a time: the ring has one producer
        self._wake = threading.Event()
        self._closing = False
        self.failed: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="mlxrt-writer", daemon=True)
        self._thread.start()

    def token(self, req_id: int, token: int, text: str, reasoning: str = "", calls=None, logprob=None,
              index: int = 0) -> None:
        if logprob is not None or index:  # log-probabilities or a choice of n > 1 (worker/choices.py)
            frame = DetailedTokens(req_id, [token], text, reasoning, list(calls or ()), index,
                                   None if logprob is None else [logprob])
            if not self._try_direct(frame):
                self._enqueue((req_id, token, text, reasoning, calls, logprob, index))
        elif reasoning or calls:  # a chat reply's reasoning or tool calls (worker/reply.py)
            if not self._try_direct(Tokens(req_id, [token], text, reasoning, list(calls or ()))):
                self._enqueue((req_id, token, text, reasoning, calls))
        elif not self._try_direct(Tokens(req_id, [token], text)):
            self._enqueue((req_id, token, text))

    def message(self, msg: object) -> None:
        if not self._try_direct(msg):
            self._enqueue(msg)

    def _try_direct(self, msg: object) -> bool:
        if self._items or self.failed is not None or not self._send_lock.acquire(blocking=False):
            return False
        try:
            return not self._items and self._tx.try_send(self._encode(msg))
        except ChannelClosed as exc:
            self.failed = exc
            return False
        finally:
            self._send_lock.release()

    def _enqueue(self, item: object) -> None:
        self._items.append(item)
        self._wake.set()

    def close(self, timeout: float = 5.0) -> None:
        """Send what is queued, then stop the writer thread."""
        self._closing = True
        self._wake.set()
        self._thread.join(timeout)

    def _run(self) -> None:
        while True:
            self._wake.wait()
            self._wake.clear()
            with self._send_lock:
                try:
                    for msg in self._drain():
                        self._tx.send(self._encode(msg))
                except ChannelClosed as exc:
                    self.failed = exc
                    return
                except BaseException as exc:  # ring full past its timeout, an oversized frame...
                    # Frames already drained are lost: the channel can no longer be trusted.
                    # Dying lets the kernel tell the orchestrator (EOF -> WorkerDied, restart)
                    # instead of leaving it to wait for tokens that will never come.
                    print(f"mlxrt worker: writer failed, exiting: {exc!r}", file=sys.stderr, flush=True)
                    os._exit(3)
            if self._closing and not self._items:
                return

    def _drain(self) -> list:
        """Everything queued, as frames: each request's (each choice's) queued tokens in one frame.

        A batch interleaves requests token by token; merging per request (not only
        runs of one request) keeps a backed-up channel at one frame per request per
        drain. A request's tokens never move past its own Done or Failed.
        """
        out: list = []
        open_frames: dict[tuple[int, int, bool], Tokens] = {}  # by request, choice, and kind of frame
        items = self._items
        while items:
            item = items.popleft()
            if type(item) is tuple:
                req_id, token, text = item[:3]
                key = (req_id, item[6], True) if len(item) > 5 else (req_id, 0, False)
                frame = open_frames.get(key)
                if frame is not None:
                    frame.token_ids.append(token)
                    frame.text += text
                else:
                    frame = open_frames[key] = _frame(item)
                    out.append(frame)
                    continue
                if len(item) > 3:  # reasoning and tool calls
                    frame.reasoning += item[3]
                    frame.tool_calls.extend(item[4] or ())
                if len(item) > 5 and item[5] is not None:  # a log-probability
                    frame.logprobs.append(item[5])  # type: ignore[attr-defined]
            else:
                req_id = getattr(item, "id", None)
                if req_id is not None:
                    for key in [k for k in open_frames if k[0] == req_id]:
                        del open_frames[key]
                out.append(item)
        return out


def _frame(item: tuple) -> Tokens:
    """A queued token as the first of its frame: plain `Tokens` unless it carries details."""
    req_id, token, text = item[:3]
    if len(item) > 5:
        logprobs = None if item[5] is None else [item[5]]
        return DetailedTokens(req_id, [token], text, item[3], list(item[4] or ()), item[6], logprobs)
    if len(item) > 3:
        return Tokens(req_id, [token], text, item[3], list(item[4] or ()))
    return Tokens(req_id, [token], text)


class Gather:
    """When several replies end on one step, holds new requests back until as many have come, or for
    at most `window_s`, so that their prefills go into one batch.

    Clients that wait for a reply before sending their next request (agents, chats, a benchmark's
    streams) send their follow-ups a few milliseconds apart once a batch's replies end together.
    Admitted as they come, the first would be prefilled alone and the others would wait for that
    prefill to end: on an H200, 7 of 8 agents' turns waited 206-670 ms so
    (docs/benchmarks/gpu-h200-families.md#reading-it-2). In-process, where the next requests are
    submitted between two steps, this does not arise. A lone reply ending opens no hold: a single
    client's next request is admitted at once.

    On an idle worker, requests are also held until none has come for `quiet_s` (at most the larger
    of the window and `quiet_s` from the first): a burst's requests reach the worker over a few ms,
    and admitted as they come the first is prefilled alone and the others in uneven batches behind
    it. A lone request waits `quiet_s` once.
    """

    def __init__(self, window_s: float, quiet_s: float = 0.0) -> None:
        self.window_s = window_s
        self.quiet_s = quiet_s
        self._expect = 0  # follow-ups awaited
        self._until = 0.0  # perf_counter time the hold ends at the latest

    def ended(self, replies: int, now: float) -> None:
        """`replies` ended on the step that just ran; a wave during a hold joins it, never extends it."""
        if replies < 2 or self.window_s <= 0:
            return
        if self._expect and now < self._until:
            self._expect += replies
        else:
            self._expect, self._until = replies, now + self.window_s

    def hold(self, waiting: int, oldest: float, now: float, *, newest: float | None = None,
             idle: bool = False) -> float:
        """Seconds to keep `waiting` new requests back (0: admit them now), the oldest of them queued at
        `oldest`, the newest at `newest`; the hold ends for good once as many as ended have come or the
        window has passed, and no request is held longer than the window. `idle`: the worker runs
        nothing, and a burst's hold applies: until `quiet_s` after the newest, at most the larger of
        the window and `quiet_s` after the oldest."""
        until = min(self._until, oldest + self.window_s)
        if self._expect and waiting < self._expect and now < until:
            return until - now
        self._expect = 0
        if idle and newest is not None and self.quiet_s > 0:
            return max(0.0, min(newest + self.quiet_s, oldest + max(self.window_s, self.quiet_s)) - now)
        return 0.0


class Server:
    """Takes requests from the reader thread and runs them in the engine's batch on the MLX thread.

    The reader thread only queues, and compiles a request's grammar before
    queueing it: every engine call (submit, cancel, step) happens on the MLX
    thread, between batch steps, so a request that arrives mid-generation
    joins the batch at the next step. After a wave of replies ends, new
    requests are held back a moment to be prefilled together (`Gather`);
    the running ones keep decoding meanwhile.
    """

    def __init__(self, engine, outbox: Outbox) -> None:
        self._engine = engine
        self._outbox = outbox
        self._cond = threading.Condition()
        self._inbox: deque[tuple[Generate | Embed, float]] = deque()
        self._cancels: list[int] = []
        self._stopping = False
        self._clear_cache = False
        burst_ms = engine.options.burst_ms
        if burst_ms is None:  # auto: held where a burst's uneven batches cost graph builds
            burst_ms = DEFAULT_BURST_MS if on_cuda() else 0
        self._gather = Gather(engine.options.gather_ms / 1000, burst_ms / 1000)
        self._ended = 0  # replies that ended on the current step (not cancelled ones)

    # -- reader thread --
    def on_message(self, msg: object) -> None:
        arrived = time.perf_counter()
        if isinstance(msg, Generate) and self._engine.grammars is not None:  # None: an embedding model's
            # Grammars compiled here, off the MLX thread (llguidance drops the GIL); admission takes a copy.
            self._engine.prepare(msg)
        with self._cond:
            if isinstance(msg, (Generate, Embed)):
                self._inbox.append((msg, arrived))
            elif isinstance(msg, Cancel):
                self._cancels.append(msg.id)
            elif isinstance(msg, Shutdown):
                self._stopping = True
            elif isinstance(msg, Ping):
                engine = self._engine
                report = engine.report()
                if self._inbox:  # requests held back count as queued too
                    report = msgspec.structs.replace(report, queued=report.queued + len(self._inbox))
                self._outbox.message(Pong(seq=msg.seq, memory=engine.memory(), engine=report))
            elif isinstance(msg, ClearCache):
                self._clear_cache = True  # done on the MLX thread, between steps
            self._cond.notify()

    def on_eof(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify()

    # -- MLX thread --
    def serve_forever(self) -> None:
        engine = self._engine
        while True:
            with self._cond:
                while True:
                    held = self._held(time.perf_counter())
                    if (self._inbox and not held) or self._cancels or self._stopping or self._clear_cache \
                            or engine.busy or self._warming():
                        break
                    self._cond.wait(held or None)  # a hold ends by its deadline, or when more arrive
                stopping, inbox, cancels, clear, dropped = self._take(held)
            if stopping:
                self._end_all(inbox)
                return
            for req in dropped:  # cancelled while held back: it never reached the engine
                self.done(req.id, Stats(finish_reason="cancelled"), "")
            if clear:
                engine.clear_cache()
            for req, queued_at in inbox:
                engine.submit(req, self, queued_at=queued_at)
            for req_id in cancels:
                engine.cancel(req_id)  # False: it already ended, and its end was sent
            if not engine.busy and self._warming():  # idle: read one more layer of a disk entry back
                engine.warm_step()
                continue
            self._ended = 0
            engine.step()
            self._gather.ended(self._ended, time.perf_counter())

    def _warming(self) -> bool:
        """Whether the engine is reading disk entries back into memory (`Engine.warm_step`); engines
        without a disk tier (vision, embeddings) never are."""
        return getattr(self._engine, "warming", False)

    def _held(self, now: float, *, busy: bool = False) -> float:
        """How long the queued requests are still held back (under the lock); 0 when none are queued.
        `busy`: work taken but not yet in the engine (a group's rank 0) counts as running."""
        if not self._inbox:
            return 0.0
        return self._gather.hold(len(self._inbox), self._inbox[0][1], now, newest=self._inbox[-1][1],
                                 idle=not (busy or self._engine.busy))

    def _take(self, held: float) -> tuple[bool, deque, list[int], bool, list[Generate | Embed]]:
        """What the MLX thread acts on now (under the lock): whether to stop, the requests to admit (none
        while `held` > 0 s, unless stopping), the cancels, whether to clear the cache, and the held
        requests those cancels dropped."""
        stopping = self._stopping
        inbox: deque = deque()
        if not held or stopping:  # held requests stay queued while the running ones decode
            inbox, self._inbox = self._inbox, deque()
        cancels, self._cancels = self._cancels, []
        clear, self._clear_cache = self._clear_cache, False
        return stopping, inbox, cancels, clear, self._drop_held(cancels)

    def _drop_held(self, cancels: list[int]) -> list[Generate | Embed]:
        """Take the held-back requests that `cancels` name out of the inbox (under the lock)."""
        if not cancels or not self._inbox:
            return []
        gone = set(cancels)
        dropped = [req for req, _ in self._inbox if req.id in gone]
        if dropped:
            self._inbox = deque(item for item in self._inbox if item[0].id not in gone)
        return dropped

    def _end_all(self, inbox) -> None:
        """Shutdown or EOF: everything queued or running ends as cancelled."""
        for req, _ in inbox:
            self.done(req.id, Stats(finish_reason="cancelled"), "")
        self._engine.cancel_all()
        self._engine.close()

    # -- the engine's listener (MLX thread) --
    def started(self, req_id: int) -> None:
        self._outbox.message(Started(req_id))

    def token(self, req_id: int, token: int, text: str, reasoning: str = "", calls=None, *, logprob=None,
              index: int = 0) -> None:
        self._outbox.token(req_id, token, text, reasoning, calls, logprob, index)

    def done(self, req_id: int, stats: Stats, text: str, reasoning: str = "", calls=None, *, index: int = 0,
             final: bool = True) -> None:
        if final and stats.finish_reason != "cancelled":
            self._ended += 1
        self._outbox.message(Done(id=req_id, stats=stats, text=text, reasoning=reasoning,
                                  tool_calls=list(calls or ()), index=index, final=final))

    def embedded(self, req_id: int, dim: int, data: bytes, stats: Stats) -> None:
        self._outbox.message(Embeddings(id=req_id, dim=dim, data=data, stats=stats))

    def failed(self, req_id: int, exc: BaseException) -> None:
        kind, field = failure_kind(exc)
        self._outbox.message(Failed(id=req_id, error_type=type(exc).__name__, message=str(exc),
                                    traceback=_format(exc), kind=kind, field=field))


def failure_kind(exc: BaseException) -> tuple[str, str | None]:
    """`Failed.kind` and `.field` for `exc`, by its type: a prompt beyond the context, the request's own
    fault (every check the worker makes raises a `ValueError`; a chat template refusing the conversation
    raises jinja's `TemplateError`), else internal."""
    if isinstance(exc, PromptTooLongError):
        return "too_long", "prompt"
    if isinstance(exc, InvalidField):
        return "invalid", exc.field
    if isinstance(exc, jinja2.TemplateError):
        return "invalid", "messages"
    if isinstance(exc, ValueError):
        return "invalid", None
    return "internal", None


def _format(exc: BaseException) -> str:
    return "".join(traceback.format_exception(exc))
