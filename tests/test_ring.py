"""The shared-memory ring, between real processes on tiny rings.

Children are `tests/ring_child.py` started with subprocess and pass_fds, the
way the orchestrator starts a worker. Every wait has a generous timeout that
fails the test instead of hanging it; nothing here measures speed.
"""

from __future__ import annotations

import mmap
import os
import queue
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import msgspec
import posix_ipc
import pytest
from mlxrt.ipc.channel import ChannelClosed, ChannelCorrupt
from mlxrt.ipc.ring import (
    RingChannel,
    attach_ring,
    ring_self_test,
    sweep_stale_segments,
)
from ring_child import StressStream, check_frame

CHILD = os.path.join(os.path.dirname(__file__), "ring_child.py")
SHM_DIR = "/dev/shm"
WAIT_S = 30.0  # generous: a hang fails the test after this, it is not a speed target
needs_shm_listing = pytest.mark.skipif(not os.path.isdir(SHM_DIR), reason="no /dev/shm listing on this OS")


class Child:
    """A child process whose stdout lines arrive on a queue (no blocking reads)."""

    def __init__(
        self,
        args: list[str],
        *,
        pass_fds: tuple[int, ...] = (),
        stdin: int | None = subprocess.DEVNULL,
        env: dict[str, str] | None = None,
    ) -> None:
        self.mode = args[0]
        self.proc = subprocess.Popen(
            [sys.executable, CHILD, *args],
            pass_fds=pass_fds,
            stdin=stdin,
            stdout=subprocess.PIPE,
            env=env,
            text=True,
        )
        self.lines: queue.Queue[str] = queue.Queue()
        self._pump_thread = threading.Thread(target=self._pump, daemon=True)
        self._pump_thread.start()

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line.rstrip("\n"))

    def line(self, startswith: str = "") -> str:
        """The next stdout line that starts with `startswith`; fail after WAIT_S."""
        deadline = time.monotonic() + WAIT_S
        while True:
            try:
                line = self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                pytest.fail(f"child {self.mode} said no {startswith!r} within {WAIT_S} s")
            if line.startswith(startswith):
                return line

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=WAIT_S)
        if self.proc.stdin:
            self.proc.stdin.close()
        self._pump_thread.join(timeout=WAIT_S)  # EOF once every holder of the pipe is gone
        assert self.proc.stdout is not None
        self.proc.stdout.close()


@pytest.fixture
def children() -> Iterator[list[Child]]:
    started: list[Child] = []
    yield started
    for child in started:
        child.stop()


def spawn_producer(
    children: list[Child],
    ring: RingChannel,
    mode: str,
    *args: str,
    stdin: int | None = subprocess.DEVNULL,
    env: dict[str, str] | None = None,
) -> Child:
    spec = msgspec.json.encode(ring.spec).decode()
    child = Child([mode, spec, *args], pass_fds=ring.child_fds, stdin=stdin, env=env)
    ring.after_spawn(child.proc.pid)
    children.append(child)
    return child


def segment_exists(name: str) -> bool:
    try:
        posix_ipc.SharedMemory(name).close_fd()
    except posix_ipc.ExistentialError:
        return False
    return True


def recv_until_closed(rx: object, first_index: int = 0) -> tuple[int, ChannelClosed]:
    """Receive checked frames until ChannelClosed; return how many and the exception."""
    index = first_index
    while True:
        try:
            frame = rx.recv(timeout=WAIT_S)  # type: ignore[attr-defined]
        except TimeoutError:
            pytest.fail(f"no frame and no ChannelClosed within {WAIT_S} s")
        except ChannelClosed as exc:
            return index - first_index, exc
        check_frame(frame, index)
        index += 1


def test_segment_name_is_short_unguessable_and_owner_only() -> None:
    """Names fit macOS's 30 characters, carry 72 random bits, and the segment is 0600."""
    with RingChannel.create(capacity=4096) as a, RingChannel.create(capacity=4096) as b:
        for ring in (a, b):
            assert len(ring.name) <= 30
            assert ring.name.startswith("/mlxrt-") and len(ring.name) == len("/mlxrt-") + 12
        assert a.name != b.name
        if os.path.isdir(SHM_DIR):
            assert os.stat(SHM_DIR + a.name).st_mode & 0o777 == 0o600


def test_stress_random_sizes_across_processes(children: list[Child]) -> None:
    """Seeded frames of 0 bytes to 3x the ring arrive whole, in order, checksummed."""
    seed = int(os.environ.get("MLXRT_RING_STRESS_SEED", random.randrange(2**32)))
    count = int(float(os.environ.get("MLXRT_RING_STRESS_N", "1e6")))
    capacity = 8192
    print(f"ring stress: seed={seed} count={count} capacity={capacity}")
    with RingChannel.create(capacity=capacity) as ring:
        child = spawn_producer(children, ring, "stress", str(seed), str(count))
        child.line("attached")
        ring.mark_attached()
        rx = ring.receiver()
        expected = StressStream(seed, capacity)
        delays = random.Random(seed + 2)
        for i in range(count):
            want = expected.frame(i)
            try:
                got = rx.recv(timeout=WAIT_S)
            except TimeoutError:
                pytest.fail(f"frame {i} (seed {seed}) did not arrive within {WAIT_S} s")
            if len(want) >= 12:
                check_frame(got, i)
            assert got == want, f"frame {i} differs (seed {seed})"
            if delays.random() < 2e-4:
                time.sleep(delays.random() * 0.003)  # let the producer hit a full ring
        with pytest.raises(ChannelClosed, match="producer closed"):
            rx.recv(timeout=WAIT_S)
        assert child.proc.wait(timeout=WAIT_S) == 0
    assert not segment_exists(ring.name)


def _model(sizes: list[int], capacity: int) -> tuple[list[int], set[str]]:
    """Where the consumer's head should stand after each frame, and which edge cases
    the sequence hits; written from the layout, independently of ring.py."""
    max_chunk = (capacity // 2 - 8) & ~7
    head, heads, hits = 0, [], set()
    for n in sizes:
        chunks = [min(max_chunk, n - s) for s in range(0, n, max_chunk)] or [0]
        hits.add("chunked" if len(chunks) > 1 else "whole")
        for c in chunks:
            record = 8 + (c + 7) // 8 * 8
            if head % capacity + record > capacity:
                head += capacity - head % capacity
                hits.add("pad")
            head += record
            if head % capacity == 0:
                hits.add("exact fit")
        heads.append(head)
    return heads, hits


def test_exact_fit_wraparound_and_chunk_boundaries(children: list[Child]) -> None:
    """Records that end exactly at the ring's end, pad to wrap, or straddle chunk sizes."""
    capacity = 4096  # one record holds at most 2040 payload bytes
    sizes = [0, 2040, 2032, 1000, 2040, 2041, 2040 * 2, 3 * capacity, 1, 7, 8, 9, 4088, 0]
    heads, hits = _model(sizes, capacity)
    assert hits == {"whole", "chunked", "pad", "exact fit"}
    with RingChannel.create(capacity=capacity) as ring:
        child = spawn_producer(children, ring, "sizes", msgspec.json.encode(sizes).decode())
        child.line("attached")
        rx = ring.receiver()
        for i, n in enumerate(sizes):
            assert rx.recv(timeout=WAIT_S) == bytes((i + k) % 251 for k in range(n)), i
            assert rx._head == heads[i], f"frame {i}: head {rx._head} != {heads[i]}"
        assert rx.peer_heartbeat() > 0
        with pytest.raises(ChannelClosed):
            rx.recv(timeout=WAIT_S)


@needs_shm_listing
def test_producer_sigkill_mid_stream(children: list[Child]) -> None:
    """A worker killed mid-stream: valid frames, then ChannelClosed, no hang, no leak."""
    with RingChannel.create(capacity=16384) as ring:
        child = spawn_producer(children, ring, "stream")
        child.line("attached")
        ring.mark_attached()
        rx = ring.receiver()
        for i in range(500):
            check_frame(rx.recv(timeout=WAIT_S), i)
        os.kill(child.proc.pid, signal.SIGKILL)
        received, exc = recv_until_closed(rx, first_index=500)
        assert "producer died" in str(exc)
        with pytest.raises(ChannelClosed):
            rx.recv(timeout=0)  # and it stays closed
    assert not os.path.exists(SHM_DIR + ring.name)
    with pytest.raises(ChannelClosed, match="is closed"):
        rx.recv(timeout=0)  # after ring.close() too


def test_spinning_consumer_still_sees_the_producer_die(children: list[Child]) -> None:
    """A consumer told to spin (almost) forever is not blind to a dead producer."""
    with RingChannel.create(capacity=4096) as ring:
        child = spawn_producer(children, ring, "idle", stdin=subprocess.PIPE)
        child.line("attached")
        rx = ring.receiver(spin_us=1e12)
        os.kill(child.proc.pid, signal.SIGKILL)
        with pytest.raises(ChannelClosed, match="producer died"):
            rx.recv(timeout=WAIT_S)


@pytest.mark.parametrize("kind", ["record", "chunk"])
def test_torn_frame_is_never_delivered(children: list[Child], kind: str) -> None:
    """A producer killed inside a record or between chunks yields no partial frame."""
    with RingChannel.create(capacity=4096) as ring:
        child = spawn_producer(children, ring, "torn", kind)
        child.line("torn")
        rx = ring.receiver()
        received, exc = recv_until_closed(rx)
        assert received == 3
        assert "producer died" in str(exc)
        if kind == "chunk":
            assert "discarded 64 bytes" in str(exc)


@needs_shm_listing
def test_consumer_sigkill_fails_the_producer(children: list[Child]) -> None:
    """An orchestrator killed while its worker floods: send raises ChannelClosed, no leak."""
    orchestrator = Child(["orchestrate", "4096"])
    children.append(orchestrator)
    _, name, _ = orchestrator.line("orchestrating").split()
    os.kill(orchestrator.proc.pid, signal.SIGKILL)
    failure = orchestrator.line("send-failed")  # the worker inherited our stdout pipe
    assert failure.startswith("send-failed ChannelClosed"), failure
    assert not os.path.exists(SHM_DIR + name)


def test_full_ring_times_out_naming_the_knob(children: list[Child]) -> None:
    """A live consumer that stops reading: send gives up and says which setting to change."""
    env = dict(os.environ, MLXRT_RING_FULL_TIMEOUT_S="0.3")
    with RingChannel.create(capacity=4096) as ring:
        child = spawn_producer(children, ring, "flood", env=env)
        failure = child.line("send-failed")
        assert failure.startswith("send-failed TimeoutError"), failure
        assert "MLXRT_RING_FULL_TIMEOUT_S" in failure


@pytest.mark.parametrize(
    ("where", "span", "message"),
    [
        ("identity", (0, 48), "bad header"),
        ("tail", (128, 136), "published tail"),
        ("record", (512, 520), "record at byte 0"),
    ],
)
def test_scribbled_header_or_record_is_corrupt(
    children: list[Child], where: str, span: tuple[int, int], message: str
) -> None:
    """Random bytes over the header or a record word: ChannelCorrupt, never a bad frame."""
    seed = random.randrange(2**32)
    print(f"scribble {where}: seed={seed}")
    with RingChannel.create(capacity=4096) as ring:
        child = spawn_producer(children, ring, "count", "5", stdin=subprocess.PIPE)
        child.line("sent")
        shm = posix_ipc.SharedMemory(ring.name)
        with mmap.mmap(shm.fd, 4096 + 512) as mm:
            shm.close_fd()
            mm[span[0] : span[1]] = random.Random(seed).randbytes(span[1] - span[0])
        rx = ring.receiver()
        with pytest.raises(ChannelCorrupt, match=message):
            for i in range(6):
                check_frame(rx.recv(timeout=WAIT_S), i)
        with pytest.raises(ChannelCorrupt):
            rx.recv(timeout=0)


def test_attach_checks_nonce_and_single_producer(children: list[Child]) -> None:
    """A spec that does not match the segment, or a second producer, is refused."""
    with RingChannel.create(capacity=4096) as ring:
        wrong = msgspec.structs.replace(ring.spec, nonce=ring.spec.nonce ^ 1)
        with pytest.raises(ChannelCorrupt, match="nonce"):
            attach_ring(wrong)
        child = spawn_producer(children, ring, "idle", stdin=subprocess.PIPE)
        child.line("attached")
        r, w = os.pipe()
        os.close(r)
        second = msgspec.structs.replace(ring.spec, doorbell_fd=w)
        with pytest.raises(ChannelCorrupt, match="already has a producer"):
            attach_ring(second)
        os.close(w)


def test_idle_consumer_uses_no_cpu(children: list[Child]) -> None:
    """A consumer blocked in recv sleeps on the doorbell instead of spinning."""
    with RingChannel.create(capacity=4096) as ring:
        child = spawn_producer(children, ring, "idle", stdin=subprocess.PIPE)
        child.line("attached")
        rx = ring.receiver()
        cpu0, wall0 = time.process_time(), time.monotonic()
        with pytest.raises(TimeoutError):
            rx.recv(timeout=1.0)
        cpu, wall = time.process_time() - cpu0, time.monotonic() - wall0
        assert cpu < 0.05 * wall, f"{cpu:.3f} s of CPU over {wall:.3f} s blocked"


@needs_shm_listing
def test_sweep_removes_only_segments_of_dead_creators(children: list[Child]) -> None:
    """A segment left by a killed orchestrator is swept; a live one is kept."""
    orphan_maker = Child(["stale", "4096"])
    children.append(orphan_maker)
    _, orphan = orphan_maker.line("created").split()
    orphan_maker.proc.wait(timeout=WAIT_S)
    assert os.path.exists(SHM_DIR + orphan)
    with RingChannel.create(capacity=4096) as live:
        removed = sweep_stale_segments()
        assert orphan in removed
        assert live.name not in removed
        assert not os.path.exists(SHM_DIR + orphan)
        assert os.path.exists(SHM_DIR + live.name)


def test_close_unlinks_an_unattached_segment_and_is_idempotent() -> None:
    """A worker that never attached leaves nothing behind once the ring is closed."""
    ring = RingChannel.create(capacity=4096)
    assert segment_exists(ring.name)
    ring.close()
    ring.close()
    assert not segment_exists(ring.name)
    with pytest.raises(ChannelClosed):
        ring.receiver()


def test_ring_self_test_passes_here() -> None:
    """transport="auto" would pick the ring on this machine."""
    assert ring_self_test() is None


def test_chunked_send_cut_off_by_timeout_poisons_the_sender() -> None:
    """A frame half-sent when the ring stayed full is never followed by a glued-on frame."""
    with RingChannel.create(capacity=4096) as ring:
        spec = msgspec.structs.replace(ring.spec, doorbell_fd=os.dup(ring.spec.doorbell_fd))
        tx = attach_ring(spec, full_timeout_s=0.2)  # in-process: nobody reads, so it fills
        ring.after_spawn(os.getpid())
        with pytest.raises(TimeoutError, match="MLXRT_RING_FULL_TIMEOUT_S"):
            tx.send(b"z" * 3 * 4096)
        with pytest.raises(ChannelClosed, match="cut off"):
            tx.send(b"next")
        tx.close()


def test_try_send_refuses_when_full_and_loses_nothing() -> None:
    """try_send publishes whole records until the ring is full, then refuses without waiting;
    after the consumer drains, every accepted frame is there, in order, across the wrap."""
    with RingChannel.create(capacity=4096) as ring:
        spec = msgspec.structs.replace(ring.spec, doorbell_fd=os.dup(ring.spec.doorbell_fd))
        tx = attach_ring(spec, full_timeout_s=0.2)
        ring.after_spawn(os.getpid())
        rx = ring.receiver()
        sent = []
        for round_ in range(3):
            i = 0
            while tx.try_send(f"{round_}:{i}".encode() * 7):
                sent.append(f"{round_}:{i}".encode() * 7)
                i += 1
            assert i > 0
            assert not tx.try_send(b"x" * 3000)  # larger than half the ring: never in one record
            got = [rx.recv(timeout=1) for _ in range(i)]
            assert got == sent[-i:]
        tx.close()


def test_pipe_receiver_keeps_a_frame_cut_by_a_timeout():
    """A pipe frame that stops halfway: recv times out, and the next call returns it whole once the
    rest arrives, and the frame after it too (the orchestrator's reader waits in short timeouts)."""
    from mlxrt.ipc.stdio import _LEN, PipeReceiver

    r, w = os.pipe()
    rx = PipeReceiver(r)
    try:
        data = _LEN.pack(11) + b"hello world" + _LEN.pack(3) + b"end"
        os.write(w, data[:9])
        with pytest.raises(TimeoutError):
            rx.recv(timeout=0.05)
        os.write(w, data[9:])
        assert rx.recv(timeout=5) == b"hello world" and rx.recv(timeout=5) == b"end"
    finally:
        rx.close()
        os.close(w)
