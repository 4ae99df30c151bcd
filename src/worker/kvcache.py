"""KV-cache quantization for the single-stream fast path, and back to full precision for the batch.

mlx-lm quantizes a cache in `generate_step` (`maybe_quantize_kv_cache`: each
layer's `KVCache` becomes a `QuantizedKVCache` once it holds
``quantized_kv_start`` tokens), but its `BatchGenerator` cannot batch a
`QuantizedKVCache` (it has no ``merge``). So only a lone sequence is
quantized (`solo.py`); a quantized cache that joins the batch (a hand-over,
or a prefix-cache entry served to a batched request) is dequantized first
(`full_precision`): its values are those the quantized attention read, in the
model's dtype. Rule and trade-off: docs/engine.md.

`quantize` differs from mlx-lm's in one point: it converts plain `KVCache`
layers only, leaving a sliding-window `RotatingKVCache` (Gemma 3, gpt-oss)
as it is, where mlx-lm would raise (``RotatingKVCache Quantization NYI``).

A bounded cache (``max_kv_size``) is the batch's window: mlx-lm's
`BatchRotatingKVCache` keeps the last ``max_kv_size`` tokens, while
`make_prompt_cache` (as `mlx_lm.generate` uses it) also keeps the first 4
for good. `make_cache` gives a lone sequence the batch's window, so a request
gets the same ids alone, in a batch, and handed over between the two.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
from mlx_lm.models.cache import KVCache, QuantizedKVCache, RotatingKVCache, make_prompt_cache


@dataclass(frozen=True)
class KVQuant:
    """How a cache is quantized: bits, group size, and from how many tokens on."""

    bits: int
    group_size: int
    start: int


def make_cache(model, max_kv_size: int | None) -> list:
    """A new cache for one sequence: the model's own, or a rotating window of `max_kv_size` tokens
    that keeps none of the first ones (as the batch's does)."""
    if max_kv_size is None:
        return make_prompt_cache(model)
    if hasattr(model, "make_cache"):
        raise ValueError(f"invalid max_kv_size={max_kv_size}: this model makes its own caches "
                         f"({sorted({type(c).__name__ for c in model.make_cache()})}), which mlx-lm does "
                         "not bound")
    return [RotatingKVCache(max_size=max_kv_size, keep=0) for _ in model.layers]


def quantize(cache: list, kv: KVQuant | None) -> None:
    """Quantize, in place, each `KVCache` layer of `cache` that holds at least ``kv.start`` tokens."""
    if kv is None:
        return
    for i, c in enumerate(cache):
        if type(c) is KVCache and c.keys is not None and c.offset >= kv.start:
            cache[i] = c.to_quantized(group_size=kv.group_size, bits=kv.bits)


def is_quantized(cache: list | None) -> bool:
    return cache is not None and any(type(c) is QuantizedKVCache for c in cache)


def full_precision(cache: list | None) -> list | None:
    """`cache` with each `QuantizedKVCache` layer dequantized into a `KVCache` (the others as they are)."""
    if not is_quantized(cache):
        return cache
    assert cache is not None
    return [_dequantized(c) if type(c) is QuantizedKVCache else c for c in cache]


def _dequantized(c: QuantizedKVCache) -> KVCache:
    out = KVCache()
    if c.keys is not None:
        def back(parts):
            wq, scales, biases = (p[..., : c.offset, :] for p in parts)
            full = mx.dequantize(wq, scales, biases, group_size=c.group_size, bits=c.bits)
            return full.astype(scales.dtype)

        out.keys, out.values = back(c.keys), back(c.values)
        out.offset = c.offset
    return out


def check_quantizable(model, kv: KVQuant) -> None:
    """`ValueError` unless `model`'s cache quantizes with `kv` and the model runs on it (the head size
    must be a multiple of the group size): checked once at load with one token."""
    cache = make_prompt_cache(model)
    try:
        model(mx.array([[0]]), cache=cache)
        quantize(cache, KVQuant(kv.bits, kv.group_size, 0))
        mx.eval(model(mx.array([[0]]), cache=cache))
    except Exception as exc:
        raise ValueError(f"invalid kv_bits={kv.bits}, kv_group_size={kv.group_size}: this model's KV cache "
                         f"cannot be quantized so: {exc}") from None
    if not is_quantized(cache):
        raise ValueError(f"invalid kv_bits={kv.bits}: this model has no KVCache layer to quantize "
                         f"(its caches: {sorted({type(c).__name__ for c in cache})})")
