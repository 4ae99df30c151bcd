# Session 19: what MLX holds after a long prompt in the scheduler (issue 28's open memory point): one engine
# in-process, the long-prompt mix once (A decoding, B's prompt, C), then MLX's counters (active, cached,
# peak) after it, after a short request, and after Engine.clear_cache.
#   python3 docs/benchmarks/data/probes-s19/memprobe.py MODEL B_TOKENS
import sys

import mlx.core as mx

sys.path.insert(0, ".")
from benchmarks.e2e import make_prompt, model_tokenizer  # noqa: E402
from benchmarks.interleave import EngineTarget  # noqa: E402


def show(what: str) -> None:
    gib = 1 << 30
    print(f"{what:28s} active {mx.get_active_memory() / gib:6.2f} GiB"
          f"  cached {mx.get_cache_memory() / gib:6.2f} GiB"
          f"  peak {mx.get_peak_memory() / gib:6.2f} GiB", flush=True)


model, b_tokens = sys.argv[1], int(sys.argv[2])
path, tok = model_tokenizer(model)
t = EngineTarget("mlxrt engine", model, None)
show("loaded")
for r in range(2):
    a, b, c = (make_prompt(tok, n, start=5000 + 1000 * r + k)[0]
               for n, k in ((64, 0), (b_tokens, 10), (60, 60)))
    out = t.run({"a": (0.0, a, 400), "b": (1.0, b, 16), "c": (1.3, c, 16)})
    show(f"round {r} after the mix")
    print("  ", {k: round(v) for k, v in out.items()}, flush=True)
t.run({"c": (0.0, make_prompt(tok, 60, start=9000)[0], 16)})
show("after a short request")
t.engine.clear_cache()
show("after clear_cache")
