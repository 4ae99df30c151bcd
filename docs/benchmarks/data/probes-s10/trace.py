# A throwaway probe of session 10 (not part of the harness): where a step's time goes, in-process.
#   python docs/benchmarks/data/probes-s10/trace.py mix MODEL B_TOKENS BUDGET [ROUNDS]
#     issue 28's long-prompt mix (benchmarks/interleave.py's shape: A decodes, B long, C short); prints the
#     engine's calls inside A's longest gap.
#   python docs/benchmarks/data/probes-s10/trace.py burst MODEL N GAP_MS BUDGET [ROUNDS]
#     N prompts of 512 tokens, 256 tokens each, arriving GAP_MS apart (a worker reads its ring between
#     steps); prints each step's calls until every stream has its first token, and the TTFTs.
# BUDGET: the engine's prefill_budget_ms ("auto": the engine's default).
import os
import statistics
import sys
import time

sys.path.insert(0, ".")
import importlib  # noqa: E402

mg = importlib.import_module("mlx_lm.generate")

from benchmarks.e2e import make_prompt, model_tokenizer  # noqa: E402
from benchmarks.interleave import EngineTarget, _figures, _schedule, _Times  # noqa: E402
from mlxrt.ipc.protocol import Generate, SamplingParams  # noqa: E402
from mlxrt.worker import prefill as pf  # noqa: E402

PROMPT, GEN = int(os.environ.get("PROMPT", 512)), int(os.environ.get("GEN", 256))
EVENTS: list[tuple[str, float, float, str]] = []  # name, start, seconds, what


def timed(name, fn, what=lambda *a, **k: ""):
    def wrapper(*a, **k):
        t0 = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            EVENTS.append((name, t0, time.perf_counter() - t0, what(*a, **k)))
    return wrapper


pf.run_chunk = timed("chunk", pf.run_chunk, lambda m, p, size, s: f"{size} tok after {len(p.tokens)}")
pf.run_rows = timed("rows", pf.run_rows, lambda m, rows, s: f"{len(rows)} rows")
mg.BatchGenerator.next = timed("batch.next", mg.BatchGenerator.next,
                               lambda self: f"{len(self._generation_batch)} decoding, "
                               f"{len(self._unprocessed_sequences)} prompts waiting")


def instrument(engine):
    if os.environ.get("GRID"):  # the grid's sizing off CUDA, to try it on a CPU
        engine.sizer.grid = True
    for name in ("_admit", "_prefill_step", "_solo_step", "_hand_over", "_deliver"):
        setattr(engine, name, timed(name, getattr(engine, name)))
    engine.step = timed("STEP", engine.step, lambda: f"waiting {len(engine._waiting)} prefills "
                        f"{len(engine._prefills)} running {len(engine._running)} solo {engine._solo is not None}")


def show(t_from, t_to, t0):
    for name, s, d, what in sorted(EVENTS, key=lambda e: e[1]):
        if s + d >= t_from and s <= t_to:
            print(f"  {(s - t0) * 1e3:9.1f} ms {name:14s} {d * 1e3:8.1f} ms  {what}")


def mix(model, b_tokens, budget, rounds):
    path, tok = model_tokenizer(model)
    t = EngineTarget(f"budget {budget}", model, None if budget == "auto" else int(budget))
    instrument(t.engine)
    for r in range(rounds):
        base = 1000 * r
        a = make_prompt(tok, 64, start=base)[0]
        b = make_prompt(tok, b_tokens, start=base + 10)[0]
        c = make_prompt(tok, 40, start=base + 60)[0]
        rec, ids_of = _Times(), {}

        def submit(name, ids, n):
            ids_of[len(ids_of)] = name
            t.engine.submit(Generate(id=len(ids_of) - 1, prompt_ids=ids,
                                     params=SamplingParams(max_tokens=n, ignore_eos=True)), rec)

        EVENTS.clear()
        arrived = _schedule({"a": (0.0, a, 400), "b": (1.0, b, 8), "c": (1.3, c, 8)}, submit, t.engine.step,
                            lambda: t.engine.busy)
        times = {ids_of[i]: v for i, v in rec.tokens.items()}
        fig = _figures(arrived, times)
        print(f"round {r}: " + ", ".join(f"{k}={v:.0f}" for k, v in fig.items()), flush=True)
        at = times["a"]
        gaps = sorted(((t1 - t0, t0, t1) for t0, t1 in zip(at, at[1:])), reverse=True)[:3]
        t0 = arrived["a"]
        print(f"  B arrived {(arrived['b'] - t0) * 1e3:.0f} ms, C {(arrived['c'] - t0) * 1e3:.0f} ms; "
              f"B's first token {(times['b'][0] - t0) * 1e3:.0f}, C's {(times['c'][0] - t0) * 1e3:.0f}")
        chunks = [e for e in EVENTS if e[0] in ("chunk", "rows")]
        print(f"  prefill calls {len(chunks)}: median {statistics.median(e[2] for e in chunks) * 1e3:.0f} ms, "
              f"max {max(e[2] for e in chunks) * 1e3:.0f} ms")
        for g, s, e in gaps:
            print(f" A's gap of {g * 1e3:.0f} ms, from {(s - t0) * 1e3:.0f} ms:")
            show(s, e, t0)


def burst(model, n, gap_ms, budget, rounds):
    path, tok = model_tokenizer(model)
    t = EngineTarget(f"budget {budget}", model, None if budget == "auto" else int(budget))
    instrument(t.engine)
    for r in range(rounds):
        spec = {f"s{i}": (i * gap_ms / 1e3, make_prompt(tok, PROMPT, start=1000 * r + 7 * i)[0], GEN)
                for i in range(n)}
        rec, ids_of = _Times(), {}

        def submit(name, ids, k):
            ids_of[len(ids_of)] = name
            t.engine.submit(Generate(id=len(ids_of) - 1, prompt_ids=ids,
                                     params=SamplingParams(max_tokens=k, ignore_eos=True)), rec)

        EVENTS.clear()
        t_start = time.perf_counter()
        arrived = _schedule(spec, submit, t.engine.step, lambda: t.engine.busy)
        wall = time.perf_counter() - t_start
        times = {ids_of[i]: v for i, v in rec.tokens.items()}
        ttft = [(times[k][0] - arrived[k]) * 1e3 for k in spec]
        total = sum(len(v) for v in times.values())
        print(f"round {r}: {n} streams {gap_ms} ms apart: {total / wall:.1f} tok/s, wall {wall:.2f} s, "
              f"TTFT median {statistics.median(ttft):.0f} ms [{min(ttft):.0f}-{max(ttft):.0f}]", flush=True)
        last_first = max(v[0] for v in times.values())
        show(t_start, last_first, t_start)


if __name__ == "__main__":
    kind, model = sys.argv[1], sys.argv[2]
    if kind == "mix":
        mix(model, int(sys.argv[3]), sys.argv[4], int(sys.argv[5]) if len(sys.argv) > 5 else 2)
    else:
        burst(model, int(sys.argv[3]), float(sys.argv[4]), sys.argv[5], int(sys.argv[6]) if len(sys.argv) > 6 else 2)
