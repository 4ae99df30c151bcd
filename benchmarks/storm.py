"""``python -m benchmarks.storm``: a crash storm, and whether every request still ends.

Client threads send streamed and non-streamed requests back to back while a
killer SIGKILLs one of the runtime's workers (a random one of our own children,
loading ones included) every 0.3-1.2 s, with the crash breaker relaxed so that
supervision keeps restarting them. Each request is recorded with its outcome
and how long the caller waited for it; each `WorkerDied` with how long after
the kill of its worker it reached the caller. After the storm one more request
must succeed, and no worker process and no shared-memory segment may outlive
the runtime. tests/test_storm.py runs a short storm through `run_storm` and
asserts on its record; this command measures a longer one. The table goes to
stdout, then the path of the JSON document with every request and kill
(``--json``, benchmarks/runner.py) and a short summary line.
"""

from __future__ import annotations

import argparse
import glob
import os
import random
import re
import signal
import sys
import threading
import time
from collections import Counter
from dataclasses import asdict, dataclass, field

import psutil

from . import runner

DEFAULT_KILL_EVERY_S = (0.3, 1.2)
DEFAULT_MAX_TOKENS = (8, 48)
#: Breaker relaxed: a storm must never trip it.
STORM_MAX_CRASHES = 10**6
#: How long a request may take once a worker runs it, on top of its queue deadline (a hang bound).
GENERATION_ALLOWANCE_S = 30.0
_PID = re.compile(r"\(pid (\d+)\)")


@dataclass
class Request:
    """One request as its caller saw it (times in s from the storm's start)."""

    thread: int
    streamed: bool
    started_s: float
    waited_s: float
    outcome: str  # "ok", or the error's class name
    message: str = ""
    tokens: int = 0
    #: For a WorkerDied: from the SIGKILL of the worker it names to the caller's error.
    after_kill_s: float | None = None


@dataclass
class StormRecord:
    """What a storm did; every figure in seconds."""

    seconds: float
    workers: int
    spares: int
    queue_s: float
    transport: str = ""
    kills: list[tuple[float, int]] = field(default_factory=list)
    requests: list[Request] = field(default_factory=list)
    #: Client threads still inside a request `GENERATION_ALLOWANCE_S + queue_s` after the storm.
    hung: int = 0
    #: Requests that went on on another worker after theirs was killed (`WorkerInfo.resumes`, all slots).
    resumes: int = 0
    recovered: bool = False
    orphans: list[int] = field(default_factory=list)
    segments_left: list[str] = field(default_factory=list)

    def outcomes(self) -> dict[str, int]:
        return dict(Counter(r.outcome for r in self.requests))

    def worst_wait_s(self, outcome: str | None = None) -> float | None:
        waits = [r.waited_s for r in self.requests if outcome is None or r.outcome == outcome]
        return max(waits) if waits else None

    def worst_after_kill_s(self) -> float | None:
        lags = [r.after_kill_s for r in self.requests if r.after_kill_s is not None]
        return max(lags) if lags else None


def run_storm(
    model: str,
    *,
    seconds: float,
    workers: int = 2,
    spares: int = 0,
    threads: int = 4,
    queue_s: float = 5.0,
    backoff_max_s: float = 1.0,
    kill_every_s: tuple[float, float] = DEFAULT_KILL_EVERY_S,
    max_tokens: tuple[int, int] = DEFAULT_MAX_TOKENS,
    transport: str = "auto",
    seed: int = 0,
) -> StormRecord:
    """Run one storm on a fresh runtime and return its record (the runtime is closed after it)."""
    from mlxrt import Runtime, Supervision, Timeouts

    record = StormRecord(seconds=seconds, workers=workers, spares=spares, queue_s=queue_s)
    shm_before = set(glob.glob("/dev/shm/mlxrt-*"))
    policy = Supervision(max_crashes=STORM_MAX_CRASHES, backoff_max_s=backoff_max_s)
    rt = Runtime(model=model, workers=workers, spares=spares, transport=transport,
                 timeouts=Timeouts(queue_s=queue_s), supervision=policy)
    pids_seen: set[int] = set()
    try:
        record.transport = rt.transport
        _storm(rt, record, threads=threads, kill_every_s=kill_every_s, max_tokens=max_tokens,
               seed=seed, pids_seen=pids_seen)
        record.recovered = _recovers(rt, queue_s + GENERATION_ALLOWANCE_S)
        pids_seen.update(w.pid for w in rt.workers if w.pid > 0)
        record.resumes = sum(w.resumes for w in rt.workers)
    finally:
        rt.close()
    record.orphans = sorted(p.pid for p in still_alive(pids_seen))
    record.segments_left = sorted(p for p in set(glob.glob("/dev/shm/mlxrt-*")) - shm_before if _ours(p))
    return record


def _storm(rt, record: StormRecord, *, threads: int, kill_every_s, max_tokens, seed: int,
           pids_seen: set[int]) -> None:
    t0 = time.monotonic()
    stop = threading.Event()
    kill_times: dict[int, float] = {}
    clients = [
        threading.Thread(target=_client, args=(rt, i, stop, random.Random(seed * 1000 + i), record,
                                               kill_times, t0, max_tokens), daemon=True)
        for i in range(threads)
    ]
    killer = threading.Thread(target=_killer, args=(rt, stop, random.Random(seed), kill_every_s, record,
                                                    kill_times, t0, pids_seen), daemon=True)
    for t in [*clients, killer]:
        t.start()
    stop.wait(record.seconds)
    stop.set()
    killer.join(10)
    end = time.monotonic() + record.queue_s + GENERATION_ALLOWANCE_S
    for t in clients:
        t.join(max(0.0, end - time.monotonic()))
    record.hung = sum(t.is_alive() for t in clients)


def _client(rt, idx: int, stop: threading.Event, rng: random.Random, record: StormRecord,
            kill_times: dict[int, float], t0: float, max_tokens: tuple[int, int]) -> None:
    from mlxrt import MlxrtError, WorkerDied

    while not stop.is_set():
        streamed = rng.random() < 0.5
        n = rng.randint(*max_tokens)
        start = time.monotonic()
        req = Request(thread=idx, streamed=streamed, started_s=start - t0, waited_s=0.0, outcome="ok")
        try:
            if streamed:
                req.tokens = sum(len(c.tokens) for c in rt.stream("a storm", max_tokens=n, ignore_eos=True))
            else:
                req.tokens = len(rt.generate("a storm", max_tokens=n, ignore_eos=True).tokens)
        except MlxrtError as exc:
            req.outcome, req.message = type(exc).__name__, str(exc)
            if isinstance(exc, WorkerDied):
                req.after_kill_s = _after_kill(str(exc), kill_times)
        except Exception as exc:  # not an mlxrt error: not a clear one
            req.outcome, req.message = f"unclear:{type(exc).__name__}", repr(exc)
        req.waited_s = time.monotonic() - start
        record.requests.append(req)


def _after_kill(message: str, kill_times: dict[int, float]) -> float | None:
    found = _PID.search(message)
    killed = kill_times.get(int(found.group(1))) if found else None
    return None if killed is None else time.monotonic() - killed


def _killer(rt, stop: threading.Event, rng: random.Random, every_s: tuple[float, float],
            record: StormRecord, kill_times: dict[int, float], t0: float, pids_seen: set[int]) -> None:
    while not stop.wait(rng.uniform(*every_s)):
        pids = [w.pid for w in rt.workers if w.pid > 0]
        pids_seen.update(pids)
        if not pids:
            continue
        pid = rng.choice(pids)
        if not _our_child(pid):
            continue
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            continue
        kill_times[pid] = time.monotonic()
        record.kills.append((kill_times[pid] - t0, pid))


def _our_child(pid: int) -> bool:
    try:
        return psutil.Process(pid).ppid() == os.getpid()
    except psutil.NoSuchProcess:
        return False


def _recovers(rt, within_s: float) -> bool:
    """Whether a request succeeds within `within_s` after the storm (asking again after an error:
    the last kills' restarts may still be under way)."""
    deadline = time.monotonic() + within_s
    box: list[bool] = []

    def ask() -> None:
        while time.monotonic() < deadline:
            try:
                if len(rt.generate("after the storm", max_tokens=4, ignore_eos=True).tokens) == 4:
                    box.append(True)
                    return
            except Exception:  # any error: not yet
                time.sleep(0.1)

    t = threading.Thread(target=ask, daemon=True)
    t.start()
    t.join(within_s + 1.0)
    return bool(box)


def still_alive(pids: set[int]) -> list[psutil.Process]:
    """Those of `pids` still running (not zombies) after up to 10 s of grace (the tests' leak check too)."""
    procs = []
    for pid in pids:
        try:
            procs.append(psutil.Process(pid))
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(procs, timeout=10)
    return [p for p in alive if p.status() != psutil.STATUS_ZOMBIE]


def _ours(path: str) -> bool:
    """Whether the ring segment at `path` was created by this process (others may run rings too)."""
    from mlxrt.ipc import ring

    try:
        with open(path, "rb") as f:
            head = f.read(ring._IDENTITY.size)
    except OSError:
        return False
    if len(head) < ring._IDENTITY.size:
        return False
    return ring._IDENTITY.unpack(head)[ring._CREATOR_PID // 8] == os.getpid()


def summary(record: StormRecord) -> dict:
    """The storm's figures: outcomes, worst waits, worst kill-to-error lag, what was left."""
    ok = [r.waited_s for r in record.requests if r.outcome == "ok"]
    return {
        "seconds": record.seconds, "workers": record.workers, "spares": record.spares,
        "queue_s": record.queue_s, "transport": record.transport, "kills": len(record.kills),
        "requests": len(record.requests), "outcomes": record.outcomes(),
        "worst_wait_s": record.worst_wait_s(), "worst_ok_wait_s": max(ok) if ok else None,
        "median_ok_wait_s": sorted(ok)[len(ok) // 2] if ok else None,
        "worst_error_wait_s": max((r.waited_s for r in record.requests if r.outcome != "ok"), default=None),
        "worst_worker_died_after_kill_s": record.worst_after_kill_s(),
        "hung": record.hung, "resumes": record.resumes, "recovered": record.recovered,
        "orphans": record.orphans, "segments_left": record.segments_left,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.storm", description=__doc__)
    p.add_argument("--model", default="synthetic:tiny")
    p.add_argument("--seconds", type=float, default=60.0)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--spares", type=int, default=0)
    p.add_argument("--threads", type=int, default=4)
    p.add_argument("--queue-s", type=float, default=5.0, help="Timeouts.queue_s (MLXRT_QUEUE_TIMEOUT_S)")
    p.add_argument("--backoff-max-s", type=float, default=1.0, help="Supervision.backoff_max_s")
    p.add_argument("--transport", default="auto")
    p.add_argument("--seed", type=int, default=0)
    runner.add_json_arg(p, study="storm")
    args = p.parse_args(argv)
    record = run_storm(args.model, seconds=args.seconds, workers=args.workers, spares=args.spares,
                       threads=args.threads, queue_s=args.queue_s, backoff_max_s=args.backoff_max_s,
                       transport=args.transport, seed=args.seed)
    s = summary(record)
    print("| kills | requests | outcomes | worst wait s | worst ok s | median ok s | worst WorkerDied "
          "after kill s | hung | recovered | orphans | segments |")
    print("|---" * 11 + "|")
    print(f"| {s['kills']} | {s['requests']} | {s['outcomes']} | {_f(s['worst_wait_s'])} | "
          f"{_f(s['worst_ok_wait_s'])} | {_f(s['median_ok_wait_s'])} | "
          f"{_f(s['worst_worker_died_after_kill_s'])} | {s['hung']} | {s['recovered']} | "
          f"{len(s['orphans'])} | {len(s['segments_left'])} |")
    doc = {"benchmark": "mlxrt-storm", "model": args.model, **s,
           "requests_detail": [asdict(r) for r in record.requests],
           "kills_detail": record.kills, "env": runner.environment()}
    keys = ("kills", "requests", "outcomes", "hung", "recovered", "worst_wait_s")
    runner.finish(doc, runner.json_path(args.json, "storm"),
                  {"benchmark": "mlxrt-storm", "model": args.model, **{k: s[k] for k in keys}})
    return 0


def _f(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


if __name__ == "__main__":
    sys.exit(main())
