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
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
from mlx_lm.models.cache import KVCache, QuantizedKVCache, make_prompt_cache


@dataclass(frozen=True)
class KVQuant:
    """How a cache is quantized: bits, group size, and from how many tokens on."""

    bits: int
    group_size: int
    start: int


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
