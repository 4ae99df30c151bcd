"""Other servers, timed the same way as mlxrt: Ollama, llama.cpp, mlx-lm's server and vllm-mlx.

Each peer is a scenario (``setup/run/close``, see `benchmarks.scenarios`) that
runs on the same weights: llama.cpp and Ollama get a GGUF export of the model
(`benchmarks.gguf_export`). A peer that cannot run raises `Skipped` with the
reason from ``setup()``. Peers are different engines, so their tokens are not
gated: their agreement with native is reported instead (``token_checked = False``).

HTTP is stdlib ``http.client`` on loopback, one connection per request, so a
peer's figures include its own HTTP and streaming framing, as mlxrt-http's do.
"""

from __future__ import annotations

import contextlib
import hashlib
import http.client
import importlib.util
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from .measure import Arrivals, Run, peak_rss_bytes
from .scenarios import Skipped

PEERS = ("mlx_lm.server", "vllm-mlx", "llama.cpp", "ollama")
#: The peers that are MLX servers over HTTP (`benchmarks.http_scenario`): the bursts', the agent part's
#: and the long-prompt mix's peers as well as the single stream's.
HTTP_PEERS = ("mlx_lm.server", "vllm-mlx")
DEFAULT_OLLAMA_HOST = "127.0.0.1:11434"
DEFAULT_START_TIMEOUT_S = 120.0  # MLXRT_BENCH_PEER_START_S
HTTP_TIMEOUT_S = 300.0


# ---------------------------------------------------------------- plumbing


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def request(
    base: str,
    method: str,
    path: str,
    body: Any = None,
    *,
    timeout: float = HTTP_TIMEOUT_S,
    raw: bytes | None = None,
) -> tuple[int, bytes]:
    """One HTTP request to `base` (``http://host:port``); returns (status, body bytes)."""
    conn = _connect(base, timeout)
    try:
        data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
        conn.request(method, path, body=data, headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def stream_lines(base: str, path: str, body: Any, *, timeout: float = HTTP_TIMEOUT_S) -> Iterator[bytes]:
    """POST `body` as JSON and yield the response's non-empty lines as they arrive."""
    conn = _connect(base, timeout)
    try:
        conn.request(
            "POST", path, body=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
        )
        resp = conn.getresponse()
        if resp.status != 200:
            raise RuntimeError(f"POST {path}: HTTP {resp.status}: {resp.read()[:300]!r}")
        while line := resp.readline():
            line = line.strip()
            if line:
                yield line
    finally:
        conn.close()


def sse_events(base: str, path: str, body: Any) -> Iterator[dict[str, Any]]:
    """POST and yield the JSON of each ``data:`` line of a server-sent-event stream."""
    for line in stream_lines(base, path, body):
        if line.startswith(b"data:"):
            data = line[5:].strip()
            if data == b"[DONE]":
                return
            yield json.loads(data)


def _connect(base: str, timeout: float) -> http.client.HTTPConnection:
    u = urlsplit(base)
    return http.client.HTTPConnection(u.hostname or "127.0.0.1", u.port or 80, timeout=timeout)


class ServerProcess:
    """A peer server started by the harness: its log goes to a temp file, shown when it fails."""

    def __init__(self, argv: list[str], *, health: str, base: str, env: dict[str, str] | None = None) -> None:
        self.base = base
        self._log = tempfile.NamedTemporaryFile(prefix="mlxrt-bench-peer-", suffix=".log", delete=False)
        self.proc = subprocess.Popen(
            argv,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env={**os.environ, **(env or {})},
        )
        limit = float(os.environ.get("MLXRT_BENCH_PEER_START_S", DEFAULT_START_TIMEOUT_S))
        deadline = time.monotonic() + limit
        while True:
            if self.proc.poll() is not None:
                tail = self.log_tail()
                self.close()
                raise Skipped(f"{argv[0]} exited with {self.proc.returncode}: {tail}")
            with contextlib.suppress(OSError, http.client.HTTPException):
                if request(base, "GET", health, timeout=2)[0] == 200:
                    return
            if time.monotonic() > deadline:
                self.close()
                raise Skipped(f"{argv[0]} not ready within {limit:g} s (set MLXRT_BENCH_PEER_START_S)")
            time.sleep(0.25)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def log_tail(self, n: int = 400) -> str:
        try:
            return Path(self._log.name).read_text(errors="replace")[-n:].strip().replace("\n", " | ")
        except OSError:
            return ""

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        with contextlib.suppress(OSError):
            os.unlink(self._log.name)


# ---------------------------------------------------------------- llama.cpp


def _llama_launcher(python: str) -> str | None:
    """Which llama.cpp server can run here: ``llama-server`` path, ``python:EXE``, or None."""
    exe = shutil.which(os.environ.get("LLAMA_SERVER", "llama-server"))
    if exe:
        return exe
    alt = os.environ.get("MLXRT_BENCH_LLAMA_PYTHON")
    if alt:
        return f"python:{alt}"
    if importlib.util.find_spec("llama_cpp") is not None:
        return f"python:{python}"
    return None


class LlamaCpp:
    """llama.cpp's server on a GGUF export of the same weights.

    ``llama-server`` (on PATH, or $LLAMA_SERVER) is driven through its native
    ``/completion`` API with prompt ids, ``return_tokens`` (exact ids back) and
    ``ignore_eos``. Without it, llama-cpp-python's server (``python -m
    llama_cpp.server``, from this interpreter or $MLXRT_BENCH_LLAMA_PYTHON)
    gets the prompt as text on ``/v1/completions``; it streams text only, so
    its tokens are counted per streamed chunk and its agreement with native is
    judged on the text.
    """

    name = "llama.cpp"
    token_checked = False

    def __init__(
        self,
        model_path: str,
        *,
        tokenizer: Any,
        parallel: int = 1,
        ctx_per_slot: int = 2048,
        threads: int | None = None,
    ) -> None:
        self.model_path = model_path
        self.tokenizer = tokenizer
        self.parallel = (
            parallel  # server slots: concurrent streams are batched, as llama-server is meant to run
        )
        self.ctx = min(_context_length(model_path), max(2048, ctx_per_slot + 64)) * parallel
        self.threads = threads or os.cpu_count() or 1
        self.server: ServerProcess | None = None
        self.info: dict[str, Any] = {}

    def setup(self) -> None:
        launcher = _llama_launcher(sys.executable)
        if launcher is None:
            raise Skipped(
                "neither llama-server on PATH nor llama-cpp-python installed "
                "(pip install 'llama-cpp-python[server]', or set LLAMA_SERVER)"
            )
        gguf = _export(self.model_path)
        port = free_port()
        base = f"http://127.0.0.1:{port}"
        ctx = str(self.ctx)
        if launcher.startswith("python:"):
            python = launcher.removeprefix("python:")
            probe = subprocess.run(
                [python, "-c", "import llama_cpp.server.app"], capture_output=True, text=True
            )
            if probe.returncode != 0:
                err = probe.stderr.strip().splitlines()[-1:] or ["?"]
                raise Skipped(
                    f"llama-cpp-python's server cannot start ({err[0]}); "
                    "pip install 'llama-cpp-python[server]'"
                )
            argv = [
                python,
                "-m",
                "llama_cpp.server",
                "--model",
                str(gguf),
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--n_ctx",
                ctx,
                "--n_threads",
                str(self.threads),
                "--n_gpu_layers",
                "-1",
            ]
            self.mode = "llama-cpp-python"
            self.server = ServerProcess(argv, health="/v1/models", base=base)
            version = subprocess.run(
                [python, "-c", "import llama_cpp; print(llama_cpp.__version__)"],
                capture_output=True,
                text=True,
            ).stdout.strip()
        else:
            argv = [
                launcher,
                "-m",
                str(gguf),
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "-c",
                ctx,
                "-t",
                str(self.threads),
                "-np",
                str(self.parallel),
                "-ngl",
                "999",
                "--no-webui",
            ]
            self.mode = "llama-server"
            self.server = ServerProcess(argv, health="/health", base=base)
            version = subprocess.run([launcher, "--version"], capture_output=True, text=True)
            version = (version.stdout + version.stderr).strip().splitlines()[-1:] or [""]
            version = version[0]
        self.info = {
            "mode": self.mode,
            "server": argv[0],
            "gguf": str(gguf),
            "version": version,
            "parallel": self.parallel,
            "ctx": self.ctx,
            "threads": self.threads,
        }

    def run(self, prompt_ids: list[int], gen_tokens: int) -> Run:
        assert self.server is not None
        if self.mode == "llama-server":
            return self._run_native(prompt_ids, gen_tokens)
        return self._run_openai(prompt_ids, gen_tokens)

    def _run_native(self, prompt_ids: list[int], gen_tokens: int) -> Run:
        body = {
            "prompt": prompt_ids,
            "n_predict": gen_tokens,
            "stream": True,
            "return_tokens": True,
            "ignore_eos": True,
            "temperature": 0.0,
            "top_k": 1,
            "repeat_penalty": 1.0,  # greedy means no penalties: some servers default to 1.1
            "cache_prompt": False,
            "seed": 0,
        }
        start = time.perf_counter()
        arr, timings = Arrivals(start), {}
        for ev in sse_events(self.server.base, "/completion", body):  # type: ignore[union-attr]
            arr.add(list(ev.get("tokens") or []))
            if ev.get("stop"):
                timings = ev.get("timings") or {}
        # The stream leaves out the id of a token whose text is an incomplete UTF-8
        # sequence; the count comes from the server's own tally instead.
        run = arr.run(prompt_tokens=len(prompt_ids), n_tokens=timings.get("predicted_n") or None)
        run.engine = {
            "ids_missing_from_stream": run.n_tokens - len(run.tokens),
            "prompt_tps": timings.get("prompt_per_second"),
            "decode_tps": timings.get("predicted_per_second"),
            "per_token_ms": timings.get("predicted_per_token_ms"),
            "generation_tokens": timings.get("predicted_n"),
            "prompt_tokens": timings.get("prompt_n"),
        }
        run.rss_peak_bytes = peak_rss_bytes(self.server.pid)  # type: ignore[union-attr]
        return run

    def _run_openai(self, prompt_ids: list[int], gen_tokens: int) -> Run:
        body = {
            "prompt": self.tokenizer.decode(prompt_ids),
            "max_tokens": gen_tokens,
            "stream": True,
            "temperature": 0.0,
            "top_k": 1,
            "repeat_penalty": 1.0,  # llama-cpp-python's server defaults to 1.1
            "seed": 0,
        }
        start = time.perf_counter()
        arr, text = Arrivals(start), []
        for ev in sse_events(self.server.base, "/v1/completions", body):  # type: ignore[union-attr]
            piece = (ev.get("choices") or [{}])[0].get("text") or ""
            if piece:
                arr.add(count=1)  # one streamed chunk per token (text held back for UTF-8 merges)
                text.append(piece)
        run = arr.run(prompt_tokens=len(prompt_ids), tokens=[])
        run.text = "".join(text)
        run.rss_peak_bytes = peak_rss_bytes(self.server.pid)  # type: ignore[union-attr]
        return run

    def describe(self) -> dict[str, Any]:
        return self.info

    def close(self) -> None:
        if self.server is not None:
            self.server.close()
            self.server = None


# ---------------------------------------------------------------- Ollama


def ollama_base() -> str:
    """Ollama's base URL from $OLLAMA_HOST (``host:port`` or a URL), default 127.0.0.1:11434."""
    host = os.environ.get("OLLAMA_HOST") or DEFAULT_OLLAMA_HOST
    if "://" not in host:
        host = "http://" + host
    u = urlsplit(host)
    hostname = u.hostname or "127.0.0.1"
    if hostname == "0.0.0.0":  # the server's bind-all address; reach it on loopback
        hostname = "127.0.0.1"
    return f"{u.scheme}://{hostname}:{u.port or 11434}"


class Ollama:
    """A reachable Ollama server, on the GGUF export imported through ``/api/create``.

    Ollama takes text, so the prompt is the decoded prompt ids sent ``raw``;
    decode speed comes from its own ``eval_count``/``eval_duration`` (ns) as well
    as from the client's clock, and the runner that served (``/api/ps``) is kept.
    Ollama has no ignore-EOS switch: a run that stops early shows fewer tokens.
    """

    name = "ollama"
    token_checked = False

    def __init__(self, model_path: str, *, tokenizer: Any) -> None:
        self.model_path = model_path
        self.tokenizer = tokenizer
        self.base = ollama_base()
        self.model = ""
        self.info: dict[str, Any] = {"host": self.base}

    def setup(self) -> None:
        try:
            status, body = request(self.base, "GET", "/api/version", timeout=3)
        except (OSError, http.client.HTTPException) as exc:
            raise Skipped(
                f"Ollama not reachable at {self.base} ({exc}); start `ollama serve` or set OLLAMA_HOST"
            ) from None
        if status != 200:
            raise Skipped(f"Ollama at {self.base} answered HTTP {status} to /api/version")
        self.info["version"] = json.loads(body).get("version")
        gguf = _export(self.model_path)
        digest = "sha256:" + _sha256(gguf)
        self.model = f"mlxrt-bench-{Path(self.model_path).name.lower()}-{digest[7:19]}"
        self._import(gguf, digest)
        self.info.update(model=self.model, gguf=str(gguf))

    def _import(self, gguf: Path, digest: str) -> None:
        """Upload the blob and create the model; fall back to a FROM path for older servers."""
        errors = []
        status, _ = request(self.base, "HEAD", f"/api/blobs/{digest}", timeout=10)
        if status != 200:
            status, body = request(self.base, "POST", f"/api/blobs/{digest}", raw=gguf.read_bytes())
            if status not in (200, 201):
                errors.append(f"blob upload HTTP {status}: {body[:200]!r}")
        attempts = [
            {
                "model": self.model,
                "files": {"model.gguf": digest},
                "template": "{{ .Prompt }}",
                "stream": False,
            },
            {"model": self.model, "modelfile": f"FROM {gguf}\nTEMPLATE {{{{ .Prompt }}}}\n", "stream": False},
        ]
        for body_json in attempts:
            status, body = request(self.base, "POST", "/api/create", body_json, timeout=600)
            if status == 200:
                return
            errors.append(f"/api/create HTTP {status}: {body[:200]!r}")
        raise Skipped("could not import the GGUF export into Ollama: " + "; ".join(errors))

    def run(self, prompt_ids: list[int], gen_tokens: int) -> Run:
        body = {
            "model": self.model,
            "prompt": self.tokenizer.decode(prompt_ids),
            "raw": True,
            "stream": True,
            "keep_alive": "10m",
            "options": {
                "temperature": 0,
                "top_k": 1,
                "repeat_penalty": 1.0,  # Ollama's default of 1.1 would change greedy output
                "seed": 0,
                "num_predict": gen_tokens,
                "num_ctx": max(2048, 2 * (len(prompt_ids) + gen_tokens)),
            },
        }
        start = time.perf_counter()
        arr, text, final = Arrivals(start), [], {}
        for line in stream_lines(self.base, "/api/generate", body):
            ev = json.loads(line)
            if ev.get("error"):
                raise RuntimeError(f"ollama: {ev['error']}")
            if ev.get("response"):
                arr.add(count=1)
                text.append(ev["response"])
            if ev.get("done"):
                final = ev
        n = int(final.get("eval_count") or arr.n)
        run = arr.run(prompt_tokens=len(prompt_ids), n_tokens=n, tokens=[])
        run.text = "".join(text)
        ev_ns, pe_ns = final.get("eval_duration") or 0, final.get("prompt_eval_duration") or 0
        run.engine = {
            "decode_tps": n / (ev_ns / 1e9) if ev_ns else None,
            "per_token_ms": ev_ns / 1e6 / n if ev_ns and n else None,
            "prompt_tokens": final.get("prompt_eval_count"),
            "prompt_tps": final["prompt_eval_count"] / (pe_ns / 1e9)
            if pe_ns and final.get("prompt_eval_count")
            else None,
            "load_ms": (final.get("load_duration") or 0) / 1e6,
        }
        self.info["runner"] = self._runner()
        return run

    def _runner(self) -> dict[str, Any] | None:
        """What /api/ps says about the loaded model: size, share in VRAM, processor."""
        try:
            status, body = request(self.base, "GET", "/api/ps", timeout=5)
        except (OSError, http.client.HTTPException):
            return None
        if status != 200:
            return None
        for m in json.loads(body).get("models", []):
            if (
                m.get("name", "").split(":")[0] == self.model
                or m.get("model", "").split(":")[0] == self.model
            ):
                size, vram = m.get("size") or 0, m.get("size_vram") or 0
                share = round(100 * vram / size) if size else 0
                proc = "CPU" if share == 0 else "GPU" if share == 100 else f"{share}% GPU"
                return {"processor": proc, "size": size, "size_vram": vram, "details": m.get("details")}
        return None

    def describe(self) -> dict[str, Any]:
        return self.info

    def close(self) -> None:
        pass  # the imported model stays in Ollama, named by digest, and is reused next time


# ---------------------------------------------------------------- shared


def _export(model_path: str) -> Path:
    try:
        from .gguf_export import ensure_gguf
    except ImportError as exc:  # numpy or gguf missing
        raise Skipped(f"GGUF export unavailable ({exc}); pip install gguf") from None
    try:
        return ensure_gguf(model_path)
    except (ValueError, FileNotFoundError) as exc:
        raise Skipped(f"GGUF export failed: {exc}") from None


def _context_length(model_path: str) -> int:
    try:
        cfg = json.loads((Path(model_path) / "config.json").read_text())
        return min(int(cfg.get("max_position_embeddings") or 4096), 8192)
    except (OSError, ValueError):
        return 4096


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def http_scenarios() -> tuple[dict[str, type], str | None]:
    """The HTTP scenarios from `benchmarks.http_scenario` ({name: class}), or why they are absent."""
    try:
        from . import http_scenario  # written alongside mlxrt's HTTP server
    except ImportError as exc:
        return {}, f"not available ({exc})"
    found = {}
    for cls_name, key in (("HttpStream", "mlxrt-http"), ("MlxLmServer", "mlx_lm.server"),
                          ("VllmMlxServer", "vllm-mlx")):
        cls = getattr(http_scenario, cls_name, None)
        if cls is not None:
            found[key] = cls
    return found, None


def make_http(cls: type, model_path: str) -> Any:
    """Build an HTTP scenario; they take the model path like the others."""
    try:
        return cls(model_path)
    except TypeError:
        return cls(model=model_path)


def peer_pid(scenario: Any) -> int | None:
    """The server process of a scenario from elsewhere, if it exposes one (.pid / .proc / .process)."""
    for attr in ("pid", "proc", "process", "server"):
        v = getattr(scenario, attr, None)
        if isinstance(v, int):
            return v
        if v is not None and isinstance(getattr(v, "pid", None), int):
            return v.pid
    return None
