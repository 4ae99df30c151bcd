"""In-process A/B of the single-stream fast path: one request at a time, on and off interleaved.

``python -m benchmarks.single_stream [PRESET|MODEL_DIR] [ROUNDS]``: decode tok/s from the engine's own stats
(128-token prompt, 128 tokens, greedy, EOS off, prefix cache off), after one unmeasured round.
The figures go to stdout, then the path of the JSON document (``--json``, benchmarks/runner.py) and a
short summary line.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from mlxrt.ipc.protocol import EngineOptions, Generate, SamplingParams
from mlxrt.synthetic.build import ensure_model
from mlxrt.worker.engine import Engine, device_name

from . import runner


class _Stats:
    """A listener that keeps the request's stats."""

    stats = None

    def started(self, req_id: int) -> None:
        pass

    def token(self, *args, **kwargs) -> None:
        pass

    def done(self, req_id: int, stats, *args, **kwargs) -> None:
        self.stats = stats

    def failed(self, req_id: int, exc: BaseException) -> None:
        raise exc


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(prog="python -m benchmarks.single_stream", description=__doc__.split("\n")[0])
    p.add_argument("preset", nargs="?", default="small", help="synthetic preset or model directory (small)")
    p.add_argument("rounds", nargs="?", type=int, default=7, help="measured rounds (default 7)")
    runner.add_json_arg(p, study="single-stream")
    args = p.parse_args(argv)
    preset, rounds = args.preset, args.rounds
    path = preset if Path(preset).is_dir() else ensure_model(preset)
    engine = Engine(str(path), options=EngineOptions(prompt_cache_bytes=0))
    ids = (engine.tokenizer.encode("The tide came in over the rocks while the gulls argued. ") * 40)[:128]
    tps: dict[str, list[float]] = {"off": [], "on": []}
    for r in range(rounds + 1):
        for mode in ("off", "on"):
            engine.solo_enabled = mode == "on"
            box = _Stats()
            params = SamplingParams(max_tokens=128, ignore_eos=True)
            engine.submit(Generate(id=r, prompt_ids=ids, params=params), box)
            while engine.busy:
                engine.step()
            if r:
                tps[mode].append(box.stats.decode_tps)
    paired = [on / off for off, on in zip(tps["off"], tps["on"], strict=True)]
    print(f"{preset} on {device_name()}, {rounds} rounds, decode tok/s median [min-max]")
    for mode, v in tps.items():
        print(f"  fast path {mode:3}  {runner.span(v)}")
    print(f"  on/off paired  {runner.span(paired, '.3f')}")
    result = {"preset": preset, "device": device_name(), "decode_tps": tps, "on_over_off": paired,
              "env": runner.environment()}
    summary = {"benchmark": "mlxrt-single-stream", "preset": preset,
               "on_over_off_median": statistics.median(paired)}
    runner.finish(result, runner.json_path(args.json, "single-stream"), summary)
    return result


if __name__ == "__main__":
    main()
