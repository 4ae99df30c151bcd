# Prints a trace of probes-s12/site (sitecustomize.py): for each process, each burst (requests arriving
# within 50 ms of each other, 4 or more) from its first arrival to its last first token: the arrivals,
# admissions and first tokens (count, first-last), and every step and call in between.
#   python docs/benchmarks/data/probes-s12/show.py DIR [MIN_REQUESTS]
import glob
import json
import os
import sys


def traces(folder):
    """Each process's trace in `folder`: (its path, its events in time order)."""
    for path in sorted(glob.glob(os.path.join(folder, "trace-*.jsonl"))):
        yield path, sorted((json.loads(x) for x in open(path)), key=lambda e: e["t"])


def bursts(ev):
    """The arrivals in `ev`, grouped into bursts: each within 50 ms of the one before."""
    out, cur = [], []
    for a in (e for e in ev if e["e"] == "arrive"):
        if cur and a["t"] - cur[-1]["t"] > 0.05:
            out.append(cur)
            cur = []
        cur.append(a)
    return out + [cur]


def main():
    least = int(sys.argv[2]) if len(sys.argv) > 2 else 4
    for path, ev in traces(sys.argv[1]):
        for b in (b for b in bursts(ev) if len(b) >= least):
            show(path, ev, b)


def show(path, ev, b):
    ids = {a["id"] for a in b}
    t0 = b[0]["t"]
    firsts = [e for e in ev if e["e"] == "first" and e["id"] in ids and e["t"] >= t0]
    subs = [e for e in ev if e["e"] == "submit" and e["id"] in ids and e["t"] >= t0]
    if not firsts:
        return
    t1 = max(e["t"] for e in firsts)
    ms = lambda t, t0=t0: (t - t0) * 1e3  # noqa: E731
    print(f"== {os.path.basename(path)}: {len(b)} requests arrived over {ms(b[-1]['t']):.1f} ms; "
          f"admitted {ms(subs[0]['t']):.1f}-{ms(subs[-1]['t']):.1f} ms ({len(subs)}); first tokens "
          f"{ms(min(e['t'] for e in firsts)):.1f}-{ms(t1):.1f} ms ({len(firsts)})")
    for e in ev:
        if e["e"] in ("arrive", "submit", "first") or e["t"] + e["d"] < t0 or e["t"] > t1:
            continue
        what = " ".join(f"{k}={v}" for k, v in e.items() if k not in ("e", "t", "d"))
        print(f"  {ms(e['t']):9.1f} ms {e['e']:14s} {e['d'] * 1e3:8.1f} ms  {what}")
    done = sorted(ms(e["t"]) for e in firsts)
    print("  first tokens at ms: " + " ".join(f"{x:.0f}" for x in done))


if __name__ == "__main__":
    main()
