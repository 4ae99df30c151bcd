"""Which waiting embedding inputs share a forward pass: the `Embedder`'s queue, without a model.

Inputs wait in length buckets (powers of two), in arrival order. A pass is
built from the oldest waiting input, so no request waits behind a stream of
others::

    the oldest input, then the rest of its bucket (a prefix of it: arrival order)
      -> each other bucket, nearest first: as much of its prefix as the budget holds,
         taken only if the pass's padding then stays within `max_waste` of its tokens
      -> rows right-padded to `padded_width(longest)` (a pass of one row is not padded)

A pass holds at most `budget` padded tokens (`EngineOptions.embed_batch_tokens`),
bar a lone input, which runs at its own length; an input over `max_row` tokens
(`prefill_step_size`) always runs alone, and the Embedder chunks it.

Merging buckets and rounding widths to two sizes per octave keep a batch of
inputs to few passes of few shapes: on a GPU a pass is launch-bound until it
is large and MLX's CUDA backend builds kernels per new shape, while on a CPU a
pass costs its padded tokens, so padding is bounded (`max_waste`).

Written by hand: mlx-lm batches prompts for generation, not inputs of an encoder pass.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any

#: Most padding a pass may carry, as a share of its padded tokens, when buckets are merged into it: on
#: a GPU a pass is launch-bound and one more costs more than its padding (so every bucket of a batch of
#: inputs of 16-128 tokens merges into one pass, as native batching pads all to the longest); on a CPU
#: a pass costs its padded tokens, so merging stops early.
MAX_WASTE_GPU = 0.5
MAX_WASTE_CPU = 0.25
#: Narrowest padded width of a pass of several rows, in tokens.
MIN_WIDTH = 8


def bucket(n: int) -> int:
    """The length bucket of an `n`-token input: inputs of one power-of-two range queue together."""
    return (n - 1).bit_length()


def padded_width(n: int) -> int:
    """The width, in tokens, a pass whose longest row has `n` tokens is padded to: the next of
    8, 12, 16, 24, 32, 48, 64, 96, ... (2^k and 3 * 2^(k-1)), at most a third of it padding."""
    if n <= MIN_WIDTH:
        return MIN_WIDTH
    power = 1 << (n - 1).bit_length()
    return power * 3 // 4 if n <= power * 3 // 4 else power


@dataclass(eq=False)
class Item:
    """One input of a request, waiting for a forward pass."""

    request: Any
    row: int
    ids: list[int]
    seq: int  # arrival order, across requests


class Batcher:
    """Waiting inputs by length bucket, and the next pass to run (see the module's docstring)."""

    def __init__(self, budget: int, *, max_waste: float, max_row: int) -> None:
        self.budget = budget  # padded tokens per pass
        self.max_waste = max_waste
        self.max_row = max_row  # tokens; a longer input runs alone
        self._buckets: dict[int, deque[Item]] = {}
        self._seq = 0

    def __bool__(self) -> bool:
        """Whether any input waits."""
        return any(self._buckets.values())

    def add(self, request: Any, row: int, ids: list[int]) -> None:
        self._buckets.setdefault(bucket(len(ids)), deque()).append(Item(request, row, ids, self._seq))
        self._seq += 1

    def drop(self, request: Any) -> None:
        """Take `request`'s waiting inputs out."""
        for b, queue in self._buckets.items():
            if any(i.request is request for i in queue):
                self._buckets[b] = deque(i for i in queue if i.request is not request)

    def next(self) -> tuple[list[Item], int]:
        """The next pass's inputs, taken out of the queues, and the width to pad them to (tokens);
        ([], 0) when none waits."""
        heads = [(q[0].seq, b) for b, q in self._buckets.items() if q]
        if not heads:
            return [], 0
        first = min(heads)[1]
        head = self._buckets[first].popleft()
        batch, longest, real = [head], len(head.ids), len(head.ids)
        if longest > self.max_row:
            return batch, longest
        others = sorted((b for b in self._buckets if b != first), key=lambda b: (abs(b - first), -b))
        for b in (first, *others):
            queue = self._buckets[b]
            k, wide = self._fits(queue, len(batch), longest)
            taken = [queue[i] for i in range(k)]
            tokens = real + sum(len(i.ids) for i in taken)
            padded = (len(batch) + k) * padded_width(wide)
            if not k or (b != first and tokens < (1 - self.max_waste) * padded):
                continue
            for _ in range(k):
                queue.popleft()
            batch += taken
            longest, real = wide, tokens
        return batch, padded_width(longest) if len(batch) > 1 else longest

    def _fits(self, queue: deque[Item], rows: int, longest: int) -> tuple[int, int]:
        """How many of `queue`'s first inputs a pass of `rows` rows (the longest `longest` tokens) can
        take within the budget, and the pass's longest row then."""
        k = 0
        for item in queue:
            wide = max(longest, len(item.ids))
            if wide > self.max_row or (rows + k + 1) * padded_width(wide) > self.budget:
                break
            k, longest = k + 1, wide
        return k, longest
