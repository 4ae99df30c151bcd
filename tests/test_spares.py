"""Hot spares: a loaded standby worker takes a crashed worker's place without a load, a new spare loads
behind it, spares take no requests, follow their model's loading and unloading, and leave nothing."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import psutil
import pytest
from mlxrt import Runtime, Supervision
from support import FAST, assert_stopped, run_with_deadline, wait_for

GATED = [sys.executable, str(Path(__file__).with_name("gated_worker.py"))]


@pytest.fixture
def gate(tmp_path, monkeypatch):
    """A file the gated worker reads: "open" lets workers load, anything else holds every new one back."""
    path = tmp_path / "gate"
    path.write_text("open")
    monkeypatch.setenv("GATE_FILE", str(path))
    return path


def test_spare_takes_over_without_waiting_for_a_load(tiny_model, gate):
    """SIGKILL of the active worker while no new worker can load: the next request is answered by the
    former spare (it did not wait for a load). Killed again with no spare ready, the slot waits out a
    long backoff, but takes the new spare as soon as it has loaded."""
    slow_restart = Supervision(backoff_initial_s=60, backoff_max_s=60, monitor_interval_s=0.05)
    with Runtime(model=tiny_model, transport="ring", spares=1, supervision=slow_restart,
                 _worker_argv=GATED) as rt:
        active, spare = rt.workers
        assert (active.spare, spare.spare, spare.state) == (False, True, "ready")
        assert rt.generate("hello", max_tokens=4).tokens
        gate.write_text("closed")
        os.kill(active.pid, signal.SIGKILL)
        c = run_with_deadline(lambda: rt.generate("hello", max_tokens=4, ignore_eos=True), 30)
        assert len(c.tokens) == 4
        serving, behind = rt.workers
        assert (serving.pid, serving.spare, serving.restarts, serving.requests) == (spare.pid, False, 1, 1)
        assert behind.spare and behind.state == "starting"  # held at the gate: no load happened
        new_spare = wait_for(lambda: rt.workers[1].pid, what="the new spare spawned")
        assert new_spare not in (active.pid, spare.pid)

        os.kill(spare.pid, signal.SIGKILL)  # no spare ready now: a 60 s backoff
        wait_for(lambda: rt.workers[0].state == "dead", what="the backoff")
        gate.write_text("open")
        c = run_with_deadline(lambda: rt.generate("hello", max_tokens=4, ignore_eos=True), 40)
        assert len(c.tokens) == 4
        assert (rt.workers[0].pid, rt.workers[0].restarts) == (new_spare, 2)
        wait_for(lambda: rt.workers[1].state == "ready", what="another spare behind it")
        pids = [w.pid for w in rt.workers]
    assert_stopped(pids)


def test_spares_take_no_requests_and_follow_their_model(tiny_model):
    """Spares get no requests while standing by, report their memory, are unloaded with their model and
    loaded again with it."""
    with Runtime(model=tiny_model, workers=2, spares=1, transport="stdio",
                 supervision=Supervision(**FAST)) as rt:
        streams = [rt.stream("hello", max_tokens=8, ignore_eos=True) for _ in range(6)]
        assert all(sum(len(c.tokens) for c in s) == 8 for s in streams)
        *active, spare = rt.workers
        assert [w.spare for w in rt.workers] == [False, False, True]
        assert spare.requests == 0 and sum(w.requests for w in active) == 6
        assert spare.pid in {m.pid for m in rt.memory()}
        assert rt.unload() == 2
        wait_for(lambda: rt.workers[2].state == "unloaded", what="the spare unloaded")
        assert rt.generate("hello", max_tokens=2).tokens
        wait_for(lambda: rt.workers[2].state == "ready", what="the spare loaded again")
        pids = [w.pid for w in rt.workers if w.pid]
    assert_stopped(pids)


def test_spares_must_be_a_count():
    """spares= takes an integer >= 0 and says so otherwise, before any worker starts."""
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="spares"):
            Runtime(model="synthetic:tiny", spares=bad)


def test_each_worker_gets_a_gpu_of_its_own_on_a_host_of_several(tiny_model, monkeypatch):
    """CUDA_VISIBLE_DEVICES=3,5 (two GPUs): two workers and a spare get 3, 5 and 3 in turn as their
    own CUDA_VISIBLE_DEVICES, and a worker restarted after a crash keeps its slot's GPU."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5")
    with Runtime(model=tiny_model, workers=2, spares=1, transport="stdio",
                 supervision=Supervision(backoff_initial_s=0.05)) as rt:
        assert [gpu_of(w.pid) for w in rt.workers] == ["3", "5", "3"]
    restart = Supervision(backoff_initial_s=0.05)
    with Runtime(model=tiny_model, workers=2, transport="stdio", supervision=restart) as rt:
        second = rt.workers[1].pid
        os.kill(second, signal.SIGKILL)
        wait_for(lambda: rt.workers[1].pid != second and rt.workers[1].state == "ready", 60, "restart")
        assert [gpu_of(w.pid) for w in rt.workers] == ["3", "5"]


def gpu_of(pid: int) -> str | None:
    return psutil.Process(pid).environ().get("CUDA_VISIBLE_DEVICES")
