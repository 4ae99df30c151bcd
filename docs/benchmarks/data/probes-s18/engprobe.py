# Session 18, this CPU: a burst in-process, mlxrt's Engine (prefix cache off) against mlx-lm's BatchGenerator
# with native-batch's settings: each round's time to the last first token, the decode after it, the total,
# the engine's steps and prefill calls, and the median TTFT.
#   .venv/bin/python docs/benchmarks/data/probes-s18/engprobe.py [STREAMS] [PREFILL_BUDGET_MS]   (none: auto)
import statistics
import sys
import time

from mlx_lm import load
from mlx_lm.generate import BatchGenerator

sys.path.insert(0, ".")
from mlxrt.ipc.protocol import EngineOptions, Generate, SamplingParams  # noqa: E402
from mlxrt.worker.engine import Engine  # noqa: E402

from benchmarks.e2e import make_prompt, model_tokenizer  # noqa: E402


class Times:
    def __init__(self) -> None:
        self.first: dict[int, float] = {}
        self.last = 0.0

    def started(self, i: int) -> None:
        pass

    def token(self, i: int, *a, **k) -> None:
        self.last = time.perf_counter()
        self.first.setdefault(i, self.last)

    def done(self, *a, **k) -> None:
        pass

    def failed(self, i: int, exc: BaseException) -> None:
        raise exc


def line(name: str, t0: float, first: dict, last: float, extra: str) -> str:
    tf, tt = max(first.values()) - t0, last - t0
    ttft = statistics.median(v - t0 for v in first.values())
    return (f"{name:7s} prefill-to-last-first {tf:5.2f}s decode {tt - tf:5.2f}s total {tt:5.2f}s {extra} "
            f"ttft median {ttft:.2f}")


path, tok = model_tokenizer("synthetic:small")
streams, gen = int(sys.argv[1]) if len(sys.argv) > 1 else 16, 128
budget = int(sys.argv[2]) if len(sys.argv) > 2 else None
engine = Engine(path, options=EngineOptions(prompt_cache_bytes=0, prefill_budget_ms=budget))
model, _ = load(path)
for rnd in range(3):
    prompts = [make_prompt(tok, 128, start=1000 * rnd + 10 * i)[0] for i in range(streams)]
    rec, t0, steps, calls = Times(), time.perf_counter(), 0, engine.prefill_calls
    for i, p in enumerate(prompts):
        params = SamplingParams(max_tokens=gen, ignore_eos=True)
        engine.submit(Generate(id=i, prompt_ids=p, params=params), rec)
    while engine.busy:
        engine.step()
        steps += 1
    print(f"round {rnd} " + line("engine", t0, rec.first, rec.last,
                                 f"steps {steps} calls {engine.prefill_calls - calls}"), flush=True)
    batch = BatchGenerator(model, completion_batch_size=32, prefill_batch_size=8)
    t0, first, last, steps = time.perf_counter(), {}, 0.0, 0
    live = set(batch.insert(prompts, max_tokens=[gen] * streams))
    while live:
        _, responses = batch.next()
        steps += 1
        last = time.perf_counter()
        for r in responses:
            first.setdefault(r.uid, last)
            if r.finish_reason is not None:
                live.discard(r.uid)
    batch.close()
    print(f"round {rnd} " + line("native", t0, first, last, f"steps {steps}"), flush=True)
