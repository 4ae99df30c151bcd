# A throwaway probe of session 14 (not part of the harness): what the scheduler's batched call costs after the
# model, per row, to hand its rows on. run_rows takes each row's cache out of the call's BatchKVCache with
# mlx-lm's extract (a contiguous copy per layer and row), and the batch merges them again at the join (a slice
# update per layer and row): each row is copied twice. "views" slices the rows out without a copy, so the
# merge is the only one. On CUDA each copy is a kernel launch per layer and row. (A view keeps the whole
# batch's arrays alive, and copy.deepcopy of a view shares them: a prefix-cache entry made from one would
# hold every row's memory, so views could only serve rows that join at once.)
#   python docs/benchmarks/data/probes-s14/extract.py [MODEL]
import statistics
import sys
import time

import mlx.core as mx
from mlx_lm import load
from mlx_lm.generate import PromptProcessingBatch
from mlx_lm.models.cache import BatchKVCache, KVCache, make_prompt_cache

sys.path.insert(0, ".")
from benchmarks.e2e import model_tokenizer  # noqa: E402

ROWS = 16


def prefill(model, prompts):
    caches = [make_prompt_cache(model) for _ in prompts]
    batch = PromptProcessingBatch(model, list(range(len(prompts))), caches, prefill_step_size=200)
    batch.prompt(prompts)
    mx.eval([c.state for c in batch.prompt_cache])
    return batch


def views(batch, i):
    """Row `i` of the batch's cache as KVCaches viewing the batch's arrays (mlx-lm's extract, uncopied)."""
    out = []
    for c in batch.prompt_cache:
        p = c.left_padding.tolist()[i]
        kv = KVCache()
        kv.keys, kv.values = c.keys[i : i + 1, :, p : c._idx], c.values[i : i + 1, :, p : c._idx]
        kv.offset = kv.keys.shape[2]
        out.append(kv)
    return out


def main():
    path, _ = model_tokenizer(sys.argv[1] if len(sys.argv) > 1 else "synthetic:small")
    model, _ = load(path)
    prompts = [[(7 * i + j) % 500 + 10 for j in range(120 + (i % 5))] for i in range(ROWS)]
    times = {"extract": [], "views": [], "extract+merge": [], "views+merge": []}
    for _ in range(8):
        merged_by = {}
        for kind in ("extract", "views"):
            batch = prefill(model, prompts)
            t0 = time.perf_counter()
            rows = [batch.extract_cache(i) if kind == "extract" else views(batch, i) for i in range(ROWS)]
            mx.eval([c.state for row in rows for c in row])
            t1 = time.perf_counter()
            merged = [BatchKVCache.merge([row[layer] for row in rows]) for layer in range(len(rows[0]))]
            mx.eval([c.state for c in merged])
            t2 = time.perf_counter()
            times[kind].append((t1 - t0) * 1e3)
            times[kind + "+merge"].append((t2 - t0) * 1e3)
            merged_by[kind] = merged
        for a, b in zip(merged_by["extract"], merged_by["views"], strict=True):  # the same batch either way
            assert mx.array_equal(a.keys, b.keys).item() and mx.array_equal(a.values, b.values).item()
    print(f"{ROWS} rows, {len(model.layers)} layers; ms, the median leaves out the first two of eight rounds")
    for k, v in times.items():
        print(f"{k:14s} median {statistics.median(v[2:]):.2f} ms  {[round(x, 2) for x in v]}")


if __name__ == "__main__":
    main()
