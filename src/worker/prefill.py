"""The engine's prefill scheduler: which prompt is prefilled next, and how many of its tokens.

mlx-lm's `BatchGenerator` prefills every prompt in its prompt batch together, `prefill_step_size`
tokens a row per step, padded to the longest row: on a CPU one 2048-token chunk of a long prompt
stops every decoding stream for seconds, and a short prompt that arrives behind it is padded to it
and waits as long. Here each admitted prompt is prefilled on a cache of its own, outside the batch,
one chunk at a time, and joins the batch at its last token (as a lone sequence is handed over):

- **A time budget per step, not a token count.** Between two decode steps the prefill runs for
  about `prefill_budget_ms`; `ChunkSizer` measures the tokens per millisecond of the last chunks on
  this machine and sizes the next chunk to the budget left, in multiples of `CHUNK_MULTIPLE`, within
  [`MIN_CHUNK_TOKENS`, `prefill_step_size`]. Every running sequence decodes one token between two
  steps' prefills.
- **Shortest remaining prefill first** (`pick`): a short prompt is prefilled ahead of the remaining
  chunks of a long one; a prompt passed over `MAX_SKIPS` chunks in a row goes next, so neither a
  flood of short prompts starves a long one nor a stream of long ones a short one, and long prompts
  take turns.

A chunk never crosses a segment boundary (`engine._segments`), so the engine keeps its checkpoints
(system prompt, end of prompt) and releases forked choices exactly where the batch would.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import mlx.core as mx

from .sequence import Sequence

#: The smallest chunk the budget may ask for: below it, per-call overheads outweigh the work.
MIN_CHUNK_TOKENS = 32
#: Budget-sized chunks are a multiple of this many tokens: a few shapes rather than one per size (a GPU
#: backend compiles kernels per shape; the matmuls' row tiles are 16-64 rows).
CHUNK_MULTIPLE = 64
#: Chunks a waiting prompt may be passed over in a row before it goes next (the age bound).
MAX_SKIPS = 8
#: Weight of the newest chunk in the measured rate (an exponential moving average).
RATE_WEIGHT = 0.5


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

    @property
    def remaining(self) -> int:
        """Prompt tokens still to prefill, the last one (the first decode step's input) left out."""
        return sum(len(s) for s in self.segments) - 1

    @property
    def ready(self) -> bool:
        """Whether only the prompt's last token is left: it joins the batch."""
        return len(self.segments) == 1 and len(self.segments[0]) == 1


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


def passed_over(prefills: list[Prefill], chosen: Prefill, seconds: float) -> None:
    """`chosen` ran a chunk of `seconds`: every other prompt waited that long behind it."""
    chosen.skipped = 0
    for p in prefills:
        if p is not chosen:
            p.skipped += 1
            p.seq.prefill_wait_s += seconds


class ChunkSizer:
    """Prompt tokens per chunk so that a step's prefill takes about `budget_ms` on this machine.

    The rate is measured on the chunks themselves (tokens per ms, a moving average), so the size
    follows the model, the machine, its load and the depth of the cache, with no figure tuned for
    one of them. `budget_ms` 0: every chunk is `ceiling` tokens.
    """

    def __init__(self, budget_ms: float, ceiling: int, floor: int = MIN_CHUNK_TOKENS) -> None:
        self.budget_ms = budget_ms
        self.ceiling = ceiling
        self.floor = min(floor, ceiling)
        #: Tokens per ms measured so far; None until a chunk has been timed.
        self.rate: float | None = None

    def size(self, spent_ms: float = 0.0) -> int:
        """Tokens for the next chunk, `spent_ms` of this step's budget already used."""
        if self.budget_ms <= 0:
            return self.ceiling
        if self.rate is None:
            return self.floor
        want = int(self.rate * (self.budget_ms - spent_ms))
        return max(self.floor, min(self.ceiling, want - want % CHUNK_MULTIPLE))

    def record(self, tokens: int, seconds: float) -> None:
        """A chunk of `tokens` took `seconds` (its results evaluated)."""
        if tokens <= 0 or seconds <= 0:
            return
        rate = tokens / (seconds * 1e3)
        self.rate = rate if self.rate is None else RATE_WEIGHT * rate + (1 - RATE_WEIGHT) * self.rate


def run_chunk(model, p: Prefill, size: int, stream) -> tuple[int, float, bool]:
    """Prefill up to `size` tokens of `p`'s current segment; (tokens, seconds, whether the segment
    ended there). The cache is evaluated, so the seconds are the chunk's."""
    seg = p.segments[0]
    chunk, p.segments[0] = seg[:size], seg[size:]
    t0 = time.perf_counter()
    with mx.stream(stream):
        model(mx.array(chunk)[None], cache=p.cache)
        mx.eval([c.state for c in p.cache])
    seconds = time.perf_counter() - t0
    mx.clear_cache()
    p.tokens += chunk
    p.seq.prefill_s += seconds
    ended = not p.segments[0]
    if ended:
        p.segments.pop(0)
    return len(chunk), seconds, ended
