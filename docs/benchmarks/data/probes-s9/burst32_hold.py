# A throwaway probe of session 9: the Engine as it is ("now") against one whose finished prompts wait to join the decode
# batch together (up to 8, or 3 steps, or none left unfinished), a 32-prompt burst in-process, rounds interleaved.
import sys, time, statistics
sys.path.insert(0, '.')
from mlxrt.ipc.protocol import EngineOptions, Generate, SamplingParams
from mlxrt.worker.engine import Engine
from mlxrt.worker import prefill as P
from benchmarks.e2e import make_prompt, model_tokenizer

def held_step(self):
    ready = [p for p in self._prefills if p.ready]
    unready = [p for p in self._prefills if not p.ready]
    self._held_steps = getattr(self, "_held_steps", 0) + (1 if ready else 0)
    if ready and (not unready or len(ready) >= 8 or self._held_steps >= 3 or not self._running):
        for p in ready:
            self._join(p)
        self._held_steps = 0
    spent = 0.0
    while any(not p.ready for p in self._prefills) and spent * 1e3 < self.sizer.budget_ms:
        live = [p for p in self._prefills if not p.ready]
        first = P.pick(live)
        size = self.sizer.size(spent * 1e3, cached=len(first.tokens))
        if size <= 0:
            break
        rows = P.batch_rows(live, first, size, self.prefill.batch_prompts)
        widest, cached = max(len(p.segments[0]) for p in rows), max(len(p.tokens) for p in rows)
        if len(rows) > 1:
            n, seconds = P.run_rows(self.model, rows, self._batch.stream); ended = True
        else:
            n, seconds, ended = P.run_chunk(self.model, rows[0], size, self._batch.stream)
        width = n if len(rows) == 1 else widest
        self.sizer.record(n, seconds, (len(rows), width, cached + width))
        self.prefill_tokens += n; self.prefill_calls += 1
        P.passed_over(live, rows, seconds)
        spent += seconds
        for p in rows:
            if ended and p.segments:
                self._boundary(p)

path, tok = model_tokenizer("synthetic:small")
class L:
    def __init__(s): s.first, s.n, s.t0 = {}, 0, time.perf_counter()
    def started(s, i): pass
    def token(s, i, *a, **k):
        s.n += 1; s.first.setdefault(i, time.perf_counter() - s.t0)
    def done(s, *a, **k): pass
    def failed(s, i, e): raise e
base = Engine("synthetic:small", options=EngineOptions(prompt_cache_bytes=0))
held = Engine("synthetic:small", options=EngineOptions(prompt_cache_bytes=0))
held._prefill_step = held_step.__get__(held)
N = int(sys.argv[1])
for rnd in range(3):
    for k, (name, e) in enumerate([("now", base), ("held", held)]):
        prompts = [make_prompt(tok, 128, start=1000 * rnd + 40 * k + i)[0] for i in range(N)]
        l = L()
        for i, p in enumerate(prompts):
            e.submit(Generate(id=i, prompt_ids=p, params=SamplingParams(max_tokens=128, ignore_eos=True)), l)
        while e.busy: e.step()
        print(f"round {rnd} {name}: {l.n / (time.perf_counter() - l.t0):.1f} tok/s, TTFT median {statistics.median(l.first.values())*1e3:.0f} ms", flush=True)
