"""Ring vs pipe: one-way latency, small-message rate and 1 MiB bandwidth.

    python -m benchmarks.transport [--quick]

One child process (the producer, like a worker) holds both a ring and a pipe
with stdio framing and takes commands on its stdin; this process is the
consumer. Ring and pipe cells alternate within every round (A/B interleaved),
and figures are medians over all samples with the per-round spread beside
them. One-way latency is perf_counter_ns() read just before send() in the
child and just after recv() returns here (CLOCK_MONOTONIC on Linux,
mach_absolute_time on macOS: one clock for both processes).

"spin": the consumer polls (ring: RingReceiver with an unbounded spin; pipe: a
non-blocking read loop). "blocked": the consumer sleeps (ring: spin_us=0, so
every frame goes through the doorbell; pipe: a blocking read), and frames are
spaced 1 ms apart so it really is asleep when each one arrives.

The tables go to stdout, then the path of the JSON document with every figure (``--json``,
benchmarks/runner.py) and a short summary line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import struct
import subprocess
import sys
import time

import msgspec
from mlxrt.ipc.channel import ChannelClosed
from mlxrt.ipc.ring import DEFAULT_RING_BYTES, RingChannel, RingSpec, attach_ring
from mlxrt.ipc.stdio import PipeReceiver, PipeSender

from . import runner

SIZES = [32, 1024, 16 * 1024, 256 * 1024, 1024 * 1024]
_STAMP = struct.Struct("<q")
_LEN = struct.Struct("<I")
SPIN_GAP_S = 50e-6
BLOCKED_GAP_S = 1e-3
WARMUP = 10
TARGETS = {"ring_spin_p50_us_32B": 2.0, "ring_small_msgs_per_s": 1e6}


# --- child (producer) --------------------------------------------------------


def _child(spec_json: str, pipe_fd: str) -> None:
    ring = attach_ring(msgspec.json.decode(spec_json, type=RingSpec))
    senders = {"ring": ring, "pipe": PipeSender(int(pipe_fd))}
    ring.send(b"hello")
    for line in sys.stdin:
        cmd = json.loads(line)
        tx = senders[cmd["tr"]]
        frame = bytearray(cmd["size"])
        clock = time.perf_counter_ns
        if cmd["op"] == "latency":
            for _ in range(cmd["n"]):
                time.sleep(cmd["gap_s"])
                _STAMP.pack_into(frame, 0, clock())
                tx.send(frame)
        else:  # burst: only the first frame carries the start time
            _STAMP.pack_into(frame, 0, clock())
            tx.send(frame)
            for _ in range(cmd["n"] - 1):
                tx.send(frame)


# --- consumer side -----------------------------------------------------------


class _SpinPipeReceiver:
    """Stdio framing read by polling a non-blocking pipe: the pipe's 'spinning consumer'."""

    def __init__(self, fd: int) -> None:
        self._fd = fd
        self._buf = bytearray()

    def recv(self) -> bytes:
        buf, fd = self._buf, self._fd
        while True:
            if len(buf) >= 4:
                (n,) = _LEN.unpack_from(buf)
                if len(buf) >= 4 + n:
                    frame = bytes(buf[4 : 4 + n])
                    del buf[: 4 + n]
                    return frame
            try:
                chunk = os.read(fd, 1 << 20)
            except BlockingIOError:
                continue
            if not chunk:
                raise ChannelClosed("pipe EOF")
            buf += chunk


class _Bench:
    """The producer child plus consumer ends for each transport and mode."""

    def __init__(self) -> None:
        self.ring = RingChannel.create(capacity=DEFAULT_RING_BYTES)
        read_fd, write_fd = os.pipe()
        self._pipe_fd = read_fd
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "benchmarks.transport",  # a module of the package (it imports the study runner)
                "--child",
                msgspec.json.encode(self.ring.spec).decode(),
                str(write_fd),
            ],
            pass_fds=(*self.ring.child_fds, write_fd),
            stdin=subprocess.PIPE,
            text=True,
            cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
        )
        self.ring.after_spawn(self.proc.pid)
        os.close(write_fd)
        self.rx = self.ring.receiver()
        if self.rx.recv(timeout=30) != b"hello":
            raise RuntimeError("benchmark child sent a bad hello")
        self.ring.mark_attached()
        self._pipe_blocked = PipeReceiver(read_fd)
        self._pipe_spin = _SpinPipeReceiver(read_fd)

    def receiver(self, tr: str, mode: str):  # -> a zero-argument recv
        if tr == "ring":
            self.rx.spin_us = 1e12 if mode == "spin" else 0.0
            return self.rx.recv
        os.set_blocking(self._pipe_fd, mode == "blocked")
        return self._pipe_blocked.recv if mode == "blocked" else self._pipe_spin.recv

    def command(self, **cmd: object) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()

    def latency_us(self, tr: str, mode: str, size: int, n: int) -> list[float]:
        recv = self.receiver(tr, mode)
        gap = SPIN_GAP_S if mode == "spin" else BLOCKED_GAP_S
        self.command(op="latency", tr=tr, size=size, n=n + WARMUP, gap_s=gap)
        clock = time.perf_counter_ns
        out = []
        for _ in range(n + WARMUP):
            frame = recv()
            out.append((clock() - _STAMP.unpack_from(frame)[0]) / 1000)
        return out[WARMUP:]

    def burst_s(self, tr: str, size: int, n: int) -> float:
        """Seconds from the first send to the last frame received."""
        recv = self.receiver(tr, "spin" if tr == "ring" else "blocked")
        self.command(op="burst", tr=tr, size=size, n=n)
        start = _STAMP.unpack_from(recv())[0]
        for _ in range(n - 1):
            recv()
        return (time.perf_counter_ns() - start) / 1e9

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait(timeout=30)
        self.ring.close()
        os.close(self._pipe_fd)


def _memcpy_gb_per_s(size: int, n: int) -> float:
    src, dst = bytearray(os.urandom(size)), bytearray(size)
    view = memoryview(dst)
    t0 = time.perf_counter()
    for _ in range(n):
        view[:] = src
    return size * n / (time.perf_counter() - t0) / 1e9


def _per_call_ns(fn, n: int) -> float:  # type: ignore[no-untyped-def]
    t0 = time.perf_counter_ns()
    for _ in range(n):
        fn()
    return (time.perf_counter_ns() - t0) / n


def _breakdown_ns(n: int) -> dict[str, float]:
    """Where a small frame's time goes, measured in one process (no cross-core traffic)."""
    import mmap

    from mlxrt.ipc._atomics import Region

    mm = mmap.mmap(-1, 4096)
    region = Region(mm)
    payload = b"x" * 32
    ring = RingChannel.create(capacity=DEFAULT_RING_BYTES)
    # The producer end in this process, on its own copy of the doorbell fd.
    spec = msgspec.structs.replace(ring.spec, doorbell_fd=os.dup(ring.spec.doorbell_fd))
    tx = attach_ring(spec)
    ring.after_spawn(os.getpid())
    rx = ring.receiver()
    batch = 10_000
    sends = recvs = 0.0
    for _ in range(max(1, n // batch)):
        sends += _per_call_ns(lambda: tx.send(payload), batch)
        recvs += _per_call_ns(rx.recv, batch)
    rounds = max(1, n // batch)
    result = {
        "empty_python_call": _per_call_ns(lambda: None, n),
        "perf_counter_ns": _per_call_ns(time.perf_counter_ns, n),
        "c_load_acquire": _per_call_ns(lambda: region.load_acquire(0), n),
        "c_put_32B": _per_call_ns(lambda: region.put(64, 1, payload, 0, 1, 8), n),
        "c_take_32B": _per_call_ns(lambda: region.take(64, 32, 0, 1), n),
        "ring_send_32B": sends / rounds,
        "ring_recv_32B": recvs / rounds,
    }
    tx.close()
    ring.close()
    region.release()
    mm.close()
    return result


def _summary(samples: list[float], rounds: list[list[float]]) -> dict[str, object]:
    qs = statistics.quantiles(samples, n=100)
    return {
        "p50": statistics.median(samples),
        "p99": qs[98],
        "n": len(samples),
        "round_p50s": [statistics.median(r) for r in rounds],
    }


def _machine() -> dict[str, object]:
    """The study runner's environment, with the load average (other work on the box skews every
    figure) and the keys this study has always written (``msgspec``, ``git_commit``)."""
    env = runner.environment()
    extra = {"loadavg_1m": os.getloadavg()[0], "msgspec": msgspec.__version__, "git_commit": env["commit"]}
    return {**env, **extra}


def run(quick: bool) -> dict:
    """Measure everything; return one JSON-able dict (see the module docstring)."""
    rounds = 2 if quick else 5
    n_lat = 100 if quick else 400
    n_small = 50_000 if quick else 200_000
    n_big = 40 if quick else 200
    lat: dict[str, dict[str, dict[str, list[list[float]]]]] = {
        tr: {m: {str(s): [] for s in SIZES} for m in ("spin", "blocked")} for tr in ("ring", "pipe")
    }
    small: dict[str, list[float]] = {"ring": [], "pipe": []}
    big: dict[str, list[float]] = {"ring": [], "pipe": [], "memcpy": []}
    bench = _Bench()
    try:
        for r in range(rounds):
            order = ("ring", "pipe") if r % 2 == 0 else ("pipe", "ring")
            for size in SIZES:
                for mode in ("spin", "blocked"):
                    for tr in order:
                        lat[tr][mode][str(size)].append(bench.latency_us(tr, mode, size, n_lat))
            for tr in order:
                small[tr].append(n_small / bench.burst_s(tr, 32, n_small))
                big[tr].append(n_big * (1 << 20) / bench.burst_s(tr, 1 << 20, n_big) / 1e9)
            big["memcpy"].append(_memcpy_gb_per_s(1 << 20, n_big * 5))
    finally:
        bench.close()
    latency = {
        tr: {
            mode: {
                size: _summary([x for rnd in per_round for x in rnd], per_round)
                for size, per_round in by_size.items()
            }
            for mode, by_size in by_mode.items()
        }
        for tr, by_mode in lat.items()
    }

    def spread(values: list[float]) -> dict[str, object]:
        return {
            "median": statistics.median(values),
            "min": min(values),
            "max": max(values),
            "rounds": values,
        }

    return {
        "benchmark": "transport",
        "quick": quick,
        "units": {"latency": "us one-way", "small": "msgs/s", "big": "GB/s (1e9 B/s)"},
        "ring_capacity_bytes": DEFAULT_RING_BYTES,
        "latency_us": latency,
        "small_msgs_per_s": {tr: spread(v) for tr, v in small.items()},
        "mib_payload_gb_per_s": {k: spread(v) for k, v in big.items()},
        "breakdown_ns": _breakdown_ns(100_000 if quick else 500_000),
        "targets": TARGETS,
        "machine": _machine(),
    }


def _table(res: dict) -> str:
    lines = [
        "one-way latency, µs: p50 / p99 (median over rounds; all samples pooled)",
        f"{'size':>9} | {'ring spin':>17} | {'pipe spin':>17} | {'ring blocked':>17} | {'pipe blocked':>17}",
    ]
    lat = res["latency_us"]
    for size in SIZES:
        cells = []
        for tr, mode in (
            ("ring", "spin"),
            ("pipe", "spin"),
            ("ring", "blocked"),
            ("pipe", "blocked"),
        ):
            s = lat[tr][mode][str(size)]
            cells.append(f"{s['p50']:8.1f} / {s['p99']:6.1f}")
        lines.append(f"{size:>8}B | " + " | ".join(cells))
    sm, bg = res["small_msgs_per_s"], res["mib_payload_gb_per_s"]
    lines += [
        "",
        f"32 B msgs/s      ring {sm['ring']['median']:>12,.0f}  pipe {sm['pipe']['median']:>12,.0f}"
        f"   (ring rounds {min(sm['ring']['rounds']):,.0f}..{max(sm['ring']['rounds']):,.0f})",
        f"1 MiB GB/s       ring {bg['ring']['median']:>12.2f}  pipe {bg['pipe']['median']:>12.2f}"
        f"   memcpy {bg['memcpy']['median']:.2f} (one copy; the ring makes two)",
        "",
        "per call, ns (one process): " + ", ".join(f"{k} {v:.0f}" for k, v in res["breakdown_ns"].items()),
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds and samples")
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    runner.add_json_arg(parser, study="transport")
    args = parser.parse_args()
    if args.child:
        _child(*args.child)
        return
    res = run(args.quick)
    print(_table(res))
    rate = {tr: s["median"] for tr, s in res["small_msgs_per_s"].items()}
    runner.finish(res, runner.json_path(args.json, "transport"),
                  {"benchmark": "transport", "quick": args.quick, "small_msgs_per_s_median": rate})

if __name__ == "__main__":
    main()
