"""Single-producer single-consumer byte ring in POSIX shared memory.

The worker's token stream (worker -> orchestrator) goes through this ring;
requests (orchestrator -> worker) stay on the worker's stdin pipe. Requests are
rare and small, and their latency is nothing next to a forward pass, so a
second ring would buy nothing; and stdin is a channel the kernel closes when
the orchestrator dies, which is how the worker learns of it.

Data flow::

    orchestrator (consumer)                        worker (producer)
    RingChannel.create()   -- shm_open(O_EXCL, 0600) -->  /mlxrt-<12 chars>
                           -- os.pipe() ------------->  doorbell (w end)
    Popen(pass_fds=ring.child_fds); ring.after_spawn(pid)   (parent drops w)
    stdin: Hello(ring=RingSpec) ----------------------> attach_ring(spec)
    <-------------------------------------------------- "attached" (stdout)
    ring.mark_attached()   -- shm_unlink: nothing left to leak
    rx.recv()  <== records in shared memory ========== tx.send(frame)
               <-- one doorbell byte, only if asleep --
               <-- doorbell EOF when the worker exits or dies

Segment layout. Every field is a native-endian u64 (x86_64 and arm64 are both
little-endian); lines are 128 bytes (Apple silicon's cache line) and each has
a single writer, so the head and the tail never share a line::

    offset  owner     field
    ---- line 0: identity, written by the creator before the spawn, then read-only
      0     creator   magic            b"MLXRTRNG"
      8     creator   version          LAYOUT_VERSION
     16     creator   capacity         bytes in the data region, multiple of 8
     24     creator   nonce            random; its low 32 bits are the first sequence
     32     creator   creator_pid      the orchestrator; read by sweep_stale_segments()
     40     creator   creator_start    its start time in ms since the epoch, 0 = unknown
    ---- line 1 (128): producer
    128     producer  tail             bytes ever published (monotonic, never wraps)
    136     producer  producer_pid     0 until attach_ring() claims it (compare-exchange)
    144     producer  producer_state   0 open, 1 closed
    152     producer  heartbeat        bumped by RingSender.beat() and while waiting for space
    ---- line 2 (256): consumer
    256     consumer  head             bytes ever consumed (monotonic, never wraps)
    264     consumer  consumer_state   0 open, 1 closed, 2 found a corrupt record
    ---- line 3 (384): consumer, rarely written so the producer's read stays cached
    384     consumer  sleeping         1 while the consumer is (about to be) blocked
    ---- 512: data region, `capacity` bytes

A record starts at ``512 + counter % capacity``, is 8-byte aligned and never
wraps around the end of the data region::

    word (u64): bits 0-29 payload length | bit 30 MORE | bit 31 PAD | bits 32-63 sequence
    payload, padded with junk to a multiple of 8 bytes

MORE says the frame continues in the next record (a frame larger than half
the ring is split into chunks and reassembled; never dropped). PAD fills the
rest of the data region when the next record does not fit there; its length
reaches exactly to the end. Sequences count records (PAD included) modulo
2**32 from the nonce, so a stray or stale word is caught rather than trusted.

What each side does::

    tail - head          producer_state  doorbell  consumer (recv)
    in (0, capacity]     any             any       read the record at head (drain first)
    0                    open            open      spin spin_us, then sleep <= 100 ms
    0                    closed          any       ChannelClosed("producer closed")
    0                    open            EOF       ChannelClosed("producer died")
    otherwise, bad word  -               -         ChannelCorrupt, consumer_state = 2

    free space           consumer_state  doorbell  producer (send)
    >= record            open            any       write, publish, ring if sleeping
    < record             open            open      back off <= 1 ms, probe every 50 ms,
                                                   TimeoutError after full_timeout_s
    any                  closed          any       ChannelClosed
    any                  corrupt         any       ChannelCorrupt
    < record             open            EPIPE     ChannelClosed (consumer gone)

Memory ordering (the C calls are in ``_atomics.c``; no reliance on x86's
strong ordering, no locks):

1. Publish. The producer writes the word and payload with plain stores, then
   release-stores the tail (``Region.put``). The consumer acquire-loads the
   tail before reading anything below it, so every byte below an observed
   tail is the producer's complete write. A producer killed before the release
   leaves the tail where it was: a half-written record is never seen.
2. Reuse. The consumer copies the payload out, then release-stores the head
   (``Region.take``). The producer acquire-loads the head before writing into
   the space it frees, so the consumer's reads happen before the overwrite.
3. Sleep and wake-up (store, fence, load on both sides). The consumer stores
   sleeping = 1, full fence, loads the tail, and sleeps only if the ring is
   still empty (``Region.flag_then_load``). The producer stores the tail, full
   fence, loads sleeping, and rings only if it is 1 (``Region.put``). The two
   seq_cst fences fall in one total order: if the producer's comes first, the
   consumer's load sees the new tail and does not sleep; if the consumer's
   comes first, the producer's load sees sleeping = 1 and rings. Both may
   happen (a spurious byte, drained and ignored); neither is impossible, so no
   wake-up is lost. A lost byte anyway (pipe full) costs at most the 100 ms
   poll timeout.
4. Close. The producer release-stores producer_state after its last publish;
   the consumer acquire-loads it and then re-reads the tail, so the final
   records are delivered before ChannelClosed.

Segment cleanup: the creator unlinks the name as soon as the worker has
attached (``mark_attached``); from then on the memory is freed when both
mappings go, whatever kills whom. ``sweep_stale_segments`` removes what a
creator killed before that moment left behind (Linux; see docs/ring.md).
"""

from __future__ import annotations

import math
import mmap
import os
import secrets
import select
import stat
import struct
import subprocess
import sys
import time
import weakref
from collections.abc import Callable
from typing import Any

import msgspec
import posix_ipc
import structlog

from .channel import MAX_FRAME_BYTES, ChannelClosed, ChannelCorrupt
from .protocol import RingSpec  # the wire schema's; re-exported for the ring's callers

log = structlog.get_logger()

#: Data-region size a new ring gets, bytes. Most frames are a few dozen bytes.
DEFAULT_RING_BYTES = 4 * 1024 * 1024
MIN_RING_BYTES = 1024
MAX_RING_BYTES = 1 << 30
#: How long an empty consumer polls before blocking on the doorbell, µs.
DEFAULT_SPIN_US = 50.0
#: How long send() waits for space before TimeoutError, s (env MLXRT_RING_FULL_TIMEOUT_S).
DEFAULT_FULL_TIMEOUT_S = 60.0
FULL_TIMEOUT_ENV = "MLXRT_RING_FULL_TIMEOUT_S"
#: Longest single sleep on the doorbell: what a lost wake-up could cost, s.
DOORBELL_WAIT_S = 0.1
#: How often a producer waiting for space checks that the consumer is alive, s.
PEER_PROBE_S = 0.05
#: Age after which a segment without a valid header is swept anyway, s.
STALE_UNINITIALISED_S = 60.0

SEGMENT_PREFIX = "mlxrt-"
LAYOUT_VERSION = 1
MAGIC = int.from_bytes(b"MLXRTRNG", "little")

# Offsets; the module docstring is the picture of these.
_MAGIC, _VERSION, _CAPACITY, _NONCE, _CREATOR_PID, _CREATOR_START = 0, 8, 16, 24, 32, 40
_IDENTITY = struct.Struct("=6Q")
_TAIL, _PRODUCER_PID, _PRODUCER_STATE, _HEARTBEAT = 128, 136, 144, 152
_HEAD, _CONSUMER_STATE = 256, 264
_SLEEPING = 384
_DATA = 512

_OPEN, _CLOSED, _CORRUPT = 0, 1, 2
_WORD = 8
_LEN_MASK = (1 << 30) - 1
_MORE = 1 << 30
_PAD = 1 << 31
_FLAG_BITS = _MORE | _PAD
_SEQ_MASK = 0xFFFFFFFF
_SPIN_BATCH = 32
_SPIN_CHECK_S = 1e-3  # how often a long spin looks at the doorbell and the close flag


def _load_region() -> type:
    from ._atomics import Region

    return Region


def _new_name() -> str:
    # 12 url-safe chars = 72 random bits; "/mlxrt-" + 12 = 19 chars, under macOS's 30.
    return "/" + SEGMENT_PREFIX + secrets.token_urlsafe(9)


def _max_chunk(capacity: int) -> int:
    """Largest payload of one record, bytes: half the ring, so a record plus the
    padding before it always fits once the consumer has caught up."""
    return min((capacity // 2 - _WORD) & ~7, MAX_FRAME_BYTES)


def _check_capacity(capacity: int) -> None:
    if not MIN_RING_BYTES <= capacity <= MAX_RING_BYTES or capacity % 8:
        raise ValueError(
            f"ring capacity {capacity} must be a multiple of 8 in [{MIN_RING_BYTES}, {MAX_RING_BYTES}] bytes"
        )


def _process_start_ms(pid: int) -> int:
    """Start time of `pid` in ms since the epoch, 0 if unknown (tells a reused pid apart)."""
    try:
        import psutil

        return int(psutil.Process(pid).create_time() * 1000)
    except Exception:
        return 0


def _identity_problem(raw: bytes, expected: tuple[int, ...]) -> str | None:
    """Name the identity fields of a header that differ from `expected`, or None."""
    got = _IDENTITY.unpack(raw)
    fields = ("magic", "layout version", "capacity", "nonce", "creator pid", "creator start")
    bad = [f"{field} {g:#x} != {e:#x}" for field, g, e in zip(fields, got, expected, strict=True) if g != e]
    return "bad header: " + ", ".join(bad) if bad else None


class _Segment:
    """One process's mapping of a ring segment and the fds that go with it.

    `close` runs once (directly or from `weakref.finalize`), in an order that
    cannot fail half-way: state flag, buffer, mapping, fds, name.
    """

    def __init__(self, name: str, shm: posix_ipc.SharedMemory, size: int, *, linked: bool) -> None:
        self.name = name
        self.linked = linked
        self.closed = False
        self.fds: list[int] = []
        #: (offset, value) stored on close, telling the peer this side is gone.
        self.final_state: tuple[int, int] | None = None
        try:
            self.mm = mmap.mmap(shm.fd, size)
            self.region: Any = _load_region()(self.mm)  # C type without stubs
        except BaseException:
            self.unlink()
            raise
        finally:
            shm.close_fd()

    def close_fd(self, fd: int) -> None:
        if fd in self.fds:
            self.fds.remove(fd)
            try:
                os.close(fd)
            except OSError:
                pass

    def unlink(self) -> None:
        if self.linked:
            self.linked = False
            try:
                posix_ipc.unlink_shared_memory(self.name)
            except posix_ipc.ExistentialError:
                pass

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        if self.final_state is not None:
            self.region.store_release(*self.final_state)
        self.region.release()
        self.mm.close()
        for fd in list(self.fds):
            self.close_fd(fd)
        self.unlink()


class RingChannel:
    """The orchestrator's end of a ring: owns the segment, its name and the doorbell.

    Create it before spawning the worker, pass `child_fds` to `Popen(pass_fds=)`,
    call `after_spawn(pid)` right after the spawn and `mark_attached()` when the
    worker confirms it attached. `close()` is idempotent and also runs from a
    finalizer, unlinking the segment if that has not happened yet.
    """

    def __init__(
        self, segment: _Segment, spec: RingSpec, read_fd: int, write_fd: int, identity: bytes
    ) -> None:
        self._seg = segment
        self.spec = spec
        self._identity = identity  # line 0 as written, to catch later scribbles
        self._read_fd = read_fd
        self._write_fd = write_fd
        self.peer_pid: int | None = None
        # Weak: the receiver holds the ring, not the other way round (no cycle to wait for).
        self._receiver: weakref.ref[RingReceiver] | None = None
        self._finalizer = weakref.finalize(self, segment.close)

    @classmethod
    def create(cls, capacity: int = DEFAULT_RING_BYTES) -> RingChannel:
        """Make a fresh segment (owner-only, unguessable name) and doorbell pipe."""
        _check_capacity(capacity)
        _load_region()  # fail here, not in the worker, if the extension is missing
        for _ in range(3):
            name = _new_name()
            try:
                shm = posix_ipc.SharedMemory(name, posix_ipc.O_CREX, mode=0o600, size=_DATA + capacity)
                break
            except posix_ipc.ExistentialError:
                continue  # 72 random bits collided: astronomically unlikely, try again
        else:
            raise RuntimeError("could not pick an unused shared-memory name")
        seg = _Segment(name, shm, _DATA + capacity, linked=True)
        success = False
        try:
            nonce = secrets.randbits(64)
            pid = os.getpid()
            _IDENTITY.pack_into(seg.mm, 0, 0, LAYOUT_VERSION, capacity, nonce, pid, _process_start_ms(pid))
            seg.region.store_release(_MAGIC, MAGIC)  # last: a header with magic is complete
            read_fd, write_fd = os.pipe()  # both close-on-exec; pass_fds opens w to the child
            seg.fds += [read_fd, write_fd]
            os.set_blocking(read_fd, False)
            os.set_blocking(write_fd, False)  # shared with the child: a full pipe never blocks
            seg.final_state = (_CONSUMER_STATE, _CLOSED)
            spec = RingSpec(name=name, capacity=capacity, nonce=nonce, doorbell_fd=write_fd)
            ring = cls(seg, spec, read_fd, write_fd, bytes(seg.mm[0 : _IDENTITY.size]))
            success = True
        finally:
            if not success:
                seg.close()
        return ring

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def child_fds(self) -> tuple[int, ...]:
        """Fds the worker must inherit, for `subprocess.Popen(pass_fds=...)`."""
        return (self._write_fd,)

    def after_spawn(self, pid: int) -> None:
        """Drop our copy of the doorbell's write end, so the worker's death reads as EOF."""
        self.peer_pid = pid
        self._seg.close_fd(self._write_fd)

    def mark_attached(self) -> None:
        """Unlink the name now that both sides have it mapped: nothing can leak after this."""
        self._seg.unlink()

    def receiver(self, *, spin_us: float = DEFAULT_SPIN_US) -> RingReceiver:
        """The consumer end (one per ring; a second call returns the same object)."""
        if self._seg.closed:
            raise ChannelClosed(f"ring {self.name} is closed")
        rx = self._receiver() if self._receiver is not None else None
        if rx is None:
            rx = RingReceiver(self, spin_us=spin_us)
            self._receiver = weakref.ref(rx)
        return rx

    def close(self) -> None:
        """Tell the producer, unmap, close the doorbell, unlink if still linked."""
        rx = self._receiver() if self._receiver is not None else None
        if rx is not None:
            rx._failed = ChannelClosed(f"ring {self.name} is closed")
        self._finalizer()

    def __enter__(self) -> RingChannel:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"RingChannel({self.name!r}, capacity={self.spec.capacity})"


class RingReceiver:
    """Consumer end: whole frames in order (`recv`), from one reading thread.

    Do not `close()` the ring from another thread while a `recv` is blocked;
    stop the worker instead, which wakes the reader with ChannelClosed.
    """

    def __init__(self, ring: RingChannel, *, spin_us: float) -> None:
        seg = ring._seg
        region = seg.region
        self._ring = ring  # keeps the segment mapped while this object lives
        self._mm = seg.mm
        self._name = ring.name
        self._cap = ring.spec.capacity
        self._max_chunk = _max_chunk(self._cap)
        self._identity = ring._identity
        #: Polling time before blocking on the doorbell, µs (0 = block at once).
        self.spin_us = spin_us
        self._head = region.load_acquire(_HEAD)
        self._tail = self._head
        self._seq = ring.spec.nonce & _SEQ_MASK
        self._parts: list[bytes] = []
        self._parts_bytes = 0
        self._peer_gone = False
        self._failed: ChannelClosed | None = None
        self._doorbell = ring._read_fd
        self._poller = select.poll()
        self._poller.register(self._doorbell, select.POLLIN)
        self._load_acquire = region.load_acquire
        self._load_relaxed = region.load_relaxed
        self._store_release = region.store_release
        self._flag_then_load = region.flag_then_load
        self._take = region.take

    def recv(self, timeout: float | None = None) -> bytes:
        """Return the next whole frame.

        Raises TimeoutError after `timeout` s without one (a partly received
        chunked frame is kept for the next call), ChannelClosed once the
        producer closed or died and everything it published is drained, and
        ChannelCorrupt on a malformed header or record.
        """
        if self._failed is not None:
            raise self._failed
        deadline = None
        while True:
            head = self._head
            tail = self._tail
            if head == tail:
                tail = self._load_acquire(_TAIL)
                if tail == head:
                    if deadline is None:
                        deadline = math.inf if timeout is None else time.monotonic() + timeout
                    tail = self._await_tail(head, deadline, timeout)
                if tail < head or tail - head > self._cap or tail & 7:
                    self._corrupt(f"published tail {tail} out of range (head {head})")
                self._tail = tail
            pos = head % self._cap
            word = self._load_relaxed(_DATA + pos)
            n = word & _LEN_MASK
            end = head + ((n + 15) & -8)
            if (
                word >> 32 != self._seq
                or end > tail
                or pos + end - head > self._cap
                or (n > self._max_chunk and not word & _PAD)
            ):
                self._bad_record(head, word)
            self._seq = (self._seq + 1) & _SEQ_MASK
            self._head = end
            if not word & _FLAG_BITS and not self._parts:
                return self._take(_DATA + pos + _WORD, n, _HEAD, end)
            frame = self._assemble(word, pos, n, end)
            if frame is not None:
                return frame

    def _assemble(self, word: int, pos: int, n: int, end: int) -> bytes | None:
        """Handle a PAD or a chunk; return the frame once its last chunk is in."""
        if word & _PAD:
            if word & _MORE or pos + _WORD + n != self._cap:
                self._corrupt(f"padding record at offset {pos} of length {n} misses the end")
            self._store_release(_HEAD, end)
            return None
        self._parts.append(self._take(_DATA + pos + _WORD, n, _HEAD, end))
        self._parts_bytes += n
        if self._parts_bytes > MAX_FRAME_BYTES:
            self._corrupt(f"chunked frame exceeds MAX_FRAME_BYTES={MAX_FRAME_BYTES}")
        if word & _MORE:
            return None
        frame = b"".join(self._parts)
        self._parts.clear()
        self._parts_bytes = 0
        return frame

    def _await_tail(self, head: int, deadline: float, timeout: float | None) -> int:
        """Spin, then sleep on the doorbell, until the tail moves past `head`."""
        load = self._load_acquire
        if self.spin_us > 0:
            now = time.monotonic()
            spin_end, next_check = now + self.spin_us * 1e-6, now + _SPIN_CHECK_S
            while True:
                for _ in range(_SPIN_BATCH):
                    tail = load(_TAIL)
                    if tail != head:
                        return tail
                now = time.monotonic()
                if now >= spin_end or now >= deadline:
                    break
                if now >= next_check:  # a long spin still notices a close or a death
                    next_check = now + _SPIN_CHECK_S
                    if self._poller.poll(0):
                        self._drain_doorbell()
                    if self._peer_gone or load(_PRODUCER_STATE) != _OPEN:
                        break
        while True:
            if self._peer_gone or load(_PRODUCER_STATE) != _OPEN:
                tail = load(_TAIL)  # after the state: records published before close
                if tail != head:
                    return tail
                self._fail_closed()
            self._check_identity()
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"no frame on ring {self._name} within {timeout} s")
            events = None
            tail = self._flag_then_load(_SLEEPING, 1, _TAIL)
            if tail == head:
                wait_ms = math.ceil(min(remaining, DOORBELL_WAIT_S) * 1000)
                events = self._poller.poll(wait_ms)
            self._store_release(_SLEEPING, 0)
            if tail != head:
                return tail
            if events:
                self._drain_doorbell()
            tail = load(_TAIL)
            if tail != head:
                return tail

    def _drain_doorbell(self) -> None:
        try:
            data = os.read(self._doorbell, 4096)
        except BlockingIOError:
            return
        if not data:
            self._peer_gone = True  # every write end closed: the worker exited or died

    def _check_identity(self) -> None:
        raw = self._mm[0 : _IDENTITY.size]
        if raw != self._identity:
            problem = _identity_problem(raw, _IDENTITY.unpack(self._identity))
            self._corrupt(problem or "bad header")

    def _bad_record(self, head: int, word: int) -> None:
        n = word & _LEN_MASK
        if word >> 32 != self._seq:
            self._corrupt(f"record at byte {head}: sequence {word >> 32:#x} != expected {self._seq:#x}")
        if not word & _PAD and n > self._max_chunk:
            self._corrupt(f"record at byte {head}: length {n} > max record {self._max_chunk}")
        self._corrupt(
            f"record at byte {head} of length {n} runs past the published tail "
            f"{self._tail} or the end of the ring"
        )

    def _corrupt(self, problem: str) -> None:
        exc = ChannelCorrupt(f"ring {self._name} corrupt: {problem}")
        self._failed = exc
        self._store_release(_CONSUMER_STATE, _CORRUPT)  # stop the producer too
        log.error("ring_corrupt", name=self._name, problem=problem)
        raise exc

    def _fail_closed(self) -> None:
        state = self._load_acquire(_PRODUCER_STATE)
        if state not in (_OPEN, _CLOSED):
            self._corrupt(f"producer_state is {state:#x}")
        how = (
            "producer closed the ring" if state == _CLOSED else "producer died (doorbell EOF without a close)"
        )
        if self._parts:
            how += f"; discarded {self._parts_bytes} bytes of an unfinished chunked frame"
            self._parts.clear()
        self._failed = ChannelClosed(f"ring {self._name}: {how}")
        raise self._failed

    def peer_heartbeat(self) -> int:
        """A number that grows whenever the producer publishes or beats; compare readings."""
        return self._load_relaxed(_HEARTBEAT) + self._load_acquire(_TAIL)

    def close(self) -> None:
        """Close the whole ring (the receiver is its only reading end)."""
        self._ring.close()


class RingSender:
    """Producer end: `send` from ONE thread; `close` from that thread or after it stopped."""

    def __init__(self, seg: _Segment, spec: RingSpec, *, full_timeout_s: float, identity: bytes) -> None:
        region = seg.region
        self._seg = seg
        self._mm = seg.mm
        self._name = spec.name
        self._cap = spec.capacity
        self._max_chunk = _max_chunk(spec.capacity)
        self._identity = identity
        self._doorbell = spec.doorbell_fd
        self._full_timeout_s = full_timeout_s
        self._tail = region.load_acquire(_TAIL)
        self._head = region.load_acquire(_HEAD)
        self._seq = spec.nonce & _SEQ_MASK
        self._beats = region.load_relaxed(_HEARTBEAT)
        #: Set once the sender is closed or failed; every later send raises it.
        self._dead: ChannelClosed | None = None
        self._load_acquire = region.load_acquire
        self._store_release = region.store_release
        self._put = region.put
        self._finalizer = weakref.finalize(self, seg.close)

    def send(self, frame: bytes | bytearray | memoryview) -> None:
        """Publish one frame whole (chunked if over half the ring); never drops it.

        Waits at most `full_timeout_s` for space (TimeoutError), and raises
        ChannelClosed as soon as it sees the consumer closed or gone.
        """
        if self._dead is not None:
            raise self._dead
        n = len(frame) if type(frame) is not memoryview else frame.nbytes
        if n > self._max_chunk:
            self._send_chunked(frame, n)
            return
        # _put_record inlined for the common single-record frame: a call less per frame.
        size = (n + 15) & -8
        tail = self._tail
        pos = tail % self._cap
        if pos + size > self._cap or tail + size - self._head > self._cap:
            tail, pos = self._make_room(pos, size)
        seq = self._seq
        self._seq = (seq + 1) & _SEQ_MASK
        self._tail = tail = tail + size
        if self._put(_DATA + pos, n | seq << 32, frame, _TAIL, tail, _SLEEPING):
            self._ring_doorbell()

    def try_send(self, frame: bytes | bytearray | memoryview) -> bool:
        """Publish the frame if it fits in one record without waiting for space; else
        publish nothing and return False."""
        if self._dead is not None:
            raise self._dead
        n = len(frame) if type(frame) is not memoryview else frame.nbytes
        if n > self._max_chunk:
            return False
        size = (n + 15) & -8
        pos = self._tail % self._cap
        need = size + (self._cap - pos if pos + size > self._cap else 0)  # padding to the wrap
        if self._tail + need - self._head > self._cap:
            self._head = self._checked_head()
            if self._tail + need - self._head > self._cap:
                return False
        self.send(frame)
        return True

    def _send_chunked(self, frame: bytes | bytearray | memoryview, n: int) -> None:
        if n > MAX_FRAME_BYTES:
            raise ValueError(f"frame of {n} bytes exceeds MAX_FRAME_BYTES={MAX_FRAME_BYTES}")
        view = memoryview(frame).cast("B")
        start = 0
        try:
            for start in range(0, n, self._max_chunk):
                stop = min(start + self._max_chunk, n)
                self._put_record(view[start:stop], stop - start, _MORE if stop < n else 0)
        except BaseException:
            if start:  # chunks are out: the next frame would be glued onto them
                self._dead = ChannelClosed(f"ring {self._name}: a chunked send was cut off")
            raise

    def _put_record(self, data: bytes | bytearray | memoryview, n: int, flags: int) -> None:
        size = (n + 15) & -8  # the word plus the payload rounded up to 8 bytes
        tail = self._tail
        pos = tail % self._cap
        if pos + size > self._cap or tail + size - self._head > self._cap:
            tail, pos = self._make_room(pos, size)
        seq = self._seq
        self._seq = (seq + 1) & _SEQ_MASK
        self._tail = tail = tail + size
        if self._put(_DATA + pos, n | flags | seq << 32, data, _TAIL, tail, _SLEEPING):
            self._ring_doorbell()

    def _make_room(self, pos: int, size: int) -> tuple[int, int]:
        """Pad to the start if the record does not fit before the end, then wait for
        `size` free bytes; return the (tail, position) to write at."""
        if pos + size > self._cap:
            pad = self._cap - pos
            self._reserve(pad)
            seq = self._seq
            self._seq = (seq + 1) & _SEQ_MASK
            self._tail += pad
            self._put(_DATA + pos, (pad - _WORD) | _PAD | seq << 32, b"", _TAIL, self._tail, _SLEEPING)
            pos = 0
        self._reserve(size)
        return self._tail, pos

    def _reserve(self, size: int) -> None:
        """Return once `size` bytes past the tail are free."""
        self._head = self._checked_head()
        if self._tail + size - self._head > self._cap:
            self._wait_for_space(size)

    def _checked_head(self) -> int:
        head = self._load_acquire(_HEAD)
        if head > self._tail or self._tail - head > self._cap:
            self._fail(ChannelCorrupt(f"ring {self._name} corrupt: head {head} vs tail {self._tail}"))
        return head

    def _wait_for_space(self, size: int) -> None:
        deadline = time.monotonic() + self._full_timeout_s
        next_probe = 0.0
        pause = 20e-6
        while True:
            state = self._load_acquire(_CONSUMER_STATE)
            if state == _CLOSED:
                self._fail(ChannelClosed(f"ring {self._name}: consumer closed the ring"))
            if state != _OPEN:
                self._fail(ChannelCorrupt(f"ring {self._name}: consumer reported corruption"))
            now = time.monotonic()
            if now >= next_probe:
                self._probe_consumer()
                self.beat()
                next_probe = now + PEER_PROBE_S
            if now >= deadline:
                raise TimeoutError(
                    f"ring {self._name} full for {self._full_timeout_s} s: the consumer is "
                    f"not draining it (set {FULL_TIMEOUT_ENV} or a larger ring capacity)"
                )
            time.sleep(pause)
            pause = min(pause * 2, 1e-3)
            self._head = self._checked_head()
            if self._tail + size - self._head <= self._cap:
                return

    def _probe_consumer(self) -> None:
        """Fail if the consumer is gone; a spare doorbell byte also undoes any lost wake-up."""
        raw = self._mm[0 : _IDENTITY.size]
        if raw != self._identity:
            problem = _identity_problem(raw, _IDENTITY.unpack(self._identity))
            self._fail(ChannelCorrupt(f"ring {self._name} corrupt: {problem or 'bad header'}"))
        self._ring_doorbell()

    def _ring_doorbell(self) -> None:
        try:
            os.write(self._doorbell, b"\x01")
        except BlockingIOError:
            pass  # the pipe is full of unread bytes: the consumer will wake anyway
        except OSError as exc:  # EPIPE: no reader left, the orchestrator is gone
            self._fail(ChannelClosed(f"ring {self._name}: consumer is gone ({exc})"))

    def _fail(self, exc: ChannelClosed) -> None:
        self._dead = exc
        raise exc

    def beat(self) -> None:
        """Bump the heartbeat the consumer reads with `peer_heartbeat()`."""
        self._beats += 1
        self._store_release(_HEARTBEAT, self._beats)

    def close(self) -> None:
        """Mark the ring closed and drop the doorbell: the consumer drains, then ChannelClosed."""
        if self._dead is None:
            self._dead = ChannelClosed(f"ring {self._name}: sender is closed")
        self._finalizer()


def attach_ring(spec: RingSpec, *, full_timeout_s: float | None = None) -> RingSender:
    """Map the ring named in `spec` as its only producer (worker side).

    `full_timeout_s` defaults to $MLXRT_RING_FULL_TIMEOUT_S, else
    DEFAULT_FULL_TIMEOUT_S. Raises ChannelClosed if the segment is gone and
    ChannelCorrupt if its header does not match `spec` or it already has a producer.
    """
    if full_timeout_s is None:
        full_timeout_s = float(os.environ.get(FULL_TIMEOUT_ENV, DEFAULT_FULL_TIMEOUT_S))
    _check_capacity(spec.capacity)
    try:
        shm = posix_ipc.SharedMemory(spec.name)
    except posix_ipc.ExistentialError as exc:
        raise ChannelClosed(f"ring segment {spec.name} does not exist ({exc})") from exc
    if shm.size < _DATA + spec.capacity:
        shm.close_fd()
        raise ChannelCorrupt(f"ring {spec.name}: segment of {shm.size} bytes is too small")
    seg = _Segment(spec.name, shm, _DATA + spec.capacity, linked=False)
    success = False
    try:
        raw = seg.mm[0 : _IDENTITY.size]
        got = _IDENTITY.unpack(raw)
        expected = (MAGIC, LAYOUT_VERSION, spec.capacity, spec.nonce, *got[4:])
        problem = _identity_problem(raw, expected)
        if problem:
            raise ChannelCorrupt(f"ring {spec.name}: {problem}")
        previous = seg.region.compare_exchange(_PRODUCER_PID, 0, os.getpid())
        if previous:
            raise ChannelCorrupt(f"ring {spec.name} already has a producer (pid {previous})")
        if not stat.S_ISFIFO(os.fstat(spec.doorbell_fd).st_mode):
            raise ChannelCorrupt(f"doorbell fd {spec.doorbell_fd} is not a pipe (was it in Popen pass_fds?)")
        seg.fds.append(spec.doorbell_fd)
        os.set_inheritable(spec.doorbell_fd, False)  # our own children must not hold it open
        os.set_blocking(spec.doorbell_fd, False)
        seg.final_state = (_PRODUCER_STATE, _CLOSED)
        sender = RingSender(seg, spec, full_timeout_s=full_timeout_s, identity=raw)
        success = True
    finally:
        if not success:
            seg.close()
    return sender


def sweep_stale_segments(*, shm_dir: str = "/dev/shm") -> list[str]:
    """Unlink `mlxrt-*` segments whose creator is dead; return the names removed.

    Linux only: elsewhere there is no listing and this returns []. There the
    unlink-after-attach leaves only a creator killed between create and attach.
    """
    if not os.path.isdir(shm_dir):
        return []
    removed = []
    for entry in os.scandir(shm_dir):
        if entry.name.startswith(SEGMENT_PREFIX) and _is_stale(entry):
            try:
                posix_ipc.unlink_shared_memory("/" + entry.name)
            except (posix_ipc.ExistentialError, posix_ipc.PermissionsError):
                continue
            removed.append("/" + entry.name)
    if removed:
        log.info("ring_segments_swept", names=removed)
    return removed


def _is_stale(entry: os.DirEntry[str]) -> bool:
    try:
        with open(entry.path, "rb") as f:
            raw = f.read(_IDENTITY.size)
        age_s = time.time() - entry.stat().st_mtime
    except OSError:
        return False  # another user's, or already gone
    if len(raw) < _IDENTITY.size or _IDENTITY.unpack(raw)[0] != MAGIC:
        return age_s > STALE_UNINITIALISED_S  # creator died before writing the header
    _, _, _, _, pid, start_ms = _IDENTITY.unpack(raw)
    return not _process_alive(pid, start_ms)


def _process_alive(pid: int, start_ms: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    if start_ms:
        now_ms = _process_start_ms(pid)
        # Same pid, different start time: the creator died and the pid was reused.
        return not now_ms or abs(now_ms - start_ms) < 2000
    return True


_SELF_TEST_CHILD = """
import sys, msgspec
from mlxrt.ipc.ring import RingSpec, attach_ring
tx = attach_ring(msgspec.json.decode(sys.argv[1], type=RingSpec))
tx.send(b"mlxrt ring self-test")
tx.send(bytes(range(256)) * 1024)
tx.close()
"""


def ring_self_test(*, timeout_s: float = 10.0) -> str | None:
    """None if the ring works here (extension, shm, a round trip with a child), else why not."""
    try:
        _load_region()
    except ImportError as exc:
        return f"C extension mlxrt.ipc._atomics is not importable ({exc}); reinstall mlxrt"
    try:
        ring = RingChannel.create(capacity=64 * 1024)
    except Exception as exc:
        return f"cannot create a shared-memory ring: {exc!r}"
    proc = None
    try:
        proc = subprocess.Popen(
            [sys.executable, "-c", _SELF_TEST_CHILD, msgspec.json.encode(ring.spec).decode()],
            pass_fds=ring.child_fds,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        ring.after_spawn(proc.pid)
        rx = ring.receiver()
        expected: list[Callable[[bytes], bool]] = [
            lambda f: f == b"mlxrt ring self-test",
            lambda f: f == bytes(range(256)) * 1024,
        ]
        for check in expected:
            if not check(rx.recv(timeout=timeout_s)):
                return "ring self-test: a frame came back altered"
        ring.mark_attached()
        if proc.wait(timeout=timeout_s) != 0:
            return f"ring self-test child failed: {_stderr_tail(proc)}"
        return None
    except (ChannelClosed, TimeoutError, subprocess.TimeoutExpired, OSError) as exc:
        detail = f": {_stderr_tail(proc)}" if proc is not None and proc.poll() is not None else ""
        return f"ring self-test failed within {timeout_s} s: {exc}{detail}"
    finally:
        ring.close()
        if proc is not None:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            if proc.stderr is not None:
                proc.stderr.close()


def _stderr_tail(proc: subprocess.Popen[bytes]) -> str:
    return proc.stderr.read().decode(errors="replace")[-500:] if proc.stderr else ""
