"""In-process A/B of the single-stream fast path: one request at a time, on and off interleaved.

``python -m benchmarks.single_stream [PRESET|MODEL_DIR] [ROUNDS]``: decode tok/s from the engine's own stats
(128-token prompt, 128 tokens, greedy, EOS off, prefix cache off), after one unmeasured round.
The last line of stdout is one JSON document.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

from mlxrt.ipc.protocol import EngineOptions, Generate, SamplingParams
from mlxrt.synthetic.build import ensure_model
from mlxrt.worker.engine import Engine, device_name


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


def main(preset: str = "small", rounds: int = 7) -> dict:
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
        print(f"  fast path {mode:3}  {statistics.median(v):7.1f} [{min(v):.1f}-{max(v):.1f}]")
    print(f"  on/off paired  {statistics.median(paired):.3f} [{min(paired):.3f}-{max(paired):.3f}]")
    result = {"preset": preset, "device": device_name(), "decode_tps": tps, "on_over_off": paired}
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main(*(f(a) for f, a in zip((str, int), sys.argv[1:], strict=False)))
