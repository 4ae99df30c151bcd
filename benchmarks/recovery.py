"""``python -m benchmarks.recovery``: time from a worker's SIGKILL to the next successful request.

Each sample starts a fresh runtime (so every kill is a first crash, with the
default supervision policy: 0.5 s backoff), warms it, SIGKILLs the worker and
times a request made right after: it waits for the replacement (backoff,
process start, model load, warm-up) and must succeed. The last stdout line is
one JSON document.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time

from .env import describe
from .measure import spread


def one_sample(model: str, transport: str) -> dict:
    from mlxrt import Runtime

    with Runtime(model=model, transport=transport) as rt:
        rt.generate("warm up", max_tokens=4)
        old = rt.workers[0].pid
        t0 = time.perf_counter()
        os.kill(old, signal.SIGKILL)
        c = rt.generate("Hello after the crash", max_tokens=8, ignore_eos=True)
        total = time.perf_counter() - t0
        (w,) = rt.workers
        assert len(c.tokens) == 8 and w.pid != old and w.restarts == 1
        return {"recovery_s": total, "restarts": w.restarts, "transport": rt.transport}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.recovery", description=__doc__)
    p.add_argument("--model", default="synthetic:small")
    p.add_argument("--samples", type=int, default=5)
    p.add_argument("--transport", default="auto")
    args = p.parse_args(argv)
    samples = []
    for i in range(args.samples):
        samples.append(one_sample(args.model, args.transport))
        print(f"sample {i + 1}/{args.samples}: {samples[-1]['recovery_s'] * 1e3:.0f} ms", file=sys.stderr)
    s = spread([x["recovery_s"] * 1e3 for x in samples])
    print(f"recovery after SIGKILL (kill -> next successful request), {args.model}, "
          f"{samples[0]['transport']}: median {s['median']:.0f} ms [{s['min']:.0f}-{s['max']:.0f}]")
    print(json.dumps({"benchmark": "mlxrt-recovery", "model": args.model, "recovery_ms": s,
                      "samples": samples, "env": describe()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
