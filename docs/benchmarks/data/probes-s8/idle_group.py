"""How much CPU each rank of an idle 2-rank group uses (backend from argv), and that it still answers."""
import sys
import time

import psutil
from mlxrt import Runtime

backend = sys.argv[1] if len(sys.argv) > 1 else "ring"
with Runtime(model="synthetic:tiny", ranks=2, backend=backend, transport="ring") as rt:
    before_ids = rt.generate("hello", max_tokens=8, ignore_eos=True).tokens
    procs = [psutil.Process(r.pid) for r in rt.workers[0].ranks]
    t0 = [sum(p.cpu_times()[:2]) for p in procs]
    w0 = time.monotonic()
    time.sleep(5)
    t1 = [sum(p.cpu_times()[:2]) for p in procs]
    w1 = time.monotonic()
    cores = [round((b - a) / (w1 - w0), 3) for a, b in zip(t0, t1, strict=True)]
    print(backend, "idle CPU, cores per rank:", cores)
    after_ids = rt.generate("hello", max_tokens=8, ignore_eos=True).tokens
    print("same ids before and after the idle spell:", before_ids == after_ids)
