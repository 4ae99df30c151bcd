"""KV-cache options in the engine: quantization on the fast path, and a bounded (rotating) cache."""

from __future__ import annotations

from importlib import resources

import mlx.core as mx
import pytest
from mlxrt.ipc.protocol import EngineOptions, Generate, SamplingParams
from mlxrt.worker.engine import Engine
from mlxrt.worker.kvcache import is_quantized
from support import Recorder, gen, run_alone, run_batch

#: Teacher forcing on `small` (bfloat16, head size 64): 64 prompt tokens, then 128 forced ones.
PROMPT_TOKENS, FORCED_TOKENS = 64, 128
#: The stated tolerance of an 8-bit KV cache against full precision, per forced position: the total
#: variation distance between the two next-token distributions (measured: max 0.007 on this model).
MAX_TV_8BIT = 0.02


@pytest.fixture(scope="module")
def small_path() -> str:
    from mlxrt.synthetic.build import ensure_model

    return str(ensure_model("small"))


def corpus_ids(tokenizer, n: int) -> list[int]:
    text = resources.files("mlxrt.synthetic").joinpath("corpus.txt").read_text(encoding="utf-8")
    return tokenizer.encode(text[:4000])[:n]


def forced_logprobs(engine: Engine, ids: list[int]) -> mx.array:
    """Teacher forcing through the engine's fast path: the prompt is ids[:64]; each later position's
    token is forced to ids[n] by a logits processor that first records the model's logits there."""
    seen: list[mx.array] = []
    forced = iter(ids[PROMPT_TOKENS:])
    positions = mx.arange(engine.vocab_size)

    def record_and_force(tokens, logits):
        seen.append(logits.astype(mx.float32))
        return mx.where(positions == next(forced, 0), 0.0, -1e9).astype(logits.dtype)[None]

    rec = Recorder()
    engine.submit(Generate(id=1, prompt_ids=ids[:PROMPT_TOKENS],
                           params=SamplingParams(max_tokens=FORCED_TOKENS, ignore_eos=True)), rec)
    engine._waiting[-1].processors.append(record_and_force)
    while engine.busy:
        engine.step()
    assert not rec.errors and rec.ids[1] == ids[PROMPT_TOKENS:PROMPT_TOKENS + FORCED_TOKENS]
    logits = mx.concatenate(seen)
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


def test_8bit_kv_cache_stays_within_tolerance_of_full_precision(small_path):
    """Teacher forcing on a fixed text: an 8-bit KV cache (quantized from the first token) gives
    next-token distributions within MAX_TV_8BIT of the full-precision cache's; a 4-bit one is
    further off, and the kept cache really is quantized and smaller."""
    full = Engine(small_path, options=EngineOptions())
    ids = corpus_ids(full.tokenizer, PROMPT_TOKENS + FORCED_TOKENS)
    reference = forced_logprobs(full, ids)
    tv = {}
    for bits in (8, 4):
        engine = Engine(small_path, options=EngineOptions(kv_bits=bits, quantized_kv_start=0))
        got = forced_logprobs(engine, ids)
        tv[bits] = (0.5 * mx.abs(mx.exp(got) - mx.exp(reference)).sum(axis=-1)).max().item()
        kept, n = engine.prefix_cache.fetch(ids[:PROMPT_TOKENS + FORCED_TOKENS])
        assert n == PROMPT_TOKENS + FORCED_TOKENS - 1 and is_quantized(kept)
        plain, _ = full.prefix_cache.fetch(ids[:PROMPT_TOKENS + FORCED_TOKENS])
        assert sum(c.nbytes for c in kept) < sum(c.nbytes for c in plain)
    assert 0.0 < tv[8] < MAX_TV_8BIT, tv
    assert tv[4] > tv[8], tv


def test_quantization_starts_at_quantized_kv_start(small_path):
    """Below quantized_kv_start the cache stays full precision; past it, it is quantized."""
    engine = Engine(small_path, options=EngineOptions(kv_bits=8, quantized_kv_start=40))
    short = gen(1, ids=list(range(100, 120)), max_tokens=8)
    long = gen(2, ids=list(range(200, 240)), max_tokens=8)
    run_alone(engine, short)
    run_alone(engine, long)
    kept, n = engine.prefix_cache.fetch(short.prompt_ids + [0])
    assert n == len(short.prompt_ids) and not is_quantized(kept)  # served, not a miss
    assert is_quantized(engine.prefix_cache.fetch(long.prompt_ids + [0])[0])


@pytest.mark.parametrize("after", [2, 12])
def test_quantized_lone_request_hands_over_to_the_batch(small_path, after):
    """A second request arrives while a lone one decodes on a quantized cache: the cache goes back
    to full precision in the batch, both finish, and the lone one's first tokens are its own."""
    engine = Engine(small_path, options=EngineOptions(kv_bits=8, quantized_kv_start=0))
    first, second = gen(1, "Once upon a time", max_tokens=24), gen(2, "The sea is", max_tokens=24)
    alone, _ = run_alone(engine, first)
    engine.clear_cache()
    rec = Recorder()
    engine.submit(first, rec)
    for _ in range(after):
        engine.step()
    assert engine._solo is not None and is_quantized(engine._solo.cache)
    engine.submit(second, rec)
    while engine.busy:
        engine.step()
    assert not rec.errors and len(rec.ids[1]) == len(rec.ids[2]) == 24
    handed = after - 1  # one step prefills; each later one delivers a token
    assert rec.ids[1][:handed] == alone[:handed]
    assert rec.stats[1].mean_batch_size > 1
    # The batch took the quantized entry of the first request's prompt as a full-precision cache.
    again = run_batch(engine, [gen(3, "Once upon a time", max_tokens=4), gen(4, "Hello", max_tokens=4)])
    assert not again.errors and again.stats[3].cached_tokens > 0


@pytest.mark.parametrize("solo", [True, False], ids=["fast-path", "batch"])
def test_rotating_cache_keeps_memory_flat_past_its_size(tiny_model, solo):
    """With max_kv_size a sequence's cache stops growing at that size, alone or in the batch:
    the cache kept after 150 and after 400 generated tokens has the same bytes; unbounded, it grows."""
    def kept_bytes(engine: Engine, n: int) -> int:
        engine.clear_cache()
        engine.solo_enabled = solo
        req = gen(n, "A long story about the sea and the mountains", max_tokens=n)
        ids, _ = run_alone(engine, req)
        assert len(ids) == n
        prompt = engine.prompt_ids(req)  # the reply's cache serves a next turn that extends it
        assert engine.prefix_cache.fetch(prompt + ids + [0])[1] == len(prompt) + n
        return engine.prefix_cache.nbytes

    bounded = Engine(tiny_model, options=EngineOptions(max_kv_size=64))
    unbounded = Engine(tiny_model, options=EngineOptions())
    assert kept_bytes(bounded, 150) == kept_bytes(bounded, 400)
    assert kept_bytes(unbounded, 400) > kept_bytes(unbounded, 150) > kept_bytes(bounded, 400)


def test_rotating_cache_batch_and_fast_path_agree(tiny_model):
    """A bounded cache gives a lone request the ids the batch gives it, past the cache's size."""
    engine = Engine(tiny_model, options=EngineOptions(max_kv_size=32, prompt_cache_bytes=0))
    req = gen(1, "Once upon a time, in a small village by the sea,", max_tokens=80)
    alone, _ = run_alone(engine, req)
    engine.solo_enabled = False
    batched, _ = run_alone(engine, req)
    assert alone == batched


def test_worker_refuses_kv_options_the_model_cannot_take(tiny_model):
    """What only the loaded model shows is refused at load with a clear error: a head size (16)
    the group size does not divide, a bound on a model that makes its own (sliding) caches."""
    from mlxrt.synthetic.build import ensure_model

    with pytest.raises(ValueError, match="invalid kv_bits=8, kv_group_size=32: .* cannot be quantized"):
        Engine(tiny_model, options=EngineOptions(kv_bits=8, kv_group_size=32))
    with pytest.raises(ValueError, match="invalid max_kv_size=64: this model makes its own caches"):
        Engine(str(ensure_model("tiny-gemma3")), options=EngineOptions(max_kv_size=64))


def test_dequantized_attention_matches_mlx_lm_quantized_attention():
    """The fallback computes mlx-lm's quantized attention (as mlx-lm has it, whatever this process
    put in its place): a decode step, causal, boolean and additive masks over a prefill chunk,
    grouped-query heads; float32 to rounding, and bfloat16 kept bfloat16."""
    from mlxrt.worker.kvcache import MLX_LM_ATTENTION, dequantized_attention

    mx.random.seed(0)
    allowed = mx.random.uniform(shape=(7, 29)) > 0.3
    allowed[:, 0] = True
    masks = {"none": (1, None), "causal": (7, "causal"), "bool": (7, allowed),
             "additive": (7, mx.where(allowed, 0.0, -1e4))}
    for name, (queries, mask) in masks.items():
        keys = 40 if queries == 1 else 29
        q = mx.random.normal((1, 4, queries, 64))
        k, v = (mx.quantize(mx.random.normal((1, 2, keys, 64)), group_size=64, bits=8) for _ in range(2))
        got = dequantized_attention(q, k, v, scale=0.125, mask=mask, group_size=64, bits=8)
        # (mlx-lm's scales the queries in place: it runs second)
        want = MLX_LM_ATTENTION(q, k, v, scale=0.125, mask=mask, group_size=64, bits=8)
        assert got.shape == want.shape, name
        assert mx.abs(got - want).max().item() < 1e-4, name
    q = mx.random.normal((1, 4, 7, 64)).astype(mx.bfloat16)
    k, v = (mx.quantize(mx.random.normal((1, 2, 29, 64)).astype(mx.bfloat16), group_size=64, bits=4)
            for _ in range(2))
    got = dequantized_attention(q, k, v, scale=0.125, mask="causal", group_size=64, bits=4)
    want = MLX_LM_ATTENTION(q, k, v, scale=0.125, mask="causal", group_size=64, bits=4)
    assert got.dtype == want.dtype == mx.bfloat16
    assert mx.abs(got.astype(mx.float32) - want.astype(mx.float32)).max().item() < 0.1


def missing_kernels(monkeypatch, *, prefill_only: bool) -> None:
    """mlx-lm's quantized attention as MLX's CUDA build runs it where kernels are missing: MLX's error
    for a prefill chunk (and, unless `prefill_only`, a decode step), probed as on CUDA."""
    from mlx_lm.models import base
    from mlxrt.worker import kvcache

    native = kvcache.MLX_LM_ATTENTION

    def attention(queries, *args, **kwargs):
        if queries.shape[-2] > 1 or not prefill_only:
            raise RuntimeError("[quantized_matmul] No implementation for problem shape: 36x100x64x8")
        return native(queries, *args, **kwargs)

    monkeypatch.setattr(base, "quantized_scaled_dot_product_attention", attention)
    monkeypatch.setattr(kvcache, "MLX_LM_ATTENTION", attention)
    monkeypatch.setattr(kvcache, "may_lack_kernels", lambda: True)
    monkeypatch.setattr(kvcache, "PROBE_SHAPES", ((1, 1), (1, 65), (37, 101)))


@pytest.mark.parametrize("prefill_only", [True, False], ids=["prefill", "prefill-and-decode"])
def test_missing_attention_kernels_fall_back_to_dequantized_attention(small_path, monkeypatch, prefill_only):
    """Where MLX lacks kernels for quantized attention (MLX's CUDA build for a prefill chunk), the load
    finds out and the engine attends over the dequantized cache instead: prefill chunks on a
    quantized cache go through the fallback, the cache stays quantized, and every forced position's
    next-token distribution is that of mlx-lm's quantized attention."""
    from mlxrt.worker import kvcache

    options = EngineOptions(kv_bits=8, quantized_kv_start=0, prefill_step_size=16)
    native = Engine(small_path, options=options)
    ids = corpus_ids(native.tokenizer, PROMPT_TOKENS + FORCED_TOKENS)
    reference = forced_logprobs(native, ids)

    missing_kernels(monkeypatch, prefill_only=prefill_only)
    calls: list[int] = []
    fallback = kvcache.dequantized_attention

    def counted(queries, *args, **kwargs):
        calls.append(queries.shape[-2])
        return fallback(queries, *args, **kwargs)

    monkeypatch.setattr(kvcache, "dequantized_attention", counted)
    engine = Engine(small_path, options=options)
    calls.clear()  # the load's own probe
    got = forced_logprobs(engine, ids)
    assert any(n > 1 for n in calls)  # the prefill's later chunks attend over a quantized cache
    assert any(n == 1 for n in calls) == (not prefill_only)
    assert kvcache.fallback_steps() == ("prefill" if prefill_only else "all")
    tv = (0.5 * mx.abs(mx.exp(got) - mx.exp(reference)).sum(axis=-1)).max().item()
    assert tv < 0.01, tv
    kept, _ = engine.prefix_cache.fetch(ids)
    assert is_quantized(kept)


def test_quantized_attention_that_cannot_run_at_all_is_refused_at_load(small_path, monkeypatch):
    """If the fallback fails too, the load says so (a ValueError naming kv_bits), and the attention
    in place before it (here an earlier model's fallback, for prefill) is left as it was."""
    from mlx_lm.models import base
    from mlxrt.worker import kvcache

    missing_kernels(monkeypatch, prefill_only=True)
    kvcache.use_dequantized_attention(decode=False)  # an earlier model's load put it in
    earlier = base.quantized_scaled_dot_product_attention
    assert kvcache.fallback_steps() == "prefill"

    def no_fallback(*args, **kwargs):
        raise RuntimeError("[dequantize] No implementation")

    monkeypatch.setattr(kvcache, "dequantized_attention", no_fallback)
    with pytest.raises(ValueError, match="invalid kv_bits=8.*cannot attend"):
        Engine(small_path, options=EngineOptions(kv_bits=8))
    assert base.quantized_scaled_dot_product_attention is earlier
