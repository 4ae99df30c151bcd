"""A lone request decodes k tokens, then three 512-token prompts arrive: the late ones' TTFT, in-process.

``python -m benchmarks.burst MODEL_DIR``: the `Engine` alone (prefix cache off, fast path on), k
varied and repeated across rounds, to see whether the late prompts' first-token time follows the
lone sequence's cache length (new shapes to compile on CUDA) or not. Prints each round's TTFT of
the last of the three and the step times until all three have their first token, then the path of
the JSON document (``--json``, benchmarks/runner.py) and a short summary line.
"""

from __future__ import annotations

import argparse
import statistics
import time

from mlxrt.ipc.protocol import EngineOptions, Generate, SamplingParams
from mlxrt.worker.engine import Engine

from . import runner
from .stagger import _Timeline


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(prog="python -m benchmarks.burst", description=__doc__.split("\n")[0])
    p.add_argument("model", help="a model directory")
    runner.add_json_arg(p, study="burst")
    args = p.parse_args(argv)
    model = args.model
    rounds = []
    eng = Engine(model, options=EngineOptions(prompt_cache_bytes=0))
    eng.warmup(16)
    base = eng.tokenizer.encode("The tide came in over the rocks while the gulls argued. " * 60)[:511]
    for rnd, k in enumerate([5, 17, 29, 41, 53, 5, 5, 17, 17, 65, 65]):
        tl = _Timeline()
        eng.submit(Generate(id=100, prompt_ids=[9, *base], params=SamplingParams(max_tokens=k + 12,
                                                                                 ignore_eos=True)), tl)
        while 100 not in tl.first:
            eng.step()
        for _ in range(k):
            eng.step()
        t0 = time.perf_counter()
        for j in range(3):
            params = SamplingParams(max_tokens=4, ignore_eos=True)
            eng.submit(Generate(id=j, prompt_ids=[5 + j, *base], params=params), tl)
        steps = []
        while not all(j in tl.first for j in range(3)):
            start = time.perf_counter()
            eng.step()
            steps.append(round(1e3 * (time.perf_counter() - start)))
        ttft = round(1e3 * (max(tl.first[j] for j in range(3)) - t0))
        print(f"round {rnd} k={k}: late TTFT {ttft} ms, steps {steps}", flush=True)
        rounds.append({"round": rnd, "k": k, "late_ttft_ms": ttft, "steps_ms": steps})
        while eng.busy:
            eng.step()
    doc = {"benchmark": "mlxrt-burst", "model": model, "rounds": rounds, "env": runner.environment()}
    late = [r["late_ttft_ms"] for r in rounds]
    runner.finish(doc, runner.json_path(args.json, "burst"),
                  {"benchmark": doc["benchmark"], "late_ttft_ms_median": statistics.median(late)})
    return doc


if __name__ == "__main__":
    main()
