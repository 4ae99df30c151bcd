"""Streaming over HTTP: ``mlxrt serve`` and, for comparison, mlx-lm's own ``mlx_lm.server`` and vllm-mlx.

Each starts a server subprocess on a free loopback port in ``setup()``, streams
greedy completions from ``/v1/completions`` in ``run()`` and is timed by the
same clock (`benchmarks.measure`) as every other scenario. The client is the
same for all: stdlib ``http.client`` on loopback, one connection per
request (as `benchmarks.peers` does), each SSE event parsed with msgspec.

- `HttpStream` sends the prompt as token ids with ``ignore_eos`` and reads the
  ids back from each chunk's ``token_ids`` (``return_token_ids``, mlxrt's
  extension): its tokens are checked against native like any scenario.
- `MlxLmServer` cannot take ids or return them: the prompt is sent as the
  decoded text (mlx-lm re-tokenises it) and each chunk that carries text
  counts as one token (mlx-lm writes one event per generated token, skipping
  tokens whose text is still incomplete); the shortfall against the final
  ``usage.completion_tokens`` is taken as the count (`Arrivals.run`'s
  ``n_tokens``), so the count is exact; only the arrival times of the skipped
  tokens are unknown.
  Its token list is ``[-1] * n``: ``token_checked = False``. EOS is disabled
  the way `Native` does it, by clearing the tokenizer's EOS ids after load.
- `VllmMlxServer` is timed as `MlxLmServer` is (text in, the count from the
  usage), but it merges the tokens made while the client reads into one event,
  so its arrivals are per event. It runs from a site directory of its own
  (`vllm_mlx_site`); EOS is off through its schedulers' stop tokens.

All take ``extra_args`` for their command line (the agent part starts each
with its prompt cache off for the uncached reference) and say how an
OpenAI client reaches them: ``base_url``, ``model`` and ``chat_extra``.
"""

from __future__ import annotations

import http.client
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import msgspec

from .measure import Arrivals, Run, time_stream
from .scenarios import Skipped

#: How long a server may take to answer its health check (MLXRT_BENCH_PEER_START_S, as for the other peers).
READY_TIMEOUT_S = float(os.environ.get("MLXRT_BENCH_PEER_START_S", 300.0))
STOP_TIMEOUT_S = 30.0
HTTP_TIMEOUT_S = 600.0
MODEL_NAME = "bench"
#: Where server processes write their stderr for reading afterwards (else a temporary file).
LOG_DIR_ENV = "MLXRT_BENCH_SERVER_LOGS"
#: A server variant's leading word that sets its environment rather than a flag (MLX_CUDA_USE_CUDNN_SDPA=0).
ENV_WORD = re.compile(r"[A-Z][A-Z0-9_]*=")


class _Choice(msgspec.Struct):
    text: str = ""
    token_ids: list[int] = []


class _Usage(msgspec.Struct):
    prompt_tokens: int = 0
    completion_tokens: int = 0


class _Chunk(msgspec.Struct):
    choices: list[_Choice] = []
    usage: _Usage | None = None
    error: Any = None


_decode_chunk = msgspec.json.Decoder(_Chunk).decode


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


#: A connection reset or refused before the response began is retried this many times, after 0.5 s,
#: then 1 s: what the official openai client does (max_retries=2). A server whose listen backlog
#: overflows in a burst (mlx_lm.server's is Python's default of 5) is then measured as its users'
#: clients see it, the wait in its TTFT, instead of failing the whole level.
CONNECT_RETRIES = 2
_CONNECT_ERRORS = (ConnectionResetError, ConnectionRefusedError, BrokenPipeError,
                   http.client.RemoteDisconnected)


class _Count:
    """A count shared by the streams' threads."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.value = 0

    def add(self) -> None:
        with self._lock:
            self.value += 1


#: Connection retries made so far, by every stream (the concurrency part reports each level's).
connect_retries = _Count()


def _post(port: int, path: str, body: dict[str, Any]) -> tuple[http.client.HTTPConnection,
                                                                 http.client.HTTPResponse]:
    """POST `body` on a fresh connection, retried (`CONNECT_RETRIES`) if it is reset or refused
    before the response starts; the connection and its response."""
    payload, headers = json.dumps(body).encode(), {"Content-Type": "application/json"}
    for attempt in range(CONNECT_RETRIES + 1):
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=HTTP_TIMEOUT_S)
        try:
            conn.request("POST", path, body=payload, headers=headers)
            return conn, conn.getresponse()
        except _CONNECT_ERRORS:
            conn.close()
            if attempt == CONNECT_RETRIES:
                raise
            connect_retries.add()
            time.sleep(0.5 * 2**attempt)
    raise AssertionError("unreachable")


def sse_data(port: int, path: str, body: dict[str, Any]) -> Iterator[bytes]:
    """POST `body` on a fresh connection; yield each SSE ``data:`` payload up to ``[DONE]``."""
    conn, resp = _post(port, path, body)
    try:
        if resp.status != 200:
            raise RuntimeError(f"POST {path}: HTTP {resp.status}: {resp.read()[:300]!r}")
        while line := resp.readline():
            if not line.startswith(b"data: "):
                continue
            if line.startswith(b"data: [DONE]"):
                return
            yield line[6:]
    finally:
        conn.close()


def _sse(port: int, path: str, body: dict[str, Any]) -> Iterator[_Chunk]:
    """Each decoded completion chunk of a streamed POST; a server error mid-stream raises."""
    for data in sse_data(port, path, body):
        chunk = _decode_chunk(data)
        if chunk.error is not None:
            raise RuntimeError(f"server error mid-stream: {chunk.error}")
        yield chunk


def _healthy(port: int, path: str) -> bool:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
    try:
        conn.request("GET", path)
        return conn.getresponse().status == 200
    except (OSError, http.client.HTTPException):
        return False
    finally:
        conn.close()


class _ServerProcess:
    """A server subprocess on a free port, ready when ``health_path`` answers 200."""

    health_path = "/health"

    def __init__(self) -> None:
        self.proc: subprocess.Popen | None = None
        self.port = 0
        self._log = None

    @property
    def base_url(self) -> str:
        """The OpenAI API root, for the ``openai`` client."""
        return f"http://127.0.0.1:{self.port}/v1"

    def _start(self, argv: list[str], env: dict[str, str] | None = None) -> None:
        # stderr to a file, not a pipe: nobody reads a pipe while we measure, and a
        # full one would stall the server mid-benchmark.
        keep = os.environ.get(LOG_DIR_ENV)
        if keep:  # kept for reading afterwards (with MLXRT_LOG_LEVEL=info: one line per request)
            os.makedirs(keep, exist_ok=True)
            self._log = open(os.path.join(keep, f"{type(self).__name__}-{time.time_ns()}.log"), "w+b")
        else:
            self._log = tempfile.TemporaryFile()
        self.proc = subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=self._log,
            env={**os.environ, **env} if env else None,
        )
        deadline = time.monotonic() + READY_TIMEOUT_S
        while not _healthy(self.port, self.health_path):
            if self.proc.poll() is not None:
                self._log.seek(0)
                err = self._log.read().decode(errors="replace")[-2000:]
                self.close()
                raise Skipped(f"server exited with {self.proc.returncode}: {err}")
            if time.monotonic() > deadline:
                self.close()
                raise Skipped(f"server not ready within {READY_TIMEOUT_S:g} s (set MLXRT_BENCH_PEER_START_S)")
            time.sleep(0.1)

    def close(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self._log is not None:
            self._log.close()
            self._log = None


def leading_env(words: Sequence[str]) -> int:
    """How many of `words`, from the first, are NAME=value environment words (`ENV_WORD`)."""
    return next((i for i, a in enumerate(words) if not ENV_WORD.match(a)), len(words))


class HttpStream(_ServerProcess):
    """``mlxrt serve`` (one worker), streaming /v1/completions with token ids in and out."""

    name = "mlxrt-http"
    token_checked = True
    model = MODEL_NAME
    #: mlxrt's extensions: EOS off, and the ids of each chunk (the first token is seen even without text)
    chat_extra = {"ignore_eos": True, "return_token_ids": True}

    def __init__(self, model_path: str, transport: str = "auto", *, extra_args: Sequence[str] = ()) -> None:
        super().__init__()
        self.model_path = model_path
        self.transport = transport
        # leading NAME=value words are the server's environment (its workers inherit it), as a shell's
        lead = leading_env(extra_args)
        self.env = dict(a.split("=", 1) for a in extra_args[:lead])
        self.extra_args = list(extra_args[lead:])

    def setup(self) -> None:
        self.port = _free_port()
        self._start(
            [
                sys.executable,
                "-m",
                "mlxrt",
                *(["--log-level", "info"] if os.environ.get(LOG_DIR_ENV) else []),
                "serve",
                "--model",
                f"{MODEL_NAME}={self.model_path}",
                "--port",
                str(self.port),
                "--transport",
                self.transport,
                # The disk tier would carry prefixes between rounds and runs; the peers keep none.
                "--prompt-cache-disk-bytes",
                "0",
                *self.extra_args,
            ],
            self.env,
        )

    def describe(self) -> dict[str, Any]:
        return {"server": "mlxrt serve", "transport": self.transport, "args": self.extra_args,
                "env": self.env}

    def run(self, prompt_ids: list[int], gen_tokens: int) -> Run:
        body = {
            "model": MODEL_NAME,
            "prompt": prompt_ids,
            "max_tokens": gen_tokens,
            "temperature": 0.0,
            "ignore_eos": True,
            "stream": True,
            "return_token_ids": True,
        }
        start = time.perf_counter()
        events = _sse(self.port, "/v1/completions", body)
        return time_stream(
            start, (c.choices[0].token_ids for c in events if c.choices), prompt_tokens=len(prompt_ids)
        )


class MlxLmServer(_ServerProcess):
    """mlx-lm's own HTTP server on the same model: same engine, its own HTTP stack."""

    name = "mlx_lm.server"
    token_checked = False
    model = "default_model"
    chat_extra: dict[str, Any] = {}  # no ignore_eos: the launcher clears the EOS ids instead

    # Runs mlx_lm.server with EOS disabled after load, as `Native` does in-process.
    LAUNCHER = (
        "import sys, mlx_lm.server as s\n"
        "_load = s.load\n"
        "def load(*a, **k):\n"
        "    out = _load(*a, **k)\n"
        "    out[1].eos_token_ids = set()\n"
        "    return out\n"
        "s.load = load\n"
        "sys.argv[0] = 'mlx_lm.server'\n"
        "s.main()\n"
    )

    def __init__(self, model_path: str, *, extra_args: Sequence[str] = ()) -> None:
        super().__init__()
        self.model_path = model_path
        self.extra_args = list(extra_args)
        self.tokenizer = None

    def setup(self) -> None:
        try:
            import mlx_lm.server  # noqa: F401
        except ImportError as exc:
            raise Skipped(f"mlx_lm.server unavailable: {exc}") from None
        from mlx_lm.utils import load_tokenizer

        self.tokenizer = load_tokenizer(Path(self.model_path))
        self.port = _free_port()
        self._start(
            [
                sys.executable,
                "-c",
                self.LAUNCHER,
                "--model",
                self.model_path,
                "--port",
                str(self.port),
                *self.extra_args,
            ]
        )

    def describe(self) -> dict[str, Any]:
        return {"server": "mlx_lm.server", "eos": "off (EOS ids cleared after load)", "args": self.extra_args}

    def run(self, prompt_ids: list[int], gen_tokens: int) -> Run:
        return _text_run(self.port, self.model, self.tokenizer.decode(prompt_ids), gen_tokens)


def _text_run(port: int, model: str, prompt: str, gen_tokens: int) -> Run:
    """A greedy completion of `prompt` (text: the server tokenises it), streamed, with the usage at the end
    (in a chunk of its own, mlx_lm.server, or with the last token's, vllm-mlx). The count is the usage's;
    each event with text is one arrival. mlx_lm.server sends an event per token; vllm-mlx merges the tokens
    its engine made while the client was reading, so its arrivals (and gaps) are per event."""
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": gen_tokens,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start = time.perf_counter()
    arr = Arrivals(start)
    usage = _Usage()
    for c in _sse(port, "/v1/completions", body):
        if c.choices and c.choices[0].text:
            arr.add(count=1)  # one event per token that has text
        if c.usage is not None:
            usage = c.usage
    n = usage.completion_tokens or arr.n
    return arr.run(prompt_tokens=usage.prompt_tokens, n_tokens=n, tokens=[-1] * n)


#: vllm-mlx pins an mlx-lm of its own (0.31 for 0.6.0), so it is not installed beside mlxrt: this names a site
#: directory holding it (``pip install --no-deps --target DIR vllm-mlx==0.6.0 mlx-lm==0.31.3`` and the few
#: modules it adds: `make peers`), put first on its server's path; the rest comes from this venv.
VLLM_MLX_SITE_ENV = "MLXRT_BENCH_VLLM_MLX_SITE"
#: Where `make peers` (run by `make test` and `make bench`) installs it; used when the variable is not set.
VLLM_MLX_SITE_DEFAULT = Path(__file__).resolve().parent.parent / ".peers" / "vllm-mlx"


def vllm_mlx_site() -> tuple[str | None, str]:
    """(the site directory vllm-mlx runs from, its version), or (None, why there is none)."""
    site = os.environ.get(VLLM_MLX_SITE_ENV) or str(VLLM_MLX_SITE_DEFAULT)
    found = sorted(Path(site).glob("vllm_mlx-*.dist-info"))
    if not found:
        return None, (f"vllm-mlx is not installed in {site} (set {VLLM_MLX_SITE_ENV} to a site directory "
                      f"with vllm-mlx and its mlx-lm, or run `make peers`)")
    return site, found[-1].name.removeprefix("vllm_mlx-").removesuffix(".dist-info")


class VllmMlxServer(_ServerProcess):
    """vllm-mlx's OpenAI server in its batching mode (``serve --continuous-batching``, as its README runs
    it for several users), from its own site directory (`vllm_mlx_site`), on the same model. Like
    mlx_lm.server it takes text and sends text (``token_checked = False``); EOS is off through its
    scheduler, whose stop tokens the launcher empties, as mlx_lm.server's launcher clears the EOS ids."""

    name = "vllm-mlx"
    token_checked = False
    chat_extra: dict[str, Any] = {}
    #: EOS off in both of its schedulers (a vision model's too, where mlx-vlm is there to import it), and
    #: no save of its prefix cache at SIGTERM (into a HOME about to be removed: it would only delay the stop).
    LAUNCHER = (
        "import sys, vllm_mlx.scheduler as s, vllm_mlx.server as srv\n"
        "s.Scheduler._get_stop_tokens = lambda self: set()\n"
        "try:\n"
        "    import vllm_mlx.mllm_scheduler as ms\n"
        "    ms.MLLMScheduler._get_stop_tokens = lambda self: set()\n"
        "except ImportError:\n"
        "    pass\n"
        "async def unsaved(*args, **kwargs):\n"
        "    return None\n"
        "srv._save_prefix_cache_to_disk = unsaved\n"
        "from vllm_mlx.cli import main\n"
        "sys.argv[0] = 'vllm-mlx'\n"
        "main()\n"
    )

    def __init__(self, model_path: str, *, extra_args: Sequence[str] = ()) -> None:
        super().__init__()
        self.model_path = self.model = model_path  # its served name is the path it loaded
        self.extra_args = list(extra_args)
        self.tokenizer = None
        self.site, found = vllm_mlx_site()
        self.version, self._missing = (found, None) if self.site else (None, found)

    def setup(self) -> None:
        if self._missing is not None:
            raise Skipped(self._missing)
        from mlx_lm.utils import load_tokenizer

        self.tokenizer = load_tokenizer(Path(self.model_path))
        self.port = _free_port()
        path = os.pathsep.join(x for x in (self.site, os.environ.get("PYTHONPATH", "")) if x)
        # HOME of its own: vllm-mlx keeps caches under ~/.cache/vllm-mlx, which no later run should find
        self._home = tempfile.TemporaryDirectory(prefix="mlxrt-bench-vllm-mlx-")
        self._start(
            [sys.executable, "-c", self.LAUNCHER, "serve", self.model_path, "--continuous-batching",
             "--host", "127.0.0.1", "--port", str(self.port), *self.extra_args],
            {"PYTHONPATH": path, "HOME": self._home.name},
        )

    def close(self) -> None:
        super().close()
        if getattr(self, "_home", None) is not None:
            self._home.cleanup()
            self._home = None

    def describe(self) -> dict[str, Any]:
        return {"server": f"vllm-mlx {self.version} (serve --continuous-batching)", "site": self.site,
                "eos": "off (its schedulers' stop tokens emptied)", "args": self.extra_args}

    def run(self, prompt_ids: list[int], gen_tokens: int) -> Run:
        return _text_run(self.port, self.model, self.tokenizer.decode(prompt_ids), gen_tokens)


def serve_accepts(flag: str) -> bool:
    """Whether this checkout's ``mlxrt serve`` takes `flag` (read from its ``--help``)."""
    try:
        out = subprocess.run(
            [sys.executable, "-m", "mlxrt", "serve", "--help"], capture_output=True, text=True, timeout=120
        )
    except (OSError, subprocess.TimeoutExpired):
        return False
    return flag in out.stdout
