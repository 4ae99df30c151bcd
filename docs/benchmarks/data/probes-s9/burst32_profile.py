# A throwaway probe of session 9: cProfile of the Engine through a 32-prompt burst (128 tokens each) at a budget (argv[1]).
# Run from a worktree with its venv: python docs/benchmarks/data/probes-s9/burst32_profile.py 200
import sys, time, cProfile, pstats
sys.path.insert(0, '.')
from mlxrt.ipc.protocol import EngineOptions, Generate, SamplingParams
from mlxrt.worker.engine import Engine
from benchmarks.e2e import make_prompt, model_tokenizer
path, tok = model_tokenizer("synthetic:small")
budget = int(sys.argv[1])
e = Engine("synthetic:small", options=EngineOptions(prompt_cache_bytes=0, prefill_budget_ms=budget))
class L:
    def started(s, i): pass
    def token(s, *a, **k): pass
    def done(s, *a, **k): pass
    def failed(s, i, x): raise x
prompts = [make_prompt(tok, 128, start=5000 + i)[0] for i in range(32)]
for i, p in enumerate(prompts):
    e.submit(Generate(id=i, prompt_ids=p, params=SamplingParams(max_tokens=128, ignore_eos=True)), L())
pr = cProfile.Profile(); t0 = time.perf_counter(); steps = 0
pr.enable()
while e.busy:
    e.step(); steps += 1
pr.disable()
print("budget", budget, "wall", round(time.perf_counter() - t0, 2), "steps", steps, "prefill_calls", e.prefill_calls, "batched", e.prefill_batched)
pstats.Stats(pr).sort_stats("cumulative").print_stats(18)
