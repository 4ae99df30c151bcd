"""A burst of four prompts that reaches the engine in one part or two, in-process.

``python -m benchmarks.stagger [PRESET|MODEL_DIR]``: four 512-token prompts, 8 tokens
each, prompt cache off; "together" submits all four before the first step, "staggered"
submits one, steps once, then the other three. Each with the single-stream fast path on
and off, three repetitions (the first compiles on a GPU). Prints each request's TTFT and,
for the last repetition, the staggered timeline (ms, event, requests with a first token), then the
path of the JSON document (``--json``, benchmarks/runner.py) and a short summary line.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from mlxrt.ipc.protocol import EngineOptions, Generate, SamplingParams
from mlxrt.synthetic.build import ensure_model
from mlxrt.worker.engine import Engine

from . import runner


class _Timeline:
    """A listener that notes when each request started and got its first token."""

    def __init__(self) -> None:
        self.log: list[tuple[float, str, int]] = []
        self.first: dict[int, float] = {}

    def started(self, req_id: int) -> None:
        self.log.append((time.perf_counter(), "started", req_id))

    def token(self, req_id: int, *args, **kwargs) -> None:
        if req_id not in self.first:
            self.first[req_id] = time.perf_counter()
            self.log.append((self.first[req_id], "first", req_id))

    def done(self, *args, **kwargs) -> None:
        pass

    def failed(self, req_id: int, exc: BaseException) -> None:
        raise exc


def burst(engine: Engine, ids: list[int], *, staggered: bool, solo: bool) -> tuple[_Timeline, list[int]]:
    """Four prompts, together or one then three; returns the timeline and their TTFTs (ms, sorted)."""
    engine.solo_enabled = solo
    tl = _Timeline()
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    reqs = [Generate(id=k, prompt_ids=[5 + k, *ids], params=params) for k in range(4)]
    t0 = time.perf_counter()
    if staggered:
        engine.submit(reqs[0], tl)
        engine.step()
        tl.log.append((time.perf_counter(), "step 1 (one request)", 0))
        reqs = reqs[1:]
    for r in reqs:
        engine.submit(r, tl)
    steps = 0
    while engine.busy:
        start = time.perf_counter()
        engine.step()
        steps += 1
        now = time.perf_counter()
        tl.log.append((now, f"step {steps} {1000 * (now - start):.0f} ms", len(tl.first)))
    ttft = sorted(round(1000 * (t - t0)) for t in tl.first.values())
    print(f"{'staggered' if staggered else 'together':9} fast path {'on ' if solo else 'off'} TTFT ms {ttft}")
    tl.log.insert(0, (t0, "t0", 0))
    return tl, ttft


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(prog="python -m benchmarks.stagger", description=__doc__.split("\n")[0])
    p.add_argument("model", nargs="?", default="small", help="synthetic preset or model directory (small)")
    runner.add_json_arg(p, study="stagger")
    args = p.parse_args(argv)
    model = args.model
    path = model if Path(model).is_dir() else ensure_model(model)
    engine = Engine(str(path), options=EngineOptions(prompt_cache_bytes=0))
    engine.warmup(16)
    ids = engine.tokenizer.encode("The tide came in over the rocks while the gulls argued. " * 60)[:511]
    bursts = []
    for rep in range(3):
        for staggered in (False, True):
            for solo in (False, True):
                tl, ttft = burst(engine, ids, staggered=staggered, solo=solo)
                bursts.append({"repetition": rep, "staggered": staggered, "solo": solo, "ttft_ms": ttft})
                if rep == 2 and staggered:
                    t0 = tl.log[0][0]
                    print("   ", [(round(1000 * (t - t0)), e, n) for t, e, n in tl.log[1:15]])
    doc = {"benchmark": "mlxrt-stagger", "model": model, "bursts": bursts, "env": runner.environment()}
    last = {f"{'staggered' if b['staggered'] else 'together'} {'on' if b['solo'] else 'off'}": b["ttft_ms"]
            for b in bursts if b["repetition"] == 2}
    runner.finish(doc, runner.json_path(args.json, "stagger"),
                  {"benchmark": doc["benchmark"], "model": model, "last_repetition_ttft_ms": last})
    return doc


if __name__ == "__main__":
    main()
