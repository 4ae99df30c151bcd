"""The public API: `Runtime` (threads) and `AsyncRuntime` (asyncio), facades over one `Pool`.

A request is a `Request` (request.py: built from `generate`/`stream`'s keywords, or by
an HTTP API's schema); `submit` checks it against its model and opens its stream
(stream.py) on a worker the pool picks (pool.py).
"""

from __future__ import annotations

import asyncio
import functools
import weakref
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import structlog

from .. import logs
from ..ipc.protocol import EngineOptions, Ready
from . import embeddings
from .config import DEFAULT_WARMUP_TOKENS, Supervision, Timeouts
from .errors import MlxrtError
from .handle import WorkerInfo, WorkerMemory
from .launch import Group
from .options import ModelSpec
from .pool import Pool
from .request import Prompt, Request, build_request, keep_alive_seconds
from .stream import AsyncStream, Chunk, Completion, Stream, collect

if TYPE_CHECKING:
    import numpy as np  # imported by `embeddings` when vectors arrive, not with the runtime

log = structlog.get_logger("mlxrt.orchestrator")

__all__ = ["Runtime", "AsyncRuntime", "Stream", "AsyncStream", "Chunk", "Completion", "Request", "Prompt",
           "build_request"]

def _model_map(model: str | ModelSpec | None,
               models: Mapping[str, str | ModelSpec] | None) -> dict[str, str | ModelSpec]:
    out = dict(models or {})
    if model is not None:
        out.setdefault(model.path if isinstance(model, ModelSpec) else model, model)
    return out


class Runtime:
    """MLX models in worker processes, from synchronous code.

    >>> with Runtime(model="synthetic:tiny") as rt:          # doctest: +SKIP
    ...     rt.generate("Hello", max_tokens=8).text

    `model` is a local directory, a Hugging Face id or ``synthetic:PRESET``;
    `models` maps names to such references to serve several. Sampling keywords
    of `generate`/`stream`: max_tokens, temperature, top_p, top_k, min_p,
    repetition_penalty, repetition_context_size, seed, stop, stop_token_ids,
    ignore_eos, num_ctx (the request's context, prompt and reply, as Ollama's);
    for structured output ``json_schema`` (a JSON schema the
    reply must match, enforced in the worker) or ``grammar`` (a `Grammar`:
    a JSON schema, a regex or a Lark grammar); ``logprobs`` (0: each token's
    log-probability, k <= 20: and the k most likely tokens; `Completion.logprobs`,
    `Chunk.logprobs`); ``n`` (<= 16 choices from one prefill: `Completion.choices`,
    `Chunk.index`). Chat keywords (the prompt a list of messages): tools,
    tool_choice (``required`` or a function force the call), think
    (`chat.chat_options`); the reply's reasoning and tool calls come apart from
    its text (`Completion.reasoning`, `.tool_calls`).

    `embed` turns texts or token ids into vectors, with an embedding model
    (docs/models.md#embeddings); such a model cannot generate.

    `engine` says how each worker batches and caches (`EngineOptions`:
    decode_concurrency, prompt_concurrency, prefill_step_size,
    prompt_cache_bytes); by default the ``MLXRT_*`` variables of the same
    names, else the defaults (the prefix cache sized from the machine's
    memory). A model given as a `ModelSpec` (``models={"q": ModelSpec(path,
    draft_model=..., kv_bits=8)}``) has options of its own: a draft model,
    KV-cache quantization or a bounded cache, a LoRA adapter, a chat template,
    its context length, a prompt-cache file and default sampling
    (docs/options.md), checked before any worker starts; a request's sampling
    keywords win over the model's defaults.

    `spares` hot spares per model (default 0): loaded, warmed-up workers that
    take no requests and take a crashed worker's place at once, a new spare
    loading behind each (docs/supervision.md). Each holds the model in memory.

    `ranks`, `backend`, `hosts`, `sharding`: make each worker a group of rank
    processes sharing the model over `mx.distributed` (`Group`; docs/distributed.md),
    e.g. ``ranks=2, backend="ring"`` on this machine, or ``hosts="hosts.json"``
    (`mlx.launch`'s host file) across machines; `groups` sets them per model
    name instead. `rt.workers` lists each group's ranks (`WorkerInfo.ranks`).
    """

    def __init__(
        self,
        model: str | ModelSpec | None = None,
        *,
        models: Mapping[str, str | ModelSpec] | None = None,
        workers: int = 1,
        transport: str = "auto",
        timeouts: Timeouts | None = None,
        supervision: Supervision | None = None,
        warmup_tokens: int = DEFAULT_WARMUP_TOKENS,
        cache_limit_bytes: int | None = None,
        engine: EngineOptions | None = None,
        spares: int = 0,
        ranks: int | None = None,
        backend: str = "auto",
        hosts: str | None = None,
        sharding: str = "auto",
        groups: Mapping[str, Group] | None = None,
        _worker_argv: list[str] | None = None,
    ) -> None:
        _ensure_logging()
        names = _model_map(model, models)
        every = Group(ranks=ranks, backend=backend, hosts=hosts, sharding=sharding)
        self._pool = Pool(
            names,
            workers=workers,
            transport=transport,
            timeouts=timeouts or Timeouts.from_env(),
            supervision=supervision or Supervision.from_env(),
            warmup_tokens=warmup_tokens,
            cache_limit_bytes=cache_limit_bytes,
            engine=engine,
            worker_argv=_worker_argv,  # tests substitute fake workers here
            spares=spares,
            groups=_groups(names, every, groups),
        )
        # Stop the workers even if the caller forgets: at garbage collection or interpreter exit.
        self._finalizer = weakref.finalize(self, self._pool.close)

    @property
    def transport(self) -> str:
        return self._pool.transport

    @property
    def workers(self) -> list[WorkerInfo]:
        """Every worker, the spares last (``spare=True``)."""
        return [s.info() for s in self._pool.all()]

    @property
    def models(self) -> list[str]:
        return list(self._pool.slots)

    @property
    def memory_pressure(self) -> str:
        """The last system memory-pressure level the monitor read: normal, warning,
        critical or unavailable."""
        return self._pool.pressure

    @property
    def pool(self) -> Pool:
        """The worker pool the streams open on (`AsyncRuntime` shares it)."""
        return self._pool

    def request(self, prompt: Prompt, *, model: str | None = None, keep_alive: float | None = None,
                **params: Any) -> Request:
        """A checked `Request` from `generate`'s keywords: the model's default sampling under them."""
        return Request.build(prompt, params, defaults=self.model_options(model).sampling_defaults(),
                             model=model, keep_alive=keep_alive)

    def submit(self, request: Request) -> Stream:
        """Start `request` (checked against its model) and return its `Stream` of chunks."""
        return Stream(self._pool, request)

    def stream(
        self, prompt: Prompt, *, model: str | None = None, keep_alive: float | None = None, **params: Any
    ) -> Stream:
        """Start a request and return its `Stream` of chunks.

        `keep_alive` (seconds) sets how long the model stays loaded once idle
        (Ollama's keep_alive; 0 unloads it right after this request).
        """
        return self.submit(self.request(prompt, model=model, keep_alive=keep_alive, **params))

    def generate(
        self, prompt: Prompt, *, model: str | None = None, keep_alive: float | None = None, **params: Any
    ) -> Completion:
        """Run a request to the end and return its `Completion`."""
        stream = self.stream(prompt, model=model, keep_alive=keep_alive, **params)
        return collect(list(stream), stream)

    def embed(
        self,
        inputs: embeddings.Inputs,
        *,
        model: str | None = None,
        dimensions: int | None = None,
        truncate: bool = False,
        keep_alive: float | None = None,
    ) -> np.ndarray:
        """Embed `inputs` with an embedding model: a float32 numpy array, one row per input, or a
        single vector (1-D) for a bare string or list of token ids.

        `inputs`: a string, a list of strings, a list of token ids or a list of such lists (texts
        are tokenized here, with the model's tokenizer). `dimensions`: keep each vector's first
        components, normalised again (Matryoshka models such as Qwen3-Embedding). `truncate`: cut
        an input longer than the model's context instead of refusing it. `keep_alive` as in
        `stream`. A model that is not an embedding model is a `ValueError`.
        """
        name = model or self._pool.default_model
        prepared = embeddings.prepare(self._pool.next_id(), inputs, self.model_info(model), name,
                                      dimensions=dimensions, truncate=truncate)
        return embeddings.run(self._pool, model, prepared, keep_alive_seconds(keep_alive)).vectors

    def model_info(self, model: str | None = None) -> Ready | None:
        """What a worker of `model` reported when it became ready (context length, vocabulary
        size, versions, device); None until one has."""
        return next((s.ready for s in self._pool.model_slots(model) if s.ready is not None), None)

    def model_options(self, model: str | None = None) -> EngineOptions:
        """The options `model`'s workers run with, as checked at the edge (paths resolved)."""
        self._pool.model_slots(model)
        return self._pool.options[model or self._pool.default_model]

    def memory(self, timeout: float = 5.0) -> list[WorkerMemory]:
        """Each loaded worker's MLX and process memory (one round trip each)."""
        found = (s.memory(timeout) for s in self._pool.all())
        return [m for m in found if m is not None]

    def reset(self, model: str | None = None) -> None:
        """Clear a failed model's crash record and start its workers (and spares) again."""
        for slot in self._pool.model_slots(model) + self._pool.model_spares(model):
            slot.reset()

    def unload(self, model: str | None = None) -> int:
        """Stop the model's idle workers now (they reload on the next request); returns how many,
        its spares not counted (they go too, and come back with the model)."""
        unloaded = sum(slot.unload() for slot in self._pool.model_slots(model))
        self._pool.follow_spares()
        return unloaded

    def load(self, model: str | None = None, keep_alive: float | None = None) -> None:
        """Start the model's unloaded workers (and spares) in the background; `keep_alive` as in
        `stream`."""
        keep = keep_alive_seconds(keep_alive)
        for slot in self._pool.model_slots(model):
            if keep is not None:
                slot.keep_alive_s = keep
            slot.touch()
            slot.load()
        self._pool.follow_spares()

    def close(self, drain_s: float = 0.0) -> None:
        """Stop every worker; idempotent. With `drain_s`, running requests get that long to
        finish before their workers are asked to exit (then SIGTERM, then SIGKILL)."""
        if drain_s > 0 and self._finalizer.alive:
            self._finalizer.detach()
            self._pool.close(drain_s)
        self._finalizer()

    def __enter__(self) -> Runtime:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _groups(models: Mapping[str, str], every: Group, groups: Mapping[str, Group] | None) -> dict[str, Group]:
    """`every` for each model unless it is the default (one process), then `groups`' own."""
    out = {name: every for name in models} if every != Group() else {}
    return {**out, **(groups or {})}


class AsyncRuntime:
    """The asyncio twin of `Runtime`: ``async with AsyncRuntime(...) as rt``.

    Workers start in a thread so the event loop keeps running meanwhile.
    """

    def __init__(self, model: str | None = None, **kwargs: Any) -> None:
        _ensure_logging()
        self._args = (model, kwargs)
        self._rt: Runtime | None = None

    async def start(self) -> AsyncRuntime:
        model, kwargs = self._args
        self._rt = await asyncio.to_thread(Runtime, model, **kwargs)
        return self

    @property
    def runtime(self) -> Runtime:
        if self._rt is None:
            raise MlxrtError("AsyncRuntime is not started: use `async with` or `await rt.start()`")
        return self._rt

    @property
    def workers(self) -> list[WorkerInfo]:
        return self.runtime.workers

    @property
    def models(self) -> list[str]:
        return self.runtime.models

    @property
    def transport(self) -> str:
        return self.runtime.transport

    @property
    def memory_pressure(self) -> str:
        return self.runtime.memory_pressure

    def submit(self, request: Request) -> AsyncStream:
        """Start `request` (checked against its model) and return its `AsyncStream` of chunks."""
        return AsyncStream(self.runtime.pool, request)

    def stream(
        self, prompt: Prompt, *, model: str | None = None, keep_alive: float | None = None, **params: Any
    ) -> AsyncStream:
        return self.submit(self.runtime.request(prompt, model=model, keep_alive=keep_alive, **params))

    async def generate(
        self, prompt: Prompt, *, model: str | None = None, keep_alive: float | None = None, **params: Any
    ) -> Completion:
        stream = self.stream(prompt, model=model, keep_alive=keep_alive, **params)
        chunks = [c async for c in stream]
        return collect(chunks, stream)

    async def embed(
        self,
        inputs: embeddings.Inputs,
        *,
        model: str | None = None,
        dimensions: int | None = None,
        truncate: bool = False,
        keep_alive: float | None = None,
    ) -> np.ndarray:
        """`Runtime.embed`, awaited; long texts are tokenized on a thread."""
        found = await self.embed_result(inputs, model=model, dimensions=dimensions, truncate=truncate,
                                        keep_alive=keep_alive)
        return found.vectors

    async def embed_result(
        self,
        inputs: embeddings.Inputs,
        *,
        model: str | None = None,
        dimensions: int | None = None,
        truncate: bool = False,
        keep_alive: float | None = None,
    ) -> embeddings.EmbedResult:
        """`embed`, with the inputs' token count and the worker's stats beside the vectors."""
        pool = self.runtime.pool
        name = model or pool.default_model
        prepare = functools.partial(embeddings.prepare, pool.next_id(), inputs, self.model_info(model), name,
                                    dimensions=dimensions, truncate=truncate)
        prepared = await asyncio.to_thread(prepare) if embeddings.needs_thread(inputs) else prepare()
        return await embeddings.run_async(pool, model, prepared, keep_alive_seconds(keep_alive))

    def model_info(self, model: str | None = None) -> Ready | None:
        return self.runtime.model_info(model)

    def model_options(self, model: str | None = None) -> EngineOptions:
        return self.runtime.model_options(model)

    async def memory(self, timeout: float = 5.0) -> list[WorkerMemory]:
        return await asyncio.to_thread(self.runtime.memory, timeout)

    def reset(self, model: str | None = None) -> None:
        self.runtime.reset(model)

    def unload(self, model: str | None = None) -> int:
        return self.runtime.unload(model)

    def load(self, model: str | None = None, keep_alive: float | None = None) -> None:
        self.runtime.load(model, keep_alive)

    async def close(self, drain_s: float = 0.0) -> None:
        if self._rt is not None:
            await asyncio.to_thread(self._rt.close, drain_s)

    async def __aenter__(self) -> AsyncRuntime:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


def _ensure_logging() -> None:
    """A library must not print to the app's stdout: default to warnings on stderr."""
    if not structlog.is_configured():
        import os

        logs.configure(level=os.environ.get("MLXRT_LOG_LEVEL", "warning"))
