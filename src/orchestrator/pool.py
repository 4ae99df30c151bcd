"""`Pool`: supervised worker slots for one or more models, and the transport they talk over.

A request goes to the worker of its model that holds its prompt's prefix, or the
least-loaded ready one (`routing.py`); two threads mind the slots: one cancels
dropped streams, unloads idle workers and follows memory pressure, the other moves
or expires requests waiting for a worker.
"""

from __future__ import annotations

import functools
import itertools
import queue
import threading
import time
from collections.abc import Iterator, Mapping

import structlog

from ..ipc.protocol import (
    DEFAULT_HEARTBEAT_S,
    EngineOptions,
    Generate,
    InvalidField,
)
from .config import Supervision, Timeouts, engine_from_env
from .errors import MemoryPressureError, MlxrtError, ModelFailedError
from .group import GroupHandle
from .handle import WorkerHandle
from .launch import Group, local_gpus
from .options import ModelSpec, as_spec, prepare
from .request import Request, check_model
from .routing import PrefixRouter, block_keys
from .supervisor import Slot

log = structlog.get_logger("mlxrt.orchestrator")

TRANSPORTS = ("auto", "ring", "stdio")
#: With no request waiting for a worker, `Pool._mind_waiting` still looks this often (s).
IDLE_DEADLINE_CHECK_S = 5.0

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
        # On a host of several GPUs each single worker gets one, in turn: MLX's CUDA backend running one
        # worker across all of them failed its warm-up (docs/benchmarks/gpu-h200-group.md).
        found = local_gpus()
        gpus = itertools.cycle(found) if len(found) > 1 else None
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
            take = functools.partial(self._take_spare, name)
            own = gpus if plan is None else None  # a group places its ranks itself (launch.py)
            self.slots[name] = [self._slot(name, spawn, own, take_spare=take) for _ in range(workers)]
            self.spares[name] = [self._slot(name, spawn, own, standby=True) for _ in range(spares)]
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

    def _slot(self, name: str, spawn, gpus: Iterator[str] | None, **kwargs) -> Slot:
        """A slot of model `name` whose workers `spawn` starts, each on the next of `gpus` (if several)."""
        device = next(gpus) if gpus is not None else None
        placed = {} if device is None else {"device": device}
        return Slot(name, lambda on_exit: spawn(on_exit=on_exit, **placed), self.supervision,
                    queue_s=self.timeouts.queue_s, wake=self._queued.set, **kwargs)

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
            raise InvalidField("model", f"={name!r}: this runtime serves {sorted(self.slots)}")
        return slots

    def admit(self, request: Request) -> Generate:
        """`request` checked against its model, as the model's workers reported themselves (unknown
        until one was ready: the worker checks then), as the frame for a new request id."""
        name = request.model or self.default_model
        ready = next((s.ready for s in self.model_slots(request.model) if s.ready is not None), None)
        request.params.validate()  # a Request built by hand has not been through `Request.build`
        check_model(request, ready, name)
        return request.to_wire(self.next_id())

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
