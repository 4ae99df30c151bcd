# A throwaway probe of session 11 (not part of the harness): a burst's time, step by step, in-process:
# mlx-lm's BatchGenerator as the harness's native-batch runs it against mlxrt's Engine, interleaved.
#   python docs/benchmarks/data/probes-s11/steps.py MODEL N[,N..] GAP_MS[,GAP_MS..] [ROUNDS] [BUDGET[,..]]
# N prompts of $PROMPT tokens (512), $GEN tokens each (256), greedy, EOS off. For each: wall, tok/s, TTFT,
# the steps until every stream decodes (and their time), and the steady state's step: the median of
# BatchGenerator.next and of the rest of a step (the engine's own work).
import os
import statistics
import sys
import time

sys.path.insert(0, ".")
import mlx.core as mx  # noqa: E402
from mlx_lm.generate import BatchGenerator  # noqa: E402
from mlxrt.ipc.protocol import Generate, SamplingParams  # noqa: E402

from benchmarks.e2e import make_prompt, model_tokenizer  # noqa: E402
from benchmarks.interleave import EngineTarget, _schedule, _Times  # noqa: E402

PROMPT, GEN = int(os.environ.get("PROMPT", 512)), int(os.environ.get("GEN", 256))
NEXT: list[tuple[float, float, int]] = []  # start, seconds, decoding rows
_next = BatchGenerator._next  # next_generated (native's loop) calls _next, not next


def timed_next(self):
    t0 = time.perf_counter()
    try:
        return _next(self)
    finally:
        NEXT.append((t0, time.perf_counter() - t0, len(self._generation_batch)))


BatchGenerator._next = timed_next


def summary(label, n, wall, ttft, steps, n_tokens):
    """steps: (start, seconds, rows decoding, next's seconds or None) per step."""
    warm = [s for s in steps if s[2] == n]
    head = len(steps) - len(warm)
    step_ms = statistics.median(s[1] for s in warm) * 1e3 if warm else 0
    nxt = [s[3] for s in warm if s[3] is not None]
    nxt_ms = statistics.median(nxt) * 1e3 if nxt else step_ms
    print(f"  {label:28s} {n_tokens / wall:8.1f} tok/s  wall {wall:5.2f} s  TTFT median "
          f"{statistics.median(ttft):5.0f} ms [{min(ttft):.0f}-{max(ttft):.0f}]  "
          f"until all decode: {head} steps "
          f"{sum(s[1] for s in steps[:head]) * 1e3:.0f} ms; steady step {step_ms:.2f} ms "
          f"(next {nxt_ms:.2f}, rest {step_ms - nxt_ms:.2f}) x {len(warm)}", flush=True)


def native(model, prompts):
    n = len(prompts)
    gen = BatchGenerator(model, completion_batch_size=32, prefill_batch_size=8)
    NEXT.clear()
    t0 = time.perf_counter()
    uids = gen.insert(prompts, [GEN] * n)
    first, count = {}, 0
    while responses := gen.next_generated():
        now = time.perf_counter()
        for r in responses:
            first.setdefault(r.uid, now)
            count += 1
    wall = time.perf_counter() - t0
    gen.close()
    steps = [(s, d, rows, d) for s, d, rows in NEXT]
    summary("native-batch", n, wall, [(first[u] - t0) * 1e3 for u in uids], steps, count)


def engine(t, prompts, gap_ms, label):
    n = len(prompts)
    spec = {f"s{i}": (i * gap_ms / 1e3, p, GEN) for i, p in enumerate(prompts)}
    rec, ids_of = _Times(), {}

    def submit(name, ids, k):
        ids_of[len(ids_of)] = name
        t.engine.submit(Generate(id=len(ids_of) - 1, prompt_ids=ids,
                                 params=SamplingParams(max_tokens=k, ignore_eos=True)), rec)

    steps = []
    real_step = t.engine.step

    def step():
        NEXT.clear()
        s = time.perf_counter()
        real_step()
        d = time.perf_counter() - s
        nxt = sum(x[1] for x in NEXT) if NEXT else None
        steps.append((s, d, len(t.engine._running), nxt))

    t0 = time.perf_counter()
    arrived = _schedule(spec, submit, step, lambda: t.engine.busy)
    wall = time.perf_counter() - t0
    times = {ids_of[i]: v for i, v in rec.tokens.items()}
    ttft = [(times[k][0] - arrived[k]) * 1e3 for k in spec]
    summary(label, n, wall, ttft, steps, sum(len(v) for v in times.values()))


if __name__ == "__main__":
    model = sys.argv[1]
    ns = [int(x) for x in sys.argv[2].split(",")]
    gaps = [float(x) for x in sys.argv[3].split(",")]
    rounds = int(sys.argv[4]) if len(sys.argv) > 4 else 2
    budgets = sys.argv[5].split(",") if len(sys.argv) > 5 else ["auto"]
    path, tok = model_tokenizer(model)
    engines = [EngineTarget(f"budget {b}", model, None if b == "auto" else int(b)) for b in budgets]
    for t in engines:
        print(f"mlx {mx.__version__}, device {mx.default_device()}, engine decode_concurrency "
              f"{t.engine.decode_concurrency}, budget {t.engine.sizer.budget_ms} "
              f"scheduled {t.engine.scheduled}",
              flush=True)
    t = engines[0]
    for r in range(rounds + 1):  # round 0 builds the shapes
        for n in ns:
            prompts = [make_prompt(tok, PROMPT, start=1000 * r + 7 * i + 100 * n)[0] for i in range(n)]
            print(f"round {r}, {n} streams{' (warm-up)' if r == 0 else ''}:", flush=True)
            native(t.engine.model, prompts)
            for t in engines:
                for g in gaps:
                    engine(t, prompts, g, f"{t.name}, {g:g} ms apart")
