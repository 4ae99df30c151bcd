"""Child programs for tests/test_ring.py: a worker-like producer, or an orchestrator.

Run as ``python tests/ring_child.py MODE ARGS...``; the ring's RingSpec comes
as JSON in argv (the real worker gets it inside Hello). Lines on stdout tell
the test what happened; the test never parses anything else.
"""

from __future__ import annotations

import os
import random
import signal
import struct
import subprocess
import sys
import time
import zlib

import msgspec
from mlxrt.ipc.channel import ChannelClosed
from mlxrt.ipc.ring import RingChannel, RingSpec, attach_ring

_CHECKED = struct.Struct("<QI")  # frame index, crc32 of the body


def say(*words: object) -> None:
    print(*words, flush=True)


def checked_frame(index: int, body: bytes) -> bytes:
    return _CHECKED.pack(index, zlib.crc32(body)) + body


def check_frame(frame: bytes, index: int) -> None:
    """Raise AssertionError unless `frame` is checked_frame(index, <its body>)."""
    got_index, crc = _CHECKED.unpack_from(frame)
    body = frame[_CHECKED.size :]
    assert got_index == index, f"frame {index}: got index {got_index}"
    assert zlib.crc32(body) == crc, f"frame {index}: crc mismatch ({len(frame)} bytes)"


class StressStream:
    """The seeded sequence of frames both sides of the stress test derive.

    Sizes run from 0 bytes to three times the ring: mostly small, some
    chunked. Frames of 12 bytes or more carry their index and a crc32.
    """

    def __init__(self, seed: int, capacity: int) -> None:
        self.rnd = random.Random(seed)
        self.capacity = capacity
        self.pool = random.Random(seed ^ 0x5EED).randbytes(4 * capacity + 4096)

    def size(self) -> int:
        r = self.rnd.random()
        if r < 0.80:
            return self.rnd.randint(0, 64)
        if r < 0.95:
            return self.rnd.randint(0, 2048)
        if r < 0.99:
            return self.rnd.randint(0, self.capacity)
        return self.rnd.randint(self.capacity, 3 * self.capacity)

    def frame(self, index: int) -> bytes:
        n = self.size()
        start = self.rnd.randrange(len(self.pool) - n)
        if n < _CHECKED.size:
            return self.pool[start : start + n]
        return checked_frame(index, self.pool[start : start + n - _CHECKED.size])


def _spec(arg: str) -> RingSpec:
    return msgspec.json.decode(arg, type=RingSpec)


def stress(spec_json: str, seed: str, count: str) -> None:
    """Send the seeded stream, pausing now and then so the consumer falls asleep."""
    spec = _spec(spec_json)
    tx = attach_ring(spec)
    say("attached")
    stream = StressStream(int(seed), spec.capacity)
    delays = random.Random(int(seed) + 1)
    for i in range(int(count)):
        tx.send(stream.frame(i))
        if delays.random() < 2e-4:
            time.sleep(delays.random() * 0.003)
    tx.close()


def sizes(spec_json: str, sizes_json: str) -> None:
    """Send one frame of each listed size: byte k of frame i is (i + k) % 251."""
    tx = attach_ring(_spec(spec_json))
    say("attached")
    for i, n in enumerate(msgspec.json.decode(sizes_json)):
        tx.send(bytes((i + k) % 251 for k in range(n)))
    tx.close()


def stream(spec_json: str) -> None:
    """Send checked frames of random sizes until killed."""
    spec = _spec(spec_json)
    tx = attach_ring(spec)
    say("attached")
    rnd = random.Random(os.getpid())
    i = 0
    while True:
        tx.send(checked_frame(i, rnd.randbytes(rnd.randint(0, 2 * spec.capacity))))
        i += 1


def torn(spec_json: str, kind: str) -> None:
    """Send three good frames, leave half a frame in the ring, then SIGKILL ourselves.

    kind "record": a record written but its tail never published.
    kind "chunk": the first chunk of a chunked frame published, the rest never sent.
    """
    spec = _spec(spec_json)
    tx = attach_ring(spec)
    for i in range(3):
        tx.send(checked_frame(i, b"good" * i))
    if kind == "record":
        # Everything Region.put does except the release of the tail.
        at = 512 + tx._tail % spec.capacity
        word = 16 | (tx._seq << 32)
        tx._seg.mm[at : at + 24] = word.to_bytes(8, "little") + b"half-written rec"
    else:
        tx._put_record(b"c" * 64, 64, 1 << 30)  # MORE: a continuation is owed
    say("torn")
    os.kill(os.getpid(), signal.SIGKILL)


def idle(spec_json: str) -> None:
    """Attach, then send nothing until stdin closes."""
    tx = attach_ring(_spec(spec_json))
    say("attached")
    sys.stdin.read()
    tx.close()


def count(spec_json: str, n: str) -> None:
    """Send `n` checked frames, then wait for stdin to close."""
    tx = attach_ring(_spec(spec_json))
    for i in range(int(n)):
        tx.send(checked_frame(i, bytes(i % 256 for _ in range(40))))
    say("sent")
    sys.stdin.read()
    tx.close()


def flood(spec_json: str) -> None:
    """Send until send() raises; report the exception on stdout."""
    tx = attach_ring(_spec(spec_json))
    say("attached")
    i = 0
    try:
        while True:
            tx.send(checked_frame(i, b"x" * 100))
            i += 1
    except (ChannelClosed, TimeoutError) as exc:
        say("send-failed", type(exc).__name__, str(exc))


def orchestrate(capacity: str) -> None:
    """Be the orchestrator of a flooding worker, then stop reading and wait to be killed."""
    ring = RingChannel.create(capacity=int(capacity))
    proc = subprocess.Popen(
        [sys.executable, __file__, "flood", msgspec.json.encode(ring.spec).decode()],
        pass_fds=ring.child_fds,
        stdin=subprocess.DEVNULL,
    )
    ring.after_spawn(proc.pid)
    ring.receiver().recv(timeout=30)  # a frame proves the worker attached
    ring.mark_attached()
    say("orchestrating", ring.name, proc.pid)
    time.sleep(3600)


def stale(capacity: str) -> None:
    """Create a ring and die before anyone attaches, leaving its segment linked."""
    ring = RingChannel.create(capacity=int(capacity))
    say("created", ring.name)
    os.kill(os.getpid(), signal.SIGKILL)


if __name__ == "__main__":
    globals()[sys.argv[1]](*sys.argv[2:])
