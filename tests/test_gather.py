"""The worker's Server gathers the follow-ups of replies that ended together, and a burst reaching an idle
worker, into one prefill.

The Server runs as in the worker process (its serve loop on its own thread, frames out through an
Outbox over a pipe), with a real Engine on the tiny model; requests come in through `on_message`, as
the reader thread hands them over. A spy on the engine records the step at which each request was
submitted: requests submitted before the same step were admitted, and prefilled, together. Each
test runs on a single worker's Server and on a group's rank 0 (`LeaderServer`, its steps shared
through the lockstep, here over MLX's group of one process).
"""

from __future__ import annotations

import os
import queue
import threading
import time

import pytest
import structlog
from mlxrt.ipc.channel import ChannelClosed
from mlxrt.ipc.protocol import (
    Cancel,
    Done,
    EngineOptions,
    Generate,
    GroupRank,
    Ping,
    Pong,
    SamplingParams,
    orchestrator_codec,
)
from mlxrt.ipc.stdio import PipeReceiver, PipeSender
from mlxrt.worker.engine import Engine
from mlxrt.worker.group import LeaderServer, RankGroup, Watchdog
from mlxrt.worker.serve import Gather, Outbox, Server

LONG_MS = 1000  # the longest window: a request held back would show as a wait this long


def gen(i: int, prompt: str = "the river runs past the mill and") -> Generate:
    return Generate(id=i, prompt=prompt, params=SamplingParams(max_tokens=6, ignore_eos=True))


class Served:
    """A Server on its own thread; the frames it sends, and the step each request was submitted at."""

    def __init__(self, model: str, gather_ms: int, leader: bool, burst_ms: int | None = 0) -> None:
        self.engine = engine = Engine(model, options=EngineOptions(gather_ms=gather_ms, burst_ms=burst_ms))
        self.steps = 0
        self.submitted: dict[int, int] = {}
        step, submit = engine.step, engine.submit

        def counted_step() -> None:
            self.steps += 1
            step()

        def spied_submit(req, listener, **kw) -> None:
            self.submitted[req.id] = self.steps
            submit(req, listener, **kw)

        engine.step, engine.submit = counted_step, spied_submit
        r, self._w = os.pipe()
        self.outbox = Outbox(PipeSender(self._w))
        self.server = Server(engine, self.outbox) if not leader else LeaderServer(engine, self.outbox,
                                                                                   group_of_one())
        self.frames: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, args=(PipeReceiver(r),), daemon=True).start()
        self._loop = threading.Thread(target=self.server.serve_forever, daemon=True)
        self._loop.start()

    def _read(self, rx: PipeReceiver) -> None:
        codec = orchestrator_codec()
        try:
            while True:
                self.frames.put(codec.decode(rx.recv(timeout=60)))
        except ChannelClosed:
            pass

    def send(self, msg) -> None:
        self.server.on_message(msg)

    def ended(self, ids: set[int], timeout_s: float) -> dict[int, Done]:
        """The final Done of each of `ids`; raises if one is missing after `timeout_s`."""
        got: dict[int, Done] = {}
        end = time.monotonic() + timeout_s
        while set(got) != ids:
            frame = self.frames.get(timeout=max(0.01, end - time.monotonic()))
            if isinstance(frame, Done) and frame.final and frame.id in ids:
                got[frame.id] = frame
        return got

    def close(self) -> None:
        self.server.on_eof()
        self._loop.join(30)
        assert not self._loop.is_alive()
        self.outbox.close()
        os.close(self._w)


def group_of_one() -> RankGroup:
    """Rank 0 of a group of one process: its lockstep's collectives return what they are given."""
    import mlx.core as mx

    def expire(what: str, limit_s: float) -> None:
        raise AssertionError(f"the watchdog fired: {what} past {limit_s} s")

    return RankGroup(GroupRank(rank=0, size=1), mx.distributed.init(), "ring", structlog.get_logger("test"),
                 Watchdog(60.0, expire))


@pytest.fixture(params=["worker", "group rank 0"])
def served(request, tiny_model):
    made: list[Served] = []

    def make(gather_ms: int, burst_ms: int | None = 0) -> Served:
        made.append(Served(tiny_model, gather_ms, leader=request.param != "worker", burst_ms=burst_ms))
        return made[-1]

    yield make
    for s in made:
        s.close()


def wave(s: Served) -> None:
    """Two requests admitted together end on one step: a wave of two replies."""
    with s.server._cond:  # both queued before the serve loop looks (the lock is re-entrant)
        s.send(gen(1))
        s.send(gen(2))
    s.ended({1, 2}, 60)
    assert s.submitted[1] == s.submitted[2]


def test_follow_ups_of_a_wave_are_admitted_together(served):
    """After a wave of two replies, follow-ups 200 ms apart go in one step; with gather_ms 0, apart."""
    for gather_ms, together in ((LONG_MS, True), (0, False)):
        s = served(gather_ms)
        wave(s)
        s.send(gen(3))
        time.sleep(0.2)
        s.send(gen(4))
        done = s.ended({3, 4}, 60)
        assert all(d.stats.finish_reason == "length" for d in done.values())
        assert (s.submitted[3] == s.submitted[4]) is together, (gather_ms, s.submitted)


def test_a_lone_reply_holds_nothing_back(served):
    """One reply ending is a single client's: its next request is admitted at once."""
    s = served(LONG_MS)
    s.send(gen(1))
    s.ended({1}, 60)
    holds: list[float] = []
    held = s.server._held

    def spied_held(now: float, **kw) -> float:  # what the serve loop decides while request 2 is queued
        holds.append(held(now, **kw))
        return holds[-1]

    s.server._held = spied_held
    s.send(gen(2))
    s.ended({2}, 60)
    assert holds and set(holds) == {0.0}  # never held back


def test_a_burst_on_an_idle_worker_is_admitted_together(served):
    """Requests 5 ms apart reaching an idle worker go in one step while each comes within burst_ms of
    the last; with burst_ms 0 (and 200 ms apart) the first goes alone. Each ends as it should."""
    from mlxrt.ipc.protocol import MAX_BURST_MS

    for burst_ms, gap_s, together in ((MAX_BURST_MS, 0.005, True), (0, 0.2, False)):
        s = served(LONG_MS, burst_ms)
        for i in (1, 2, 3):
            s.send(gen(i))
            time.sleep(gap_s)
        done = s.ended({1, 2, 3}, 60)
        assert all(d.stats.finish_reason == "length" for d in done.values())
        assert (s.submitted[1] == s.submitted[2] == s.submitted[3]) is together, (burst_ms, s.submitted)


def test_a_request_cancelled_while_held_back_ends_cancelled(served):
    """A held follow-up counts as queued; cancelled, it never reaches the engine, and ends."""
    s = served(LONG_MS)
    wave(s)
    s.send(gen(3))
    time.sleep(0.1)  # the Server holds it: one of the two follow-ups it expects
    s.send(Ping(seq=1))
    pong = s.frames.get(timeout=30)
    while not isinstance(pong, Pong):
        pong = s.frames.get(timeout=30)
    assert pong.engine.queued == 1  # a held request shows in the worker's report as queued
    s.send(Cancel(3))
    done = s.ended({3}, 30)
    assert done[3].stats.finish_reason == "cancelled" and 3 not in s.submitted  # not run after its hold


def test_a_shutdown_ends_the_requests_held_back(served):
    """EOF while a follow-up is held: it ends cancelled, as everything queued does, and the loop exits."""
    s = served(LONG_MS)
    wave(s)
    s.send(gen(3))
    time.sleep(0.1)
    s.server.on_eof()
    done = s.ended({3}, 30)
    assert done[3].stats.finish_reason == "cancelled" and 3 not in s.submitted


def test_gather_holds_until_the_wave_has_come_or_the_window_ends():
    """The hold's arithmetic: opened by two or more replies, ended by as many requests or the window."""
    g = Gather(0.05)
    g.ended(1, now=0.0)
    assert g.hold(1, oldest=0.0, now=0.001) == 0.0  # a lone reply opens none
    g.ended(3, now=1.0)
    assert g.hold(1, oldest=1.005, now=1.01) == pytest.approx(0.04)
    assert g.hold(2, oldest=1.005, now=1.02) == pytest.approx(0.03)
    assert g.hold(3, oldest=1.005, now=1.03) == 0.0  # all three came
    assert g.hold(1, oldest=1.03, now=1.031) == 0.0  # ... and the hold is over until the next wave
    g.ended(2, now=2.0)
    assert g.hold(1, oldest=2.0, now=2.06) == 0.0  # the window passed
    off = Gather(0.0)
    off.ended(8, now=0.0)
    assert off.hold(1, oldest=0.0, now=0.0) == 0.0


def test_a_wave_during_a_hold_joins_it_and_never_extends_it():
    """Waves ending while requests are held add to those awaited, but the hold keeps its deadline,
    and no request waits longer than the window from its arrival."""
    g = Gather(0.05)
    g.ended(2, now=0.0)
    g.ended(6, now=0.04)  # another wave, before the first's follow-ups came
    assert g.hold(2, oldest=0.01, now=0.045) == pytest.approx(0.005)  # 8 awaited; the first deadline
    assert g.hold(2, oldest=0.01, now=0.05) == 0.0
    g.ended(2, now=1.0)
    assert g.hold(1, oldest=0.99, now=1.03) == pytest.approx(0.01)  # queued before the wave: its own window


def test_a_burst_is_held_until_quiet_on_an_idle_worker_only():
    """The burst hold's arithmetic: on an idle worker, until `quiet_s` after the newest request, at
    most the window (or `quiet_s`) after the oldest; a busy worker, or quiet_s 0, holds nothing."""
    g = Gather(0.05, 0.002)
    assert g.hold(1, oldest=1.0, now=1.0005, newest=1.0, idle=True) == pytest.approx(0.0015)
    assert g.hold(1, oldest=1.0, now=1.0005, newest=1.0) == 0.0  # busy: joins the next step
    assert g.hold(3, oldest=1.0, now=1.0015, newest=1.001, idle=True) == pytest.approx(0.0015)
    assert g.hold(3, oldest=1.0, now=1.0031, newest=1.001, idle=True) == 0.0  # quiet: admitted
    assert g.hold(40, oldest=1.0, now=1.0495, newest=1.049, idle=True) == pytest.approx(0.0005)  # the window
    assert Gather(0.0, 0.002).hold(1, oldest=1.0, now=1.0, newest=1.0, idle=True) == pytest.approx(0.002)
    assert Gather(0.05, 0.0).hold(1, oldest=1.0, now=1.0, newest=1.0, idle=True) == 0.0


def test_the_burst_hold_on_auto_is_cudas_only(served, monkeypatch):
    """burst_ms left on auto holds a burst for DEFAULT_BURST_MS on MLX's CUDA backend and not at all
    elsewhere (on the CPU a held 32-stream burst measured slower); the environment sets it."""
    from mlxrt.ipc.protocol import DEFAULT_BURST_MS
    from mlxrt.orchestrator.config import engine_from_env
    from mlxrt.worker.limits import on_cuda

    s = served(LONG_MS, None)
    assert s.server._gather.quiet_s == (DEFAULT_BURST_MS / 1000 if on_cuda() else 0.0)
    monkeypatch.setenv("MLXRT_BURST_MS", "7")
    assert engine_from_env().burst_ms == 7


def test_gather_ms_and_burst_ms_are_checked():
    """The options are bounded: a negative or huge window is refused by name."""
    assert (EngineOptions().gather_ms, EngineOptions().burst_ms) == (50, None)
    for bad in (-1, 100_000):
        with pytest.raises(ValueError, match="gather_ms"):
            EngineOptions(gather_ms=bad).validate()
        with pytest.raises(ValueError, match="burst_ms"):
            EngineOptions(burst_ms=bad).validate()
