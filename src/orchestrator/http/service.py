"""What every API shares: the `Service` their handlers hold and the `Generation` they stream.

`Service` holds the runtime, the config and the metrics; it resolves model
names (a name, or the path a model is served from), reads and checks bodies
(`body.py`), checks sampling parameters and capabilities against the model and
starts generations. Imports run one way: app.py, then the APIs (openai.py,
ollama.py, anthropic.py, responses.py), then this.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, TypeVar

import msgspec
import structlog
from starlette.requests import Request
from starlette.responses import Response

from ...ipc.protocol import Capabilities, InvalidField, TokenLogprob, ToolCall
from ..errors import MlxrtError
from ..images import PREFETCHED, prefetch, remote_urls
from ..request import Request as RtRequest
from ..runtime import AsyncRuntime, AsyncStream, Chunk
from .body import decode, read_body
from .config import ServerConfig
from .errors import HttpError, from_invalid_field, from_runtime_error
from .metrics import Metrics
from .schemas import ENCODER
from .streaming import ClientGone, until_disconnect

log = structlog.get_logger("mlxrt.http")

T = TypeVar("T")

#: "Until the context is full": the worker clamps max_tokens to context minus prompt.
UNLIMITED_TOKENS = 1 << 30
#: Most tokens generated for a request that sets no limit (and a model served without --max-tokens):
#: mlx_lm.server's default. A client that sends none (Codex) must not run to the end of a long context.
DEFAULT_MAX_TOKENS = 512
JSON = "application/json"


@dataclass(frozen=True)
class ModelFacts:
    """What /api/show, /api/tags and /api/ps report, and the vocabulary size requests are checked
    against: read from the model's config.json when local."""

    ref: str
    family: str = ""
    quantization: str = ""
    context_length: int = 0
    vocab_size: int = 0  #: the key the worker checks token ids against; 0: unknown
    size_bytes: int = 0
    modified_at: str = ""
    config: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def read(cls, ref: str) -> ModelFacts:
        path = Path(ref).expanduser()
        cfg_path = path / "config.json"
        try:
            config = json.loads(cfg_path.read_text())
        except (OSError, ValueError):
            return cls(ref=ref, modified_at=iso_now())
        quant = config.get("quantization") or {}
        bits = quant.get("bits") if isinstance(quant, dict) else None
        weights = list(path.glob("*.safetensors"))
        mtime = max((p.stat().st_mtime for p in [cfg_path, *weights]), default=time.time())
        return cls(
            ref=ref,
            family=str(config.get("model_type", "")),
            quantization=f"Q{bits}" if bits else str(config.get("torch_dtype", config.get("dtype", ""))),
            context_length=int(config.get("max_position_embeddings") or 0),
            vocab_size=int(config.get("vocab_size") or 0),
            size_bytes=sum(p.stat().st_size for p in weights),
            modified_at=iso(mtime),
            config=config,
        )


def iso(ts: float) -> str:
    """RFC 3339 in UTC with a ``Z``, as Ollama writes timestamps."""
    return datetime.fromtimestamp(ts, timezone.utc).isoformat().replace("+00:00", "Z")


def iso_now() -> str:
    return iso(time.time())


@dataclass
class Reply:
    """One choice of a collected generation: its text, ids, reasoning, calls and log-probabilities."""

    index: int
    texts: list[str] = field(default_factory=list)
    ids: list[int] = field(default_factory=list)
    thoughts: list[str] = field(default_factory=list)
    tool_calls: list[ToolCall] = field(default_factory=list)
    #: None unless the request asked for log-probabilities.
    logprobs: list[TokenLogprob] | None = None
    finish_reason: str = "stop"

    def add(self, c: Chunk) -> None:
        self.texts.append(c.text)
        self.ids.extend(c.tokens)
        self.thoughts.append(c.reasoning)
        self.tool_calls.extend(c.tool_calls)
        if c.logprobs is not None:
            self.logprobs = (self.logprobs or []) + c.logprobs

    @property
    def text(self) -> str:
        return "".join(self.texts)

    @property
    def reasoning(self) -> str:
        return "".join(self.thoughts)


class Generation:
    """One generation in flight: its stream, its first chunk and what the client received.

    `finish(reason)` records it once: metrics and one log line.
    """

    __slots__ = ("svc", "endpoint", "model", "stream", "first", "t0", "ttft_s", "tokens", "_finished",
                 "reasoning", "tool_calls", "replies")

    def __init__(self, svc: Service, endpoint: str, model: str, stream: AsyncStream, t0: float) -> None:
        self.svc = svc
        self.endpoint = endpoint
        self.model = model
        self.stream = stream
        self.first: Chunk | None = None
        self.t0 = t0
        self.ttft_s = 0.0
        self.tokens = 0
        self._finished = False
        #: A chat reply's reasoning and tool calls, once `collect` has run (the first choice's).
        self.reasoning = ""
        self.tool_calls: list[ToolCall] = []
        #: Every choice (n > 1: several), once `collect` has run.
        self.replies: list[Reply] = []

    @property
    def prompt_tokens(self) -> int:
        return self.stream.stats.prompt_tokens if self.stream.stats else 0

    @property
    def finish_reason(self) -> str:
        return self.stream.finish_reason or "stop"

    async def collect(self, receive) -> tuple[str, list[int]]:
        """The whole completion (text, ids; `reasoning` and `tool_calls` set aside), the first
        choice's; every choice in `replies`. The generation stops if the client disconnects."""
        replies: dict[int, Reply] = {}
        for c in await self.all_chunks(receive):
            reply = replies.get(c.index)
            if reply is None:
                reply = replies[c.index] = Reply(c.index)
            reply.add(c)
        stats = self.stream.choice_stats
        self.replies = [replies.get(i) or Reply(i) for i in sorted(set(replies) | set(stats) | {0})]
        for r in self.replies:
            r.finish_reason = stats[r.index].finish_reason if r.index in stats else self.finish_reason
        first = self.replies[0]
        self.reasoning, self.tool_calls = first.reasoning, first.tool_calls
        return first.text, first.ids

    async def all_chunks(self, receive) -> list[Chunk]:
        """Every chunk of the completion, in order, every choice's (`reasoning` and `tool_calls`
        gathered too); the generation stops if the client disconnects."""
        chunks = [] if self.first is None else [self.first]

        async def drain() -> None:
            async for c in self.stream:
                chunks.append(c)

        await self.unless_gone(receive, drain())
        self.tokens = sum(len(c.tokens) for c in chunks)
        self.reasoning = "".join(c.reasoning for c in chunks)
        self.tool_calls.extend(t for c in chunks for t in c.tool_calls)
        self.finish(self.finish_reason)
        return chunks

    async def unless_gone(self, receive, work: Awaitable[T], names: Mapping[str, str] | None = None) -> T:
        """Await `work` unless the client disconnects first; a disconnect or a runtime error
        is recorded as this generation's outcome and re-raised (as an HTTP error naming the field
        as the API does: `names`)."""
        try:
            return await until_disconnect(receive, work)
        except ClientGone:
            self.finish("disconnected")
            raise
        except MlxrtError as exc:
            self.finish("error", str(exc))
            raise from_runtime_error(exc, names) from exc

    async def chunks(self) -> AsyncIterator[Chunk]:
        """The first chunk (awaited before the response began), then the rest, counting
        tokens sent; the stream is closed at the end (and by `on_close` if the client goes)."""
        try:
            if self.first is not None:
                self.tokens += len(self.first.tokens)
                yield self.first
            async for c in self.stream:
                self.tokens += len(c.tokens)
                yield c
        finally:
            self.stream.close()

    def on_close(self, gone: bool) -> None:
        """`EventStream`'s end: disconnected, failed (no stats), or finished as the worker said."""
        self.finish("disconnected" if gone else (self.finish_reason if self.stream.stats else "error"))

    def finish(self, reason: str, error: str = "") -> None:
        """Close the stream (a no-op once it ended) and record the outcome, with the `error` that ended
        it if one did; idempotent."""
        if self._finished:
            return
        self._finished = True
        self.stream.close()
        m = self.svc.metrics
        m.finished.labels(self.model, reason).inc()
        if self.tokens:
            m.tokens.labels(self.model).inc(self.tokens)
            m.ttft.labels(self.model).observe(self.ttft_s)
        stats = self.stream.stats
        if stats is not None:
            m.prompt_tokens.labels(self.model).inc(stats.prompt_tokens)
            m.cached_tokens.labels(self.model).inc(stats.cached_tokens)
            if stats.draft_tokens:
                m.draft_tokens.labels(self.model).inc(stats.draft_tokens)
                m.draft_accepted.labels(self.model).inc(stats.draft_accepted)
            if stats.decode_tps > 0:
                m.decode_rate.labels(self.model).observe(stats.decode_tps)
            if stats.generation_tokens > 1:
                m.decode_gap.labels(self.model).observe(stats.longest_gap_ms / 1e3)
        worker = {} if stats is None else {  # the worker's share of the TTFT: waiting, then prefill
            "worker_queue_ms": round(stats.queue_ms, 2),
            "worker_ttft_ms": round(stats.ttft_ms, 2),
            # of the TTFT: its own prefill chunks, and other prompts' chunks it waited behind
            "prefill_ms": round(stats.prefill_ms, 2),
            "prefill_wait_ms": round(stats.prefill_wait_ms, 2),
        }
        if stats is not None and stats.resumes:  # it went on after its worker died
            worker["resumes"] = stats.resumes
        if error:
            worker["error"] = error
        log.info("http.generation", endpoint=self.endpoint, model=self.model, reason=reason,
                 prompt_tokens=self.prompt_tokens, cached_tokens=stats.cached_tokens if stats else 0,
                 tokens=self.tokens,
                 ttft_ms=round(self.ttft_s * 1e3, 2),
                 total_ms=round((time.perf_counter() - self.t0) * 1e3, 2), **worker)


class Service:
    """What the handlers share: the runtime, the config, the metrics, the models' facts."""

    def __init__(self, rt: AsyncRuntime, config: ServerConfig, model_refs: Mapping[str, str]) -> None:
        self.rt = rt
        self.config = config
        self.metrics = Metrics(lambda: rt.workers)
        self.created = int(time.time())
        self.model_refs = dict(model_refs)
        self.aliases = path_aliases(self.model_refs)
        self._facts: dict[str, ModelFacts] = {}

    def facts(self, name: str) -> ModelFacts:
        if name not in self._facts:
            self._facts[name] = ModelFacts.read(self.model_refs.get(name, name))
        return self._facts[name]

    def sampling_defaults(self, name: str) -> dict[str, Any]:
        """The model's default sampling (`--temp`, `--top-p`, ...): what a request leaves out."""
        return self.rt.model_options(name).sampling_defaults()

    def capabilities(self, name: str) -> Capabilities | None:
        """What the model's workers reported they support; None until one has been ready."""
        info = self.rt.model_info(name)
        return info.capabilities if info is not None else None

    def model(self, requested: str, *, ollama: bool = False) -> str:
        """The served model called `requested`, or served from the path `requested` (Ollama's
        ``:latest`` tag optional); 404 otherwise."""
        served = self.rt.models
        name = self._served(requested, served)
        if name is None and ollama and requested.endswith(":latest"):
            name = self._served(requested[: -len(":latest")], served)
        if name is not None:
            return name
        if not requested:
            raise HttpError(400, f"model: required; this server serves {served}", param="model")
        raise HttpError(404, f"model {requested!r} not found; this server serves {served}",
                        param="model", code="model_not_found")

    def _served(self, requested: str, served: list[str]) -> str | None:
        name = requested if requested in served else self.aliases.get(requested)
        return name if name in served else None

    async def read(self, request: Request, decoder: msgspec.json.Decoder, prefix: str = "",
                   ignored: list[str] | None = None) -> Any:
        """Read the body (at most `max_body_bytes`, else 413) and decode it (a bad value: 400).

        Fields the schema does not declare are dropped and named in one log line; a caller that
        finds more to ignore passes `ignored`, gets them appended, and logs them (`log_ignored`).
        """
        found: list[str] = [] if ignored is None else ignored
        value = decode(await read_body(request, self.config.max_body_bytes), decoder, prefix, found)
        if ignored is None:
            log_ignored(request, found)
        if self.config.allow_image_urls and (urls := remote_urls(value)):
            PREFETCHED.set(await prefetch(urls))  # this request's task reads them when its schema converts
        return value

    def build(self, names: Mapping[str, str], to_request: Callable[..., RtRequest], *args: Any) -> RtRequest:
        """``to_request(*args)``, an API's request as the runtime's; an `InvalidField` is a 400 naming the
        field as the API does (`names` maps mlxrt's field names to the API's)."""
        try:
            return to_request(*args)
        except InvalidField as exc:
            raise from_invalid_field(exc, names) from None

    async def start(
        self,
        request: Request,
        endpoint: str,
        rt_req: RtRequest,
        names: Mapping[str, str],
        t0: float,
        *,
        refusal: Callable[[InvalidField], HttpError] | None = None,
    ) -> Generation:
        """Start a generation and wait for its first chunk (or its end, or its error).

        What the model cannot do (thinking, tools: `InvalidField` with code "unsupported") is
        `refusal`'s to word, where the API has its own wording (Ollama's).
        """
        model = rt_req.model or ""
        try:
            stream = self.rt.submit(rt_req)
        except InvalidField as exc:
            if refusal is not None and exc.code == "unsupported":
                raise refusal(exc) from None
            raise from_invalid_field(exc, names) from None
        except MlxrtError as exc:
            raise from_runtime_error(exc, names) from None
        gen = Generation(self, endpoint, model, stream, t0)
        gen.first = await gen.unless_gone(request.receive, _first(stream), names)
        gen.ttft_s = time.perf_counter() - t0
        return gen


async def _first(stream: AsyncStream) -> Chunk | None:
    try:
        return await stream.__anext__()
    except StopAsyncIteration:
        return None


def log_ignored(request: Request, fields: list[str], dropped: list[str] | None = None) -> None:
    """One line naming the request fields the server ignored (and what it `dropped`, e.g. hosted tools
    it cannot run: a warning), if any."""
    if dropped:
        log.warning("http.ignored", path=request.url.path, fields=fields, dropped=dropped)
    elif fields:
        log.info("http.ignored_fields", path=request.url.path, fields=fields)


def path_aliases(model_refs: Mapping[str, str]) -> dict[str, str]:
    """``{ref: name}``: a model also answers to the reference it is served from, as given and,
    for a local directory, resolved (as mlx_lm.server does); a shared path is the first model's."""
    aliases: dict[str, str] = {}
    for name, ref in model_refs.items():
        aliases.setdefault(ref, name)
        path = Path(ref).expanduser()
        if path.is_dir():
            aliases.setdefault(str(path.resolve()), name)
    return aliases


def new_id(prefix: str, sep: str = "-") -> str:
    """``chatcmpl-...`` (OpenAI chat); with ``sep="_"``, ``msg_...``, ``resp_...`` (Anthropic, Responses)."""
    return f"{prefix}{sep}{uuid.uuid4().hex[:24]}"


def json_response(obj: object, status: int = 200) -> Response:
    return Response(ENCODER.encode(obj), status_code=status, media_type=JSON)
