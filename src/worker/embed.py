"""A worker's embedding path: a decoder's last hidden states, pooled, many inputs per forward pass.

An embedding model is recognised by its directory, as sentence-transformers
recognises one: ``modules.json`` lists a ``Pooling`` module, whose
``config.json`` names the pooling (Qwen3-Embedding: ``pooling_mode_lasttoken``),
and a ``Normalize`` module (L2). A worker of such a model runs an `Embedder`
in place of the generating `Engine`, with the same surface for the worker's
loop (`submit`, `cancel`, `step`, `busy`, ...). The model is mlx-lm's own class
for its ``model_type``, loaded without its head (Qwen3-Embedding ships none)
and run to its last hidden states: ``model.model(ids)``, the final norm
included. Inputs arrive as token ids, tokenized by the orchestrator.

::

    submit(Embed) -> ids checked -> one item per input, queued in its length bucket
    cancel(id)                          |
                                        v
    step(): the oldest item, its bucket (powers of two) and, while padding stays
            bounded, neighbouring buckets, from any request, within
            `embed_batch_tokens` padded tokens (`embed_batch.Batcher`); one
            forward pass; each row pooled, cut to its request's `dimensions`,
            L2-normalised -> a request whose every row is in: listener.embedded()

Inputs are padded on the right. Attention is causal, so a real token never
attends to the padding after it, and every row's positions start at 0: a
row's hidden states are those it has alone, and pooling reads real positions
only (the last real token, the mean over real tokens, or the first). So no
padding mask is needed and none is built; `tests/test_embeddings.py` checks
that an input's vector is the same alone and beside longer ones. An input
longer than `prefill_step_size` runs alone, in chunks through mlx-lm's KV
cache, as a prompt is prefilled.

Written by hand, since mlx-lm has no embedding path and `mlx-embeddings` is
not used (docs/models.md#embeddings says why): the loading of a headless
checkpoint into mlx-lm's class, the pooling and the batching (`embed_batch`).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from ..ipc.protocol import Capabilities, Embed, EngineOptions, EngineReport, MemoryReport, Stats
from .embed_batch import MAX_WASTE_CPU, MAX_WASTE_GPU, Batcher, Item
from .engine import BatchStepError, ModelKindError, resolve_model_path
from .limits import out_of_memory, relieve
from .prompt import DEFAULT_CONTEXT_LENGTH, PromptTooLongError

#: sentence-transformers' pooling modes that are served, and their names in `Capabilities.embedding`.
POOLING_MODES = {"lasttoken": "last", "mean_tokens": "mean", "cls_token": "cls"}
#: Smallest norm a vector is divided by (an all-zero vector stays zero).
NORM_EPS = 1e-12


@dataclass(frozen=True)
class EmbeddingSpec:
    """How a model embeds: its pooling ("last", "mean", "cls") and whether vectors are L2-normalised."""

    pooling: str
    normalize: bool


def embedding_spec(path: str | Path) -> EmbeddingSpec | None:
    """How the model directory says it embeds (sentence-transformers' ``modules.json``), or None for a
    generative model; `ValueError` for a pooling mode that is not served."""
    root = Path(path)
    try:
        modules = json.loads((root / "modules.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    kinds = {str(m.get("type", "")).rsplit(".", 1)[-1]: m for m in modules if isinstance(m, dict)}
    pooling = kinds.get("Pooling")
    if pooling is None:
        return None
    config = json.loads((root / str(pooling.get("path", "")) / "config.json").read_text(encoding="utf-8"))
    modes = [k.removeprefix("pooling_mode_") for k, on in config.items()
             if k.startswith("pooling_mode_") and on is True]
    if len(modes) != 1 or modes[0] not in POOLING_MODES:
        raise ValueError(f"{root}: pooling {modes} is not served; mlxrt pools by one of "
                         f"{sorted(POOLING_MODES)} (sentence-transformers' pooling_mode_* names)")
    return EmbeddingSpec(POOLING_MODES[modes[0]], normalize="Normalize" in kinds)


def local_model_path(model: str) -> str:
    """The local directory of `model`: a synthetic one made, a Hugging Face id downloaded as mlx-lm
    downloads it for `load`; a local directory as is."""
    path = resolve_model_path(model)
    if Path(path).is_dir():
        return path
    from mlx_lm.utils import _download  # what mlx_lm.load fetches, so a later load finds it all

    return str(_download(path))


def load_backbone(path: str) -> tuple[Any, dict[str, Any]]:
    """mlx-lm's model for `path`, without its head, and its config.

    Qwen3-Embedding ships a bare backbone (``embed_tokens``, ``layers``,
    ``norm``, no ``model.`` prefix, no head even where the config says
    untied); a converted one may have the prefix. Both load strictly, and
    quantised checkpoints as mlx-lm loads them (`mlx_lm.utils.load_model`).
    """
    from mlx_lm.utils import load_model

    model, config = load_model(Path(path), get_model_classes=_headless_classes)
    if not hasattr(model, "model"):
        raise ValueError(f"{path}: mlx-lm's {config.get('model_type')!r} model has no `.model` backbone "
                         "to take hidden states from")
    return model, config


def _headless_classes(config: dict[str, Any]) -> tuple[type, type]:
    """mlx-lm's classes for `config`, the model's head removed and its weight names given the backbone's
    ``model.`` prefix where they lack it."""
    from mlx_lm.utils import _get_classes

    try:
        model_class, args_class = _get_classes(config)
    except ValueError as exc:  # "Model type bert not supported."
        raise ValueError(f"{exc} Encoder embedding models (BERT family) are not served: only decoder "
                         "models mlx-lm can load (docs/models.md#embeddings)") from exc

    class Headless(model_class):  # type: ignore[misc, valid-type]
        def __init__(self, args: Any) -> None:
            super().__init__(args)
            if "lm_head" in self:
                del self["lm_head"]

        def sanitize(self, weights: dict[str, Any]) -> dict[str, Any]:
            weights = {k if k.startswith("model.") else f"model.{k}": v
                       for k, v in weights.items() if not k.startswith("lm_head.")}
            return super().sanitize(weights)

    return Headless, args_class


@dataclass(eq=False)
class _Request:
    """One Embed request in the worker: where its rows go and how far it got."""

    req: Embed
    listener: Any
    dim: int
    out: np.ndarray  # (inputs, dim) float32, filled row by row
    left: int
    queued_at: float
    tokens: int
    started_at: float = 0.0
    passes: int = 0
    rows: int = 0  # the sizes of those passes, summed


class Embedder:
    """One loaded embedding model serving many requests, their inputs batched; every method runs on
    one thread (the worker's MLX thread)."""

    def __init__(self, path: str, spec: EmbeddingSpec, *, cache_limit_bytes: int | None = None,
                 options: EngineOptions | None = None, max_waste: float | None = None) -> None:
        """`max_waste`: the padding a pass may carry when length buckets merge (`embed_batch`);
        None: the device's (MAX_WASTE_GPU on a GPU, MAX_WASTE_CPU on a CPU)."""
        t0 = time.perf_counter()
        if cache_limit_bytes is not None:
            mx.set_cache_limit(cache_limit_bytes)
        self.options = (options or EngineOptions()).validate()
        generating = ("draft_model", "adapter_path", "chat_template", "kv_bits", "max_kv_size",
                      "context_length", "prompt_cache_file")
        unsupported = [n for n in generating if getattr(self.options, n) is not None]
        if unsupported:  # refused rather than ignored: the vectors would not be what was asked for
            raise ValueError(f"{', '.join(unsupported)}: not supported for an embedding model")
        self.path = path
        self.spec = spec
        self.model, config = load_backbone(path)
        text = {**config.get("text_config", {}), **config}
        self.context_length = int(text.get("max_position_embeddings") or DEFAULT_CONTEXT_LENGTH)
        self.model_context = self.context_length  # what Ready reports (no per-model context option here)
        self.vocab_size = int(text.get("vocab_size") or 0)
        self.dim = int(text["hidden_size"])
        self.capabilities = Capabilities(embedding=spec.pooling, embedding_dim=self.dim)
        #: No generation here, so no grammar is compiled for this worker's requests.
        self.grammars = None
        if max_waste is None:
            max_waste = MAX_WASTE_GPU if mx.default_device() == mx.gpu else MAX_WASTE_CPU
        self._waiting = Batcher(self.options.embed_batch_tokens, max_waste=max_waste,
                                max_row=self.options.prefill_step_size)
        self._requests: dict[int, _Request] = {}
        #: Forward passes run and the inputs they carried (for tests and reports).
        self.passes = 0
        self.rows = 0
        self.load_s = time.perf_counter() - t0
        self.warmup_s = 0.0

    # -- the worker loop's surface ---------------------------------------------
    @property
    def busy(self) -> bool:
        """Whether any input waits for a forward pass."""
        return bool(self._waiting)

    def submit(self, req: Any, listener: Any, *, queued_at: float | None = None) -> None:
        """Check `req` and queue its inputs; a bad request (or a generation) fails at once, alone."""
        try:
            if not isinstance(req, Embed):
                raise ModelKindError(f"model {self.path} is an embedding model: it cannot generate "
                                     "(ask it for embeddings)")
            request = self._request(req, listener, queued_at or time.perf_counter())
        except Exception as exc:
            listener.failed(req.id, exc)
            return
        self._requests[req.id] = request
        for row, ids in enumerate(req.inputs):
            self._waiting.add(request, row, ids)

    def cancel(self, req_id: int) -> bool:
        """End `req_id` as cancelled; False if it is not here."""
        request = self._requests.pop(req_id, None)
        if request is None:
            return False
        self._waiting.drop(request)
        request.listener.done(req_id, self._stats(request, "cancelled"), "")
        return True

    def cancel_all(self) -> None:
        for req_id in list(self._requests):
            self.cancel(req_id)

    def close(self) -> None:
        """The worker is stopping: an embedding model keeps nothing to write."""

    def step(self) -> None:
        """One forward pass over the next batch of inputs; requests it completes are answered."""
        batch, width = self._waiting.next()
        if not batch:
            return
        requests = list({id(i.request): i.request for i in batch}.values())
        now = time.perf_counter()
        for r in requests:
            r.passes += 1
            r.rows += len(batch)
            if not r.started_at:
                r.started_at = now
                r.listener.started(r.req.id)
        try:
            pooled = self.forward([i.ids for i in batch], width)
        except Exception as exc:
            self._fail(requests, exc)
            return
        self.passes += 1
        self.rows += len(batch)
        for item, vector in zip(batch, pooled, strict=True):
            self._store(item, vector)

    def report(self) -> EngineReport:
        """Requests waiting for their first pass, and those under way (safe from another thread)."""
        requests = list(self._requests.values())
        started = sum(1 for r in requests if r.started_at)
        return EngineReport(queued=len(requests) - started, batch_size=started)

    def memory(self) -> MemoryReport:
        import psutil

        return MemoryReport(active_bytes=int(mx.get_active_memory()), peak_bytes=int(mx.get_peak_memory()),
                            cache_bytes=int(mx.get_cache_memory()),
                            rss_bytes=int(psutil.Process().memory_info().rss))

    def clear_cache(self) -> None:
        mx.clear_cache()

    def warmup(self, tokens: int) -> None:
        """Run one input alone and four together before the first request (kernels, buffers)."""
        if tokens <= 0:
            return
        t0 = time.perf_counter()
        ids = [t % max(self.vocab_size, 1) for t in range(1, 9)]
        box = _Collect()
        self.submit(Embed(id=-1, inputs=[ids]), box)
        self.submit(Embed(id=-2, inputs=[ids[: i + 1] for i in range(4)]), box)
        while self.busy:
            self.step()
        if box.error is not None:
            raise box.error
        self.warmup_s = time.perf_counter() - t0

    # -- the model ---------------------------------------------------------------
    def forward(self, rows: list[list[int]], width: int = 0) -> np.ndarray:
        """The pooled last hidden states of `rows` (float32, one per row, not normalised): one pass,
        the rows right-padded to `width` tokens (at least the longest); a single row longer than
        `prefill_step_size` in chunks."""
        step = self.options.prefill_step_size
        if len(rows) == 1 and len(rows[0]) > step:
            return self._chunked(rows[0], step)
        lengths = [len(r) for r in rows]
        width = max(width, *lengths)
        x = mx.array([r + [0] * (width - len(r)) for r in rows], dtype=mx.int32)  # pads are never read
        hidden = self.model.model(x)
        n = mx.array(lengths)
        if self.spec.pooling == "last":
            pooled = hidden[mx.arange(len(rows)), n - 1]
        elif self.spec.pooling == "cls":
            pooled = hidden[:, 0]
        else:  # summed in float32: a bfloat16 sum over many tokens loses digits
            real = (mx.arange(width)[None, :] < n[:, None])[..., None]
            pooled = (hidden.astype(mx.float32) * real).sum(axis=1) / n[:, None]
        return np.array(pooled.astype(mx.float32))

    def _chunked(self, ids: list[int], step: int) -> np.ndarray:
        """One long input through mlx-lm's KV cache, `step` tokens at a time."""
        from mlx_lm.models.cache import make_prompt_cache

        cache = make_prompt_cache(self.model)
        total = first = last = None
        for start in range(0, len(ids), step):
            hidden = self.model.model(mx.array([ids[start : start + step]]), cache=cache).astype(mx.float32)
            first = hidden[:, 0] if first is None else first
            last = hidden[:, -1]
            if self.spec.pooling == "mean":
                part = hidden.sum(axis=1)
                total = part if total is None else total + part
            mx.eval(first, last, total, [c.state for c in cache])
        pooled = {"last": last, "cls": first}.get(self.spec.pooling)
        return np.array(pooled if pooled is not None else total / len(ids))

    # -- requests ------------------------------------------------------------------
    def _request(self, req: Embed, listener: Any, queued_at: float) -> _Request:
        if not req.inputs:
            raise ValueError("invalid input: no inputs to embed")
        for i, ids in enumerate(req.inputs):
            if not ids:
                raise ValueError(f"invalid input[{i}]: empty")
            if len(ids) > self.context_length:
                raise PromptTooLongError(f"input[{i}] has {len(ids)} tokens; the model's context is "
                                         f"{self.context_length} tokens (max_position_embeddings)")
            bad = [t for t in ids if not 0 <= t < self.vocab_size] if self.vocab_size else []
            if bad:
                raise ValueError(f"invalid input[{i}]: token ids outside [0, {self.vocab_size}): {bad[:5]}")
        if not 0 <= req.dimensions <= self.dim:
            raise ValueError(f"invalid dimensions={req.dimensions}: must be in [1, {self.dim}]")
        dim = req.dimensions or self.dim
        n = len(req.inputs)
        return _Request(req, listener, dim, np.empty((n, dim), "<f4"), n, queued_at,
                        tokens=sum(len(ids) for ids in req.inputs))

    def _store(self, item: Item, vector: np.ndarray) -> None:
        """Keep one row, cut and normalised; answer its request when it was the last."""
        r = item.request
        if self._requests.get(r.req.id) is not r:
            return  # failed or cancelled meanwhile
        v = vector[: r.dim]
        if self.spec.normalize:
            v = v / max(float(np.linalg.norm(v)), NORM_EPS)
        r.out[item.row] = v
        r.left -= 1
        if r.left == 0:
            del self._requests[r.req.id]
            r.listener.embedded(r.req.id, r.dim, r.out.tobytes(), self._stats(r, "stop"))

    def _fail(self, requests: list[_Request], exc: Exception) -> None:
        """A forward pass raised: fail the requests it carried (the others go on)."""
        error = BatchStepError(f"embedding pass failed: {exc!r}")
        error.__cause__ = exc
        for r in requests:
            if self._requests.pop(r.req.id, None) is not None:
                self._waiting.drop(r)
                r.listener.failed(r.req.id, error)
        if out_of_memory(exc):
            relieve(exc, self.clear_cache, kept_bytes=0, knobs="--embed-batch-tokens",
                    what="the pass's requests failed; MLX's cached buffers were dropped")

    def _stats(self, r: _Request, reason: str) -> Stats:
        now = time.perf_counter()
        start = r.started_at or now
        elapsed = now - start
        return Stats(
            prompt_tokens=r.tokens,
            prompt_tps=r.tokens / elapsed if elapsed > 0 else 0.0,
            ttft_ms=elapsed * 1e3,
            queue_ms=(start - r.queued_at) * 1e3,
            peak_memory_bytes=int(mx.get_peak_memory()),
            finish_reason=reason,
            mean_batch_size=r.rows / r.passes if r.passes else 0.0,
        )


class _Collect:
    """A listener that keeps what it is sent: warm-up requests, and in-process use."""

    def __init__(self) -> None:
        self.error: BaseException | None = None
        self.results: dict[int, np.ndarray] = {}
        self.stats: dict[int, Stats] = {}

    def started(self, req_id: int) -> None:
        pass

    def embedded(self, req_id: int, dim: int, data: bytes, stats: Stats) -> None:
        self.results[req_id] = np.frombuffer(data, "<f4").reshape(-1, dim)
        self.stats[req_id] = stats

    def done(self, req_id: int, stats: Stats, text: str, reasoning: str = "", calls=None) -> None:
        self.stats[req_id] = stats

    def failed(self, req_id: int, exc: BaseException) -> None:
        self.error = self.error or exc
