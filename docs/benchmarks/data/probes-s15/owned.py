"""Session 15: what `kvcache.owned` costs, and what a prefix-cache entry held before it.

    python owned.py cost              `owned` on an 8B shape's KV (32 layers, 8 KV heads of 128, float16):
                                      a copy of every array at 59c1d76, an evaluation since the review
    python owned.py pinned PRESET...  8 streams at once on an engine, then the prefix cache dropped: the
                                      bytes that frees against the bytes its entries counted

`pinned` under PROBE_NO_OWNED=1 (probes-s12/site on PYTHONPATH) gives the way before: deep copies.
"""

import gc
import sys
import time

import mlx.core as mx


def cost() -> None:
    from mlx_lm.models.cache import KVCache
    from mlxrt.worker.kvcache import owned

    for tokens in (1024, 4096, 16384):
        cache = []
        for _ in range(32):
            c = KVCache()
            c.keys = mx.random.normal((1, 8, tokens, 128)).astype(mx.float16)
            c.values = mx.random.normal((1, 8, tokens, 128)).astype(mx.float16)
            c.offset = tokens
            cache.append(c)
        mx.eval([c.state for c in cache])
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            copy = owned(cache)
            times.append((time.perf_counter() - t0) * 1e3)
            del copy
        print(f"{tokens:6d} tokens, {sum(c.nbytes for c in cache) / 1e6:5.0f} MB: owned "
              + ", ".join(f"{t:.1f}" for t in times) + " ms")
        del cache


def pinned(presets: list[str]) -> None:
    from mlxrt.ipc.protocol import EngineOptions, Generate, SamplingParams
    from mlxrt.synthetic.build import ensure_model
    from mlxrt.worker.engine import Engine

    class Quiet:
        def __getattr__(self, name):
            return lambda *a, **k: None

    def active() -> int:
        gc.collect()
        return mx.get_active_memory()

    for preset in presets:
        engine = Engine(str(ensure_model(preset)), options=EngineOptions(decode_concurrency=8))
        for i in range(8):
            ids = [5 + (i * 13 + j * 7) % 200 for j in range(300)]
            params = SamplingParams(max_tokens=8, ignore_eos=True)
            engine.submit(Generate(id=i, prompt_ids=ids, params=params), Quiet())
        while engine.busy:
            engine.step()
        counted, before = engine.prefix_cache.nbytes, active()
        engine.prefix_cache.clear()
        freed = before - active()
        print(f"{preset}: dropping the prefix cache freed {freed / 1e6:.2f} MB, "
              f"counted {counted / 1e6:.2f} MB: {freed / counted:.2f}x")


if __name__ == "__main__":
    cost() if sys.argv[1] == "cost" else pinned(sys.argv[2:])
