# A throwaway probe of session 13 (not part of the harness): where the engine's burst path spends its time
# on a backend, call by call, outside any server: B prompts of 127 tokens prefilled in one call as the
# scheduler does (`prefill.run_rows`: one batch, each row's cache extracted), then joined to mlx-lm's
# BatchGenerator at their last token as `Engine._join` does (its merge of B caches), then one decode
# step; each timed with its results evaluated, and the Python GC's pauses in each.
#   python docs/benchmarks/data/probes-s13/joinbench.py MODEL B[,B..]
import gc
import sys
import time
from types import SimpleNamespace

sys.path.insert(0, ".")
import mlx.core as mx  # noqa: E402
from mlx_lm import load  # noqa: E402
from mlx_lm.generate import BatchGenerator  # noqa: E402
from mlx_lm.models.cache import make_prompt_cache  # noqa: E402
from mlxrt.worker.prefill import run_rows  # noqa: E402

from benchmarks.e2e import model_tokenizer  # noqa: E402

path, _ = model_tokenizer(sys.argv[1])
model, _ = load(path)
PAUSES: list[float] = []
_gc_t = [0.0]


def on_gc(phase, info):
    if phase == "start":
        _gc_t[0] = time.perf_counter()
    else:
        PAUSES.append((time.perf_counter() - _gc_t[0]) * 1e3)


gc.callbacks.append(on_gc)
stream = mx.new_stream(mx.default_device())


def ms(t0):
    return (time.perf_counter() - t0) * 1e3


def burst(b, k):
    rows = [SimpleNamespace(seq=SimpleNamespace(prefill_s=0.0), cache=make_prompt_cache(model), tokens=[],
                            segments=[[(i * 7 + k * 13 + j * 31) % 1000 + 10 for j in range(127)]])
            for i in range(b)]
    PAUSES.clear()
    t0 = time.perf_counter()
    run_rows(model, rows, stream)
    t_rows, gc_rows = ms(t0), sum(PAUSES)
    gen = BatchGenerator(model, completion_batch_size=64, prefill_batch_size=64)
    gen._stream = stream
    gen.insert_segments([[[5 + i]] for i in range(b)], max_tokens=[8] * b, caches=[r.cache for r in rows],
                        all_tokens=[r.tokens for r in rows])
    PAUSES.clear()
    t0 = time.perf_counter()
    gen.next()  # the join: merge, the last tokens' forward (async)
    t_join = ms(t0)
    t0 = time.perf_counter()
    gen.next()  # first tokens: the join's results waited for
    t_first = ms(t0)
    gc_join = sum(PAUSES)
    t0 = time.perf_counter()
    gen.next()
    t_dec = ms(t0)
    gen.close()
    print(f"B={b:3d} rows {t_rows:6.1f} ms (gc {gc_rows:4.1f})  join {t_join:6.1f}  first {t_first:6.1f} "
          f"(gc {gc_join:4.1f})  decode {t_dec:5.1f}", flush=True)


for k, b in enumerate(int(x) for x in sys.argv[2].split(",")):
    burst(b, k)
