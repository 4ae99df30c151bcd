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

When a worker dies, requests that had produced tokens fail at once with
`WorkerDied`; requests that had not (queued in the worker, or sent in the
instant before the death was noticed) are replayed once on the replacement,
so a caller who asks right after a crash gets an answer. Requests that arrive
while no worker is ready wait in the slot's pending queue (bounded by the
caller's token timeout) rather than failing.
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
from .config import Supervision
from .errors import ModelFailedError, WorkerDied
from .handle import Entry, ExitCallback, Sink, WorkerHandle, WorkerInfo, WorkerMemory

log = structlog.get_logger("mlxrt.orchestrator")

#: spawn(on_exit) starts a worker process and returns its handle, not yet ready.
Spawn = Callable[[ExitCallback], WorkerHandle]

_slot_names = itertools.count(1)


class Slot:
    """One supervised worker position for one model."""

    def __init__(self, model_name: str, spawn: Spawn, policy: Supervision) -> None:
        self.name = f"s{next(_slot_names)}"
        self.model_name = model_name
        self._spawn = spawn
        self._policy = policy
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
        """Send `req` to this slot's worker, or hold it until a worker is ready."""
        with self._lock:
            if self.state == "failed":
                raise ModelFailedError(self._failure)
            if self._closing:
                raise WorkerDied(f"runtime is closing: request {req.id} not started")
            self.last_used = time.monotonic()
            if keep_alive_s is not None:
                self.keep_alive_s = keep_alive_s
            h = self.handle
            if h is not None and h.alive:
                try:
                    h.submit(req, sink)
                    return
                except WorkerDied:
                    pass  # died this instant: hold the request for the replacement
            self._pending.append(Entry(req, sink))
            self._ensure_starting(0.0)

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
        """Called by a worker's reader thread once it is gone."""
        fail: list[tuple[Entry, BaseException]] = []
        with self._lock:
            crashed = handle.crashed and not self._closing
            if crashed and handle is self.handle:
                self.handle = None
                fail += self._record_crash(str(error))
            replacing = crashed and self.state != "failed"
            for e in reversed(entries):  # appendleft: keep their order, ahead of newer requests
                if e.cancelled:
                    fail.append((e, Done(id=e.req.id, stats=Stats(finish_reason="cancelled"))))
                elif replacing and not e.started and not e.replayed:
                    e.replayed = True
                    self._pending.appendleft(e)
                else:
                    fail.append((e, error))
            if not crashed and handle is self.handle:  # stopped on purpose: close
                self.handle = None
                self.state = "stopped"
        for e, event in fail:
            e.sink(event)

    def _record_crash(self, why: str) -> list[tuple[Entry, BaseException]]:
        """Count a crash; restart after a backoff or trip the breaker. Lock held."""
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
            pending, self._pending = list(self._pending), deque()
            return [(e, ModelFailedError(self._failure)) for e in pending]
        self.state = "dead"
        delay = min(p.backoff_initial_s * 2 ** (n - 1), p.backoff_max_s)
        log.warning("slot.restart_scheduled", slot=self.name, model=self.model_name, in_s=delay, crashes=n)
        self._ensure_starting(delay)
        return []

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
            if self._closing:
                self._starting = False
                return
            self.state = "starting"
            restart = bool(self._crashes)
        try:
            handle = self._spawn(self._on_exit)
            with self._lock:
                self._loading = handle
                closing = self._closing
            if closing:  # close() ran while we spawned: it could not see this worker
                handle.kill()
                with self._lock:
                    self._loading, self._starting = None, False
                return
            handle.wait_ready()
        except Exception as exc:  # load errors, timeouts, spawn failures: all count as a crash
            with self._lock:
                self._loading = None
                self._starting = False
                if self._closing:
                    return
                fail = self._record_crash(str(exc))
            for e, err in fail:
                e.sink(err)
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
                pending, self._pending = list(self._pending), deque()
        if stale is not None:
            stale.stop()
            return
        log.info("slot.ready", slot=self.name, model=self.model_name, pid=handle.pid, restarts=self.restarts)
        for e in pending:
            try:
                handle.submit(e.req, e.sink, replayed=e.replayed)
            except WorkerDied as exc:
                e.sink(exc)

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
            cached_tokens=e.cached_tokens_total,
        )

    def close(self, drain_s: float = 0.0) -> None:
        """Stop for good: fail waiting requests, optionally let running ones finish first."""
        with self._lock:
            self._closing = True
            self._wake.set()
            pending, self._pending = list(self._pending), deque()
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
        return replace(base, state=state, restarts=self.restarts,
                       in_flight=base.in_flight + waiting, queued=base.queued + waiting)
