"""The embedding queue (`embed_batch.Batcher`): which waiting inputs share a forward pass, without a model.
Exactness of merged, padded passes is checked on the real model in test_embeddings.py."""

from __future__ import annotations

import random

import numpy as np
import pytest
from mlxrt.worker.embed_batch import MAX_WASTE_CPU, MAX_WASTE_GPU, Batcher, bucket, padded_width

WIDTHS = {8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048}


def drain(batcher: Batcher) -> list[tuple[list, int]]:
    """Every pass until none is left: (items, padded width)."""
    passes = []
    while batcher:
        passes.append(batcher.next())
    return passes


def test_padded_widths_are_a_few_fixed_sizes():
    """A pass is padded to the next of 8, 12, 16, 24, 32, 48, ...: at least its longest row, at most a
    third of it padding."""
    assert [padded_width(n) for n in (1, 8, 9, 12, 13, 17, 25, 33, 49, 100, 129, 2048)] == \
        [8, 8, 12, 12, 16, 24, 32, 48, 64, 128, 192, 2048]
    for n in range(9, 2049):
        w = padded_width(n)
        assert w in WIDTHS and n <= w and (w - n) / w < 1 / 3, n


def test_a_batch_of_mixed_lengths_is_one_pass_on_a_gpu():
    """32 inputs of 16-128 tokens: one pass under the GPU's padding bound (as native batching pads all to
    the longest), a few under the CPU's; never more passes than the length buckets they span."""
    rng = np.random.default_rng(0)
    lengths = rng.integers(16, 129, 32).tolist()
    gpu = Batcher(16384, max_waste=MAX_WASTE_GPU, max_row=2048)
    cpu = Batcher(16384, max_waste=MAX_WASTE_CPU, max_row=2048)
    for b in (gpu, cpu):
        for i, n in enumerate(lengths):
            b.add("r", i, [0] * n)
    ((items, width),) = drain(gpu)
    assert len(items) == 32 and width == 128
    passes = drain(cpu)
    assert 1 < len(passes) <= len({bucket(n) for n in lengths})
    for items, width in passes:
        real = sum(len(i.ids) for i in items)
        assert real >= (1 - 0.5) * len(items) * width  # under half padding, rounding included


@pytest.mark.parametrize("seed", range(20))
def test_every_pass_keeps_the_queue_s_promises(seed):
    """Random inputs, budgets and padding bounds: every input goes out once; each pass starts with the
    oldest waiting input; a bucket's inputs leave in arrival order; a pass of several rows fits the
    budget, padded to a fixed width no shorter than its longest row; an input over max_row runs alone."""
    rnd = random.Random(seed)
    print(f"seed {seed}")
    budget, max_row = rnd.choice([64, 512, 2048, 16384]), rnd.choice([32, 100, 2048])
    batcher = Batcher(budget, max_waste=rnd.choice([0.0, MAX_WASTE_CPU, MAX_WASTE_GPU]), max_row=max_row)
    lengths: list[int] = []
    waiting: list[int] = []  # rows, in arrival order
    seen: list[int] = []

    def arrive() -> None:
        lengths.append(rnd.randint(1, 300))
        waiting.append(len(lengths) - 1)
        batcher.add("r", waiting[-1], [0] * lengths[-1])

    for _ in range(rnd.randint(1, 120)):
        arrive()
    while batcher:
        if rnd.random() < 0.3:  # inputs keep arriving between passes
            arrive()
        items, width = batcher.next()
        rows = [i.row for i in items]
        assert rows[0] == min(waiting), "the oldest input goes first"
        longest = max(len(i.ids) for i in items)
        if len(items) > 1:
            assert width in WIDTHS and longest <= width and len(items) * width <= budget
            assert longest <= max_row
        else:
            assert width == longest
        for b in {bucket(len(i.ids)) for i in items}:
            mine = [r for r in rows if bucket(lengths[r]) == b]
            assert mine == [r for r in waiting if bucket(lengths[r]) == b][: len(mine)], "arrival order"
        waiting = [r for r in waiting if r not in rows]
        seen += rows
    assert sorted(seen) == list(range(len(lengths)))


def test_dropped_requests_leave_the_queue():
    """A cancelled or failed request's waiting inputs are taken out; the others stay, in order."""
    batcher = Batcher(2048, max_waste=MAX_WASTE_CPU, max_row=2048)
    for row, n in enumerate([5, 6, 40, 7]):
        batcher.add("a" if row % 2 else "b", row, [0] * n)
    batcher.drop("a")
    assert [[i.row for i in items] for items, _ in drain(batcher)] == [[0], [2]]
