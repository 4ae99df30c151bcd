"""A recording reverse proxy: what a real client sent to a server, and what it got back.

`RecordingProxy(upstream).start()` listens on 127.0.0.1 (a free port) in a thread of this process,
forwards every request to `upstream` unchanged, streams the answer back as it comes, and appends an
`Exchange` per request to `.exchanges`: method, path and query, the request's JSON body, the status,
and the response body (an SSE stream kept whole). The coding-agent tests assert on these, and
`benchmarks/agents.py` replays them as fixtures.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import threading
import time
from typing import Any

import httpx
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.routing import Route

UPSTREAM_TIMEOUT_S = 600.0  # a 40k-token first prefill on the CPU takes a while
START_TIMEOUT_S = 30.0
HOP_BY_HOP = {"connection", "content-length", "transfer-encoding", "keep-alive", "host"}


@dataclasses.dataclass
class Exchange:
    """One request through the proxy and its answer (`body` None where the request had no JSON)."""

    method: str
    path: str
    query: str
    body: Any
    status: int = 0
    response: bytes = b""
    error: str | None = None

    def events(self) -> list[Any]:
        """The response's SSE ``data:`` payloads, JSON-decoded where they are JSON."""
        out = []
        for line in self.response.decode(errors="replace").splitlines():
            if line.startswith("data:"):
                payload = line[5:].strip()
                try:
                    out.append(json.loads(payload))
                except ValueError:
                    out.append(payload)
        return out

    def json(self) -> Any:
        """The response body as JSON (None if it is not)."""
        try:
            return json.loads(self.response)
        except ValueError:
            return None

    def record(self) -> dict[str, Any]:
        """The exchange as plain JSON: what was sent, the status, the usage reported."""
        return {"method": self.method, "path": self.path, "query": self.query, "body": self.body,
                "status": self.status, "usage": self.usage(),
                "response": self.response.decode(errors="replace")}

    def usage(self) -> tuple[int, int] | None:
        """(prompt tokens, of which read from the prefix cache) as the response reported them, in any
        of the three APIs, streamed or not; None if it reported none."""
        for item in reversed([self.json(), *self.events()]):
            if not isinstance(item, dict):
                continue
            u = (item.get("response") or item.get("message") or item).get("usage") or {}
            if "cache_read_input_tokens" in u:  # Anthropic: input_tokens excludes the cached part
                cached = u.get("cache_read_input_tokens") or 0
                fresh = (u.get("input_tokens") or 0) + (u.get("cache_creation_input_tokens") or 0)
                return fresh + cached, cached
            if "prompt_tokens" in u:  # chat completions
                return u["prompt_tokens"], (u.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
            if "input_tokens" in u:  # Responses
                return u["input_tokens"], (u.get("input_tokens_details") or {}).get("cached_tokens") or 0
        return None


class RecordingProxy:
    """Forwards to `upstream` (a base URL) and records every exchange; `start()` returns its URL."""

    def __init__(self, upstream: str) -> None:
        self.upstream = upstream.rstrip("/")
        self.exchanges: list[Exchange] = []
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> str:
        app = Starlette(routes=[Route("/{path:path}", self._forward,
                                      methods=["GET", "POST", "PUT", "DELETE", "HEAD", "OPTIONS"])])
        self._server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning",
                                                     lifespan="off", access_log=False))
        self._thread = threading.Thread(target=self._server.run, name="recording-proxy", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + START_TIMEOUT_S
        while not self._server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError(f"recording proxy did not start within {START_TIMEOUT_S:g} s "
                                   "(agent_proxy.START_TIMEOUT_S)")
            time.sleep(0.05)
        (sock,) = self._server.servers[0].sockets
        return f"http://127.0.0.1:{sock.getsockname()[1]}"

    def stop(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(30)

    def __enter__(self) -> RecordingProxy:
        self.url = self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    async def _forward(self, request: Request) -> StreamingResponse:
        raw = await request.body()
        try:
            body = json.loads(raw) if raw else None
        except ValueError:
            body = None
        ex = Exchange(request.method, request.url.path, request.url.query, body)
        self.exchanges.append(ex)
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP_BY_HOP}
        client = httpx.AsyncClient(timeout=httpx.Timeout(UPSTREAM_TIMEOUT_S, connect=10.0))
        url = self.upstream + request.url.path + (f"?{request.url.query}" if request.url.query else "")
        try:
            upstream = await client.send(client.build_request(request.method, url, headers=headers,
                                                              content=raw), stream=True)
        except httpx.HTTPError as exc:
            await client.aclose()
            ex.status, ex.error = 502, f"upstream {url}: {exc!r}"
            return StreamingResponse(iter([ex.error.encode()]), status_code=502)
        ex.status = upstream.status_code

        async def relay():
            try:
                async for chunk in upstream.aiter_raw():
                    ex.response += chunk
                    yield chunk
            except (httpx.HTTPError, asyncio.CancelledError) as exc:
                ex.error = repr(exc)
                raise
            finally:
                await upstream.aclose()
                await client.aclose()

        out_headers = {k: v for k, v in upstream.headers.items() if k.lower() not in HOP_BY_HOP}
        return StreamingResponse(relay(), status_code=upstream.status_code, headers=out_headers)
