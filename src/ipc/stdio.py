"""Length-prefixed frames over pipes (the worker's stdin and stdout).

Frame: ``[u32 little-endian length][payload]``. A length above
`MAX_FRAME_BYTES`, or EOF in the middle of a frame, is `ChannelCorrupt`;
EOF between frames is `ChannelClosed`.
"""

from __future__ import annotations

import math
import os
import select
import struct
import threading
import time

from .channel import MAX_FRAME_BYTES, ChannelClosed, ChannelCorrupt

_LEN = struct.Struct("<I")


def _wait(fd: int, events: int, timeout: float | None) -> bool:
    """Wait until `fd` is ready (or closed); False on timeout. poll, not select: select
    fails for fds >= 1024, which a server with many sockets reaches."""
    p = select.poll()
    p.register(fd, events)
    return bool(p.poll(None if timeout is None else max(0, math.ceil(timeout * 1000))))


class PipeSender:
    """Writes frames to a pipe fd; safe to call from several threads.

    The fd is made non-blocking so `try_send` can refuse instead of waiting;
    `send` waits for room with `poll`, for at most its `timeout`.
    """

    def __init__(self, fd: int) -> None:
        self._fd = fd
        self._lock = threading.Lock()
        self._closed = False
        os.set_blocking(fd, False)

    def fileno(self) -> int:
        return self._fd

    def send(self, frame: bytes | bytearray | memoryview, timeout: float | None = None) -> None:
        """Write the frame whole; with `timeout` (s), raise `TimeoutError` if the pipe (or another
        thread's send) does not take it in time. A frame cut off by the timeout leaves the pipe
        unusable: the sender closes itself and later sends raise `ChannelClosed`."""
        n = len(frame)
        if n > MAX_FRAME_BYTES:
            raise ValueError(f"frame of {n} bytes exceeds MAX_FRAME_BYTES={MAX_FRAME_BYTES}")
        data = memoryview(_LEN.pack(n) + bytes(frame))
        deadline = None if timeout is None else time.monotonic() + timeout
        if not self._lock.acquire(timeout=-1 if timeout is None else timeout):
            raise TimeoutError(f"pipe busy with another frame for {timeout:g} s")
        try:
            if self._closed:
                raise ChannelClosed("pipe sender is closed")
            self._write_all(data, deadline)
        finally:
            self._lock.release()

    def _write_all(self, data: memoryview, deadline: float | None) -> None:
        total = len(data)
        try:
            while data:
                try:
                    data = data[os.write(self._fd, data) :]
                except BlockingIOError:
                    left = None if deadline is None else deadline - time.monotonic()
                    if left is not None and (left <= 0 or not _wait(self._fd, select.POLLOUT, left)):
                        if len(data) < total:
                            self._closed = True  # half a frame is in the pipe: nothing can follow it
                        raise TimeoutError(f"pipe full: {total - len(data)} of {total} bytes written "
                                           "before the timeout") from None
                    if left is None:
                        _wait(self._fd, select.POLLOUT, None)
        except TimeoutError:
            raise
        except OSError as exc:
            raise ChannelClosed(f"peer closed the pipe: {exc}") from exc

    def try_send(self, frame: bytes | bytearray | memoryview) -> bool:
        """Write the frame in one atomic write (at most PIPE_BUF bytes) or not at all."""
        data = _LEN.pack(len(frame)) + bytes(frame)
        if len(data) > select.PIPE_BUF or not self._lock.acquire(blocking=False):
            return False
        try:
            if self._closed:
                raise ChannelClosed("pipe sender is closed")
            os.write(self._fd, data)  # POSIX: a write of <= PIPE_BUF bytes is all or nothing
            return True
        except BlockingIOError:
            return False
        except OSError as exc:
            raise ChannelClosed(f"peer closed the pipe: {exc}") from exc
        finally:
            self._lock.release()

    def close(self) -> None:
        with self._lock:
            if not self._closed:
                self._closed = True
                try:
                    os.close(self._fd)
                except OSError:
                    pass


class PipeReceiver:
    """Reads frames from a pipe fd; one reading thread at a time."""

    def __init__(self, fd: int) -> None:
        self._fd = fd
        self._buf = bytearray()
        self._closed = False

    def fileno(self) -> int:
        return self._fd

    def _fill(self, need: int, timeout: float | None, in_frame: bool) -> None:
        while len(self._buf) < need:
            if timeout is not None and not _wait(self._fd, select.POLLIN, timeout):
                raise TimeoutError(f"no frame within {timeout} s")
            try:
                chunk = os.read(self._fd, max(65536, need - len(self._buf)))
            except OSError as exc:
                raise ChannelClosed(f"pipe read failed: {exc}") from exc
            if not chunk:
                if in_frame or self._buf:
                    raise ChannelCorrupt(
                        f"pipe closed mid-frame ({len(self._buf)} of {need} bytes)"
                    )
                raise ChannelClosed("peer closed the pipe (EOF)")
            self._buf += chunk

    def recv(self, timeout: float | None = None) -> bytes:
        if self._closed:
            raise ChannelClosed("pipe receiver is closed")
        self._fill(_LEN.size, timeout, in_frame=False)
        (n,) = _LEN.unpack_from(self._buf)
        if n > MAX_FRAME_BYTES:
            raise ChannelCorrupt(f"frame length {n} exceeds MAX_FRAME_BYTES={MAX_FRAME_BYTES}")
        # A timeout mid-frame keeps what came in `_buf`: the next call reads the same prefix again.
        self._fill(_LEN.size + n, timeout, in_frame=True)
        frame = bytes(self._buf[_LEN.size : _LEN.size + n])
        del self._buf[: _LEN.size + n]
        return frame

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            try:
                os.close(self._fd)
            except OSError:
                pass
