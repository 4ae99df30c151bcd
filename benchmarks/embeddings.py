"""Embedding throughput: mlxrt's workers against an in-process mlx-lm forward pass.

``python -m benchmarks.embeddings [--preset P] [--rounds N] [--inputs N] [--transport ring|stdio]``

Inputs are token ids, their lengths drawn uniformly from [16, 128] (seeded), so tokenization is left
out on both sides. Scenarios, in interleaved rounds after one unmeasured round:

- ``native-b1``: mlx-lm's class in this process (the checkpoint's backbone), one input per forward pass,
  last token, L2-normalised, copied to numpy as mlxrt returns it;
- ``native-b32``: 32 inputs per pass, in arrival order, right-padded to the longest;
- ``mlxrt-b1``: `AsyncRuntime.embed` of one input per request, one request at a time;
- ``mlxrt-b32``: 32 inputs per request;
- ``mlxrt-c32``: 32 requests of one input each in flight at once (the worker batches across requests).

Figures are inputs/s and tokens/s, median [min-max] over rounds, and forward passes per 32 inputs
(native's by construction, mlxrt's from the worker's per-request ``mean_batch_size``: a request of n
inputs at a mean of m per pass, alone in its passes or one of m single-input requests in each, adds
n / m passes); every vector is checked against native-b1's (max abs difference; beyond
`GATE_ABS_DIFF` the run exits 1). Tables go to stdout, then the path of the JSON document (``--json``,
benchmarks/runner.py) and a short summary line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
from mlxrt import AsyncRuntime
from mlxrt.synthetic.build import ensure_model

from . import runner

BATCH = 32
CONCURRENCY = 32
MIN_TOKENS, MAX_TOKENS = 16, 128
#: Largest difference from native's vectors a scenario may show; beyond it the run fails (exit 1).
GATE_ABS_DIFF = 1e-4


def native_model(path: str):
    """mlx-lm's class for the checkpoint, its bare-backbone weights loaded into the backbone."""
    from mlx_lm.utils import _get_classes

    config = json.loads(Path(path, "config.json").read_text())
    model_class, args_class = _get_classes(config)
    model = model_class(args_class.from_dict(config))
    weights: dict[str, Any] = {}
    for f in sorted(Path(path).glob("model*.safetensors")):
        weights.update(mx.load(str(f)))
    model.model.load_weights(list(weights.items()))
    mx.eval(model.parameters())
    return model


def native_embed(model, rows: list[list[int]]) -> np.ndarray:
    """One forward pass over `rows` (right-padded): last real token, L2-normalised, as numpy."""
    lengths = [len(r) for r in rows]
    width = max(lengths)
    x = mx.array([r + [0] * (width - len(r)) for r in rows])
    hidden = model.model(x).astype(mx.float32)
    last = hidden[mx.arange(len(rows)), mx.array(lengths) - 1]
    return np.array(last / mx.linalg.norm(last, axis=-1, keepdims=True))


def native(model, inputs: list[list[int]], batch: int) -> tuple[np.ndarray, float]:
    """The vectors, and the forward passes they took."""
    parts = [native_embed(model, inputs[i : i + batch]) for i in range(0, len(inputs), batch)]
    return np.concatenate(parts), float(len(parts))


async def mlxrt(rt: AsyncRuntime, inputs: list[list[int]], batch: int,
                concurrency: int) -> tuple[np.ndarray, float]:
    """The vectors, and the forward passes the worker ran for them (from each request's mean pass size)."""
    if concurrency == 1:
        found = [await rt.embed_result(inputs[i : i + batch]) for i in range(0, len(inputs), batch)]
        vectors = np.concatenate([f.vectors for f in found])
    else:
        gate = asyncio.Semaphore(concurrency)

        async def one(ids: list[int]):
            async with gate:
                return await rt.embed_result(ids)

        found = await asyncio.gather(*(one(ids) for ids in inputs))
        vectors = np.stack([f.vectors for f in found])
    passes = sum(len(np.atleast_2d(f.vectors)) / f.stats.mean_batch_size for f in found)
    return vectors, passes


async def run(args: argparse.Namespace) -> dict[str, Any]:
    path = str(ensure_model(args.preset))
    rng = np.random.default_rng(0)
    config = json.loads(Path(path, "config.json").read_text())
    vocab = int(config["vocab_size"]) - 16  # keep clear of the special tokens at the top
    inputs = [rng.integers(0, vocab, int(n)).tolist()
              for n in rng.integers(MIN_TOKENS, MAX_TOKENS + 1, args.inputs)]
    tokens = sum(len(r) for r in inputs)
    model = native_model(path)
    expected, _ = native(model, inputs, 1)
    async with AsyncRuntime(path, transport=args.transport) as rt:
        scenarios: dict[str, Callable[[], Any]] = {
            "native-b1": lambda: native(model, inputs, 1),
            f"native-b{BATCH}": lambda: native(model, inputs, BATCH),
            "mlxrt-b1": lambda: mlxrt(rt, inputs, 1, 1),
            f"mlxrt-b{BATCH}": lambda: mlxrt(rt, inputs, BATCH, 1),
            f"mlxrt-c{CONCURRENCY}": lambda: mlxrt(rt, inputs, 1, CONCURRENCY),
        }
        seconds: dict[str, list[float]] = {name: [] for name in scenarios}
        passes: dict[str, list[float]] = {name: [] for name in scenarios}
        worst: dict[str, float] = {}
        for r in range(args.rounds + 1):
            for name, scenario in scenarios.items():
                t0 = time.perf_counter()
                out = scenario()
                if asyncio.iscoroutine(out):
                    out = await out
                elapsed = time.perf_counter() - t0
                vectors, n_passes = out
                worst[name] = max(worst.get(name, 0.0), float(np.abs(vectors - expected).max()))
                if r:
                    seconds[name].append(elapsed)
                    passes[name].append(n_passes)
                print(f"round {r} {name}: {elapsed:.3f} s", file=sys.stderr)
    return report(args, seconds, passes, worst, tokens)


def report(args: argparse.Namespace, seconds: dict[str, list[float]], passes: dict[str, list[float]],
           worst: dict[str, float], tokens: int) -> dict[str, Any]:
    n = args.inputs
    base = statistics.median(seconds["native-b1"])
    print(f"{args.preset}, {n} inputs of {MIN_TOKENS}-{MAX_TOKENS} tokens ({tokens} in all), "
          f"{args.rounds} rounds, transport {args.transport}; median [min-max]")
    print(f"{'scenario':12} {'inputs/s':>24} {'tokens/s':>26} {'x native-b1':>12} {'max |diff|':>11} "
          f"{'passes/32':>10}")
    rows = {}
    for name, s in seconds.items():
        ips = [n / x for x in s]
        tps = [tokens / x for x in s]
        per32 = [p * BATCH / n for p in passes[name]]
        rows[name] = {"inputs_per_s": ips, "tokens_per_s": tps, "max_abs_diff": worst[name],
                      "passes_per_32_inputs": per32}
        print(f"{name:12} {runner.span(ips):>24} {runner.span(tps, '.0f'):>26} "
              f"{base / statistics.median(s):12.3f} {worst[name]:11.2e} {statistics.median(per32):10.2f}")
    result = {"preset": args.preset, "inputs": n, "tokens": tokens, "rounds": args.rounds,
              "transport": args.transport, "scenarios": rows, "env": runner.environment()}
    ips = {name: statistics.median(r["inputs_per_s"]) for name, r in rows.items()}
    runner.finish(result, runner.json_path(args.json, "embeddings"),
                  {"benchmark": "mlxrt-embeddings", "preset": args.preset, "inputs_per_s_median": ips})
    return result


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--preset", default=None,
                   help="default: qwen3-embedding-0.6b on a GPU, else tiny-qwen3-embedding")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--inputs", type=int, default=256)
    p.add_argument("--transport", default="ring", choices=("ring", "stdio"))
    runner.add_json_arg(p, study="embeddings")
    args = p.parse_args(argv)
    if args.preset is None:
        args.preset = "qwen3-embedding-0.6b" if mx.default_device() == mx.gpu else "tiny-qwen3-embedding"
    result = asyncio.run(run(args))
    off = {k: v["max_abs_diff"] for k, v in result["scenarios"].items() if v["max_abs_diff"] > GATE_ABS_DIFF}
    if off:
        print(f"vectors differ from native-b1's by more than {GATE_ABS_DIFF}: {off}", file=sys.stderr)
        sys.exit(1)
    return result


if __name__ == "__main__":
    main()
