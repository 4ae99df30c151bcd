"""``python -m benchmarks.recovery``: time from a worker's SIGKILL to the next successful request.

Each sample starts a fresh runtime (so every kill is a first crash, with the
default supervision policy: 0.5 s backoff), warms it, SIGKILLs the active
worker and times a request made right after: without a spare it waits for
the replacement (backoff, process start, model load, warm-up); with one
(``--spares 0,1`` measures both, interleaved A B A B) the spare takes the
dead worker's place at once. Each request must succeed, and with a spare it
must be served by the former spare. The JSON document goes to ``--json`` (benchmarks/runner.py);
stdout ends with the figures, its path and a short summary line.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time

from . import runner
from .measure import spread


def one_sample(model: str, transport: str, spares: int = 0) -> dict:
    from mlxrt import Runtime

    with Runtime(model=model, transport=transport, spares=spares) as rt:
        rt.generate("warm up", max_tokens=4)
        t0 = time.perf_counter()  # the same request on the warm worker: what recovery adds to
        rt.generate("Hello after the crash", max_tokens=8, ignore_eos=True)
        request_s = time.perf_counter() - t0
        active, *standby = rt.workers
        t0 = time.perf_counter()
        os.kill(active.pid, signal.SIGKILL)
        c = rt.generate("Hello after the crash", max_tokens=8, ignore_eos=True)
        total = time.perf_counter() - t0
        w = rt.workers[0]
        assert len(c.tokens) == 8 and w.pid != active.pid and w.restarts == 1
        assert not standby or w.pid == standby[0].pid, "the spare did not take over"
        ready = rt.model_info()  # the serving worker's own record of its start
        return {"recovery_s": total, "request_s": request_s, "spares": spares, "restarts": w.restarts,
                "transport": rt.transport,
                "worker_load_s": ready.load_s if ready else None,
                "worker_warmup_s": ready.warmup_s if ready else None}


def _spares(text: str) -> list[int]:
    return [int(x) for x in text.split(",")]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.recovery", description=__doc__)
    p.add_argument("--model", default="synthetic:small")
    p.add_argument("--samples", type=int, default=5, help="per --spares value")
    p.add_argument("--transport", default="auto")
    p.add_argument("--spares", type=_spares, default=[0], help="comma-separated, e.g. 0,1 (default 0)")
    runner.add_json_arg(p, study="recovery")
    args = p.parse_args(argv)
    samples: dict[int, list[dict]] = {n: [] for n in args.spares}
    for i in range(args.samples):
        for n in args.spares:  # interleaved, so drift on a shared machine hits both alike
            samples[n].append(one_sample(args.model, args.transport, n))
            print(f"sample {i + 1}/{args.samples}, spares={n}: {samples[n][-1]['recovery_s'] * 1e3:.0f} ms",
                  file=sys.stderr)
    results = {}
    for n, got in samples.items():
        s = spread([x["recovery_s"] * 1e3 for x in got])
        results[str(n)] = {"recovery_ms": s, "samples": got}
        print(f"recovery after SIGKILL (kill -> next successful request), {args.model}, "
              f"{got[0]['transport']}, spares={n}: median {runner.span(s, '.0f')} ms"
              f"; the same request without a crash: median "
              f"{spread([x['request_s'] * 1e3 for x in got])['median']:.0f} ms")
    first = results[str(args.spares[0])]
    doc = {"benchmark": "mlxrt-recovery", "model": args.model, "recovery_ms": first["recovery_ms"],
           "samples": first["samples"], "by_spares": results, "env": runner.environment()}
    median_ms = {n: r["recovery_ms"]["median"] for n, r in results.items()}
    summary = {"benchmark": doc["benchmark"], "model": args.model, "recovery_ms_median_by_spares": median_ms}
    runner.finish(doc, runner.json_path(args.json, "recovery"), summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
