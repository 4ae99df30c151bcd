"""One worker process as the orchestrator sees it: spawn, handshake, dispatch, stop.

Death is noticed by the kernel: when the worker exits for any reason its end
of the frame channel closes, the reader thread gets EOF and every request in
flight fails at once with `WorkerDied` (or is resumed elsewhere, `supervisor`).
The channel closes only once the worker's last thread is gone, which on MLX's
CUDA backend comes 100-350 ms after its main thread (the driver tears its
context down first); so while requests are in flight and no frame comes, the
reader also looks every `DEATH_PROBE_S` for an exited main thread (Linux:
/proc), drains what was sent, and ends then; and every `IDLE_DEATH_PROBE_S`
while idle, for a worker whose child outlives it holding its channel open.
A malformed frame is treated the same way (the worker is stopped: its channel
can no longer be trusted), and so is a worker that does not read its input
within `Timeouts.send_s`: every write to it has that limit, and a cut-off
frame would leave its input unusable anyway.

Whoever takes a request out of `_sinks` owns its end: the reader thread (its
Done or Failed), the death path (every entry left when the worker is gone),
or `submit` itself when the frame could not be sent.
"""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import msgspec
import structlog

from ..ipc.channel import MAX_FRAME_BYTES, ChannelClosed, ChannelCorrupt, Receiver
from ..ipc.protocol import (
    DEFAULT_DECODE_CONCURRENCY,
    PROTOCOL_VERSION,
    Attached,
    Cancel,
    ClearCache,
    DetailedTokens,
    DiskCacheReport,
    Done,
    Embeddings,
    EngineOptions,
    EngineReport,
    Failed,
    Fatal,
    Generate,
    Hello,
    MemoryReport,
    Ping,
    Pong,
    Ready,
    Resume,
    Shutdown,
    Started,
    Tokens,
    orchestrator_codec,
)
from ..ipc.stdio import PipeReceiver, PipeSender
from .config import Timeouts
from .errors import ChannelError, MlxrtTimeout, ModelLoadError, WorkerDied

log = structlog.get_logger("mlxrt.orchestrator")

#: While requests are in flight and no frame comes, how often the reader looks whether the worker's
#: main thread has exited (`exit_status`), s: what a death may go unnoticed before its channel closes;
#: and how often while none is (a child of the worker's that outlives it keeps its channel open).
DEATH_PROBE_S = 0.01
IDLE_DEATH_PROBE_S = 0.1


def exit_status(pid: int) -> int | None:
    """Child `pid`'s returncode (as `Popen`'s: -N for signal N) once its main thread has exited, while
    its other threads may still be exiting; None while it runs, once reaped, or without /proc (then the
    channel's close tells). Linux's /proc/PID/stat: the state (3rd field), the wait status (52nd)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rpartition(b")")[2].split()
    except OSError:
        return None
    if len(fields) < 50 or fields[0] not in (b"Z", b"X"):
        return None
    status = int(fields[49])
    return -(status & 0x7F) if status & 0x7F else status >> 8


#: sink(event) receives a request's Tokens, then one Done or Failed, or a WorkerDied (with n > 1,
#: a Done per choice, the last one `final`; an Embed request: one Embeddings, Done if cancelled, or Failed).
Sink = Callable[[object], None]


@dataclass
class Entry:
    """A request in flight on a worker: where its events go, and how far it got."""

    req: Generate
    sink: Sink
    #: The worker began it (Started received): not replayed if the worker dies.
    started: bool = False
    #: Already replayed once after a crash: never twice.
    replayed: bool = False
    #: The caller cancelled it: it ends as cancelled, never replayed.
    cancelled: bool = False
    #: While it waits for a worker (queued, or replayed after a crash), it fails at this
    #: `time.monotonic()` (its submission plus `Timeouts.queue_s`).
    deadline: float = float("inf")
    #: What the caller has got, for a resume if the worker dies (`Slot`): each choice's token ids, by
    #: choice index, and the choices that have ended.
    got: dict[int, list[int]] = field(default_factory=dict)
    ended: set[int] = field(default_factory=set)
    #: Times it went on after its worker died.
    resumes: int = 0

    def took(self, msg: Tokens) -> None:
        """Note tokens passed to the caller."""
        index = msg.index if type(msg) is DetailedTokens else 0
        got = self.got.get(index)
        if got is None:
            self.got[index] = list(msg.token_ids)
        else:
            got += msg.token_ids

    def resumed(self, queue_s: float) -> None:
        """Make the request go on from what the caller has got, on the next worker (`Generate.resume`),
        waiting for one at most `queue_s` from now."""
        self.resumes += 1
        n = self.req.params.n
        resume = Resume(tokens=[list(self.got.get(i, ())) for i in range(n)], ended=sorted(self.ended),
                        count=self.resumes)
        self.req = msgspec.structs.replace(self.req, resume=resume)
        self.started = False
        self.deadline = time.monotonic() + queue_s


#: on_exit(handle, error, entries): called once from the reader thread when the worker is gone,
#: with the requests still in flight; the callback must end or re-route every one of them.
ExitCallback = Callable[["WorkerHandle", WorkerDied, list[Entry]], None]

_names = itertools.count(1)


@dataclass(frozen=True)
class WorkerMemory:
    """One worker's memory, bytes (peak: since its current or last request began)."""

    name: str
    pid: int
    active_bytes: int
    peak_bytes: int
    cache_bytes: int
    rss_bytes: int
    #: The worker's prefix cache: bytes held, entries, lookups that hit and missed, tokens served,
    #: and its byte cap (the option's, or the worker's share of auto; 0: off).
    prompt_cache_bytes: int = 0
    prompt_cache_entries: int = 0
    prompt_cache_hits: int = 0
    prompt_cache_misses: int = 0
    cached_tokens: int = 0
    prompt_cache_cap_bytes: int = 0
    #: The prefix cache's disk tier (`DiskCacheReport`: bytes, budget, entries and its counters); None
    #: without one.
    disk_cache: DiskCacheReport | None = None
    #: The model this worker serves.
    model: str = ""


@dataclass(frozen=True)
class RankInfo:
    """One process of a worker group: its rank, its pid on its host, the host, its state
    (starting, ready, exited)."""

    rank: int
    pid: int
    host: str
    state: str


@dataclass(frozen=True)
class WorkerInfo:
    """A snapshot of one worker, as `Runtime.workers` reports it.

    state: starting, ready, busy, draining, dead (restarting), failed, unloaded, stopped.
    """

    name: str
    pid: int
    model: str
    state: str
    transport: str
    in_flight: int
    requests: int
    tokens: int
    restarts: int = 0
    #: Requests that went on after a worker of this slot died (`MLXRT_MAX_RESUMES`).
    resumes: int = 0
    #: Of `in_flight`: sequences in the worker's batch, and requests waiting for a place in it.
    batch_size: int = 0
    queued: int = 0
    #: A hot spare: loaded and warmed up, standing by for a crashed worker's place; never sent requests.
    spare: bool = False
    #: A worker group's processes, rank 0 (this worker's `pid`) first; empty for a single process.
    ranks: tuple[RankInfo, ...] = ()


def _discard(_event: object) -> None:
    pass


def _fail_all(_handle: WorkerHandle, error: WorkerDied, entries: list[Entry]) -> None:
    for entry in entries:
        entry.sink(error)


class WorkerHandle:
    """A worker process and its channels. States: starting, ready, stopping, dead."""

    def __init__(
        self,
        model: str,
        *,
        model_name: str,
        transport: str,
        timeouts: Timeouts,
        warmup_tokens: int,
        cache_limit_bytes: int | None = None,
        engine: EngineOptions | None = None,
        argv: list[str] | None = None,
        on_exit: ExitCallback = _fail_all,
        prompt_cache_share: int = 1,
        device: str | None = None,
    ) -> None:
        self.model = model
        #: The GPU this worker may use (its CUDA_VISIBLE_DEVICES), on a host of several; None: as inherited.
        self.device = device
        self.engine = engine or EngineOptions()
        #: How many workers split the auto prompt cache cap (`Hello.prompt_cache_share`).
        self.prompt_cache_share = prompt_cache_share
        self._argv = argv or [sys.executable, "-m", "mlxrt.worker"]
        self._on_exit = on_exit
        self.model_name = model_name
        self.transport = transport
        self.name = f"w{next(_names)}"
        self._timeouts = timeouts
        self._lock = threading.Lock()
        #: Frames the pipe did not take at once, in order, for the writer thread (`_send`).
        self._outq: deque[bytes] = deque()
        self._out = threading.Condition()
        self._writer: threading.Thread | None = None
        self._write_failed: str | None = None  # why the writer stopped: later sends raise ChannelClosed
        self._sinks: dict[int, Entry] = {}
        self._pings: dict[int, tuple[threading.Event, list[Pong]]] = {}
        self._ping_seq = itertools.count(1)
        self._state = "starting"
        self._requests = 0
        self._tokens = 0
        self._stderr_tail: deque[str] = deque(maxlen=40)
        self._codec = orchestrator_codec()
        self._ring = None
        self._reading = False
        #: Why this side killed the worker (a send timeout), for the error its requests get.
        self._kill_reason: WorkerDied | None = None
        self.ready: Ready | None = None
        self.death: WorkerDied | None = None
        #: Set when the worker is gone: True unless it was asked to stop.
        self.crashed = False
        #: When its last request ended (monotonic s): idle time counts from here.
        self.last_done = time.monotonic()
        self._spawn(warmup_tokens, cache_limit_bytes)

    # -- life cycle ---------------------------------------------------------
    def _spawn(self, warmup_tokens: int, cache_limit_bytes: int | None) -> None:
        hello = Hello(
            protocol=PROTOCOL_VERSION,
            model=self.model,
            worker_id=self.name,
            transport=self.transport,  # type: ignore[arg-type]
            warmup_tokens=warmup_tokens,
            cache_limit_bytes=cache_limit_bytes,
            engine=self.engine,
            prompt_cache_share=self.prompt_cache_share,
            **self._hello_extra(),
        )
        pass_fds: tuple[int, ...] = ()
        if self.transport == "ring":
            from ..ipc.ring import RingChannel

            self._ring = RingChannel.create()
            hello = msgspec.structs.replace(hello, ring=self._ring.spec)
            pass_fds = self._ring.child_fds
        self.proc = subprocess.Popen(
            self._argv,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            pass_fds=pass_fds,
            bufsize=0,
            env=None if self.device is None else {**os.environ, "CUDA_VISIBLE_DEVICES": self.device},
            **self._popen_extra(),
        )
        self.pid = self.proc.pid
        self._tx = PipeSender(os.dup(self.proc.stdin.fileno()))
        self.proc.stdin.close()
        self._rx: Receiver
        if self._ring is not None:
            self._ring.after_spawn(self.pid)
            self._rx = self._ring.receiver()
            self.proc.stdout.close()
        else:
            self._rx = PipeReceiver(os.dup(self.proc.stdout.fileno()))
            self.proc.stdout.close()
        self._stderr_thread = threading.Thread(
            target=self._pump_stderr, name=f"mlxrt-{self.name}-stderr", daemon=True
        )
        self._stderr_thread.start()
        try:
            self._tx.send(self._codec.encode(hello))
        except ChannelClosed:
            pass  # it already exited: wait_ready reports how, with its stderr

    def _hello_extra(self) -> dict:
        """More fields of the worker's Hello (a worker group's rank 0 adds its place)."""
        return {}

    def _popen_extra(self) -> dict:
        """More arguments of the worker's Popen (a worker group's rank 0 leads a process group)."""
        return {}

    def wait_ready(self) -> Ready:
        """Block until the worker is ready; raise `ModelLoadError` or `MlxrtTimeout` otherwise.

        On failure the process is stopped before the error is raised.
        """
        limit = self._timeouts.ready_s
        deadline = time.monotonic() + limit
        try:
            while True:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TimeoutError
                msg = self._codec.decode(self._rx.recv(timeout=remaining))
                if isinstance(msg, Attached) and self._ring is not None:
                    self._ring.mark_attached()
                elif isinstance(msg, Ready):
                    break
                if isinstance(msg, Fatal):
                    raise ModelLoadError(
                        f"worker for model {self.model!r} failed to start: "
                        f"{msg.error_type}: {msg.message}"
                    )
        except TimeoutError:
            self.kill()
            raise MlxrtTimeout(
                f"worker for model {self.model!r} did not become ready within {limit:g} s "
                "(set MLXRT_READY_TIMEOUT_S)"
            ) from None
        except (ChannelClosed, msgspec.DecodeError) as exc:
            code = self._reap(1.0)
            self.kill()  # still running after a garbage frame; and either way its fds must go
            raise ModelLoadError(
                f"worker for model {self.model!r} exited before it was ready "
                f"(exit code {code}): {self._last_stderr()}"
            ) from exc
        except BaseException:
            self.kill()
            raise
        if msg.protocol != PROTOCOL_VERSION:
            self.kill()
            raise ModelLoadError(f"worker speaks protocol {msg.protocol}, expected {PROTOCOL_VERSION}")
        self.ready = msg
        with self._lock:
            self._state = "ready"
        self._reading = True
        threading.Thread(target=self._read, name=f"mlxrt-{self.name}-reader", daemon=True).start()
        log.info("worker.ready", worker=self.name, pid=self.pid, model=self.model_name,
                 transport=self.transport, load_s=round(msg.load_s, 3), device=msg.device)
        return msg

    def stop(self, timeout: float | None = None) -> None:
        """Ask the worker to exit; SIGTERM then SIGKILL if it does not within `timeout` s."""
        timeout = self._timeouts.shutdown_s if timeout is None else timeout
        with self._lock:
            if self._state == "ready":
                self._state = "stopping"
        try:
            self._send(self._codec.encode(Shutdown()))
        except ChannelClosed:
            pass
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            log.warning("worker.stop_timeout", worker=self.name, pid=self.pid, timeout_s=timeout)
            self.proc.terminate()
            try:
                self.proc.wait(2.0)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._close_channels()

    def kill(self) -> None:
        """SIGKILL the worker and release its channels."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        self._close_channels()

    def _close_channels(self) -> None:
        self._stop_writing("the worker's channels are closed")  # ends the writer thread, if any
        self._tx.close()
        if not self._reading:  # else the reader thread closes it (and the ring) at EOF
            self._rx.close()
            if self._ring is not None:
                self._ring.close()
        self._stderr_thread.join(5.0)

    def _exit_code(self) -> int | None:
        """The worker's returncode as soon as its main thread has one (`exit_status`), so that its
        requests go on before its last thread is gone; else after up to 1 s of waiting for the exit."""
        code = self.proc.poll()
        if code is None:
            code = exit_status(self.pid)
        return self._reap(1.0) if code is None else code

    def _reap(self, timeout: float) -> int | None:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return None

    # -- requests -----------------------------------------------------------
    def submit(self, entry: Entry) -> None:
        """Send a request; its events go to `entry.sink` from the reader thread.

        Raises `WorkerDied` if the worker is not ready or the frame could not be sent:
        the request is then the caller's again. If the worker died while the frame
        was on its way, the death path owns the request and this returns.
        """
        frame = self._codec.encode(entry.req)
        with self._lock:
            if self._state != "ready":
                raise self.death or WorkerDied(f"worker {self.name} (pid {self.pid}) is {self._state}")
            self._sinks[entry.req.id] = entry
            self._requests += 1
        try:
            self._send(frame)
        except ChannelClosed:
            with self._lock:
                mine = self._sinks.get(entry.req.id) is entry
                if mine:
                    del self._sinks[entry.req.id]
            if mine:
                gone = WorkerDied(f"worker {self.name} (pid {self.pid}) is gone")
                raise self.death or self._kill_reason or gone from None

    def adopt(self, on_exit: ExitCallback) -> bool:
        """Send this worker's death to `on_exit` from now on; False if it is already gone (or going)."""
        with self._lock:
            if self._state != "ready":
                return False
            self._on_exit = on_exit
            return True

    def _send(self, frame: bytes) -> None:
        """Send one frame without waiting; raise `ChannelClosed` if the worker is gone.

        The frame is written at once when the pipe takes it whole (a frame of up to PIPE_BUF
        bytes, nothing queued before it); otherwise it waits, in order, for the writer thread.
        So no caller, not a Slot under its lock nor an asyncio event loop, waits on a worker
        that has stopped reading: the writer gives up after `Timeouts.send_s` and kills it.
        """
        if len(frame) > MAX_FRAME_BYTES:
            raise ValueError(f"frame of {len(frame)} bytes exceeds MAX_FRAME_BYTES={MAX_FRAME_BYTES}")
        with self._out:
            if self._write_failed is not None:
                raise ChannelClosed(self._write_failed)
            if not self._outq and self._tx.try_send(frame):
                return
            self._outq.append(frame)
            if self._writer is None:
                self._writer = threading.Thread(target=self._write_queued, name=f"mlxrt-{self.name}-writer",
                                                daemon=True)
                self._writer.start()
            self._out.notify()

    def _write_queued(self) -> None:
        """The writer thread: queued frames to the pipe, each within `Timeouts.send_s`.

        A worker that does not take a frame in time is killed: the reader thread then sees EOF
        and ends its requests (the queued ones among them) with an error naming
        MLXRT_SEND_TIMEOUT_S. A closed pipe ends the thread the same way, through the death path.
        """
        limit = self._timeouts.send_s
        while True:
            with self._out:
                while not self._outq:
                    if self._write_failed is not None:  # the channels were closed
                        return
                    self._out.wait()
                frame = self._outq[0]
            try:
                self._tx.send(frame, timeout=limit)
            except TimeoutError:
                self._kill_reason = WorkerDied(
                    f"worker {self.name} (pid {self.pid}) did not read its input for {limit:g} s and was "
                    "killed (set MLXRT_SEND_TIMEOUT_S)"
                )
                log.error("worker.send_timeout", worker=self.name, pid=self.pid, timeout_s=limit)
                self.proc.kill()
                self._stop_writing(str(self._kill_reason))
                return
            except ChannelClosed as exc:
                self._stop_writing(str(exc))
                return
            with self._out:
                self._outq.popleft()

    def _stop_writing(self, why: str) -> None:
        """The pipe is unusable: drop what is queued (the death path ends those requests)."""
        with self._out:
            if self._write_failed is None:
                self._write_failed = why
            self._outq.clear()
            self._out.notify()

    def cancel(self, req_id: int, *, discard: bool = False) -> None:
        """Stop a request between two tokens; with `discard`, drop its remaining events.

        Safe to call twice or after the request ended.
        """
        with self._lock:
            entry = self._sinks.get(req_id)
            if entry is None or self._state != "ready":
                return
            entry.cancelled = True
            if discard:
                entry.sink = _discard
        try:
            self._send(self._codec.encode(Cancel(req_id)))
        except ChannelClosed:
            pass

    def memory(self, timeout: float) -> tuple[MemoryReport, EngineReport] | None:
        """Ask the worker for its memory and engine figures; None if it does not answer within `timeout` s."""
        seq = next(self._ping_seq)
        done: tuple[threading.Event, list[Pong]] = (threading.Event(), [])
        self._pings[seq] = done
        try:
            self._send(self._codec.encode(Ping(seq)))
            done[0].wait(timeout)
        except ChannelClosed:
            pass
        finally:
            self._pings.pop(seq, None)
        if not done[1]:
            return None
        pong = done[1][0]
        return pong.memory, pong.engine or EngineReport()

    def clear_cache(self) -> None:
        """Ask the worker to free MLX's buffer cache between requests."""
        try:
            self._send(self._codec.encode(ClearCache()))
        except ChannelClosed:
            pass

    @property
    def in_flight(self) -> int:
        return len(self._sinks)

    @property
    def saturated(self) -> bool:
        """Whether a new request would wait for a place in the worker's batch."""
        ready = self.ready.decode_concurrency if self.ready is not None else 0
        return len(self._sinks) >= (ready or self.engine.decode_concurrency or DEFAULT_DECODE_CONCURRENCY)

    @property
    def alive(self) -> bool:
        return self._state == "ready"

    def info(self) -> WorkerInfo:
        batch = sum(1 for e in list(self._sinks.values()) if e.started)
        return WorkerInfo(
            name=self.name,
            pid=self.pid,
            model=self.model_name,
            state=("busy" if self._sinks else "ready") if self._state == "ready" else self._state,
            transport=self.transport,
            in_flight=len(self._sinks),
            requests=self._requests,
            tokens=self._tokens,
            batch_size=batch,
            queued=len(self._sinks) - batch,
        )

    # -- threads ------------------------------------------------------------
    def _next_frame(self) -> bytes:
        """The worker's next frame; `ChannelClosed` once it has exited (its main thread, `exit_status`)
        and every frame it sent is read. Waits in `DEATH_PROBE_S` steps while requests are in flight,
        else `IDLE_DEATH_PROBE_S`."""
        gone = False
        while True:
            try:  # once gone, one more wait: a thread of the worker's may still be finishing a write
                return self._rx.recv(DEATH_PROBE_S if gone or self._sinks else IDLE_DEATH_PROBE_S)
            except TimeoutError:
                if gone:
                    raise ChannelClosed(f"worker {self.name} (pid {self.pid}) exited") from None
                gone = exit_status(self.pid) is not None

    def _read(self) -> None:
        decode, sinks = self._codec.decode, self._sinks
        try:
            while True:
                msg = decode(self._next_frame())
                if type(msg) is Tokens or type(msg) is DetailedTokens:
                    self._tokens += len(msg.token_ids)
                    entry = sinks.get(msg.id)
                    if entry is not None:
                        entry.took(msg)
                        entry.sink(msg)
                elif type(msg) is Done and not msg.final:  # one of n choices ended; others run on
                    entry = sinks.get(msg.id)
                    if entry is not None:
                        entry.ended.add(msg.index)
                        entry.sink(msg)
                elif type(msg) is Started:
                    entry = sinks.get(msg.id)
                    if entry is not None:
                        entry.started = True
                elif isinstance(msg, (Done, Failed, Embeddings)):
                    with self._lock:
                        entry = sinks.pop(msg.id, None)
                        self.last_done = time.monotonic()
                    if entry is not None:
                        entry.sink(msg)
                elif isinstance(msg, Pong):
                    waiter = self._pings.get(msg.seq)
                    if waiter is not None:
                        waiter[1].append(msg)
                        waiter[0].set()
        except ChannelCorrupt as exc:
            self._die(ChannelError(f"worker {self.name} (pid {self.pid}) sent a bad frame: {exc}"))
        except msgspec.DecodeError as exc:
            self._die(ChannelError(f"worker {self.name} (pid {self.pid}) sent a malformed message: {exc}"))
        except ChannelClosed:
            self._die(None)
        except BaseException as exc:  # any other failure here must still end the requests in flight
            why = f"reading its channel failed: {exc!r}"
            self._die(ChannelError(f"worker {self.name} (pid {self.pid}): {why}"))

    def _die(self, error: WorkerDied | None) -> None:
        if error is not None:
            self.proc.kill()
        code = self._exit_code()
        with self._lock:
            stopping = self._state == "stopping"
            self.crashed = not stopping
            self._state = "dead"
            if error is None:
                how = "was stopped" if stopping else f"died (exit code {code})"
                error = self._kill_reason or WorkerDied(f"worker {self.name} (pid {self.pid}) {how}")
            self.death = error
            entries, self._sinks = list(self._sinks.values()), {}
            on_exit = self._on_exit  # read under the lock: `adopt` may have just changed it
        try:
            self._rx.close()
            for _, waiter in list(self._pings.items()):
                waiter[0].set()
            (log.info if stopping else log.error)(
                "worker.exit", worker=self.name, pid=self.pid, code=code, error=str(error),
                in_flight=len(entries), stderr=None if stopping else self._last_stderr(),
            )
        finally:  # whatever happens above, the requests in flight must be ended
            try:
                on_exit(self, error, entries)
            finally:
                self._stop_writing(f"worker {self.name} (pid {self.pid}) is gone")
                self._tx.close()  # after the requests' ends: it may wait for a send that is failing
                self._reap(1.0)  # the zombie, once its last thread is gone

    def _pump_stderr(self) -> None:
        pump_stderr(self.proc.stderr, self._stderr_tail, self.name)

    def _last_stderr(self, lines: int = 8) -> str:
        tail = list(self._stderr_tail)[-lines:]
        return " | ".join(tail) if tail else "(no output)"


_LEVELS = {"debug": 10, "info": 20, "warning": 30, "error": 40, "critical": 50}


def pump_stderr(stream, tail: deque[str], worker: str) -> None:
    """Log a worker's stderr, its JSON lines as the events they are; keep the last lines in `tail`."""
    decoder = msgspec.json.Decoder(dict)
    for raw in iter(stream.readline, b""):
        line = raw.decode("utf-8", "replace").rstrip()
        tail.append(line)
        try:
            fields = decoder.decode(raw)
            event = str(fields.pop("event", "log"))
            level = str(fields.pop("level", "info"))
            fields.pop("timestamp", None)
            log.log(_LEVELS.get(level, 20), event, worker=worker, **fields)
        except (msgspec.DecodeError, TypeError):
            log.info("worker.stderr", worker=worker, line=line)
    stream.close()
