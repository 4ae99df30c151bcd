"""What the tests share: leak accounting, HTTP servers in a thread, the scripted worker's script,
in-process engine drivers, waits with deadlines and the mlx-lm reference.

Test modules import helpers from here, never from one another; fixtures live in conftest.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import sys
import threading
import time
from pathlib import Path

import httpx
import psutil
import uvicorn
from mlxrt import AsyncRuntime
from mlxrt.ipc.protocol import ChatMessage, Generate, SamplingParams
from mlxrt.orchestrator.http import ServerConfig
from mlxrt.orchestrator.http.app import create_app
from mlxrt.synthetic.presets import PRESETS
from mlxrt.worker.engine import Engine

from benchmarks.storm import still_alive

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # `benchmarks` is a top-level folder of the checkout, not an installed package
    sys.path.insert(0, str(ROOT))


SHM_GLOB = "/dev/shm/mlxrt-*"
TRANSPORTS = ["stdio", "ring"]


# ---- processes and shared memory ------------------------------------------------


def created_here(path: str, pid: int | None = None) -> bool:
    """True if the ring header at `path` names this process (or `pid`) as its creator.

    Other programs on the machine may use rings at the same time; only ours count.
    """
    from mlxrt.ipc import ring

    try:
        with open(path, "rb") as f:
            head = f.read(ring._IDENTITY.size)
    except OSError:
        return False
    if len(head) < ring._IDENTITY.size:
        return False  # being created by someone right now: not a leak of ours
    return ring._IDENTITY.unpack(head)[ring._CREATOR_PID // 8] == (pid or os.getpid())


def child_pids() -> set[int]:
    """Pids of every live descendant of this process."""
    return {p.pid for p in psutil.Process().children(recursive=True)}


def assert_stopped(pids: list[int]) -> None:
    """Fail if any of `pids` is still running (after a grace period)."""
    alive = still_alive(set(pids))
    for p in alive:
        p.kill()
    assert not alive, f"workers outlived their runtime: {[p.pid for p in alive]}"


# ---- waits with deadlines ------------------------------------------------------


def run_with_deadline(fn, seconds: float):
    """Run fn in a thread; fail the test if it has not returned or raised after `seconds`."""
    box: dict = {}

    def target() -> None:
        try:
            box["value"] = fn()
        except BaseException as exc:  # handed back to the test
            box["error"] = exc

    t = threading.Thread(target=target, daemon=True)
    t.start()
    t.join(seconds)
    assert not t.is_alive(), f"still waiting after {seconds} s: a hang"
    if "error" in box:
        raise box["error"]
    return box.get("value")


FAST = dict(backoff_initial_s=0.05, backoff_max_s=0.2, monitor_interval_s=0.05)  # supervisor timings


def wait_for(predicate, seconds: float = 30.0, what: str = "condition"):
    """Poll `predicate` until true; fail the test (not hang) after `seconds`."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.02)
    raise AssertionError(f"{what} not reached within {seconds} s")


# ---- HTTP servers in a thread of this process ----------------------------------


try:  # the supervisor restarts dead workers; the 503 case needs it not to
    from mlxrt.orchestrator.config import Supervision

    NO_RESTART: dict = {"supervision": Supervision(restart=False)}
except ImportError:  # before the supervisor: dead workers stay dead
    NO_RESTART = {}


class ServerThread:
    """An `AsyncRuntime` and uvicorn servers over it, on an event loop in a thread of this process."""

    def __init__(self, models: dict[str, str], **runtime_kw) -> None:
        self.models = models
        self.runtime_kw = {"transport": "stdio", **runtime_kw}
        self.rt: AsyncRuntime | None = None
        self.servers: list[uvicorn.Server] = []
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread = threading.Thread(target=self._main, name="http-test-server", daemon=True)

    def start(self, config: ServerConfig | None = None) -> str:
        self._thread.start()
        if not self._ready.wait(120) or self._error is not None:
            raise RuntimeError(f"server did not start: {self._error!r}")
        return self.serve(config or ServerConfig())

    def serve(self, config: ServerConfig, *, model_refs: dict[str, str] | None = None) -> str:
        """Start one more server (its own config, and `model_refs` if given) over the same runtime;
        return its base URL."""
        fut = asyncio.run_coroutine_threadsafe(self._serve(config, model_refs or self.models), self._loop)
        return fut.result(30)

    def stop(self) -> None:
        for s in self.servers:
            s.should_exit = True
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._stopping.set)
        self._thread.join(60)
        assert not self._thread.is_alive(), "server thread did not stop"

    @property
    def pids(self) -> list[int]:
        return [w.pid for w in self.rt.workers]

    def _main(self) -> None:
        async def main() -> None:
            self._loop = asyncio.get_running_loop()
            self._stopping = asyncio.Event()
            try:
                self.rt = await AsyncRuntime(models=self.models, **self.runtime_kw).start()
            except BaseException as exc:
                self._error = exc
                self._ready.set()
                return
            self._ready.set()
            try:
                await self._stopping.wait()
                await asyncio.gather(*self._tasks)
            finally:
                await self.rt.close()

        self._tasks: list[asyncio.Task] = []
        asyncio.run(main())

    async def _serve(self, config: ServerConfig, model_refs: dict[str, str]) -> str:
        app = create_app(self.rt, config, model_refs=model_refs)
        server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning",
                                               lifespan="off", access_log=False,
                                               timeout_graceful_shutdown=2))
        self.servers.append(server)
        self._tasks.append(asyncio.ensure_future(server.serve()))
        while not server.started:
            await asyncio.sleep(0.01)
        port = server.servers[0].sockets[0].getsockname()[1]
        return f"http://127.0.0.1:{port}"


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def running(models: dict[str, str], **kwargs):
    """A started `ServerThread` on `models`; stopped on exit, its workers checked gone."""
    s = ServerThread(models, **kwargs)
    s.url = s.start()
    pids = s.pids
    yield s
    s.stop()
    assert_stopped(pids)


def sse_events(resp: httpx.Response) -> list:
    """The ``data:`` payloads of an SSE response, decoded; ``[DONE]`` kept as the string."""
    out = []
    for line in resp.iter_lines():
        if line.startswith("data: "):
            payload = line[len("data: "):]
            out.append(payload if payload == "[DONE]" else json.loads(payload))
    return out


def metric(http: httpx.Client, name: str, **labels: str) -> float:
    """One sample of /metrics (0 if absent)."""
    want = name + ("{" + ",".join(f'{k}="{v}"' for k, v in sorted(labels.items())) + "}" if labels else "")
    for line in http.get("/metrics").text.splitlines():
        if not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            if key == want or (labels and _same_sample(key, name, labels)):
                return float(value)
    return 0.0


def _same_sample(key: str, name: str, labels: dict[str, str]) -> bool:
    if not key.startswith(name + "{"):
        return False
    pairs = dict(p.split("=", 1) for p in key[len(name) + 1 : -1].split(","))
    return {k: v.strip('"') for k, v in pairs.items()} == labels


# ---- the scripted worker (scripted_worker.py) and its script -------------------


SCRIPTED = [sys.executable, str(Path(__file__).with_name("scripted_worker.py"))]
CALL = {"name": "get_weather", "arguments": {"city": "Paris"}}
QWEN_CALL = f"<tool_call>\n{json.dumps(CALL)}\n</tool_call>"
LLAMA_CALL = '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}'
LLAMA_TEXT = 'Hello! No tool needed: {"name": "not a call"}'
THOUGHT = "The notes will say."
# [marker in the templated prompt, forced reply]; the first marker found wins. With "prefix", only the
# reply's start is forced: the model (under a forced tool choice's grammar) writes the rest.
SCRIPT = [
    ["<|im_start|>user\nThink, then find", f"<think>\n{THOUGHT}\n</think>\n\n", "prefix"],
    ["<|start|>user<|message|>Think, then find",
     f"<|channel|>analysis<|message|>{THOUGHT}<|end|><|start|>assistant<|channel|>commentary", "prefix"],
    # Qwen3 (and Qwen2.5): ChatML, <think> and <tool_call> JSON.
    ["<tool_response>\nsunny, 21 C", "<think>\nThe tool answered.\n</think>\n\nIt is sunny in Paris."],
    ['<tools>\n{"type": "function", "function": {"name": "get_weather"',
     f"<think>\nI should call the tool.\n</think>\n\n{QWEN_CALL}"],
    ["<|im_start|>user\nWeather in Paris?", f"Plain text: {QWEN_CALL}"],
    ["Say hi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>", "Hello without thinking."],
    ["<|im_start|>user\nSay hi", "<think>\nA greeting.\n</think>\n\nHi there!"],
    # gpt-oss: harmony channels; the call ends with <|call|>, the answer with <|return|>.
    ["<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>sunny, 21 C",
     "<|channel|>analysis<|message|>The tool answered.<|end|><|start|>assistant<|channel|>final"
     "<|message|>It is sunny in Paris.<|return|>"],
    ["type get_weather = ",
     "<|channel|>analysis<|message|>I should call the tool.<|end|><|start|>assistant<|channel|>commentary"
     ' to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>'],
    ["Reasoning: high", "<|channel|>analysis<|message|>Thinking hard.<|end|><|start|>assistant"
                        "<|channel|>final<|message|>Done.<|return|>"],
    ["<|start|>user<|message|>Say hi", "<|channel|>analysis<|message|>A greeting.<|end|><|start|>assistant"
                                        "<|channel|>final<|message|>Hi there!<|return|>"],
    # Llama 3.x: bare JSON calls after the tools its template puts in the first user turn; results as
    # ipython turns (the tool content as JSON).
    ['<|start_header_id|>ipython<|end_header_id|>\n\n"sunny, 21 C"', "It is sunny in Paris."],
    ["}\n\nWeather in Paris?<|eot_id|>", LLAMA_CALL],
    ["}\n\nGreet me<|eot_id|>", LLAMA_TEXT],
]
THINKERS = ["qwen3", "gpt-oss"]


# ---- the engine in-process ------------------------------------------------------


#: The tiny preset of every generating family: every cache kind mlx-lm has (KV, rotating, arrays).
FAMILIES = ["tiny"] + sorted(p for p in PRESETS if p.startswith("tiny-") and not PRESETS[p].embedding
                          and PRESETS[p].vision is None)  # vision presets: tests/test_vision.py

SYSTEM = "You answer questions about the weather, the sea and the mountains, at length. " * 5


class Recorder:
    """A listener that keeps every request's ids, text and end."""

    def __init__(self) -> None:
        self.ids: dict[int, list[int]] = {}
        self.text: dict[int, str] = {}
        self.stats: dict = {}
        self.errors: dict[int, BaseException] = {}
        self.started_ids: list[int] = []
        self.events: list[tuple[str, int]] = []  # ("started" | "token", id), in order

    def started(self, req_id: int) -> None:
        self.started_ids.append(req_id)
        self.events.append(("started", req_id))

    def token(self, req_id: int, token: int, text: str, reasoning: str = "", calls=None, **extra) -> None:
        self.ids.setdefault(req_id, []).append(token)
        self.text[req_id] = self.text.get(req_id, "") + text
        self.events.append(("token", req_id))

    def done(self, req_id: int, stats, text: str, reasoning: str = "", calls=None, **extra) -> None:
        self.text[req_id] = self.text.get(req_id, "") + text
        self.stats[req_id] = stats

    def failed(self, req_id: int, exc: BaseException) -> None:
        self.errors[req_id] = exc


def fail_once(owner: object, name: str, exc: BaseException) -> None:
    """Make `owner.name` (a module's function or an object's method) raise `exc` at its next call, and be
    itself again from then on."""
    real = getattr(owner, name)

    def boom(*args, **kwargs):
        setattr(owner, name, real)
        raise exc

    setattr(owner, name, boom)


def run_handed_over(engine: Engine, first: Generate, second: Generate, after: int) -> Recorder:
    """`first` alone for `after` steps (on the fast path), then `second` arrives; run both to the end."""
    rec = Recorder()
    engine.submit(first, rec)
    for _ in range(after):
        engine.step()
    assert engine._solo is not None
    engine.submit(second, rec)
    while engine.busy:
        engine.step()
    return rec


def run_batch(engine: Engine, reqs: list[Generate], rec=None):
    """Submit every request at once and step the engine until all have ended; `rec` (any listener, a new
    `Recorder` unless given) hears every event, and is returned."""
    rec = Recorder() if rec is None else rec
    for r in reqs:
        engine.submit(r, rec)
    while engine.busy:
        engine.step()
    return rec


def run_alone(engine: Engine, req: Generate) -> tuple[list[int], object]:
    """`req` alone through the batch: its ids and stats, or its error raised."""
    rec = run_batch(engine, [req])
    if req.id in rec.errors:
        raise rec.errors[req.id]
    return rec.ids.get(req.id, []), rec.stats[req.id]


def gen(i: int, prompt=None, *, messages=None, ids=None, **params) -> Generate:
    """Request `i`: 16 tokens, EOS ignored, unless `params` say otherwise."""
    params.setdefault("max_tokens", 16)
    params.setdefault("ignore_eos", True)
    return Generate(id=i, prompt=prompt, prompt_ids=ids, messages=messages, params=SamplingParams(**params))


def chat(*turns: str, system: str = SYSTEM) -> list[ChatMessage]:
    """A chat under `system` whose turns alternate user, assistant, user, ..."""
    msgs = [ChatMessage("system", system)]
    for i, t in enumerate(turns):
        msgs.append(ChatMessage("user" if i % 2 == 0 else "assistant", t))
    return msgs


# ---- references -----------------------------------------------------------------


def native_tokens(reference, prompt, max_tokens: int, ignore_eos: bool = True) -> list[int]:
    """What in-process mlx-lm generates greedily for `prompt` (text, ids or chat messages)."""
    from mlx_lm import stream_generate

    model, tokenizer = reference
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], dict):
        prompt = tokenizer.apply_chat_template(prompt, add_generation_prompt=True)
    saved = tokenizer.eos_token_ids
    if ignore_eos:
        tokenizer.eos_token_ids = set()
    try:
        return [r.token for r in stream_generate(model, tokenizer, prompt, max_tokens=max_tokens)
                if r.finish_reason != "stop"]
    finally:
        tokenizer.eos_token_ids = saved


def run_of(tokens):
    """A measured run that emitted `tokens` (the figures are placeholders)."""
    from benchmarks import measure

    return measure.Run(tokens=tokens, prompt_tokens=1, ttft_ms=1.0, decode_tps=1.0, total_s=1.0)
