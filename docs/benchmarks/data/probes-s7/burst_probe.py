"""A burst through the engine in-process: 16 at once, or 1 then 15 (as the ring delivers them), against
mlx-lm's BatchGenerator."""
import sys, time
import mlx.core as mx
from mlxrt.synthetic.build import ensure_model
from mlxrt.worker.engine import Engine
from mlxrt.ipc.protocol import Generate, SamplingParams, EngineOptions

name = sys.argv[1] if len(sys.argv) > 1 else "small"
P, G, N = (int(x) for x in (sys.argv[2:5] if len(sys.argv) > 4 else (256, 64, 16)))
path = str(ensure_model(name))

class L:
    def __init__(s, t0): s.t0, s.first, s.n, s.stats = t0, {}, {}, {}
    def started(s, i): pass
    def token(s, req_id, token, text, reasoning="", calls=None, *, logprob=None, index=0):
        s.first.setdefault(req_id, time.perf_counter() - s.t0); s.n[req_id] = s.n.get(req_id, 0) + 1
    def done(s, req_id, stats, *a, **k): s.stats[req_id] = stats
    def failed(s, req_id, exc): raise exc

eng = Engine(path, options=EngineOptions(prefill_budget_ms=0)); eng.warmup(4)
tok = eng.tokenizer
import random
def prompts(k):
    r = random.Random(k)
    return [[r.randrange(10, 2000) for j in range(P)] for i in range(N)]
def req(i, ids): return Generate(id=i, prompt_ids=ids, params=SamplingParams(max_tokens=G, ignore_eos=True))
def med(xs): xs = sorted(xs); return xs[len(xs)//2]
import gc
MODES = ("together", "one-then-rest", "native", "together-gc-frozen", "together-after-clear",
         "one-then-rest-noclear")
real_clear = mx.clear_cache
for rnd in range(3):
    for mode in MODES:
        ps = prompts(rnd * 10 + MODES.index(mode) + 1)
        mx.clear_cache = (lambda: None) if mode.endswith("noclear") else real_clear
        if mode == "together-after-clear":
            real_clear()
        if mode == "together-gc-frozen":
            gc.collect(); gc.freeze(); gc.disable()
        else:
            gc.enable(); gc.unfreeze()
        t0 = time.perf_counter()
        if mode == "native":
            from mlx_lm.generate import BatchGenerator
            gen = BatchGenerator(eng.model, max_tokens=G, completion_batch_size=32, prefill_batch_size=8)
            uids = gen.insert(ps, [G] * N); first = {}
            while rs := gen.next_generated():
                for r in rs: first.setdefault(r.uid, time.perf_counter() - t0)
            gen.close(); total = time.perf_counter() - t0
            print(f"{mode:14s} total {total:.2f} s, TTFT median {med(first.values()):.2f} s", flush=True)
            continue
        l = L(t0); calls = eng.prefill_calls
        if mode.startswith("together"):
            for i, p in enumerate(ps): eng.submit(req(i, p), l)
        else:  # one-then-rest*
            eng.submit(req(0, ps[0]), l); eng.step()
            for i, p in enumerate(ps[1:], 1): eng.submit(req(i, p), l)
        while eng.busy: eng.step()
        total = time.perf_counter() - t0
        print(f"{mode:14s} total {total:.2f} s, TTFT median {med(l.first.values()):.2f} s, batch {med([s.mean_batch_size for s in l.stats.values()]):.1f}, solo {eng.solo_requests}", flush=True)
