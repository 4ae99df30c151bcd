# Session 18, this CPU: where a burst's CPU time goes. native-batch in-process against mlxrt over the ring:
# each round's CPU seconds of this process (the orchestrator and the client threads) and of the worker
# process (psutil), beside the aggregate tok/s.
#   .venv/bin/python docs/benchmarks/data/probes-s18/cpuprobe.py [STREAMS]     (from the checkout's root)
import sys
import time

import psutil

sys.path.insert(0, ".")
from benchmarks.concurrency import run_level  # noqa: E402
from benchmarks.e2e import make_prompt, model_tokenizer  # noqa: E402
from benchmarks.scenarios import Embedded, NativeBatch  # noqa: E402


def cpu(p: psutil.Process) -> float:
    t = p.cpu_times()
    return t.user + t.system


path, tok = model_tokenizer("synthetic:small")
streams, gen = int(sys.argv[1]) if len(sys.argv) > 1 else 16, 128
me = psutil.Process()
native = NativeBatch(path)
native.setup()
ring = Embedded(path, "ring")
ring.setup()
worker = psutil.Process(ring.rt.workers[0].pid)
for rnd in range(3):
    prompts = [make_prompt(tok, 128, start=1000 * rnd + 10 * i)[0] for i in range(streams)]
    for name, scenario in (("native-batch", native), ("ring", ring)):
        c0, w0, t0 = cpu(me), cpu(worker), time.perf_counter()
        figures, _ = run_level(scenario, prompts, gen)
        wall = time.perf_counter() - t0
        here, there = cpu(me) - c0, cpu(worker) - w0
        share = (here + there) / wall
        print(f"round {rnd} {name:13s} {figures['aggregate_tps']:6.1f} tok/s wall {wall:5.2f}s  "
              f"this process cpu {here:5.2f}s  worker cpu {there:5.2f}s  cpu/wall {share:4.2f}", flush=True)
ring.close()
