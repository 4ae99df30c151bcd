# Session 18, this CPU: what a burst's prefill costs by the shape of its calls. 16 prompts' worth of tokens
# (16 x 128) prefilled as 1 call of 16 rows, 2 of 8, 4 of 4, 8 of 2, 16 of 1, 16 of 1 in two pieces each,
# and 32 calls of 1 row x 64 tokens; best of 3, twice over.
#   .venv/bin/python docs/benchmarks/data/probes-s18/callprobe.py     (from the checkout's root)
import sys
import time

import mlx.core as mx
from mlx_lm import load
from mlx_lm.models.cache import make_prompt_cache

sys.path.insert(0, ".")
from benchmarks.e2e import model_tokenizer  # noqa: E402

path, _ = model_tokenizer("synthetic:small")
model, _ = load(path)


def run(rows: int, length: int, pieces: int = 1) -> float:
    t0 = time.perf_counter()
    cache = make_prompt_cache(model)
    x = mx.array([[5 + (i * 7 + r) % 500 for i in range(length)] for r in range(rows)])
    step = length // pieces
    for k in range(pieces):
        model(x[:, k * step:(k + 1) * step], cache=cache)
        mx.eval([c.state for c in cache])  # as a prefill step does: the logits are not needed
    return time.perf_counter() - t0


for _ in range(2):
    for rows, calls, length, pieces in ((16, 1, 128, 1), (8, 2, 128, 1), (4, 4, 128, 1), (2, 8, 128, 1),
                                        (1, 16, 128, 1), (1, 16, 128, 2), (1, 32, 64, 1)):
        best = min(sum(run(rows, length, pieces) for _ in range(calls)) for _ in range(3))
        print(f"{calls} calls of {rows} rows x {length} tokens in {pieces} piece(s): {best * 1e3:.0f} ms",
              flush=True)
