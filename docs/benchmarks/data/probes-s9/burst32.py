# A throwaway probe of session 9 (not part of the harness): N prompts of 128 tokens at once, 128 tokens each, in-process:
# mlx-lm BatchGenerator ("bg") against mlxrt Engine at the given budgets, rounds interleaved. Run from a worktree with its venv:
# python docs/benchmarks/data/probes-s9/burst32.py 32 bg,200,0
import sys, time, statistics
sys.path.insert(0, '.')
from mlxrt.ipc.protocol import EngineOptions, Generate, SamplingParams
from mlxrt.worker.engine import Engine
from benchmarks.e2e import make_prompt, model_tokenizer

N, GEN = int(sys.argv[1]), 128
path, tok = model_tokenizer("synthetic:small")
variants = sys.argv[2].split(",")

class L:
    def __init__(s): s.first, s.n, s.t0 = {}, 0, time.perf_counter()
    def started(s, i): pass
    def token(s, i, *a, **k):
        s.n += 1; s.first.setdefault(i, time.perf_counter() - s.t0)
    def done(s, *a, **k): pass
    def failed(s, i, e): raise e

engines = {}
for v in variants:
    if v == "bg": continue
    budget = int(v)
    engines[v] = Engine("synthetic:small", options=EngineOptions(prompt_cache_bytes=0, prefill_budget_ms=budget))
from mlx_lm import load
from mlx_lm.generate import BatchGenerator
model, _ = load(path)

def run_engine(e, prompts):
    l = L()
    for i, p in enumerate(prompts):
        e.submit(Generate(id=i, prompt_ids=p, params=SamplingParams(max_tokens=GEN, ignore_eos=True)), l)
    while e.busy: e.step()
    return l.n / (time.perf_counter() - l.t0), statistics.median(l.first.values())

def run_bg(prompts):
    gen = BatchGenerator(model, completion_batch_size=32, prefill_batch_size=8)
    t0 = time.perf_counter(); first = {}; n = 0
    uids = gen.insert(prompts, max_tokens=[GEN] * len(prompts)); live = set(uids)
    while live:
        _, rs = gen.next()
        for r in rs:
            n += 1; first.setdefault(r.uid, time.perf_counter() - t0)
            if r.finish_reason is not None: live.discard(r.uid)
    gen.close()
    return n / (time.perf_counter() - t0), statistics.median(first.values())

for rnd in range(3):
    for k, v in enumerate(variants):
        prompts = [make_prompt(tok, 128, start=1000 * rnd + 40 * k + i)[0] for i in range(N)]
        tps, ttft = run_bg(prompts) if v == "bg" else run_engine(engines[v], prompts)
        print(f"round {rnd} {v}: {tps:.1f} tok/s, TTFT median {ttft*1e3:.0f} ms", flush=True)
