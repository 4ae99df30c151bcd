"""First-use stalls: how long a prompt of each length takes the first time and the next, in one process.

MLX's CUDA backend compiles kernels on first use (NVRTC, cached on disk under
``MLX_PTX_CACHE_DIR``, by default ``/tmp/mlx/<version>/ptx``) and builds
cuDNN attention graphs per shape (in memory). This probe loads a model with
mlxrt's `Engine`, warms it up as the worker does, then sends prompts of the
given lengths one at a time, each twice, and prints each one's prefill time,
so a stall on first use stands out. Run it twice with the same
``MLX_PTX_CACHE_DIR`` to tell the disk-cached part from the in-process part.

    python -m benchmarks.first_use MODEL [--lengths 512,2112,4122,3000] [--batch 1]

Each prompt's line is printed as it ends (a lent GPU may cut the run short); then the path of the
whole JSON document with the environment (``--json``, benchmarks/runner.py) and a short summary line.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

from . import runner


def _ptx_files() -> set[str]:
    d = os.environ.get("MLX_PTX_CACHE_DIR")
    return {p.stem for p in Path(d).glob("*.ptx")} if d and Path(d).is_dir() else set()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--lengths", default="512,2112,4122,3000,3500,4122")
    ap.add_argument("--batch", type=int, default=1, help="prompts of each length sent together")
    ap.add_argument("--no-warmup", action="store_true")
    runner.add_json_arg(ap, study="first-use")
    a = ap.parse_args()

    from mlxrt.ipc.protocol import EngineOptions, Generate, SamplingParams
    from mlxrt.worker.engine import Engine

    t0 = time.perf_counter()
    engine = Engine(a.model, options=EngineOptions(prompt_cache_bytes=0))
    load = time.perf_counter() - t0
    if not a.no_warmup:
        engine.warmup(4)
    seen = _ptx_files()
    out = {"load_s": load, "warmup_s": engine.warmup_s, "kernels_compiled": len(seen), "prompts": []}
    print(json.dumps(out), flush=True)
    vocab = engine.vocab_size
    for k, n in enumerate(int(x) for x in a.lengths.split(",")):
        for rep in range(2):
            reqs = [
                Generate(
                    id=k * 100 + rep * 10 + b,
                    prompt_ids=[(7 * i + 13 * b + k + 1) % vocab for i in range(n)],
                    params=SamplingParams(max_tokens=2, ignore_eos=True),
                )
                for b in range(a.batch)
            ]
            t = time.perf_counter()
            engine._run_to_end(reqs)
            row = {"tokens": n, "batch": a.batch, "repeat": rep, "s": round(time.perf_counter() - t, 3)}
            now = _ptx_files()
            row["new_kernels"], seen = sorted(now - seen), now
            out["prompts"].append(row)
            print(json.dumps(row), flush=True)
    out["env"] = runner.environment()
    slowest = max(out["prompts"], key=lambda r: r["s"], default=None)
    runner.finish(out, runner.json_path(a.json, "first-use"),
                  {"benchmark": "mlxrt-first-use", "warmup_s": out["warmup_s"], "slowest_prompt": slowest})


if __name__ == "__main__":
    main()
