"""The contract every transport keeps: whole frames in, whole frames out.

A frame is one encoded message (bytes). A `Sender` delivers a frame whole or
raises; a `Receiver` yields frames in order, whole, or raises. Both the stdio
framing (`mlxrt.ipc.stdio`) and the shared-memory ring (`mlxrt.ipc.ring`)
implement these, so the worker's engine and the orchestrator's API never see
which one is in use.
"""

from __future__ import annotations

from typing import Protocol

#: Largest frame either transport accepts, in bytes. A longer length prefix is
#: taken as corruption rather than as a reason to allocate gigabytes.
MAX_FRAME_BYTES = 256 * 1024 * 1024


class ChannelClosed(Exception):
    """The peer closed the channel or died (EOF): no more frames will come."""


class ChannelCorrupt(ChannelClosed):
    """A malformed, truncated or torn frame: the channel can no longer be trusted."""


class Sender(Protocol):
    def send(self, frame: bytes | bytearray | memoryview) -> None:
        """Deliver one frame whole; raise `ChannelClosed` if the peer is gone."""
        ...

    def try_send(self, frame: bytes | bytearray | memoryview) -> bool:
        """Deliver the frame whole if that needs no waiting and return True; else send
        nothing and return False. Raises `ChannelClosed` if the peer is gone."""
        ...

    def close(self) -> None: ...


class Receiver(Protocol):
    def recv(self, timeout: float | None = None) -> bytes:
        """Return the next whole frame.

        Raises `TimeoutError` after `timeout` seconds with nothing to read,
        `ChannelClosed` at EOF and `ChannelCorrupt` on a bad frame.
        """
        ...

    def close(self) -> None: ...
