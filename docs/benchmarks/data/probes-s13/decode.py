# A throwaway probe of session 13: for each traced worker (probes-s12/site), each burst of 16 or more
# requests, the decode steps after its last first token until the next burst: their median (all, and with
# the whole burst decoding), the batch step's median, and the GC pauses over 5 ms.
#   python docs/benchmarks/data/probes-s13/decode.py TRACE_DIR
import os
import statistics as st
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "probes-s12"))
from show import bursts, traces  # noqa: E402

for path, ev in traces(sys.argv[1]):
    found = bursts(ev)
    starts = [b[0]["t"] for b in found if b] + [float("inf")]
    for i, b in enumerate(found):
        ids = {a["id"] for a in b}
        firsts = [e["t"] for e in ev if e["e"] == "first" and e["id"] in ids]
        if len(b) < 16 or not firsts:
            continue
        t1 = max(firsts)

        def after(kind, ev=ev, t1=t1, end=starts[i + 1]):
            return [e for e in ev if e["e"] == kind and t1 < e["t"] < end]
        steps, nexts = after("STEP"), after("batch.next")
        gcs = [round(g["d"] * 1e3) for g in after("gc") if g["d"] > 0.005]
        if not steps:
            continue
        full = [s["d"] for s in steps if s.get("running") == len(b)]
        print(f"{os.path.basename(path)} {len(b)} streams: TTFT last {1e3 * (t1 - b[0]['t']):.0f} ms; "
              f"{len(steps)} steps, median {1e3 * st.median(s['d'] for s in steps):.2f} ms (full batch "
              f"{1e3 * st.median(full) if full else 0:.2f}, n={len(full)}), next "
              f"{1e3 * st.median(s['d'] for s in nexts):.2f}; decode span "
              f"{1e3 * (steps[-1]['t'] + steps[-1]['d'] - t1):.0f} ms; gc>5ms {gcs}")
