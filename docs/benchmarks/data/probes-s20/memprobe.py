# Session 20: what MLX holds after issue 28's mix with a long prompt's chunks beside the decode step (this
# tree) or before it (PROBE_NO_OVERLAP=1): session 19's memprobe.py, with the peak after each round. A 4-round
# mix over HTTP ran out of GPU memory in its third round at c4bae69 (docs/benchmarks/gpu-h200-s20.md).
#   [PROBE_NO_OVERLAP=1] python3 docs/benchmarks/data/probes-s20/memprobe.py MODEL B_TOKENS [ROUNDS]
import os
import sys
import types

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
rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 3
path, tok = model_tokenizer(model)
t = EngineTarget("mlxrt engine", model, None)
if os.environ.get("PROBE_NO_OVERLAP"):
    t.engine._overlaps = types.MethodType(lambda self, p, size, spent: False, t.engine)
print("overlap", not os.environ.get("PROBE_NO_OVERLAP"), flush=True)
show("loaded")
for r in range(rounds):
    a, b, c = (make_prompt(tok, n, start=5000 + 1000 * r + k)[0]
               for n, k in ((64, 0), (b_tokens, 10), (60, 60)))
    out = t.run({"a": (0.0, a, 400), "b": (1.0, b, 16), "c": (1.3, c, 16)})
    show(f"round {r} after the mix")
    print("  ", {k: round(v) for k, v in out.items()}, "beside", t.engine.prefill_overlapped, flush=True)
t.engine.clear_cache()
show("after clear_cache")
