# A throwaway probe of session 9: a 32-prompt burst in-process, the engine as it is, the same with MLX's
# clear_cache a no-op (the scheduler clears after every chunk), and budget 0; rounds interleaved.
import sys, time, statistics
sys.path.insert(0, '.')
import mlx.core as mx
from mlxrt.ipc.protocol import EngineOptions, Generate, SamplingParams
from mlxrt.worker.engine import Engine
from benchmarks.e2e import make_prompt, model_tokenizer
path, tok = model_tokenizer("synthetic:small")
real_clear = mx.clear_cache
class L:
    def __init__(s): s.first, s.n, s.t0 = {}, 0, time.perf_counter()
    def started(s, i): pass
    def token(s, i, *a, **k):
        s.n += 1; s.first.setdefault(i, time.perf_counter() - s.t0)
    def done(s, *a, **k): pass
    def failed(s, i, e): raise e
engines = {"200": Engine("synthetic:small", options=EngineOptions(prompt_cache_bytes=0)),
           "200-noclear": Engine("synthetic:small", options=EngineOptions(prompt_cache_bytes=0)),
           "0": Engine("synthetic:small", options=EngineOptions(prompt_cache_bytes=0, prefill_budget_ms=0))}
for rnd in range(3):
    for k, (name, e) in enumerate(engines.items()):
        mx.clear_cache = (lambda: None) if name.endswith("noclear") else real_clear
        prompts = [make_prompt(tok, 128, start=1000 * rnd + 40 * k + i)[0] for i in range(32)]
        l = L(); steps = 0
        for i, p in enumerate(prompts):
            e.submit(Generate(id=i, prompt_ids=p, params=SamplingParams(max_tokens=128, ignore_eos=True)), l)
        while e.busy: e.step(); steps += 1
        mx.clear_cache = real_clear
        print(f"round {rnd} {name}: {l.n / (time.perf_counter() - l.t0):.1f} tok/s, TTFT median {statistics.median(l.first.values())*1e3:.0f} ms, steps {steps}", flush=True)
