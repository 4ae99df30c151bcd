"""Supervision: restarts, replay of unstarted requests, circuit breaker, idle unload, memory policy."""

from __future__ import annotations

import os
import queue
import signal
import sys
import time
from pathlib import Path

import psutil
import pytest
from mlxrt import (
    MemoryPressureError,
    MlxrtTimeout,
    ModelFailedError,
    Runtime,
    Supervision,
    Timeouts,
    WorkerDied,
)
from mlxrt.ipc.protocol import Done, Tokens
from mlxrt.orchestrator.runtime import build_request
from support import FAST, run_with_deadline, wait_for

FLAKY = [sys.executable, str(Path(__file__).with_name("flaky_worker.py"))]
def test_killed_worker_is_restarted_and_serves_again(tiny_model):
    """SIGKILL mid-stream with resumes off (MLXRT_MAX_RESUMES=0): WorkerDied for that request, a new pid,
    restarts=1, the next request served."""
    with Runtime(model=tiny_model, transport="ring", supervision=Supervision(**FAST, max_resumes=0)) as rt:
        old = rt.workers[0].pid
        stream = rt.stream("hello", max_tokens=400, ignore_eos=True)
        next(stream)
        os.kill(old, signal.SIGKILL)
        with pytest.raises(WorkerDied):
            run_with_deadline(lambda: list(stream), 5)
        assert rt.generate("hello", max_tokens=4).tokens
        (w,) = rt.workers
        assert w.pid != old and w.restarts == 1 and w.state == "ready"


def test_request_sent_right_after_a_crash_is_answered(tiny_model):
    """A request made the instant after a SIGKILL, before the death is noticed, gets an answer."""
    with Runtime(model=tiny_model, transport="stdio", supervision=Supervision(**FAST)) as rt:
        os.kill(rt.workers[0].pid, signal.SIGKILL)
        c = run_with_deadline(lambda: rt.generate("hello", max_tokens=4, ignore_eos=True), 60)
        assert len(c.tokens) == 4


def test_queued_request_is_replayed_on_the_replacement(tiny_model):
    """A request still queued in a worker that dies is served by the replacement, not failed (even with
    resumes off, which fail the running one)."""
    with Runtime(model=tiny_model, transport="stdio", supervision=Supervision(**FAST, max_resumes=0)) as rt:
        running = rt.stream("hello", max_tokens=400, ignore_eos=True)
        next(running)
        pid = rt.workers[0].pid
        # Stopped, the worker reads nothing more, so the next request is still queued at the kill (a fast
        # worker could start it first, and with resumes off fail it: a fresh clone's CI did once).
        os.kill(pid, signal.SIGSTOP)
        queued = rt.stream("hello", max_tokens=8, ignore_eos=True)
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(WorkerDied):
            run_with_deadline(lambda: list(running), 5)
        chunks = run_with_deadline(lambda: list(queued), 60)
        assert sum(len(c.tokens) for c in chunks) == 8


def test_idle_worker_killed_is_replaced(tiny_model):
    """SIGKILL while idle: the slot restarts on its own; rt.workers shows the new pid."""
    with Runtime(model=tiny_model, transport="stdio", supervision=Supervision(**FAST)) as rt:
        old = rt.workers[0].pid
        os.kill(old, signal.SIGKILL)
        wait_for(lambda: rt.workers[0].state == "ready" and rt.workers[0].pid != old, what="restart")
        assert rt.workers[0].restarts == 1


def test_kill_during_model_load_is_survived(tiny_model):
    """SIGKILL of a replacement while it loads: another one is started and serves."""
    with Runtime(model=tiny_model, transport="stdio", supervision=Supervision(**FAST)) as rt:
        first = rt.workers[0].pid
        os.kill(first, signal.SIGKILL)
        loading = wait_for(lambda: rt.workers[0].pid not in (0, first) and rt.workers[0].state == "starting"
                           and rt.workers[0].pid, what="replacement loading")
        os.kill(loading, signal.SIGKILL)
        c = run_with_deadline(lambda: rt.generate("hello", max_tokens=4), 60)
        assert c.tokens
        assert rt.workers[0].pid not in (first, loading)


def test_model_that_crashes_on_every_load_trips_the_breaker(tiny_model, tmp_path):
    """Crash on every reload: after max_crashes the model is failed with a clear error, no restart storm;
    reset() brings it back once loading works again."""
    state = tmp_path / "flaky"
    state.write_text("ok")
    os.environ["FLAKY_STATE"] = str(state)
    try:
        policy = Supervision(max_crashes=3, crash_window_s=60, **FAST)
        with Runtime(model=tiny_model, transport="stdio", supervision=policy, _worker_argv=FLAKY) as rt:
            state.write_text("crash")
            os.kill(rt.workers[0].pid, signal.SIGKILL)
            wait_for(lambda: rt.workers[0].state == "failed", what="failed state")
            with pytest.raises(ModelFailedError, match="MLXRT_MAX_CRASHES"):
                rt.generate("hello", max_tokens=2)
            time.sleep(0.5)  # a storm would keep starting workers meanwhile
            starts = Path(str(state) + ".starts").read_text().count("start")
            assert starts == 1 + 2  # the first load, then two failed reloads (3 crashes in all)
            state.write_text("ok")
            rt.reset()
            c = run_with_deadline(lambda: rt.generate("hello", max_tokens=2), 60)
            assert c.tokens and rt.workers[0].state == "ready"
    finally:
        del os.environ["FLAKY_STATE"]


def test_idle_model_is_unloaded_and_reloaded_on_demand(tiny_model):
    """keep_alive: an idle worker is unloaded, and the next request loads it again."""
    policy = Supervision(keep_alive_s=0.3, **FAST)
    with Runtime(model=tiny_model, transport="stdio", supervision=policy) as rt:
        first = rt.workers[0].pid
        rt.generate("hello", max_tokens=2)
        wait_for(lambda: rt.workers[0].state == "unloaded", what="unload")
        # The state flips before the process has finished exiting: wait for the exit itself.
        wait_for(lambda: not psutil.pid_exists(first), what="unloaded worker exit")
        assert rt.generate("hello", max_tokens=2).tokens
        assert rt.workers[0].pid != first and rt.workers[0].restarts == 0


def test_keep_alive_zero_unloads_after_the_request(tiny_model):
    """A request with keep_alive=0 unloads the model once it is done (Ollama's keep_alive: 0)."""
    with Runtime(model=tiny_model, transport="stdio", supervision=Supervision(**FAST)) as rt:
        rt.generate("hello", max_tokens=2, keep_alive=0)
        wait_for(lambda: rt.workers[0].state == "unloaded", what="unload")
        with pytest.raises(ValueError, match="keep_alive"):
            rt.generate("hello", max_tokens=2, keep_alive=-5)


def test_memory_reports_mlx_and_process_figures(tiny_model):
    """rt.memory() returns each worker's MLX active/peak/cache bytes and RSS."""
    with Runtime(model=tiny_model, transport="stdio") as rt:
        rt.generate("hello", max_tokens=4)
        (m,) = rt.memory()
        assert m.pid == rt.workers[0].pid
        assert m.active_bytes > 0 and m.peak_bytes > 0 and m.rss_bytes > m.active_bytes


def test_critical_memory_pressure_refuses_new_requests(tiny_model):
    """Under critical pressure new requests fail with MemoryPressureError instead of starting."""
    level = ["normal"]
    policy = Supervision(memory_level=lambda: level[0], **FAST)
    with Runtime(model=tiny_model, transport="stdio", supervision=policy) as rt:
        assert rt.generate("hello", max_tokens=2).tokens
        level[0] = "critical"
        wait_for(lambda: rt.memory_pressure == "critical", what="pressure seen")
        with pytest.raises(MemoryPressureError, match="memory pressure"):
            rt.generate("hello", max_tokens=2)
        level[0] = "normal"
        wait_for(lambda: rt.memory_pressure == "normal", what="pressure cleared")
        assert rt.generate("hello", max_tokens=2).tokens


def test_warning_memory_pressure_clears_worker_caches(tiny_model):
    """Under warning pressure the workers' MLX buffer caches are freed."""
    level = ["normal"]
    policy = Supervision(memory_level=lambda: level[0], **FAST)
    with Runtime(model=tiny_model, transport="stdio", supervision=policy) as rt:
        rt.generate("hello " * 50, max_tokens=32)
        assert rt.memory()[0].cache_bytes > 0
        level[0] = "warning"
        wait_for(lambda: rt.memory()[0].cache_bytes == 0, what="cache cleared")


def test_graceful_close_lets_running_requests_finish(tiny_model):
    """close(drain_s=...) lets a running request finish before stopping the worker."""
    rt = Runtime(model=tiny_model, transport="stdio")
    stream = rt.stream("hello", max_tokens=64, ignore_eos=True)
    next(stream)
    rt.close(drain_s=30)
    rest = run_with_deadline(lambda: list(stream), 5)
    assert stream.finish_reason == "length"
    assert 1 + sum(len(c.tokens) for c in rest) == 64


def test_request_waiting_for_a_worker_ends_at_its_deadline(tiny_model, tmp_path, monkeypatch):
    """No replacement can load: a request waiting for one fails with MlxrtTimeout naming
    MLXRT_QUEUE_TIMEOUT_S at its deadline, not after the token timeout; the pool serves again later."""
    gate = tmp_path / "gate"
    gate.write_text("open")
    monkeypatch.setenv("GATE_FILE", str(gate))
    gated = [sys.executable, str(Path(__file__).with_name("gated_worker.py"))]
    with Runtime(model=tiny_model, transport="stdio", timeouts=Timeouts(queue_s=1.0),
                 supervision=Supervision(**FAST), _worker_argv=gated) as rt:
        gate.write_text("closed")
        os.kill(rt.workers[0].pid, signal.SIGKILL)
        with pytest.raises(MlxrtTimeout, match="within 1 s .*MLXRT_QUEUE_TIMEOUT_S"):
            run_with_deadline(lambda: rt.generate("hello", max_tokens=2), 20)
        gate.write_text("open")
        wait_for(lambda: rt.workers[0].state == "ready", what="the replacement ready")
        assert rt.generate("hello", max_tokens=2).tokens


def test_waiting_requests_move_to_a_sibling_with_a_worker(tiny_model, tmp_path, monkeypatch):
    """A request waiting in a slot whose worker died (and cannot be replaced yet) does not wait for
    that restart while a sibling worker of the model is ready: it is served there."""
    gate = tmp_path / "gate"
    gate.write_text("open")
    monkeypatch.setenv("GATE_FILE", str(gate))
    gated = [sys.executable, str(Path(__file__).with_name("gated_worker.py"))]
    with Runtime(model=tiny_model, workers=2, transport="stdio", supervision=Supervision(**FAST),
                 _worker_argv=gated) as rt:
        dead, live = rt._pool.slots[rt.models[0]]
        gate.write_text("closed")
        os.kill(dead.handle.pid, signal.SIGKILL)
        wait_for(lambda: not dead.serving, what="the death noticed")
        events: queue.SimpleQueue = queue.SimpleQueue()
        # Straight to the dead slot (routing would pick the live one): it waits there, then moves.
        dead.submit(build_request(rt._pool.next_id(), "hello", {"max_tokens": 3, "ignore_eos": True}),
                    events.put)
        done = run_with_deadline(lambda: _last_event(events), 30)
        assert isinstance(done, Done) and done.stats.finish_reason == "length"
        assert live.handle.info().requests == 1
        gate.write_text("open")


def _last_event(events: queue.SimpleQueue) -> object:
    """The request's terminal event (Done, Failed or an error), skipping its Tokens."""
    while True:
        event = events.get(timeout=60)
        if not isinstance(event, Tokens):
            return event
