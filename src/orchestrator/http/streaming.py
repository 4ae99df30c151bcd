"""Waiting on a generation while watching for the client to hang up.

A disconnected client must stop its generation in the worker. uvicorn drops
writes to a closed connection silently, so a stream that only writes would
never notice; instead a watcher task waits on ``receive()`` for
``http.disconnect`` next to the work, and whichever finishes first wins. The
cost is one task per request, nothing per token.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

T = TypeVar("T")
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]

SSE_HEADERS = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),  # proxies must not hold tokens back
]
NDJSON_HEADERS = [(b"content-type", b"application/x-ndjson")]


class ClientGone(Exception):
    """The client disconnected before the response was complete."""


async def _disconnected(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def until_disconnect(receive: Receive, work: Awaitable[T]) -> T:
    """Await `work`; if the client disconnects first, cancel it and raise `ClientGone`.

    `work` has unwound (its ``finally`` blocks ran) by the time this returns or raises.
    """
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(receive))
    try:
        await asyncio.wait((task, watcher), return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            await asyncio.wait((task,))
    if task.cancelled():
        raise ClientGone
    return task.result()


class EventStream:
    """An ASGI response that sends each bytes of `events` as it comes, then ends.

    `on_close(gone)` runs once at the end, with ``gone`` True when the client
    disconnected first; `events` is closed (its ``finally`` runs) before that.
    """

    def __init__(
        self,
        events: AsyncIterator[bytes],
        *,
        headers: list[tuple[bytes, bytes]],
        on_close: Callable[[bool], None],
    ) -> None:
        self.events = events
        self.headers = headers
        self.on_close = on_close

    async def __call__(self, scope: dict[str, Any], receive: Receive, send: Send) -> None:
        gone = False
        try:
            await send({"type": "http.response.start", "status": 200, "headers": self.headers})
            await until_disconnect(receive, self._pump(send))
        except ClientGone:
            gone = True
        finally:
            await self.events.aclose()  # type: ignore[attr-defined]
            self.on_close(gone)

    async def _pump(self, send: Send) -> None:
        async for body in self.events:
            await send({"type": "http.response.body", "body": body, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})
