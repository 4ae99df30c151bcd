"""Where a resumed request's time goes in a fresh (spare-like) engine: first use against later uses."""
import sys, time
import mlx.core as mx
from mlxrt.synthetic.build import ensure_model
from mlxrt.worker.engine import Engine
from mlxrt.ipc.protocol import Generate, SamplingParams, Resume

name = sys.argv[1] if len(sys.argv) > 1 else "small"
path = str(ensure_model(name))

class L:
    def __init__(s): s.ids, s.t_first, s.stats = [], None, None
    def started(s, i): pass
    def token(s, req_id, token, text, reasoning="", calls=None, *, logprob=None, index=0):
        if s.t_first is None: s.t_first = time.perf_counter()
        s.ids.append(token)
    def done(s, req_id, stats, *a, **k): s.stats = stats
    def failed(s, req_id, exc): raise exc

def run(eng, req):
    l = L(); t = time.perf_counter(); eng.submit(req, l)
    while eng.busy: eng.step()
    return l, (l.t_first - t) * 1e3

PROMPTS = [f"Write a long story number {i} about a lighthouse keeper and the ships she guides through storms." for i in range(8)]
def req(i, resume=None, n=200):
    return Generate(id=i, prompt=PROMPTS[i], params=SamplingParams(max_tokens=n, ignore_eos=True), resume=resume)

ref = Engine(path); ref.warmup(4)
refs = [run(ref, req(i))[0].ids for i in range(6)]
t = time.perf_counter(); spare = Engine(path); spare.warmup(4); print(f"spare load+warmup {time.perf_counter()-t:.2f} s")
for i, label in [(0, "1st resume (50)"), (1, "2nd resume (50)"), (2, "3rd resume (50)")]:
    l, ms = run(spare, req(i, Resume(tokens=[refs[i][:50]])))
    print(f"{label}: ttft {ms:.0f} ms, prefill {l.stats.prefill_ms:.0f} ms, same {refs[i][50:] == l.ids}", flush=True)
l, ms = run(spare, req(3, n=60)); print(f"plain request: ttft {ms:.0f} ms, decode {l.stats.decode_tps:.0f} tok/s")
l, ms = run(spare, req(4, Resume(tokens=[refs[4][:5]]))); print(f"resume (5): ttft {ms:.0f} ms, prefill {l.stats.prefill_ms:.0f}")
l, ms = run(spare, req(5, Resume(tokens=[refs[5][:150]]))); print(f"resume (150): ttft {ms:.0f} ms, prefill {l.stats.prefill_ms:.0f}")
# the raw model calls: 50 one-token calls on a fresh cache, evaluated every 32, after a 20-token prefill
from mlx_lm.models.cache import make_prompt_cache
m = spare.model
for rep in range(3):
    c = make_prompt_cache(m); m(mx.array([list(range(1, 21))]), cache=c); mx.eval([x.state for x in c])
    t = time.perf_counter()
    for k in range(50):
        m(mx.array([[100 + k]]), cache=c)
        if k % 32 == 31: mx.eval([x.state for x in c])
    mx.eval([x.state for x in c]); print(f"raw 50 singles, rep {rep}: {(time.perf_counter()-t)*1e3:.0f} ms", flush=True)
    t = time.perf_counter()
    for k in range(50):
        y = m(mx.array([[100 + k]]), cache=c); mx.eval(y)
    print(f"raw 50 singles, eval each: {(time.perf_counter()-t)*1e3:.0f} ms", flush=True)
    t = time.perf_counter()
    for k in range(50):
        m(mx.array([[100 + k]]), cache=c); mx.async_eval([x.state for x in c])
    mx.eval([x.state for x in c]); print(f"raw 50 singles, async each: {(time.perf_counter()-t)*1e3:.0f} ms", flush=True)
