"""Embeddings, the orchestrator's side: inputs checked and tokenized here, vectors from a worker.

::

    rt.embed(inputs) -> `embed_inputs`: a str, a list of str, a list of token ids or of id lists
                     -> `prepare`: texts tokenized here (`InputTokenizer`: the model's
                        tokenizer.json, from the directory its worker reported in `Ready.path`),
                        each input checked against the model's context (cut with `truncate`,
                        else refused), `dimensions` against its vector size
                     -> Embed frame -> a worker of the model (src/worker/embed.py)
                     -> Embeddings frame: float32 rows -> a numpy array

Unlike prompts, inputs are tokenized in the orchestrator: so an input over
the model's context is refused (or cut) before any worker sees it, and the
token counts are known at the edge. A worker's answer is awaited at most
`Timeouts.token_s` (MLXRT_TOKEN_TIMEOUT_S); past that, or if the caller goes
away, the request is cancelled in the worker.
"""

from __future__ import annotations

import asyncio
import functools
import queue
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..ipc.protocol import Done, Embed, Embeddings, Failed, InvalidField, Ready, Stats
from .errors import MlxrtError, MlxrtTimeout, RequestError

if TYPE_CHECKING:
    import numpy as np

    from .pool import Pool

#: Most inputs in one request (OpenAI's limit).
MAX_INPUTS = 2048
#: Inputs and their text tokenized on a thread beyond this many characters (the event loop goes on).
INLINE_TEXT_CHARS = 4096

Inputs = str | Sequence[str] | Sequence[int] | Sequence[Sequence[int]]


def _is_id(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def embed_inputs(inputs: Any) -> tuple[list[str | list[int]], bool]:
    """The inputs as a list (each a non-empty str or list of token ids >= 0), and whether a single
    bare input was given (its vector comes back alone, 1-D). `ValueError` names the bad item."""
    if isinstance(inputs, str) or (isinstance(inputs, Sequence) and inputs and all(map(_is_id, inputs))):
        items, single = [inputs], True
    elif isinstance(inputs, Sequence) and not isinstance(inputs, (bytes, bytearray)):
        items, single = list(inputs), False
    else:
        raise InvalidField("input", f"={inputs!r:.60}: a string, list of strings, list of token ids or "
                                    "list of token-id lists")
    if not items:
        raise InvalidField("input", ": an empty list; give at least one input")
    if len(items) > MAX_INPUTS:
        raise InvalidField("input", f": {len(items)} inputs; at most {MAX_INPUTS} per request")
    out: list[str | list[int]] = []
    for i, item in enumerate(items):
        name = "input" if single else f"input[{i}]"
        if isinstance(item, str):
            if not item:
                raise InvalidField(name, ": an empty string")
            out.append(item)
        elif isinstance(item, Sequence) and item and all(map(_is_id, item)):
            if min(item) < 0:
                raise InvalidField(name, ": token ids must be >= 0")
            out.append(list(item))
        else:
            raise InvalidField(name, f"={item!r:.60}: a non-empty string or list of token ids")
    return out, single


class InputTokenizer:
    """A model's ``tokenizer.json``, read with the `tokenizers` library, encoding as the model's own
    tokenizer does (its special tokens added: Qwen3-Embedding appends the EOS it pools)."""

    def __init__(self, directory: str) -> None:
        from tokenizers import Tokenizer

        path = Path(directory) / "tokenizer.json"
        if not path.is_file():
            raise InvalidField("input", f": the model at {directory} has no tokenizer.json to tokenize "
                                        "text with; send token ids")
        self._tok = Tokenizer.from_file(str(path))
        self._tok.no_truncation()
        self._tok.no_padding()

    def encode(self, texts: list[str], limit: int, *, truncate: bool) -> list[list[int]]:
        """Token ids of each text; over `limit` tokens, cut to it (keeping the special tokens that
        begin and end it) when `truncate`, else left whole for the caller to refuse."""
        out = []
        for enc in self._tok.encode_batch(texts):
            ids = enc.ids
            if truncate and len(ids) > limit:
                mask = enc.special_tokens_mask
                head = next((i for i, m in enumerate(mask) if not m), len(ids))
                tail = next((i for i, m in enumerate(reversed(mask)) if not m), 0)
                end = len(ids) - tail
                ids = (ids[:head] + ids[head:end][: max(limit - head - tail, 0)] + ids[end:])[:limit]
            out.append(ids)
        return out


@functools.lru_cache(maxsize=8)
def input_tokenizer(directory: str) -> InputTokenizer:
    """The tokenizer of the model in `directory`, read once per process."""
    return InputTokenizer(directory)


class ContextLengthError(InvalidField):
    """An input is longer than the model's context (and was not to be cut)."""


@dataclass(frozen=True)
class Prepared:
    """A checked request: the frame to send, and what the caller is told beside the vectors."""

    req: Embed
    single: bool
    tokens: int  #: the inputs' tokens, summed (OpenAI's usage.prompt_tokens)


def prepare(req_id: int, inputs: Any, ready: Ready | None, name: str, *, dimensions: int | None = None,
            truncate: bool = False) -> Prepared:
    """Check `inputs` and `dimensions` against the model `ready` describes and tokenize its texts;
    `ValueError` naming the field (``input[2]``, ``dimensions``, ``model``) when they do not fit."""
    caps = ready.capabilities if ready is not None else None
    if ready is None or caps is None or not caps.embedding:
        raise InvalidField("model", f": {name!r} is not an embedding model" if ready is not None else
                           f": no worker of {name!r} has been ready yet, so whether it embeds is unknown")
    if dimensions is not None and (not _is_id(dimensions) or not 1 <= dimensions <= caps.embedding_dim):
        raise InvalidField("dimensions", f"={dimensions!r}: must be in [1, {caps.embedding_dim}] "
                                         f"(model {name!r} makes vectors of {caps.embedding_dim})")
    items, single = embed_inputs(inputs)
    limit = ready.context_length
    texts = [(i, x) for i, x in enumerate(items) if isinstance(x, str)]
    if texts:
        encoded = input_tokenizer(ready.path).encode([t for _, t in texts], limit, truncate=truncate)
        for (i, _), ids in zip(texts, encoded, strict=True):
            items[i] = ids
    rows: list[list[int]] = []
    for i, ids in enumerate(items):
        assert isinstance(ids, list)
        if truncate:
            ids = ids[:limit]
        if len(ids) > limit:
            field = "input" if single else f"input[{i}]"
            raise ContextLengthError(field, f": {len(ids)} tokens; the model's context is {limit} "
                                            "tokens (max_position_embeddings)")
        if ready.vocab_size and max(ids) >= ready.vocab_size:
            field = "input" if single else f"input[{i}]"
            bad = [t for t in ids if t >= ready.vocab_size][:5]
            raise InvalidField(field, f": token ids outside the model's vocabulary "
                                      f"[0, {ready.vocab_size}): {bad}")
        rows.append(ids)
    embed = Embed(id=req_id, inputs=rows, dimensions=dimensions or 0)
    return Prepared(embed, single, sum(len(r) for r in rows))


def needs_thread(inputs: Any) -> bool:
    """Whether tokenizing `inputs` is worth a thread hop (a long text, or many)."""
    if isinstance(inputs, str):
        return len(inputs) > INLINE_TEXT_CHARS
    texts = [x for x in inputs if isinstance(x, str)] if isinstance(inputs, Sequence) else []
    return sum(len(t) for t in texts) > INLINE_TEXT_CHARS


@dataclass(frozen=True)
class EmbedResult:
    """A finished embedding request."""

    #: float32, one row per input; a single vector (1-D) for a single bare input.
    vectors: np.ndarray
    #: The inputs' tokens, summed (OpenAI's usage.prompt_tokens, Ollama's prompt_eval_count).
    prompt_tokens: int
    #: The worker's figures: ``ttft_ms`` from the request's first forward pass to its last,
    #: ``queue_ms`` before it, ``mean_batch_size`` inputs per pass.
    stats: Stats


def result(event: object, prepared: Prepared) -> EmbedResult:
    """The vectors in a worker's answer; the runtime's error when the request failed."""
    if isinstance(event, Embeddings):
        import numpy as np  # here, so that importing mlxrt does not import numpy

        # A bytearray, so the array is writable without a copy.
        array = np.frombuffer(event.data, dtype="<f4").reshape(len(prepared.req.inputs), event.dim)
        return EmbedResult(array[0] if prepared.single else array, prepared.tokens, event.stats)
    if isinstance(event, Failed):
        raise RequestError(event.error_type, event.message, event.traceback, kind=event.kind,
                           field=event.field)
    if isinstance(event, Done):  # only a cancelled request ends with Done
        raise MlxrtError(f"embedding request {prepared.req.id} was cancelled")
    if isinstance(event, BaseException):
        raise event
    raise MlxrtError(f"unexpected event {event!r}")


def _timeout(pool: Pool, slot, req_id: int) -> MlxrtTimeout:
    slot.cancel(req_id, discard=True)
    return MlxrtTimeout(f"embedding request {req_id} got nothing from worker {slot.name} within "
                        f"{pool.timeouts.token_s:g} s (set MLXRT_TOKEN_TIMEOUT_S)")


def run(pool: Pool, model: str | None, prepared: Prepared, keep_alive_s: float | None) -> EmbedResult:
    """Send `prepared` to a worker of `model` and wait for its vectors (this thread blocks)."""
    events: queue.SimpleQueue = queue.SimpleQueue()
    slot = pool.submit(model, prepared.req, events.put, keep_alive_s)
    try:
        event = events.get(timeout=pool.timeouts.token_s)
    except queue.Empty:
        raise _timeout(pool, slot, prepared.req.id) from None
    except BaseException:  # e.g. KeyboardInterrupt: the worker need not finish it
        slot.cancel(prepared.req.id, discard=True)
        raise
    return result(event, prepared)


async def run_async(pool: Pool, model: str | None, prepared: Prepared,
                    keep_alive_s: float | None) -> EmbedResult:
    """`run` for asyncio: the worker's answer is awaited; a cancelled caller cancels the request."""
    loop = asyncio.get_running_loop()
    answer: asyncio.Future = loop.create_future()

    def settle(event: object) -> None:
        if not answer.done():
            answer.set_result(event)

    def sink(event: object) -> None:
        try:
            loop.call_soon_threadsafe(settle, event)
        except RuntimeError:  # the loop is closed: nobody is waiting any more
            pass

    slot = pool.submit(model, prepared.req, sink, keep_alive_s)
    try:
        event = await asyncio.wait_for(answer, pool.timeouts.token_s)
    except asyncio.TimeoutError:
        raise _timeout(pool, slot, prepared.req.id) from None
    except BaseException:  # cancelled: the client went away
        slot.cancel(prepared.req.id, discard=True)
        raise
    return result(event, prepared)
