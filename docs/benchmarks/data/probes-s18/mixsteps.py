# Prints a trace of probes-s12/site taken while `benchmarks.interleave --no-http` ran (job1.sh): for the
# scheduled engine's rounds after the first, B alone's fast-path steps, then the mix step by step from B's
# arrival for 5 s (each step's prefill chunks as (tokens, cache before, ms), its batch calls in ms), and
# the 1,024-token chunks of each, alone (fast path) and in the mix (the scheduler), compared.
#   python docs/benchmarks/data/probes-s18/mixsteps.py TRACE.jsonl
# A round's submits, in order: the scheduled engine's B alone, its mix (A, B, C), its C alone, then the
# same five for the engine at budget 0 (mlx-lm's BatchGenerator target submits nothing traced).
import json
import statistics
import sys

ev = sorted((json.loads(x) for x in open(sys.argv[1])), key=lambda e: e["t"])
subs = [i for i, e in enumerate(ev) if e["e"] == "submit"]
for r in range(1, len(subs) // 10):
    alone = [e for e in ev[subs[r * 10]:subs[r * 10 + 1]] if e["e"] == "_solo_step"]
    print(f"--- round {r}: B alone, fast-path steps (ms):", [round(e["d"] * 1e3) for e in alone])
    seg = ev[subs[r * 10 + 2]:subs[r * 10 + 4]]
    tb = ev[subs[r * 10 + 2]]["t"]
    print(f"--- round {r}: the mix from B's arrival (ms since)")
    for s in (e for e in seg if e["e"] == "STEP" and e["t"] - tb <= 5):
        inner = [e for e in seg if s["t"] <= e["t"] <= s["t"] + s["d"]]
        chunks = [(e["size"], e["after"], round(e["d"] * 1e3, 1)) for e in inner if e["e"] == "chunk"]
        batch = [round(e["d"] * 1e3, 1) for e in inner if e["e"] == "_batch_step"]
        print(f"{(s['t'] - tb) * 1e3:7.0f} step {s['d'] * 1e3:6.1f} running={s['running']} "
              f"prefilling={s['prefills']} solo={s['solo']} chunks={chunks} batch={batch}")
    # The 1,024-token steps, told by their time (100-190 ms): that also takes in round 1's last step (the
    # last 424 tokens, 171 ms) and round 2's first (123 ms); over the 20 at the mix's depths the medians
    # are 144.0 and 141.0 ms. These are whole fast-path steps, against the mix's chunk calls alone.
    solo = [e["d"] * 1e3 for e in alone if 100 < e["d"] * 1e3 < 190]
    mix = [e["d"] * 1e3 for e in ev[subs[r * 10 + 1]:subs[r * 10 + 4]]
           if e["e"] == "chunk" and e["size"] == 1024]
    print(f"round {r}: 1,024-token chunks alone (fast path) {len(solo)}, "
          f"median {statistics.median(solo):.1f} ms; in the mix (scheduler) {len(mix)}, "
          f"median {statistics.median(mix):.1f} ms")
