"""Supervision: one `Slot` per worker position, restarting its process when it dies.

::

    Slot states                       what moves it
    -----------                       -------------
    starting --ready--> ready/busy    worker's Ready message
    ready    --crash--> dead          EOF on the channel (kernel-noticed death)
    dead     --backoff--> starting    timer: backoff_initial_s * 2**(crashes-1), capped
    dead     --too many crashes--> failed   max_crashes within crash_window_s
    failed   --reset()--> starting
    ready    --idle keep_alive_s--> unloaded --next request--> starting
    any      --close()--> stopped

When a worker dies, the requests it had begun go on, on the next worker of
the slot (a spare, or the restarted one) or of a sibling slot: each is sent
again with the tokens its caller already has (`Generate.resume`), which the new
worker prefills as prompt and feeds through the reply's text, grammar and
sampler state without sending them, so the caller sees a pause, and a greedy or
seeded reply the tokens it would have had. A request goes on at most
`Supervision.max_resumes` times (MLXRT_MAX_RESUMES); the next death fails it
with `WorkerDied`, so a request that kills workers cannot walk through the pool.
Requests the worker had not begun (queued in it, or sent in the instant before
the death was noticed) are replayed once on the replacement, so a caller who
asks right after a crash gets an answer. Requests that arrive
while no worker is ready wait in the slot's pending queue rather than failing,
each until its deadline, `Timeouts.queue_s` after its submission (a replayed
request keeps the deadline it had): then it fails with `MlxrtTimeout` naming
MLXRT_QUEUE_TIMEOUT_S (`Pool` runs the clock, `Slot.expire`). Meanwhile the
pool moves them to a sibling slot of the same model that has a live worker,
if there is one (`Slot.steal_waiting`).

A standby slot (``standby=True``) holds a hot spare: a loaded, warmed-up worker
that is never sent requests. When an active slot's worker crashes, the slot
takes a ready spare of its model at once (`hand_over`), instead of waiting
for a backoff and a load, and the standby slot starts a new spare behind it.
With no spare ready, the restart goes as in the table, except that a slot
waiting out its backoff takes a spare as soon as one is ready (the pool
asks it to, `take_spare_now`, when any worker gets ready). Lock order: an active
slot's lock, then a standby slot's, then a worker handle's; a frame is never
sent while a slot's lock is held (a send may wait up to `Timeouts.send_s`).
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import replace

import structlog

from ..ipc.protocol import Done, Generate, Ready, Stats
from .config import DEFAULT_QUEUE_TIMEOUT_S, Supervision
from .errors import MlxrtTimeout, ModelFailedError, WorkerDied
from .handle import Entry, ExitCallback, Sink, WorkerHandle, WorkerInfo, WorkerMemory

log = structlog.get_logger("mlxrt.orchestrator")

#: spawn(on_exit) starts a worker process and returns its handle, not yet ready.
Spawn = Callable[[ExitCallback], WorkerHandle]
#: take_spare(on_exit): a ready spare of the slot's model, now reporting its death to on_exit; or None.
TakeSpare = Callable[[ExitCallback], "WorkerHandle | None"]


def _no_spare(_on_exit: ExitCallback) -> WorkerHandle | None:
    return None


def _nothing() -> None:
    pass

_slot_names = itertools.count(1)


class Slot:
    """One supervised worker position for one model (a hot spare's, with ``standby``)."""

    def __init__(
        self,
        model_name: str,
        spawn: Spawn,
        policy: Supervision,
        *,
        queue_s: float = DEFAULT_QUEUE_TIMEOUT_S,
        standby: bool = False,
        take_spare: TakeSpare = _no_spare,
        wake: Callable[[], None] = _nothing,
    ) -> None:
        self.name = f"s{next(_slot_names)}"
        self.model_name = model_name
        self.standby = standby
        self._spawn = spawn
        self._policy = policy
        self._queue_s = queue_s
        self._take_spare = take_spare
        #: Tells the pool that a request started waiting or a worker got ready (`Pool._mind_waiting`).
        self._wake_pool = wake
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self.handle: WorkerHandle | None = None
        self._loading: WorkerHandle | None = None
        self.state = "starting"
        self._pending: deque[Entry] = deque()
        self._crashes: deque[float] = deque()
        self._starting = False
        self._closing = False
        self._failure = ""
        self.restarts = 0
        #: Requests that went on after their worker died (`Entry.resumed`).
        self.resumes = 0
        #: The last Ready report of this slot's workers: kept across restarts and unloads.
        self.ready: Ready | None = None
        self.last_used = time.monotonic()
        self.keep_alive_s = policy.keep_alive_s

    # -- start-up -----------------------------------------------------------
    def begin(self) -> None:
        """Spawn the first worker (the caller then calls `finish`)."""
        self._loading = self._spawn(self._on_exit)

    def finish(self) -> None:
        """Wait for the first worker; its start-up errors propagate to the caller."""
        handle = self._loading
        assert handle is not None
        handle.wait_ready()
        with self._lock:
            self.handle, self._loading, self.state = handle, None, "ready"
            self.ready = handle.ready

    # -- requests -----------------------------------------------------------
    @property
    def routing_key(self) -> tuple[int, int]:
        """Routing key: (0 if ready else 1, requests in flight or waiting)."""
        h = self.handle
        ready = h is not None and h.alive
        return (0 if ready else 1, (h.in_flight if ready else 0) + len(self._pending))

    @property
    def saturated(self) -> bool:
        """Whether a request sent now would wait for a place in a batch (or for a worker)."""
        h = self.handle
        return h is None or not h.alive or h.saturated or bool(self._pending)

    @property
    def failed(self) -> bool:
        return self.state == "failed"

    def submit(self, req: Generate, sink: Sink, keep_alive_s: float | None = None) -> None:
        """Send `req` to this slot's worker, or hold it until a worker is ready (at most
        `queue_s` from now; then its sink gets `MlxrtTimeout`)."""
        entry = Entry(req, sink, deadline=time.monotonic() + self._queue_s)
        with self._lock:
            if self.state == "failed":
                raise ModelFailedError(self._failure)
            if self._closing:
                raise WorkerDied(f"runtime is closing: request {req.id} not started")
            self.last_used = time.monotonic()
            if keep_alive_s is not None:
                self.keep_alive_s = keep_alive_s
        self._dispatch(entry)

    def _dispatch(self, entry: Entry) -> None:
        """Send `entry` to the worker, outside the slot's lock; if there is none, or it is gone
        by the time the frame goes, hold the entry for the next one. Errors go to its sink."""
        tried: WorkerHandle | None = None
        while True:
            with self._lock:
                h = self.handle
                if h is None or not h.alive or h is tried:
                    error = self._hold(entry, start=h is None)
                    break
            try:
                h.submit(entry)
                return
            except WorkerDied:
                tried = h  # gone this instant: its death path replaces it; look once more
        if error is not None:
            entry.sink(error)

    def _hold(self, entry: Entry, *, start: bool) -> BaseException | None:
        """Queue `entry` for the next worker (starting one if `start`); or the error that ends it
        now instead. Lock held."""
        if self.state == "failed":
            return ModelFailedError(self._failure)
        if self._closing:
            return WorkerDied(f"runtime closed before request {entry.req.id} started")
        self._pending.append(entry)
        if start:
            self._ensure_starting(0.0)
        self._wake_pool()
        return None

    def _take_pending(self) -> list[Entry]:
        """Everything waiting, for a worker that is ready now. Lock held."""
        pending, self._pending = list(self._pending), deque()
        return pending

    @property
    def serving(self) -> bool:
        """Whether a request sent now goes straight to a live worker."""
        h = self.handle
        return not self.standby and h is not None and h.alive

    def dispatch(self, entry: Entry) -> None:
        """Take over a request that waited in a sibling slot without a worker."""
        self._dispatch(entry)

    def steal_waiting(self) -> list[Entry]:
        """The requests waiting here, taken away for a sibling slot with a worker; none if this
        slot has one itself."""
        with self._lock:
            return [] if self.serving else self._take_pending()

    def expire(self, now: float) -> float | None:
        """End with `MlxrtTimeout` the requests that waited for a worker past their deadline;
        return the nearest deadline still ahead, if any (monotonic s)."""
        with self._lock:
            late = [e for e in self._pending if e.deadline <= now]
            for e in late:
                self._pending.remove(e)
            nearest = min((e.deadline for e in self._pending), default=None)
            state = self.state
        for e in late:
            e.sink(MlxrtTimeout(
                f"request {e.req.id} got no worker of model {self.model_name!r} within {self._queue_s:g} s "
                f"(slot {self.name} is {state}; set MLXRT_QUEUE_TIMEOUT_S)"
            ))
        return nearest

    def cancel(self, req_id: int, *, discard: bool) -> None:
        with self._lock:
            entry = next((e for e in self._pending if e.req.id == req_id), None)
            if entry is not None:
                self._pending.remove(entry)
            h = self.handle
        if entry is not None:
            if not discard:
                entry.sink(Done(id=req_id, stats=Stats(finish_reason="cancelled")))
        elif h is not None:
            h.cancel(req_id, discard=discard)

    def touch(self) -> None:
        self.last_used = time.monotonic()

    # -- death and restart --------------------------------------------------
    def _on_exit(self, handle: WorkerHandle, error: WorkerDied, entries: list[Entry]) -> None:
        """Called by a worker's reader thread once it is gone: end or replay its requests."""
        ends: list[tuple[Entry, object]] = []
        with self._lock:
            crashed = handle.crashed and not self._closing
            if handle is self.handle:
                self.handle = None
                if crashed:
                    ends += self._record_crash(str(error))
                else:  # stopped on purpose: close
                    self.state = "stopped"
            replay = not self._closing and self.state != "failed"
            resumes = self._policy.max_resumes
            for e in reversed(entries):  # appendleft: keep their order, ahead of newer requests
                if e.cancelled:
                    ends.append((e, Done(id=e.req.id, stats=Stats(finish_reason="cancelled"))))
                elif replay and not e.started and not e.replayed:
                    e.replayed = True
                    self._pending.appendleft(e)
                elif replay and e.started and type(e.req) is Generate and e.resumes < resumes:
                    e.resumed(self._queue_s)
                    self.resumes += 1
                    log.warning("request.resumed", slot=self.name, model=self.model_name, id=e.req.id,
                                worker=handle.name, tokens=sum(map(len, e.got.values())), resume=e.resumes)
                    self._pending.appendleft(e)
                elif replay and e.started and type(e.req) is Generate:
                    ends.append((e, WorkerDied(f"{error}; request {e.req.id} went on after a worker died "
                                               f"{e.resumes} time(s) already (set MLXRT_MAX_RESUMES)")))
                else:
                    ends.append((e, error))
            ready = self.handle
            flush = self._take_pending() if ready is not None and self._pending else []
            if self._pending:
                if ready is None:  # e.g. a worker unloaded just as a request reached it
                    self._ensure_starting(0.0)
                self._wake_pool()
        for e, event in ends:
            e.sink(event)
        for e in flush:
            self._dispatch(e)

    def _record_crash(self, why: str) -> list[tuple[Entry, object]]:
        """Count a crash; take a spare's worker, restart after a backoff, or trip the breaker.
        Lock held."""
        now = time.monotonic()
        self._crashes.append(now)
        while self._crashes and now - self._crashes[0] > self._policy.crash_window_s:
            self._crashes.popleft()
        n = len(self._crashes)
        p = self._policy
        if n >= p.max_crashes or not p.restart:
            self.state = "failed"
            self._failure = (
                f"model {self.model_name!r} failed: {n} worker crash(es) within "
                f"{p.crash_window_s:g} s (set MLXRT_MAX_CRASHES, MLXRT_CRASH_WINDOW_S); "
                f"last: {why}; call Runtime.reset({self.model_name!r}) to try again"
                if p.restart
                else f"model {self.model_name!r}: worker died and restart is disabled; last: {why}"
            )
            log.error("slot.failed", slot=self.name, model=self.model_name, crashes=n, reason=why)
            return [(e, ModelFailedError(self._failure)) for e in self._take_pending()]
        if self._adopt_spare():
            return []
        self.state = "dead"
        delay = min(p.backoff_initial_s * 2 ** (n - 1), p.backoff_max_s)
        log.warning("slot.restart_scheduled", slot=self.name, model=self.model_name, in_s=delay, crashes=n)
        self._ensure_starting(delay)
        return []

    def _adopt_spare(self) -> bool:
        """Put a ready spare of this model in this slot's place, if there is one. Lock held."""
        if self.standby or self._closing:
            return False
        h = self._take_spare(self._on_exit)
        if h is None:
            return False
        self.handle, self.state, self.ready = h, "ready", h.ready
        self.restarts += 1
        self.last_used = time.monotonic()
        self._wake_pool()
        log.warning("slot.spare_took_over", slot=self.name, model=self.model_name, pid=h.pid,
                    restarts=self.restarts)
        return True

    def take_spare_now(self) -> None:
        """While waiting out a restart backoff, take a spare that has become ready meanwhile."""
        with self._lock:
            if self.state != "dead" or self.handle is not None or not self._adopt_spare():
                return
            pending = self._take_pending()
        for e in pending:
            self._dispatch(e)

    def hand_over(self, on_exit: ExitCallback) -> WorkerHandle | None:
        """Give this standby slot's ready worker away, its death now reported to `on_exit`, and
        start loading a new spare behind it; None if no spare is ready."""
        with self._lock:
            h = self.handle
            if h is None or self._closing or not h.adopt(on_exit):
                return None
            self.handle = None
            self._ensure_starting(0.0)
        log.info("slot.spare_handed_over", slot=self.name, model=self.model_name, pid=h.pid)
        return h

    def _ensure_starting(self, delay_s: float) -> None:
        """Start a worker in the background unless one is on its way. Lock held."""
        if self._starting or self._closing or self.state == "failed":
            return
        self._starting = True
        if delay_s == 0.0:
            self.state = "starting"
        threading.Thread(
            target=self._start, args=(delay_s,), name=f"mlxrt-{self.name}-start", daemon=True
        ).start()

    def _start(self, delay_s: float) -> None:
        if delay_s > 0 and self._wake.wait(delay_s) and self._closing:
            return
        with self._lock:
            if self._closing or self.handle is not None:  # or a spare took the place meanwhile
                self._starting = False
                return
            restart = bool(self._crashes)
            if restart and self._adopt_spare():  # a spare got ready during the backoff
                self._starting = False
                pending = self._take_pending()
            else:
                pending = None
                self.state = "starting"
        if pending is not None:
            for e in pending:
                self._dispatch(e)
            return
        handle = self._load()
        if handle is None:
            return
        with self._lock:
            self._loading = None
            self._starting = False
            if self._closing:
                stale = handle
            else:
                stale = None
                self.handle, self.state = handle, "ready"
                self.ready = handle.ready
                self.restarts += restart
                self.last_used = time.monotonic()
                pending = self._take_pending()
        if stale is not None:
            stale.stop()
            return
        log.info("slot.ready", slot=self.name, model=self.model_name, pid=handle.pid, restarts=self.restarts)
        self._wake_pool()  # requests waiting in a sibling without a worker can come here
        for e in pending or ():
            self._dispatch(e)

    def _load(self) -> WorkerHandle | None:
        """Spawn a worker and wait until it is ready; None (a crash recorded) if that fails."""
        try:
            handle = self._spawn(self._on_exit)
            with self._lock:
                self._loading = handle
                closing = self._closing
            if closing:  # close() ran while we spawned: it could not see this worker
                handle.kill()
                with self._lock:
                    self._loading, self._starting = None, False
                return None
            handle.wait_ready()
            return handle
        except Exception as exc:  # load errors, timeouts, spawn failures: all count as a crash
            with self._lock:
                self._loading = None
                self._starting = False
                if self._closing:
                    return None
                fail = self._record_crash(str(exc))
                flush = self._take_pending() if self.handle is not None else []
            for e, err in fail:
                e.sink(err)
            for e in flush:
                self._dispatch(e)
            return None

    # -- operations ---------------------------------------------------------
    def reset(self) -> None:
        """Clear a failed slot's crash record and start a worker again."""
        with self._lock:
            self._crashes.clear()
            if self.state == "failed":
                self.state = "dead"
                self._ensure_starting(0.0)

    def unload(self) -> bool:
        """Stop an idle worker (reloaded on the next request); False if busy or not loaded."""
        with self._lock:
            h = self.handle
            if h is None or not h.alive or h.in_flight or self._pending or self._closing:
                return False
            # Detach it under the lock: a request from now on starts a new worker
            # instead of reaching this one while it shuts down.
            self.handle, self.state = None, "unloaded"
        log.info("slot.unload", slot=self.name, model=self.model_name, pid=h.pid)
        h.stop()
        return True

    def load(self) -> None:
        """Start a worker now if none is loaded or loading."""
        with self._lock:
            if self.handle is None and self.state in ("unloaded", "stopped", "dead"):
                self._ensure_starting(0.0)

    def idle_for(self) -> float:
        """Seconds since the worker last had work (from the end of its last request)."""
        h = self.handle
        if h is None or h.in_flight or self._pending:
            return 0.0
        return time.monotonic() - max(self.last_used, h.last_done)

    def memory(self, timeout: float) -> WorkerMemory | None:
        h = self.handle
        if h is None or not h.alive:
            return None
        found = h.memory(timeout)
        if found is None:
            return None
        m, e = found
        return WorkerMemory(
            h.name, h.pid, m.active_bytes, m.peak_bytes, m.cache_bytes, m.rss_bytes,
            prompt_cache_bytes=e.prompt_cache_bytes, prompt_cache_entries=e.prompt_cache_entries,
            prompt_cache_hits=e.prompt_cache_hits, prompt_cache_misses=e.prompt_cache_misses,
            cached_tokens=e.cached_tokens_total, prompt_cache_cap_bytes=e.prompt_cache_cap_bytes,
            disk_cache=e.disk_cache, model=self.model_name,
        )

    def close(self, drain_s: float = 0.0) -> None:
        """Stop for good: fail waiting requests, optionally let running ones finish first."""
        with self._lock:
            self._closing = True
            self._wake.set()
            pending = self._take_pending()
            h, loading = self.handle, self._loading
            if drain_s > 0 and h is not None and h.in_flight:
                self.state = "draining"
        for e in pending:
            e.sink(WorkerDied(f"runtime closed before request {e.req.id} started"))
        if loading is not None:
            loading.kill()
        if h is not None:
            deadline = time.monotonic() + drain_s
            while h.in_flight and time.monotonic() < deadline:
                time.sleep(0.01)
            h.stop()
        with self._lock:
            self.state = "stopped"

    def info(self) -> WorkerInfo:
        h = self.handle or self._loading
        if h is None:
            base = WorkerInfo(name=self.name, pid=0, model=self.model_name, state=self.state,
                              transport="", in_flight=0, requests=0, tokens=0)
        else:
            base = h.info()
        state = base.state if self.state == "ready" else self.state
        waiting = len(self._pending)
        return replace(base, state=state, restarts=self.restarts, resumes=self.resumes, spare=self.standby,
                       in_flight=base.in_flight + waiting, queued=base.queued + waiting)
