"""Forcing a reply out of a random-weight model: a logits processor that dictates each token."""

from __future__ import annotations

import mlx.core as mx


def reply_ids(tokenizer, reply: str) -> list[int]:
    """`reply`'s token ids, ending its turn: with the model's end-of-turn token unless it ends in one."""
    end = sorted(tokenizer.eos_token_ids)
    ids = tokenizer.encode(reply, add_special_tokens=False)
    if not (ids and ids[-1] in end):  # a reply ending in an end-of-turn token (<|call|>) ends there
        ids.append(tokenizer.eos_token_id if tokenizer.eos_token_id in end else end[0])
    return ids


def forced(ids: list[int], vocab: int):
    """A logits processor that makes a sequence's n-th generated token ids[n] (then the last, forever)."""
    steps = iter(ids)
    positions = mx.arange(vocab)

    def processor(tokens, logits):
        return mx.where(positions == next(steps, ids[-1]), 0.0, -1e9).astype(logits.dtype)[None]

    return processor


def prefixed(ids: list[int], vocab: int):
    """A logits processor that makes a sequence's first generated tokens `ids`, then leaves the
    logits alone: the model (and any grammar after this processor) writes the rest."""
    steps = iter(ids)
    positions = mx.arange(vocab)

    def processor(tokens, logits):
        forced_id = next(steps, None)
        if forced_id is None:
            return logits
        return mx.where(positions == forced_id, 0.0, -1e9).astype(logits.dtype)[None]

    return processor
