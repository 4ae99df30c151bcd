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

Attention over a quantized cache is mlx-lm's (`quantized_scaled_dot_product_attention`:
two `mx.quantized_matmul`s). MLX's CUDA build lacks kernels for some of its
shapes: attention over a quantized cache stops with "[quantized_matmul] No
implementation for problem shape" (seen on an H100, mlx 0.32.4, 8-bit, group 64,
head size 128: a decode step, and a prefill chunk of 2,047 queries over 8,191
keys). `check_quantizable` tries the shapes a request meets, and
where one fails it puts `dequantized_attention` in mlx-lm's place for those
shapes: the cache is dequantized for the call and MLX's fused attention reads
it. The cache stays quantized in memory; each call adds one layer's
full-precision keys and values for its duration. Written by hand: mlx-lm has
no fallback, and the alternative is refusing `kv_bits` on CUDA.

A bounded cache (``max_kv_size``) is the batch's window: mlx-lm's
`BatchRotatingKVCache` keeps the last ``max_kv_size`` tokens, while
`make_prompt_cache` (as `mlx_lm.generate` uses it) also keeps the first 4
for good. `make_cache` gives a lone sequence the batch's window, so a request
gets the same ids alone, in a batch, and handed over between the two.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
import structlog
from mlx.utils import tree_map
from mlx_lm.models import base
from mlx_lm.models.cache import (
    ArraysCache,
    CacheList,
    KVCache,
    QuantizedKVCache,
    RotatingKVCache,
    make_prompt_cache,
)

from .limits import on_cuda

log = structlog.get_logger("mlxrt.worker")

#: mlx-lm's attention over a quantized cache, as it was imported: what the fallback stands in for.
MLX_LM_ATTENTION = base.quantized_scaled_dot_product_attention
#: (query tokens, cached tokens) tried by `check_quantizable` where kernels may be missing: decode
#: steps, a short prefill chunk and a full one (2,048 tokens less one, over four chunks' keys).
PROBE_SHAPES = ((1, 1), (1, 8191), (37, 101), (2047, 8191))


@dataclass(frozen=True)
class KVQuant:
    """How a cache is quantized: bits, group size, and from how many tokens on."""

    bits: int
    group_size: int
    start: int


def always_trimmable(cache: list) -> bool:
    """Whether every layer's cache can always be trimmed back to a shorter prefix.

    A `RotatingKVCache` can be trimmed only until it first rotates, and an
    `ArraysCache` never: such models need checkpoints, whatever an empty
    cache says now.
    """
    return all(type(c) in (KVCache, QuantizedKVCache) for c in cache)


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


def owned(cache: list) -> list:
    """A copy of `cache` to keep, evaluated: each layer a new object, an `ArraysCache`'s arrays copied (in
    a `CacheList` too), the others' shared (`copy.deepcopy`; MLX arrays are not changed in place).

    mlx-lm's extract of a batch's row is lazy: until evaluated, a `KVCache` or rotating row is a graph
    over the whole batch's arrays (its `mx.contiguous` copies the row once evaluated). Its extract of an
    `ArraysCache` row is a view, which keeps the batch's arrays alive evaluated or not. Either way the
    row holds far more than its `nbytes`, which the prefix cache's byte cap counts: its entries after 8
    streams held 2.4-2.7x the bytes they counted on each tiny preset
    (docs/benchmarks/data/cpu-s15-owned.log). A recurrent state is small, so its copy is too.
    """
    out = [_owned_layer(c) for c in cache]
    mx.eval([c.state for c in out])
    return out


def _owned_layer(c):
    if isinstance(c, CacheList):
        return CacheList(*(_owned_layer(sub) for sub in c.caches))
    if isinstance(c, ArraysCache):
        mine = copy.copy(c)
        mine.state = tree_map(lambda x: mx.array(x) if isinstance(x, mx.array) else x, c.state)
        return mine
    return copy.deepcopy(c)


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


def check_quantizable(model: nn.Module, kv: KVQuant) -> None:
    """`ValueError` unless `model`'s cache quantizes with `kv` and the model runs on it (the head size
    must be a multiple of the group size): checked once at load with one token.

    Where MLX may lack kernels for quantized attention (`may_lack_kernels`: its CUDA build), the
    shapes of `PROBE_SHAPES` are tried with this model's heads, and those that fail are given
    `dequantized_attention` instead (`use_dequantized_attention`)."""
    cache = make_prompt_cache(model)
    try:
        model(mx.array([[0]]), cache=cache)
        quantize(cache, KVQuant(kv.bits, kv.group_size, 0))
    except Exception as exc:
        raise ValueError(f"invalid kv_bits={kv.bits}, kv_group_size={kv.group_size}: this model's KV cache "
                         f"cannot be quantized so: {exc}") from None
    if not is_quantized(cache):
        raise ValueError(f"invalid kv_bits={kv.bits}: this model has no KVCache layer to quantize "
                         f"(its caches: {sorted({type(c).__name__ for c in cache})})")
    if may_lack_kernels():
        _fall_back_where_missing(model, cache, kv)
    try:
        mx.eval(model(mx.array([[0]]), cache=cache))
    except Exception as exc:
        raise ValueError(f"invalid kv_bits={kv.bits}, kv_group_size={kv.group_size}: this model cannot "
                         f"attend over a cache quantized so: {exc}") from None


def may_lack_kernels() -> bool:
    """Whether MLX's quantized attention may miss kernels here: its CUDA build (CPU and Metal have all)."""
    return on_cuda()


def dequantized_attention(queries: mx.array, q_keys: tuple, q_values: tuple, scale: float,
                          mask: mx.array | str | None, group_size: int = 64, bits: int = 8) -> mx.array:
    """mlx-lm's `quantized_scaled_dot_product_attention`, computed by dequantizing the keys and
    values first and running MLX's fused attention on them (same arguments, same result up to
    rounding)."""
    keys = mx.dequantize(*q_keys, group_size=group_size, bits=bits).astype(queries.dtype)
    values = mx.dequantize(*q_values, group_size=group_size, bits=bits).astype(queries.dtype)
    return mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale, mask=mask)


def use_dequantized_attention(*, decode: bool) -> None:
    """Put `dequantized_attention` in mlx-lm's place for every model of this process: for prefill
    chunks (more than one query token), and for decode steps too when `decode`."""
    def attention(queries: mx.array, q_keys: tuple, q_values: tuple, scale: float,
                  mask: mx.array | str | None, group_size: int = 64, bits: int = 8) -> mx.array:
        fn = dequantized_attention if decode or queries.shape[-2] > 1 else MLX_LM_ATTENTION
        return fn(queries, q_keys, q_values, scale=scale, mask=mask, group_size=group_size, bits=bits)

    attention.steps = "all" if decode else "prefill"  # (fallback_steps)
    base.quantized_scaled_dot_product_attention = attention


def attention_failures(heads: int, kv_heads: int, k_dim: int, v_dim: int, dtype: mx.Dtype, kv: KVQuant
                       ) -> dict[tuple[int, int], str]:
    """The shapes of `PROBE_SHAPES` where mlx-lm's current quantized attention fails, with MLX's error.

    Each is laid out as a model's attention call has it: queries transposed from (batch, tokens,
    heads, size), keys and values as a `QuantizedKVCache` returns them, slices of its buffers
    rounded up to 256 tokens. MLX picks its kernels by layout (contiguous or not), not by size
    alone, so the probe has the layout of the calls it stands for."""
    failed = {}
    for queries, keys in PROBE_SHAPES:
        q = mx.zeros((1, queries, heads, k_dim), dtype).transpose(0, 2, 1, 3)
        cache = QuantizedKVCache(group_size=kv.group_size, bits=kv.bits)
        k, v = cache.update_and_fetch(mx.zeros((1, kv_heads, keys, k_dim), dtype),
                                      mx.zeros((1, kv_heads, keys, v_dim), dtype))
        mask = "causal" if queries > 1 else None
        try:
            mx.eval(base.quantized_scaled_dot_product_attention(q, k, v, scale=1.0, mask=mask,
                                                                 group_size=kv.group_size, bits=kv.bits))
        except (RuntimeError, ValueError) as exc:
            failed[(queries, keys)] = str(exc)
    return failed


def _fall_back_where_missing(model: nn.Module, cache: list, kv: KVQuant) -> None:
    """Probe quantized attention for each kind of quantized layer of `cache` (its KV heads, key and
    value sizes, dtype; it holds one token) with `model`'s query heads, and fall back to
    `dequantized_attention` for the kinds of step that fail; `ValueError` if it fails too, with the
    attention that was in place before put back."""
    heads = int(getattr(getattr(model, "args", None), "num_attention_heads", 0) or 0)
    per_word = 32 // kv.bits
    kinds = set()
    for c in cache:
        if type(c) is QuantizedKVCache:
            _, kv_heads, _, k_packed = c.keys[0].shape
            kinds.add((heads or kv_heads, kv_heads, k_packed * per_word, c.values[0].shape[-1] * per_word,
                       c.keys[1].dtype))

    def failures() -> dict[tuple[int, int], str]:
        return {shape: error for kind in sorted(kinds, key=str)
                for shape, error in attention_failures(*kind, kv).items()}

    failed = failures()
    if not failed:
        return
    before = base.quantized_scaled_dot_product_attention
    use_dequantized_attention(decode=any(q == 1 for q, _ in failed))
    still = failures()
    if still:
        base.quantized_scaled_dot_product_attention = before
        raise ValueError(f"invalid kv_bits={kv.bits}, kv_group_size={kv.group_size}: MLX cannot attend "
                         f"over a cache quantized so on {mx.default_device()}: {next(iter(still.values()))}")
    log.warning("kv_cache.dequantized_attention", steps=fallback_steps(),
                shapes=sorted(f"{q}x{k}" for q, k in failed), error=next(iter(failed.values())))


def fallback_steps() -> str | None:
    """Which steps attend over the dequantized cache in this process: "all", "prefill", or None."""
    return getattr(base.quantized_scaled_dot_product_attention, "steps", None)
