"""The engine's prefill scheduler: which prompt is prefilled next, and how many of its tokens.

mlx-lm's `BatchGenerator` prefills every prompt in its prompt batch together, `prefill_step_size`
tokens a row per step, padded to the longest row: on a CPU one 2048-token chunk of a long prompt
stops every decoding stream for seconds, and a short prompt that arrives behind it is padded to it
and waits as long. Here each admitted prompt is prefilled on a cache of its own, outside the batch,
one chunk at a time, and joins the batch at its last token (as a lone sequence is handed over):

- **A time budget per step, not a token count.** Between two decode steps the prefill runs for
  about `prefill_budget_ms`; `ChunkSizer` measures the tokens per millisecond of the last chunks on
  this machine and sizes the next chunk to the budget left, in multiples of `CHUNK_MULTIPLE`, within
  [`MIN_CHUNK_TOKENS`, `prefill_step_size`]. Every running sequence decodes a token between two
  steps' prefills (two where a prompt joined the batch: its first token comes in that step).
- **Shortest remaining prefill first** (`pick`): a short prompt is prefilled ahead of the remaining
  chunks of a long one; a prompt passed over `MAX_SKIPS` chunks in a row goes next, so neither a
  flood of short prompts starves a long one nor a stream of long ones a short one, and long prompts
  take turns.
- **Short prompts together** (`batch_rows`, `run_rows`): where the prompt chosen next fits the chunk
  whole, the shortest others that fit beside it (padding counted, at most `prompt_concurrency`) join
  it in one call, right-padded as mlx-lm's `BatchGenerator` prefills a burst, each on its own cache
  again after. On CUDA a call keeps to few shapes: rows a power of two, padded to a multiple of
  `CHUNK_MULTIPLE` tokens.
- **On CUDA, a step's last chunk beside the decode** (`_overlaps`): where it ends inside its segment,
  it runs on an MLX stream of its own while the batch decodes, and is waited for at the step's end.

A chunk never crosses a segment boundary (`prompt_segments`), so the engine keeps its checkpoints
(system prompt, end of prompt) and releases forked choices exactly where the batch would.

`PrefillScheduler`, a base class of `Engine` (as `prompt.PromptBuilder` is), holds the engine's side:
an admitted sequence's way into the batch (`_insert`), directly or through the scheduler's chunks
(`_prefill_step`), and what happens at its prompt's boundaries (checkpoints, forked choices, the
system prompts others wait for).
"""

from __future__ import annotations

import copy
import os
import time
from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import mlx.core as mx
import structlog
from mlx_lm.generate import PromptProcessingBatch
from mlx_lm.models.cache import BatchKVCache, KVCache

from ..ipc.protocol import EngineOptions
from .kvcache import full_precision, make_cache, owned
from .limits import PrefillSteps
from .prefix_cache import PrefixCache
from .sequence import BatchStepError, Sequence, reseed

if TYPE_CHECKING:
    from .solo import Solo

log = structlog.get_logger("mlxrt.worker")

#: The smallest chunk the budget may ask for: below it, per-call overheads outweigh the work.
MIN_CHUNK_TOKENS = 32
#: Budget-sized chunks are a multiple of this many tokens: a few shapes rather than one per size (a GPU
#: backend compiles kernels per shape; the matmuls' row tiles are 16-64 rows). On the grid, a batched
#: call's rows are also padded to a multiple of it (`grid_width`).
CHUNK_MULTIPLE = 64
#: Chunks a waiting prompt may be passed over in a row before it goes next (the age bound).
MAX_SKIPS = 8
#: Weight of the newest chunk in the measured rate (an exponential moving average).
RATE_WEIGHT = 0.5
#: On the grid, a rung is kept while at most this many times what the budget asks for (a rung is a
#: power of two: without a margin the chunks would flap between two rungs).
RUNG_MARGIN = 1.1
#: On the grid, what a chunk of a shape not met before costs beyond its work, ms: its attention graph's
#: build, measured at 43-56 ms for a chunk of an 8B model and 66-87 ms for a short prompt on an H200
#: (docs/benchmarks/gpu-h200-scheduler-s9.md). A prior, not measured here: the build's time and the
#: work's cannot be told apart in one call.
BUILD_MS = 50.0
#: The grid's smallest rung: below it a chunk is mostly its build and the call's overhead, and the rate
#: measured on such chunks would keep them that small (an H200 trace: 32-token chunks of ~90 ms each).
GRID_MIN_RUNG = 256
#: On the grid, a step's next call starts only while this share of the budget is left: a call's fixed
#: costs (its launches, attention over a deep cache) are not in the rate, and a small call is mostly them
#: (an H200 trace: the 423 tokens after 24,576 of an 8B prompt took 85 ms, costed 47).
SECOND_CALL_LEFT = 0.5
#: A chunk beside the decode step whose wait took at least this long was still running when the step
#: came to it (an evaluated array's wait takes microseconds).
STILL_RUNNING_S = 1e-3
#: Chunk shapes the grid remembers as met, the most recent first out of mind: as many as MLX keeps
#: attention graphs on CUDA (its `MLX_CUDA_SDPA_CACHE_SIZE`, 256 by default; the two share no state).
MAX_SHAPES = int(_size) if (_size := os.environ.get("MLX_CUDA_SDPA_CACHE_SIZE", "")).isdigit() else 256


@dataclass
class Prefill:
    """An admitted prompt being prefilled outside the batch, on a cache of its own."""

    seq: Sequence
    cache: list
    #: The prompt still to prefill, by segment; the last is the prompt's last token (the batch's).
    segments: list[list[int]]
    #: The tokens whose keys and values are in `cache`, in order.
    tokens: list[int]
    #: Chunks of other prompts run since this one's last (or since it was admitted).
    skipped: int = 0
    #: Admission order: ties go to the earlier.
    order: int = 0
    #: Whether it went in pieces: a call (here or on the fast path) ended inside a segment (`outgrown`).
    pieces: bool = False

    @property
    def remaining(self) -> int:
        """Prompt tokens still to prefill, the last one (the first decode step's input) left out."""
        return sum(len(s) for s in self.segments) - 1

    @property
    def ready(self) -> bool:
        """Whether only the prompt's last token is left: it joins the batch."""
        return len(self.segments) == 1 and len(self.segments[0]) == 1

    @property
    def kept(self) -> bool:
        """Whether the end of the current segment keeps the cache (`PrefillScheduler._boundary`): a
        checkpoint there, or the prompt's end where its other choices start from it."""
        kind, forking = next_boundary(self.seq)
        return kind is not None or forking


def outgrown(p: Prefill | Solo, ceiling: int) -> bool:
    """Whether the cache of `p` (here, or on the fast path) outgrew buffers worth handing back to MLX once
    it is in or ends: it went in pieces, more than one call's worth (`ceiling`) prefilled for it. On the
    grid they stay cached otherwise (59-73 GiB after an 8B's 25,000 tokens on an H200,
    docs/benchmarks/gpu-h200-s19.md), while a short prompt's cut at a step's end leaves little, and a
    burst's next calls reuse it."""
    return p.pieces and len(p.tokens) - p.seq.cached_tokens > ceiling


def next_boundary(seq: Sequence) -> tuple[str | None, bool]:
    """What `seq`'s next prompt boundary keeps, not taken yet: its checkpoint kind (None: none), and
    whether its other choices start there (the prompt's end)."""
    kinds = seq.checkpoint_kinds
    return (kinds[-1] if kinds else None), bool(kinds) and bool(seq.forks) and len(kinds) == 1


def split_last(segments: list[list[int]]) -> list[list[int]]:
    """Non-empty segments, the prompt's last token a segment of its own (as mlx-lm splits it)."""
    segments = [list(s) for s in segments if s]
    if len(segments[-1]) != 1:
        segments.append(segments[-1][-1:])
        segments[-2] = segments[-2][:-1]
    return segments


def pick(prefills: list[Prefill]) -> Prefill:
    """The prompt to prefill next: one passed over `MAX_SKIPS` chunks (the longest passed over first),
    else the one with the fewest tokens left (the earliest admitted among equals)."""
    overdue = [p for p in prefills if p.skipped >= MAX_SKIPS]
    if overdue:
        return max(overdue, key=lambda p: (p.skipped, -p.order))
    return min(prefills, key=lambda p: (p.remaining, p.order))


def batch_rows(prefills: list[Prefill], first: Prefill, size: int, room: int, most: int, *,
               grid: bool = False) -> list[Prefill]:
    """The prompts to prefill in one call: `first` alone unless its current segment fits in `size`
    tokens; then with up to `most` - 1 others whose current segments fit beside it, fewest tokens left
    first, `room` counting the padding (rows times the longest segment), as mlx-lm batches prompts.

    `grid` (CUDA): a call's shape is one of few, its width padded (`grid_width`, counted so in `room`
    whatever the caches: kinds other than `KVCache` are padded as mlx-lm pads them, `paddable`) and its
    rows the largest power of two of those that fit, the others left for the next call. A burst
    arrives split in ways of its own, and each (rows, width) not met before costs its graphs' builds: on
    an H200, 16 rows of 511 tokens took 164-170 ms the first time and 87 the next
    (docs/benchmarks/gpu-h200-s17.md)."""
    if first.ready or len(first.segments[0]) > size:
        return [first]
    rows, longest = [first], len(first.segments[0])
    for p in sorted(prefills, key=lambda p: (p.remaining, p.order)):
        if len(rows) >= most:
            break
        n = len(p.segments[0])
        if p is first or p.ready or (len(rows) + 1) * grid_width(max(longest, n), grid) > room:
            continue
        rows.append(p)
        longest = max(longest, n)
    return rows[: 1 << (len(rows).bit_length() - 1)] if grid else rows


def grid_width(tokens: int, grid: bool = True) -> int:
    """The width a batched call of rows up to `tokens` long is padded to: on the grid the next multiple
    of `CHUNK_MULTIPLE`, else its longest row (mlx-lm's padding)."""
    return -(-tokens // CHUNK_MULTIPLE) * CHUNK_MULTIPLE if grid else tokens


def passed_over(prefills: list[Prefill], chosen: list[Prefill], seconds: float) -> None:
    """`chosen` ran a chunk of `seconds`: every other prompt waited that long behind it."""
    for p in prefills:
        if any(p is c for c in chosen):
            p.skipped = 0
        else:
            p.skipped += 1
            p.seq.prefill_wait_s += seconds


class ChunkSizer:
    """Prompt tokens per chunk so that a step's prefill takes about `budget_ms` on this machine.

    The rate is measured on the chunks themselves (tokens per ms, a moving average), so the size
    follows the model, the machine, its load and the depth of the cache, with no figure tuned for
    one of them. `budget_ms` 0: every chunk is `ceiling` tokens.

    `grid` (MLX's CUDA backend): attention there builds a cuDNN graph for each new (query length,
    cache length) of a prefill, tens of ms each (docs/benchmarks/gpu-h200-scheduler-s9.md), so chunks
    keep to few shapes: a size is a power of two (a `rung`), and a chunk ends where the cache holds a
    multiple of it, so the cache lengths repeat from prompt to prompt (a piece under `floor` tokens up
    to the grid takes a rung with it). A chunk of a shape not met before is costed `BUILD_MS` more
    than its tokens at the rate (the rate is measured net of it, the build taken as at most half the
    chunk), so a step's chunk and its build fit the budget together: a rung is chosen for the budget
    less a build, at least `GRID_MIN_RUNG`, and kept while within `RUNG_MARGIN` of it. The rest of a
    segment that fits the budget whole (a build counted) goes in one call, off the grid: its shape is
    its own either way, and one call is cheaper than a piece and a rung. A step's next call starts only
    while `SECOND_CALL_LEFT` of the budget is left. Until anything is timed,
    chunks are the largest power of two within `ceiling`, near mlx-lm's step.
    """

    def __init__(self, budget_ms: float, ceiling: int, floor: int = MIN_CHUNK_TOKENS, *,
                 grid: bool = False) -> None:
        self.budget_ms = budget_ms
        self.ceiling = ceiling
        self.floor = min(floor, ceiling)
        self.grid = grid
        #: Tokens per ms measured so far (on the grid, net of the builds); None until a chunk is timed.
        self.rate: float | None = None
        #: The grid's current chunk size (a power of two); None until the first chunk on the grid.
        self.rung: int | None = None
        self._shapes: OrderedDict[tuple[int, int, int], None] = OrderedDict()

    def size(self, spent_ms: float = 0.0, cached: int = 0, rest: int | None = None) -> int:
        """Tokens for the next chunk, `spent_ms` of this step's budget already used, `cached` tokens in
        the prompt's cache already, `rest` tokens left in its segment (None: unknown); 0 on the grid
        when no chunk fits what is left of the budget."""
        if self.budget_ms <= 0:
            return self.ceiling
        if not self.grid:
            want = self.floor if self.rate is None else int(self.rate * (self.budget_ms - spent_ms))
            return max(self.floor, min(self.ceiling, want - want % CHUNK_MULTIPLE))
        left = self.budget_ms - spent_ms
        if not self.holds_another(spent_ms):
            return 0
        if rest is not None and rest <= self.ceiling and self.cost_ms(rest, cached) <= left:
            return rest
        rung = self._rung(self.ceiling if self.rate is None else int(self.rate * (self.budget_ms - BUILD_MS)))
        n = rung - cached % rung
        if n < self.floor and n + rung <= self.ceiling:  # a call of a few tokens is mostly overhead
            n += rung
        if spent_ms > 0 and self.cost_ms(n if rest is None else min(n, rest), cached) > left:
            return 0  # the rest of this step's budget holds no chunk on the grid
        return n

    def holds_another(self, spent_ms: float) -> bool:
        """On the grid, whether a step `spent_ms` into its budget starts another call: while
        `SECOND_CALL_LEFT` of the budget is left."""
        return self.budget_ms - spent_ms >= self.budget_ms * SECOND_CALL_LEFT

    def room(self, spent_ms: float = 0.0) -> int:
        """Padded tokens one call of several short prompts may carry in what is left of the budget: on
        the grid the budget's worth less a build (the caller takes at least a chunk's; like mlx-lm's
        prompt batches, it may pass `ceiling`, the rows being at most `prompt_concurrency`; the caller also
        keeps it within what the backend takes in one call, `PrefillSteps.call_tokens`); off it, `size`'s."""
        if not self.grid or self.rate is None or self.budget_ms <= 0:
            return self.size(spent_ms)
        return max(0, int(self.rate * (self.budget_ms - spent_ms - BUILD_MS)))

    def cost_ms(self, tokens: int, cached: int) -> float:
        """What a call of `tokens` over `cached` should take, ms: at the rate, plus a build on the grid
        for a shape not met before; inf before any chunk is timed."""
        if self.rate is None:
            return float("inf")
        new = self.grid and (1, tokens, cached + tokens) not in self._shapes
        return tokens / self.rate + (BUILD_MS if new else 0.0)

    def _rung(self, want: int) -> int:
        """The grid's chunk size for `want` tokens: the current rung while it is at most
        `RUNG_MARGIN` times `want` and its double would not fit; else the largest power of two
        within `want`; at least `GRID_MIN_RUNG` (and `floor`), at most `ceiling`."""
        top = 1 << (self.ceiling.bit_length() - 1)
        low = min(top, max(GRID_MIN_RUNG, 1 << max(0, (self.floor - 1).bit_length())))
        r = self.rung
        if r is None or r > RUNG_MARGIN * want or 2 * r <= want:
            r = 1 << max(0, max(1, want).bit_length() - 1)
        self.rung = max(low, min(top, r))
        return self.rung

    def record(self, tokens: int, seconds: float, shape: tuple[int, int, int] | None = None) -> None:
        """A chunk of `tokens` took `seconds` (its results evaluated); `shape`: (rows, tokens a row,
        cache length after), which on the grid tells a first-met shape, timed net of a build
        (`BUILD_MS`, at most half its time)."""
        if tokens <= 0 or seconds <= 0:
            return
        ms = seconds * 1e3
        if self.grid and shape is not None:
            new = shape not in self._shapes
            self._shapes[shape] = None
            self._shapes.move_to_end(shape)
            if len(self._shapes) > MAX_SHAPES:
                self._shapes.popitem(last=False)
            if new:  # its build is a guess: at most half the chunk's time
                ms = max(ms - BUILD_MS, ms / 2)
        rate = tokens / ms
        self.rate = rate if self.rate is None else RATE_WEIGHT * rate + (1 - RATE_WEIGHT) * self.rate


def run_chunk(model, p: Prefill, size: int, stream, *, keep: bool = False) -> tuple[int, float, bool]:
    """Prefill up to `size` tokens of `p`'s current segment; (tokens, seconds, whether the segment
    ended there). The cache is evaluated, so the seconds are the chunk's. MLX's freed buffers are
    handed back after, as mlx-lm does after each prompt step, unless `keep` (`release`)."""
    chunk = launch_chunk(model, p, size, stream)
    seconds = chunk.wait(keep)
    ended = not p.segments[0]
    if ended:
        p.segments.pop(0)
    return chunk.tokens, seconds, ended


@dataclass
class Launched:
    """A chunk of `p` whose work MLX was given (`launch_chunk`), not yet waited for."""

    p: Prefill
    tokens: int
    #: (rows, tokens a row, cache length after): `ChunkSizer.record`'s shape.
    shape: tuple[int, int, int]
    states: list
    started: float
    waited: float = 0.0

    def wait(self, keep: bool) -> float:
        """Wait for the chunk; its seconds since launch, counted to its prompt (`waited`: how long the
        wait itself took). `keep`: `run_chunk`'s."""
        t0 = time.perf_counter()
        mx.eval(self.states)
        self.waited = time.perf_counter() - t0
        seconds = self.waited + t0 - self.started
        release(keep)
        self.p.seq.prefill_s += seconds
        return seconds


def launch_chunk(model, p: Prefill, size: int, stream) -> Launched:
    """Give MLX the work of up to `size` tokens of `p`'s current segment on `stream` (`mx.async_eval`),
    and move them from the segment to `p.tokens`; a segment it empties stays, for the caller to pop."""
    seg = p.segments[0]
    chunk, p.segments[0] = seg[:size], seg[size:]
    started = time.perf_counter()
    with mx.stream(stream):
        model(mx.array(chunk)[None], cache=p.cache)
        states = [c.state for c in p.cache]
        mx.async_eval(states)
    p.tokens += chunk
    p.pieces = p.pieces or bool(p.segments[0])
    return Launched(p, len(chunk), (1, len(chunk), len(p.tokens)), states, started)


def run_rows(model, rows: list[Prefill], stream, width: int = 0, *, keep: bool = False) -> tuple[int, float]:
    """Prefill the current segment of every prompt in `rows` in one call, right-padded as mlx-lm's
    `PromptProcessingBatch` does (to `width` tokens where that is wider: `padded_prompt`), each prompt on
    its own cache again after (`row_caches`); (tokens, seconds). The caches are evaluated, so the seconds
    are the call's, and each row's own prefill time. `keep`: as `run_chunk`'s."""
    chunks = [p.segments.pop(0) for p in rows]
    t0 = time.perf_counter()
    with mx.stream(stream):
        batch = PromptProcessingBatch(model, list(range(len(rows))), [p.cache for p in rows],
                                      prefill_step_size=max(len(c) for c in chunks))
        padded_prompt(batch, chunks, width)
        caches = row_caches(batch, [p.ready and not p.kept for p in rows])
        mx.eval([c.state for cache in caches for c in cache])
    seconds = time.perf_counter() - t0
    release(keep)
    for p, chunk, cache in zip(rows, chunks, caches, strict=True):
        p.cache = cache
        p.tokens += chunk
        p.seq.prefill_s += seconds
    return sum(len(c) for c in chunks), seconds


def release(keep: bool) -> None:
    """After a prefill call: MLX's freed buffers handed back (`mx.clear_cache`), as mlx-lm does after
    each prompt step, so a long prompt's temporaries do not stay cached; `keep` (on the grid, CUDA):
    kept for the next calls, which a burst's calls and joins would otherwise allocate again (a long
    prompt's next chunk too), bounded by MLX's cache limit (its default, or `cache_limit_bytes`). On an
    H200, bursts of 32 streams (512-token prompts) made 1.06x the aggregate (ahead in 10 of 10 paired
    rounds) and 0.85x the TTFT of the same tree clearing after each call; of 16, within the spread
    (0.99x, TTFT 0.96x) (docs/benchmarks/gpu-h200-s17.md). A lone prompt's chunks on the fast path
    (`Solo.prefill`) keep them too, until the prompt's last: in one H200 process (8B shape, 1,024-token
    chunks at the same depths), its chunks, clearing, took a median 141-145 ms against the scheduler's
    133 ms, keeping (docs/benchmarks/gpu-h200-s18.md). A long prompt's last call in the scheduler hands
    them back after its step (`PrefillScheduler._release`; a failed call's, after its step too), or when it
    is cancelled before (`_drop`); so does a lone prompt cancelled or failed mid-prompt (`Solo.end`)."""
    if not keep:
        mx.clear_cache()


def paddable(rows: list[Prefill]) -> bool:
    """Whether a batched call of `rows` may be padded past its longest row (`padded_prompt`): every layer
    of every row a `KVCache`. Other kinds (rotating, recurrent) are padded as mlx-lm pads them."""
    return all(type(c) is KVCache for p in rows for c in p.cache)


def padded_prompt(batch: PromptProcessingBatch, chunks: list[list[int]], width: int) -> None:
    """`batch.prompt(chunks)` in one call. Where every layer is a `BatchKVCache`, every row is
    right-padded to `width` tokens (at least the longest): mlx-lm's `prompt` pads uneven rows so, to the
    longest, and `finalize` moves the padding to the left, where the attention masks it out. Other kinds
    go through mlx-lm's `prompt`, `width` aside (`paddable`). MLX's freed buffers are left to the caller
    (`release`), where mlx-lm's `prompt` hands them back after the call and again after `finalize`."""
    lengths = [len(c) for c in chunks]
    if not all(type(c) is BatchKVCache for c in batch.prompt_cache):
        batch.prompt(chunks)
        return
    width = max(width, *lengths)
    for held, chunk in zip(batch.tokens, chunks, strict=True):
        held += chunk
    for c in batch.prompt_cache:
        c.prepare(lengths=lengths, right_padding=[width - n for n in lengths])
    batch.model(mx.array([c + [0] * (width - len(c)) for c in chunks]), cache=batch.prompt_cache)
    for c in batch.prompt_cache:
        c.finalize()


def row_caches(batch: PromptProcessingBatch, views: list[bool]) -> list[list]:
    """Each row's cache after a batched call, as mlx-lm's `extract_cache` gives it, but where `views`
    says so (a row that joins the decode batch at once, its cache kept nowhere): its `KVCache` layers as
    views of the call's arrays (`CallRow`), where mlx-lm's extract copies them.

    The batch's merge copies a joining row in the next step, so a copy here would be a second one:
    16 rows x 4 layers handed on in 6.40 ms that way on a 2-core CPU, against 3.97 ms with views
    (docs/benchmarks/data/probes-s14/extract.py); where the rows of whole calls join together, the merge
    takes the calls' arrays as they are (`CallRow.merge`). A view keeps the whole call's arrays alive
    until every row has merged, within the step, so none goes where a cache is kept: a checkpoint, a
    forked choice's start (`Prefill.kept`), or a row that goes on prefilling and may wait for steps.
    """
    out: list[list] = [[] for _ in views]
    for layer in batch.prompt_cache:
        viewed = type(layer) is BatchKVCache and any(views)
        padding = layer.left_padding.tolist() if viewed else []
        for i, view in enumerate(views):
            out[i].append(CallRow(layer, i, padding[i]) if view and viewed else layer.extract(i))
    return out


class CallRow(KVCache):
    """Row `index` of a batched call's cache `call`, `padding` on its left, as a `KVCache` over views of
    its arrays (`BatchKVCache.extract` less its copy), which knows its call.

    mlx-lm's batch takes the prompts that join it together, merging their caches into one
    (`BatchKVCache.merge`): two slice updates a row and layer, each an op to build and launch, 1.2 ms a
    row on an H200's host (docs/benchmarks/gpu-h200-s13.md). Where the caches merged are every row of
    one or more calls, `merge` takes those calls' caches whole instead (`whole_calls`), as mlx-lm's own
    prefill hands its prompt batch on; anything else is merged as mlx-lm does. On an H200 a join of one
    call's 16 rows went from 37-71 ms to 28-32 (docs/benchmarks/gpu-h200-s17.md).
    """

    def __init__(self, call: BatchKVCache, index: int, padding: int) -> None:
        super().__init__()
        end = call.size()
        self.keys = call.keys[index : index + 1, :, padding:end]
        self.values = call.values[index : index + 1, :, padding:end]
        self.offset = self.keys.shape[2]
        self.call, self.index = call, index

    @classmethod
    def merge(cls, caches: list) -> BatchKVCache:
        whole = whole_calls(caches)
        return BatchKVCache.merge(caches) if whole is None else whole

    def __deepcopy__(self, memo) -> KVCache:
        """A copy holds this row alone, as a plain `KVCache`, not its call (a deep copy of a view shares
        the whole call's buffers: `mx.contiguous` copies the row's part, as mlx-lm's extract does)."""
        row = KVCache()
        row.keys, row.values, row.offset = mx.contiguous(self.keys), mx.contiguous(self.values), self.offset
        return row


def whole_calls(caches: list) -> BatchKVCache | None:
    """`caches` as one `BatchKVCache` where they are every row of one or more batched calls (`CallRow`s,
    in any order): the calls' caches as they are (each row left-padded to its call's width), joined as
    mlx-lm joins two batches (`extend`) and put in `caches`' order; None where they are anything else."""
    if not all(type(c) is CallRow for c in caches):
        return None
    calls = {id(c.call): c.call for c in caches}
    rows = {(id(c.call), c.index) for c in caches}
    if len(rows) != len(caches) or len(caches) != sum(call.offset.shape[0] for call in calls.values()):
        return None
    out, base = None, {}
    for key, call in calls.items():
        base[key] = 0 if out is None else out.offset.shape[0]
        if out is None:
            out = copy.copy(call)  # a new object over the call's arrays: `extend` and `filter` replace them
        else:
            out.extend(call)
    order = [base[id(c.call)] + c.index for c in caches]
    if order != list(range(len(order))):
        out.filter(order)
    return out


class PrefillScheduler:
    """How an admitted sequence reaches the batch: inserted with its prompt (no budget), or prefilled
    here chunk by chunk and inserted at its last token; its prompt's checkpoints on the way.

    Part of `Engine` (a base class), whose state it reads and changes: the attributes below.
    """

    model: Any
    options: EngineOptions
    prefix_cache: PrefixCache
    trimmable: bool  # every layer's cache can be trimmed: no "user" checkpoint needed
    scheduled: bool  # prompts are prefilled here in budgeted chunks (else by mlx-lm, in the batch)
    sizer: ChunkSizer
    prefill: PrefillSteps
    prefill_tokens: int
    #: Model calls the scheduler made, and the prompts prefilled in calls that carried several.
    prefill_calls: int
    prefill_batched: int
    _batch: Any  # mlx-lm's BatchGenerator
    _waiting: deque[Sequence]
    _running: dict[int, Sequence]
    _with_logprobs: set[int]
    _leaders: dict[tuple[int, ...], int]
    _prefills: list[Prefill]
    _admitted: int
    #: A long prompt's last chunk ran in this step: MLX's buffers go back once the step is over (`_end_step`).
    _release: bool = False
    #: The step's last chunk, left running beside the batch's step (`_overlaps`), waited for at its end.
    _inflight: Launched | None = None
    #: The MLX stream those chunks run on (`mx.new_stream`), made for the first.
    _side: Any = None
    #: Chunks that ran beside the batch's step.
    prefill_overlapped: int = 0

    if TYPE_CHECKING:
        def _failed(self, seq: Sequence, exc: BaseException) -> None: ...
        def _admit(self) -> None: ...

    def _insert(self, seq: Sequence) -> None:
        if seq.start is not None:  # a choice forked at the end of its leader's prompt
            (cache, n), seq.start = seq.start, None
        else:
            cache, n = self.prefix_cache.fetch(seq.ids)
        cache = full_precision(cache)  # a lone sequence's quantized cache: the batch cannot merge it
        seq.cached_tokens = n
        segments, kinds = prompt_segments(seq.ids, n, seq.system_end, trimmable=self.trimmable,
                                          fork=bool(seq.forks), turn_end=seq.turn_end)
        if self.scheduled:
            self._queue_prefill(seq, cache, segments, kinds, list(seq.ids[:n]))
            return
        (seq.uid,) = self._batch.insert_segments(
            [segments],
            max_tokens=[seq.max_tokens],
            caches=[cache] if cache is not None else None,
            all_tokens=[seq.ids[:n]],
            samplers=[seq.sampler],
            logits_processors=[seq.processors],
            stop_sequences=[seq.stop],
        )
        seq.checkpoint_kinds = kinds
        seq.admitted_at = time.perf_counter()
        self._running[seq.uid] = seq
        if seq.logprobs is not None:
            self._with_logprobs.add(seq.uid)
        if "system" in kinds:
            seq.leads = tuple(seq.ids[: seq.system_end])
            self._leaders[seq.leads] = seq.uid
        seq.listener.started(seq.req.id)
        if seq.forks and len(seq.ids) - n <= 1:  # one token to prefill, no boundary: the others start alike
            self._release_forks(seq, None)

    def _queue_prefill(self, seq: Sequence, cache: list | None, segments: list, kinds: list,
                       tokens: list[int]) -> None:
        """Admit `seq` to the prefill scheduler, on a cache of its own, with the prompt `segments`
        still to prefill after `tokens` (those in `cache`)."""
        if cache is None:
            cache = make_cache(self.model, self.options.max_kv_size)
        seq.checkpoint_kinds = kinds
        seq.admitted_at = time.perf_counter()
        self._add_prefill(seq, cache, split_last(segments), tokens)
        seq.listener.started(seq.req.id)
        if seq.forks and len(seq.ids) - seq.cached_tokens <= 1:  # as `_insert`: nothing to fork from
            self._release_forks(seq, None)

    def _add_prefill(self, seq: Sequence, cache: list, segments: list, tokens: list[int]) -> None:
        self._admitted += 1
        self._prefills.append(Prefill(seq, cache, segments, tokens, order=self._admitted))
        if "system" in seq.checkpoint_kinds:  # its system prompt is still to come: others may follow it
            seq.leads = tuple(seq.ids[: seq.system_end])
            self._leaders[seq.leads] = -1  # no batch uid yet: only its presence counts

    def _prefill_step(self) -> None:
        """Prefill for about the budget (`options.prefill_budget_ms`): chunks of the prompts `pick`
        chooses, each sized by the measured rate, short prompts that fit the chunk together in one
        call (`batch_rows`); a prompt left with its last token joins the batch."""
        self._settle()
        self._join_ready()
        spent = 0.0
        while self._prefills and spent * 1e3 < self.sizer.budget_ms:
            first = pick(self._prefills)
            size = self.sizer.size(spent * 1e3, cached=len(first.tokens), rest=len(first.segments[0]))
            if size <= 0:
                break
            room = max(size, self.sizer.room(spent * 1e3))
            if self.prefill.call_tokens is not None:  # a mixture of experts on CUDA (limits.py)
                room = min(room, self.prefill.call_tokens)  # at least `size`: a lone step is within it
            grid = self.sizer.grid
            rows = batch_rows(self._prefills, first, size, room, self.prefill.batch_prompts, grid=grid)
            # The call's attention shape: rows padded to the longest segment (on the grid, where every
            # layer is a `KVCache`, further: `grid_width`), over the longest cache.
            padded = grid and len(rows) > 1 and paddable(rows)
            widest = grid_width(max(len(p.segments[0]) for p in rows), padded)
            cached = max(len(p.tokens) for p in rows)
            try:
                if len(rows) == 1 and self._overlaps(first, size, spent):
                    if self._side is None:
                        self._side = mx.new_stream(mx.default_device())
                    self._inflight = launch_chunk(self.model, first, size, self._side)
                    break
                if len(rows) > 1:
                    n, seconds = run_rows(self.model, rows, self._batch.stream, widest, keep=grid)
                    ended = True
                else:
                    n, seconds, ended = run_chunk(self.model, rows[0], size, self._batch.stream, keep=grid)
            except Exception as exc:
                self._call_failed(rows, exc)
                continue
            if grid and any(p.ready and self._outgrown(p) for p in rows):  # back after the step, its join's
                self._release = True
            width = n if len(rows) == 1 else widest
            # A batched call's work is its rows times its width, padding included, as `room` counts it.
            self.sizer.record(len(rows) * width, seconds, (len(rows), width, cached + width))
            self._count_call(rows, n, seconds)
            spent += seconds
            leaders, waiting = len(self._leaders), len(self._waiting)
            for p in rows:
                if ended and p.segments:
                    self._boundary(p)
            if self._waiting and (len(self._leaders) < leaders or len(self._waiting) > waiting):
                # A system prompt's checkpoint is in, or a prompt's end released its other choices:
                # they start in this budget.
                self._admit()
            self._join_ready()  # the rows, and any admitted, down to their last token

    def _overlaps(self, p: Prefill, size: int, spent: float) -> bool:
        """Whether `p`'s chunk of `size` tokens, `spent` seconds into the step, runs beside the batch's
        step rather than before it: on the grid (CUDA), with a sequence decoding, the chunk ending inside
        its segment (no boundary, no join waits on it), and the budget left after it, at its expected
        cost, holding no other call (`ChunkSizer.holds_another`). The chunk goes on an MLX stream of its
        own, the batch's step on its own, and the GPU runs both at once: in issue 28's mix on an H200 a
        25,000-token prompt beside a stream took 1.08x its time alone, 1.12x one after the other
        (docs/benchmarks/gpu-h200-s20.md). On a CPU a step's work is its cores' either way; Metal was
        not tried."""
        s = self.sizer
        if not (s.grid and self._running and size < len(p.segments[0])):
            return False
        return not s.holds_another(spent * 1e3 + s.cost_ms(size, len(p.tokens)))

    def _settle(self) -> None:
        """Wait for the chunk left running beside the batch's step, and count it as the step's loop
        counts a call; a chunk that failed fails its prompt (one that ended meanwhile, a choice of a
        request failed in the batch's step, is only logged).

        Its time from launch is its prompt's and the others' wait, as a call's; the rate takes it only
        where the chunk was still running when the step came to wait (`STILL_RUNNING_S`): its time is
        then its own, with the decode step's share of the GPU, what the next chunk beside one will take.
        One that ended during the batch's step ended at a time not known."""
        chunk, self._inflight = self._inflight, None
        if chunk is None:
            return
        try:
            seconds = chunk.wait(keep=True)
        except Exception as exc:
            rows = [p for p in self._prefills if p is chunk.p]
            if rows:
                self._call_failed(rows, exc)
            else:
                log.warning("prefill.chunk_failed_after_its_end", req=chunk.p.seq.req.id, error=repr(exc))
            return
        self.prefill_overlapped += 1
        if chunk.waited >= STILL_RUNNING_S:
            self.sizer.record(chunk.tokens, seconds, chunk.shape)
        self._count_call([chunk.p], chunk.tokens, seconds)

    def _count_call(self, rows: list[Prefill], tokens: int, seconds: float) -> None:
        """A prefill call of `rows` ran, `tokens` prompt tokens in `seconds`: the scheduler's counters,
        and every other prompt waited that long (`passed_over`)."""
        self.prefill_tokens += tokens
        self.prefill_calls += 1
        self.prefill_batched += len(rows) if len(rows) > 1 else 0
        passed_over(self._prefills, rows, seconds)

    def _call_failed(self, rows: list[Prefill], exc: Exception) -> None:
        """A prefill call of `rows` raised: each of them fails, the batch goes on (after a failed call on
        the grid, MLX's buffers go back after the step)."""
        reseed()
        error = BatchStepError(f"prefill step failed: {exc!r}")
        error.__cause__ = exc
        for p in rows:
            self._prefills.remove(p)
            self._unlead(p.seq)
            self._failed(p.seq, error)
            self._release = self._release or (self.sizer.grid and self._outgrown(p))

    def _outgrown(self, p: Prefill) -> bool:
        return outgrown(p, self.sizer.ceiling)

    def _end_step(self) -> None:
        """After a step: the chunk left running beside it is waited for; where a long prompt's last chunk
        ran in it, MLX's buffers go back, its join and first token having reused them."""
        self._settle()
        if self._release:
            self._release = False
            mx.clear_cache()

    def _drop(self, p: Prefill) -> None:
        """`p` ends before it is in (cancelled): what its cache outgrew goes back at once."""
        if self.sizer.grid and self._outgrown(p):
            mx.clear_cache()
        self._prefills.remove(p)

    def _join_ready(self) -> None:
        """Every prompt left with only its last token joins the batch (`pick` must never see one)."""
        for p in [p for p in self._prefills if p.ready]:
            self._join(p)

    def _boundary(self, p: Prefill) -> None:
        """`p`'s prefill reached a segment's end: keep its checkpoint, release its forks, as the batch's
        `_checkpoint` does."""
        seq = p.seq
        if not seq.checkpoint_kinds:
            return
        kind, forking = next_boundary(seq)
        seq.checkpoint_kinds.pop()
        if forking:
            self._release_forks(seq, (p.cache, len(p.tokens)))
        if kind is not None:  # the cache goes on: the prefix cache copies it
            self.prefix_cache.insert(list(p.tokens), p.cache, kind)
        if kind == "system":
            self._unlead(seq)

    def _join(self, p: Prefill) -> None:
        """`p` is prefilled but for its last token: it joins the batch, whose next step decodes it."""
        self._prefills.remove(p)
        seq = p.seq
        try:
            (seq.uid,) = self._batch.insert_segments(
                [p.segments],
                max_tokens=[seq.max_tokens],
                caches=[p.cache],
                all_tokens=[p.tokens],
                samplers=[seq.sampler],
                logits_processors=[seq.processors],
                stop_sequences=[seq.stop],
            )
        except Exception as exc:
            self._unlead(seq)
            self._failed(seq, exc)
            return
        self._running[seq.uid] = seq
        if seq.logprobs is not None:
            self._with_logprobs.add(seq.uid)

    def _release_forks(self, seq: Sequence, start: tuple[list, int] | None) -> None:
        """`seq`'s prompt is prefilled up to its last token: its other choices start from a copy of
        that cache (`start`; None: each from the prefix cache, as `seq` did), ahead of the queue."""
        forks, seq.forks = seq.forks, []
        # Settled once (`owned`): a row taken out of a batch may hold the batch's arrays, and a choice
        # may wait for room in the batch for many steps.
        base = None if start is None else owned(start[0])
        for fork in forks:
            fork.start = None if start is None else (copy.deepcopy(base), start[1])
        self._waiting.extendleft(reversed(forks))

    def _end_forks(self, seq: Sequence) -> None:
        """`seq` ended before its prompt was prefilled (cancelled): its other choices end with it."""
        forks, seq.forks = seq.forks, []
        for fork in forks:
            fork.listener.done(fork.req.id, fork.stats("cancelled"), "")

    def _checkpoint(self, seq: Sequence) -> None:
        """Keep the cache at the prompt boundary just reached."""
        if not seq.checkpoint_kinds:
            return
        kind, forking = next_boundary(seq)
        seq.checkpoint_kinds.pop()
        if kind is None and not forking:
            return
        for cache, tokens in self._batch.extract_cache([seq.uid]).values():
            if forking:
                self._release_forks(seq, (cache, len(tokens)))
            if kind is not None:
                self.prefix_cache.insert(tokens, cache, kind)
        if kind == "system":
            self._unlead(seq)

    def _unlead(self, seq: Sequence) -> None:
        """`seq` no longer prefills a system prompt for others: its followers may start."""
        if seq.leads is not None:
            self._leaders.pop(seq.leads, None)
            seq.leads = None


def prompt_segments(ids: list[int], cached: int, system_end: int, *, trimmable: bool,
                    fork: bool = False, turn_end: int = 0) -> tuple[list, list[str | None]]:
    """The uncached prompt as segments, and the checkpoint kind at each inner boundary, last first.

    An uncached system prompt is a segment of its own, checkpointed, so that
    chats arriving beside this one start from it. mlx-lm splits the last
    token off into a segment of its own, so the end of the prompt before it
    is a boundary too: a cache that cannot be trimmed is checkpointed there
    ("user": the next turn of this chat starts with this whole prompt); a
    trimmable one needs no such checkpoint, the finished sequence's cache
    is trimmed back instead. A sequence with other choices to fork (n > 1) needs
    that boundary whatever its cache: they start from its cache there.

    `turn_end` (`Engine._turn_end`): a tail of the prompt the next turn does not repeat begins there; it
    is a segment of its own, the "user" checkpoint goes before it, and the boundary before the
    prompt's last token keeps nothing (None) unless choices fork there.
    """
    end: list[str | None] = [] if trimmable and not fork else ["user"]
    cuts = [system_end] if cached < system_end else []
    if end and max(cached, system_end) < turn_end < len(ids) - 1:
        cuts.append(turn_end)
        end = [None, "user"]
    bounds = [cached, *cuts, len(ids)]
    segments = [ids[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]
    return segments, [*end, *(["system"] if cached < system_end else [])]
