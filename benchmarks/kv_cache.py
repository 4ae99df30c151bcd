"""KV-cache quantization: cache bytes, peak memory and decode speed at a few context lengths.

``python -m benchmarks.kv_cache [--target REF] [--context N ...] [--bits B ...] [--rounds N]``

In-process, one request at a time on the fast path (where ``kv_bits`` acts,
docs/engine.md): a prompt of ``context`` tokens, then ``--tokens`` greedy
tokens, EOS off, quantized from the first token (``quantized_kv_start=0``).
Full precision and each bit width run interleaved, round by round, on one
loaded model (the engine's `kv` swapped). Reported per configuration: the
bytes of the sequence's KV cache when it ends (the entry kept in the prefix
cache), MLX's peak memory over the request, and decode tok/s. The JSON document
goes to ``--json`` (benchmarks/runner.py); stdout ends with the table, its path
and a short summary line.
"""

from __future__ import annotations

import argparse
import statistics

from mlxrt.ipc.protocol import EngineOptions, Generate, SamplingParams
from mlxrt.worker.engine import Engine, device_name, resolve_model_path
from mlxrt.worker.kvcache import KVQuant, check_quantizable, fallback_steps

from . import runner
from .env import default_preset
from .speculative import _Box


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.kv_cache", description=__doc__.split("\n")[0])
    ap.add_argument("--target", default=None,
                    help="model (default: synthetic:small, the 0.5B shape on a GPU)")
    ap.add_argument("--context", type=int, action="append", default=None, help="prompt tokens; repeat")
    ap.add_argument("--bits", type=int, action="append", default=None, help="KV bits; repeat (default 8, 4)")
    ap.add_argument("--group-size", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    runner.add_json_arg(ap, study="kv-cache")
    a = ap.parse_args(argv)
    target = a.target or f"synthetic:{default_preset()}"
    engine = Engine(resolve_model_path(target), options=EngineOptions())
    contexts = a.context or [1024, 3072]
    kinds: list[int | None] = [None, *(a.bits or [8, 4])]
    for bits in kinds[1:]:  # as a worker's load does: where kernels are missing, the fallback goes in
        check_quantizable(engine.model, KVQuant(bits, a.group_size, 0))
    fallback = fallback_steps()
    unit = engine.tokenizer.encode("The tide came in over the rocks while the gulls argued. ")
    rows: dict[str, dict[str, list[float]]] = {}
    for r in range(a.rounds + 1):
        for n in contexts:
            ids = (unit * (n // len(unit) + 1))[:n]
            for bits in kinds:
                engine.kv = None if bits is None else KVQuant(bits, a.group_size, 0)
                engine.clear_cache()
                box = _Box()
                params = SamplingParams(max_tokens=a.tokens, ignore_eos=True)
                engine.submit(Generate(id=r, prompt_ids=ids, params=params), box)
                while engine.busy:
                    engine.step()
                if not r:
                    continue  # the first round compiles and warms
                row = rows.setdefault(f"{n} tokens, {'full' if bits is None else f'{bits}-bit'}", {
                    "cache_mb": [], "peak_mb": [], "decode_tps": []})
                row["cache_mb"].append(engine.prefix_cache.nbytes / 2**20)
                row["peak_mb"].append(box.stats.peak_memory_bytes / 2**20)
                row["decode_tps"].append(box.stats.decode_tps)
    engine.kv = None
    print(f"{target} on {device_name()}, {a.rounds} rounds, {a.tokens} tokens decoded, group {a.group_size}; "
          "median [min-max]")
    how = (f"dequantized first for {'every step' if fallback == 'all' else 'prefill chunks'} (MLX lacks"
           " mlx-lm's kernels here)" if fallback else "mlx-lm's quantized_matmul")
    print(f"attention over a quantized cache: {how}")
    print(f"{'configuration':24} {'KV cache MB':>12} {'MLX peak MB':>12} {'decode tok/s':>24}")
    for name, row in rows.items():
        t = row["decode_tps"]
        cache, peak = statistics.median(row["cache_mb"]), statistics.median(row["peak_mb"])
        print(f"{name:24} {cache:12.1f} {peak:12.1f} {runner.span(t):>24}")
    result = {"target": target, "tokens": a.tokens, "group_size": a.group_size, "rows": rows,
              "dequantized_attention": fallback,
              "env": runner.environment()}
    tps = {name: statistics.median(row["decode_tps"]) for name, row in rows.items()}
    runner.finish(result, runner.json_path(a.json, "kv-cache"),
                  {"benchmark": "mlxrt-kv-cache", "target": target, "decode_tps_median": tps})
    return result


if __name__ == "__main__":
    main()
