"""What a prefill chunk costs the first time its shape is met, and again (issue 28, item 4).

MLX's CUDA backend builds a cuDNN attention graph for each new (query, key) shape of a prefill and
keeps it in memory (`MLX_CUDA_SDPA_CACHE_SIZE`, 256 graphs); decoding rebuilds one each time the
cache's buffer grows. A chunked prefill whose chunks take new shapes pays a build per chunk. This
probe times, in one process with mlxrt's `Engine` warmed up as a worker is:

- ``stepped``: a long prompt prefilled in chunks, each plan twice (other token ids, the same shapes:
  the second pass finds every graph built); ``fixed:N``, ``vary`` (multiples of 64 around 1,024, as
  a budget sizes them; a second seed: new shapes again);
- ``prefix``: 4,096 tokens after a cached prefix of an odd length, then after another, cut plainly
  and on the grid;
- ``short``: prompts of 8 distinct lengths near 45 tokens, each twice;
- ``batch``: right-padded prompt batches of several sizes (`PromptProcessingBatch`), each twice;
- ``decode``: one sequence decoding on its own cache: the steps over 3x the median, and where.

    python -m benchmarks.chunk_shapes MODEL [--tokens 25000] [--parts stepped,prefix,short,batch,decode]

Each part's line is printed as it ends; then the JSON document's path (``--json``) and a summary line.
Run it again with ``MLX_CUDA_USE_CUDNN_SDPA=0`` to see the same without cuDNN.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

from . import runner


def _ids(n: int, seed: int, vocab: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, vocab - 10) for _ in range(n)]


def _grid_plan(start: int, n: int, rung: int) -> list[int]:
    """Chunks of `n` tokens after `start`, each ending on a multiple of `rung` (the last on `n`)."""
    sizes, at, end = [], start, start + n
    while at < end:
        step = min(rung - at % rung, end - at)
        sizes.append(step)
        at += step
    return sizes


class Probe:
    def __init__(self, model: str) -> None:
        import mlx.core as mx
        from mlxrt.ipc.protocol import EngineOptions
        from mlxrt.worker.engine import Engine

        self.mx = mx
        t0 = time.perf_counter()
        self.engine = Engine(model, options=EngineOptions(prompt_cache_bytes=0, prefill_budget_ms=0))
        self.load_s = time.perf_counter() - t0
        self.engine.warmup(4)
        self.model, self.vocab = self.engine.model, self.engine.vocab_size

    def cache(self) -> list:
        from mlxrt.worker.kvcache import make_cache

        return make_cache(self.model, None)

    def chunks(self, cache: list, ids: list[int], sizes: list[int]) -> list[float]:
        """Prefill `ids` into `cache` in chunks of `sizes`; each chunk's seconds (evaluated)."""
        mx, out, at = self.mx, [], 0
        for n in sizes:
            t = time.perf_counter()
            self.model(mx.array(ids[at:at + n])[None], cache=cache)
            mx.eval([c.state for c in cache])
            out.append(time.perf_counter() - t)
            mx.clear_cache()
            at += n
        return out

    def stepped(self, tokens: int) -> list[dict]:
        def plan(name: str) -> list[int]:
            if name.startswith("fixed:"):
                c = int(name[6:])
                return [c] * (tokens // c) + ([tokens % c] if tokens % c else [])
            if name.startswith("grid:"):
                return _grid_plan(0, tokens, int(name[5:]))
            rng, sizes = random.Random(int(name[5:])), []
            while sum(sizes) < tokens:
                sizes.append(min(64 * rng.randint(12, 20), tokens - sum(sizes)))
            return sizes

        rows = []
        for name, seeds in [("fixed:2048", (1, 2)), ("fixed:1024", (3, 4)), ("vary:7", (5, 6)),
                            ("vary:8", (7,)), ("vary:7", (8,))]:
            sizes = plan(name)
            for seed in seeds:
                s = self.chunks(self.cache(), _ids(tokens, seed, self.vocab), sizes)
                rows.append({"plan": name, "seed": seed, "chunks": len(s), "total_s": round(sum(s), 3),
                             "max_s": round(max(s), 3), "median_s": round(statistics.median(s), 4),
                             "each_s": [round(x, 4) for x in s]})
                print(json.dumps({k: v for k, v in rows[-1].items() if k != "each_s"}), flush=True)
        return rows

    def prefix(self) -> list[dict]:
        rows = []
        for how in ("plain", "grid"):
            for start in self.starts:
                cache = self.cache()
                self.chunks(cache, _ids(start, start, self.vocab), [2048] * (start // 2048) + [start % 2048])
                sizes = [1024] * 4 if how == "plain" else _grid_plan(start, 4096, 1024)
                s = self.chunks(cache, _ids(4096, start + 1, self.vocab), sizes)
                rows.append({"part": "prefix", "how": how, "start": start, "sizes": sizes,
                             "each_s": [round(x, 4) for x in s], "total_s": round(sum(s), 3)})
                print(json.dumps(rows[-1]), flush=True)
        return rows

    def short(self) -> list[dict]:
        rows = []
        for rep in range(2):
            for n in range(41, 49):
                s = self.chunks(self.cache(), _ids(n, 100 * rep + n, self.vocab), [n])
                rows.append({"part": "short", "tokens": n, "repeat": rep, "s": round(s[0], 4)})
        print(json.dumps({"part": "short", "first_s": [r["s"] for r in rows[:8]],
                          "again_s": [r["s"] for r in rows[8:]]}), flush=True)
        return rows

    def batch(self) -> list[dict]:
        from mlx_lm.generate import PromptProcessingBatch

        mx, rows = self.mx, []
        for rep in range(2):
            for b in (3, 16, 5, 11, 1, 8):
                prompts = [_ids(500 + (7 * i) % 13, 1000 * rep + 50 * b + i, self.vocab) for i in range(b)]
                t = time.perf_counter()
                batch = PromptProcessingBatch(self.model, list(range(b)), [self.cache() for _ in range(b)],
                                              prefill_step_size=2048)
                batch.prompt(prompts)
                mx.eval([c.state for c in batch.prompt_cache])
                s = round(time.perf_counter() - t, 4)
                rows.append({"part": "batch", "rows": b, "repeat": rep, "s": s})
                mx.clear_cache()
        print(json.dumps({"part": "batch", "first_s": {r["rows"]: r["s"] for r in rows[:6]},
                          "again_s": {r["rows"]: r["s"] for r in rows[6:]}}), flush=True)
        return rows

    def decode(self) -> dict:
        mx, cache, steps = self.mx, self.cache(), self.decode_steps
        y = self.model(mx.array(_ids(100, 42, self.vocab))[None], cache=cache)[:, -1].argmax(-1)
        mx.eval(y)
        times = []
        for _ in range(steps):
            t = time.perf_counter()
            y = self.model(y[:, None], cache=cache)[:, -1].argmax(-1)
            mx.eval(y)
            times.append(time.perf_counter() - t)
        med = statistics.median(times)
        slow = [(100 + i, round(t, 4)) for i, t in enumerate(times) if t > 3 * med]
        row = {"part": "decode", "steps": steps, "median_s": round(med, 5), "slow_steps": slow[:40],
               "slow_total_s": round(sum(t for _, t in slow), 3)}
        print(json.dumps(row), flush=True)
        return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--tokens", type=int, default=25000)
    ap.add_argument("--parts", default="stepped,prefix,short,batch,decode")
    ap.add_argument("--prefixes", default="16011,16300", help="the prefix part's cached lengths")
    ap.add_argument("--decode-steps", type=int, default=1100)
    runner.add_json_arg(ap, study="chunk-shapes")
    a = ap.parse_args()
    p = Probe(a.model)
    p.starts, p.decode_steps = [int(x) for x in a.prefixes.split(",")], a.decode_steps
    out: dict = {"load_s": p.load_s, "warmup_s": p.engine.warmup_s}
    print(json.dumps(out), flush=True)
    for part in a.parts.split(","):
        out[part] = p.stepped(a.tokens) if part == "stepped" else getattr(p, part)()
    out["env"] = runner.environment()
    steps = {f"{r['plan']}/{r['seed']}": r["total_s"] for r in out.get("stepped", [])}
    runner.finish(out, runner.json_path(a.json, "chunk-shapes"),
                  {"benchmark": "mlxrt-chunk-shapes", "stepped_total_s": steps})


if __name__ == "__main__":
    main()
