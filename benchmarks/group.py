"""A worker group against one process: decode and prefill speed, and what its collectives cost.

``python -m benchmarks.group [--model M] [--ranks 1,2] [--backend auto] [--rounds 5] ...``

Two parts, both through real processes:

- **speed**: a `Runtime` per rank count (1 = an ordinary worker), all loaded
  at once and measured in interleaved rounds (1 2 1 2 ...): one request alone
  (prefill tok/s, TTFT, decode tok/s, from the worker's own stats) and
  ``--batch`` requests at once (their tokens over the wall time). Greedy, EOS
  off, prefix cache off, a fresh prompt each round; each group's ids are
  compared with the one-process ids (reported in the table: pipeline
  parallelism gives the same ids; tensor parallelism in bfloat16 sums its
  shards' partial results in bfloat16, so its greedy ids may part from one
  process's after some tokens, as `mlx_lm`'s own tensor parallelism does).
- **collectives**: ``--probe-ranks`` processes joined exactly as a group's
  ranks are (the orchestrator's plan, the worker's `join`), timing what a
  group adds per engine step, `Lockstep.exchange` of an empty step (every
  decode step of a running batch) and of a step carrying a new request, a
  run of them to the end of the stream, and what tensor parallelism does
  twice per layer and token: an all_sum of one token's hidden state
  (float16, the model's hidden size), waited for.

Tables on stdout, progress on stderr; stdout ends with the path of the JSON document (``--json``,
benchmarks/runner.py) and a short summary line.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from . import runner
from .measure import spread

PROBE_ITERATIONS = 200
PROBE_TIMEOUT_S = 600
METRICS = ("prefill_tps", "ttft_ms", "decode_tps", "batch_tps")


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# -- speed ---------------------------------------------------------------------------------------


def prompt_ids(vocab: int, n: int, round_: int, k: int = 0) -> list[int]:
    """A prompt no earlier round has seen (the prefix cache is off anyway): ids in [16, vocab)."""
    base = 7919 * (round_ + 1) + 104729 * k
    return [16 + (base + 31 * i * i + 17 * i) % (vocab - 16) for i in range(n)]


def one_round(rt, vocab: int, args, round_: int) -> dict:
    params = {"max_tokens": args.gen_tokens, "ignore_eos": True}
    alone = rt.generate(prompt_ids(vocab, args.prompt_tokens, round_), **params)
    t0 = time.perf_counter()
    with ThreadPoolExecutor(args.batch) as pool:
        batch = list(pool.map(lambda k: rt.generate(prompt_ids(vocab, args.prompt_tokens, round_, k + 1),
                                                    **params), range(args.batch)))
    wall = time.perf_counter() - t0
    return {
        "prefill_tps": alone.stats.prompt_tps,
        "ttft_ms": alone.stats.ttft_ms,
        "decode_tps": alone.stats.decode_tps,
        "batch_tps": sum(len(c.tokens) for c in batch) / wall,
        "ids": [alone.tokens] + [c.tokens for c in batch],
    }


def speed(args, reference: list[list[int]] | None) -> dict:
    """`reference`: the lone prompts' ids from mlx-lm over a group of --probe-ranks, if measured."""
    from mlxrt import EngineOptions, Runtime

    cache = None if args.prompt_cache_bytes < 0 else args.prompt_cache_bytes
    engine = EngineOptions(prompt_cache_bytes=cache, decode_concurrency=max(args.batch, 1))
    runtimes = {}
    try:
        for n in args.ranks:
            log(f"loading {args.model} on {n} rank(s)")
            group = {} if n == 1 else {"ranks": n, "backend": args.backend, "sharding": args.sharding}
            # a one-rank worker on a host of several GPUs gets one of them from the pool, as a rank does
            runtimes[n] = Runtime(model=args.model, engine=engine, **group)
        vocab = next(iter(runtimes.values())).model_info().vocab_size
        rows: dict[int, list[dict]] = {n: [] for n in runtimes}
        for r in range(args.rounds + 1):  # round 0 warms up, unmeasured
            for n, rt in runtimes.items():
                got = one_round(rt, vocab, args, r)
                if r:
                    rows[n].append(got)
                log(f"round {r} ranks {n}: decode {got['decode_tps']:.1f} tok/s, "
                    f"prefill {got['prefill_tps']:.0f} tok/s, batch {got['batch_tps']:.1f} tok/s")
    finally:
        for rt in runtimes.values():
            rt.close()
    first = min(rows)
    out = {}
    for n, rs in rows.items():
        pairs = [(a, b) for x, y in zip(rs, rows[first], strict=True) for a, b in zip(x["ids"], y["ids"],
                                                                                        strict=True)]
        out[n] = {k: spread([x[k] for x in rs]) for k in METRICS}
        out[n]["same_ids"] = sum(a == b for a, b in pairs)
        out[n]["requests"] = len(pairs)
        out[n]["first_difference"] = min((_first_difference(a, b) for a, b in pairs if a != b), default=None)
        if reference is not None and n == args.probe_ranks:
            out[n]["same_as_mlx_lm"] = sum(x["ids"][0] == ref for x, ref in zip(rs, reference, strict=True))
    return out


def _first_difference(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


# -- collectives ---------------------------------------------------------------------------------


def probe(args) -> dict:
    """Start --probe-ranks processes as a group's ranks; rank 0's timings (microseconds)."""
    from mlxrt.ipc.protocol import GroupRank
    from mlxrt.orchestrator.launch import Group

    plan = Group(ranks=args.probe_ranks, backend=args.backend).plan()
    assert plan is not None
    procs = []
    for spec in plan.launch():
        rank = GroupRank(rank=spec.rank, size=plan.size, backend=plan.backend, sharding=args.sharding,
                         env=spec.env, files=spec.files)
        cmd = [sys.executable, "-m", "benchmarks.group", "--probe-rank", json.dumps(_builtins(rank)),
               "--hidden", str(args.hidden), "--model", args.model, "--rounds", str(args.rounds),
               "--prompt-tokens", str(args.prompt_tokens), "--gen-tokens", str(args.gen_tokens)]
        procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True,
                                      cwd=Path(__file__).resolve().parent.parent))
    return json.loads(_wait_all(procs, PROBE_TIMEOUT_S).strip().splitlines()[-1])


def _wait_all(procs: list[subprocess.Popen], timeout_s: float) -> str:
    """Rank 0's stdout once every probe rank exited 0; at the first that fails (or past `timeout_s`),
    the others are killed (a rank left inside a collective would wait for the lost one) and
    `RuntimeError` gives each rank's exit code. Each rank's stderr is this process's."""
    out: list[str] = []
    reader = threading.Thread(target=lambda: out.append(procs[0].stdout.read()), daemon=True)
    reader.start()
    deadline = time.monotonic() + timeout_s
    while any(p.poll() is None for p in procs):
        failed = any(p.poll() for p in procs)
        if failed or time.monotonic() > deadline:
            for p in procs:
                if p.poll() is None:
                    p.kill()
            codes = [p.wait() for p in procs]
            why = "a rank failed" if failed else f"they ran past {timeout_s:g} s (PROBE_TIMEOUT_S)"
            raise RuntimeError(f"probe ranks exited with {codes}: {why}; their stderr is above")
        time.sleep(0.2)
    reader.join(10)
    codes = [p.returncode for p in procs]
    if any(codes):
        raise RuntimeError(f"probe ranks exited with {codes}; their stderr is above")
    return out[0] if out else ""


def mlx_lm_ids(group, args) -> tuple[list[list[int]], list[float]]:
    """Each measured round's lone prompt, greedy, by mlx-lm alone over this group's shards: the ids,
    and the decode tok/s (first token to last)."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step
    from mlxrt.worker.engine import resolve_model_path

    model, _, config = group.load(resolve_model_path(args.model))
    vocab = int({**config.get("text_config", {}), **config}["vocab_size"])
    out, tps = [], []
    for r in range(1, args.rounds + 1):
        steps = generate_step(mx.array(prompt_ids(vocab, args.prompt_tokens, r)), model)
        ids, times = [], []
        for _, (t, _) in zip(range(args.gen_tokens), steps, strict=False):
            ids.append(int(t))
            times.append(time.perf_counter())
        out.append(ids)
        tps.append((len(ids) - 1) / (times[-1] - times[0]))
    # generate_step keeps a token queued: its collectives must meet the other ranks' before any exits.
    mx.eval(group._all_sum(mx.array([1])))
    return out, tps


def _builtins(obj):
    import msgspec

    return msgspec.to_builtins(obj)


def probe_rank(spec_json: str, args) -> None:
    """One probe rank: join as a worker's rank does, time the collectives, then generate each round's
    lone prompt with mlx-lm's own `generate_step` over `sharded_load`: the reference for a group."""
    import msgspec
    import structlog
    from mlxrt import logs
    from mlxrt.ipc.protocol import Generate, GroupRank, SamplingParams, Step
    from mlxrt.worker.group import Lockstep, join

    logs.configure(level="warning")  # stderr: stdout carries the result
    spec = msgspec.convert(json.loads(spec_json), GroupRank)
    # MLX only after join: it sets what CUDA reads once (CUDA_VISIBLE_DEVICES) and picks the device.
    group = join(spec, None, structlog.get_logger("probe"))  # type: ignore[arg-type]
    import mlx.core as mx
    from mlx_lm.generate import generation_stream

    lead = group.rank == 0
    new = Step(generate=[Generate(id=1, params=SamplingParams(max_tokens=256), prompt_ids=list(range(512)))])
    hidden = args.hidden
    x = mx.zeros((1, hidden), dtype=mx.float16)
    lockstep = Lockstep(group)

    def per_step(fn) -> float:
        """Microseconds per call, a run of them to the end of the model's stream (as steps follow
        one another), after a few unmeasured."""
        for _ in range(10):
            fn()
        mx.synchronize(generation_stream)
        t0 = time.perf_counter()
        for _ in range(PROBE_ITERATIONS):
            fn()
        mx.synchronize(generation_stream)
        return (time.perf_counter() - t0) * 1e6 / PROBE_ITERATIONS

    result = {
        "ranks": group.size,
        "backend": group.backend,
        "exchange_empty_us": per_step(lambda: lockstep.exchange(None)),
        "exchange_new_request_us": per_step(lambda: lockstep.exchange(new if lead else None)),
        "all_sum_hidden_us": per_step(lambda: mx.eval(group._all_sum(x))),
        "hidden": hidden,
        "step_frame_bytes": len(msgspec.msgpack.encode(new)),
    }
    lockstep.exchange(Step(stop=True) if lead else None)
    lockstep.exchange(None)  # both ranks see the stop: neither is left waiting
    result["mlx_lm_ids"], result["mlx_lm_decode_tps"] = mlx_lm_ids(group, args)
    if lead:
        print(json.dumps(result), flush=True)
    sys.stdout.flush()
    os._exit(0)


# -- report --------------------------------------------------------------------------------------


def _fmt(s: dict) -> str:
    return runner.span(s)


def report(args, result: dict) -> None:
    print(f"{args.model}, {result['machine']['device']}, backend {args.backend}, "
          f"{args.prompt_tokens}-token prompts, {args.gen_tokens} tokens, batch {args.batch}, "
          f"{args.rounds} interleaved rounds: median [min-max]")
    print(f"{'ranks':>5} {'prefill tok/s':>24} {'TTFT ms':>24} {'decode tok/s':>24} "
          f"{'batch tok/s':>24}  ids")
    for n, s in result.get("speed", {}).items():
        ids = f"{s['same_ids']}/{s['requests']} same"
        if s["first_difference"] is not None:
            ids += f", first difference at token {s['first_difference']}"
        if "same_as_mlx_lm" in s:
            ids += f"; alone {s['same_as_mlx_lm']}/{s['decode_tps']['n']} same as mlx-lm's on the same shards"
        print(f"{n:>5} {_fmt(s['prefill_tps']):>24} {_fmt(s['ttft_ms']):>24} {_fmt(s['decode_tps']):>24} "
              f"{_fmt(s['batch_tps']):>24}  {ids}")
    p = result.get("collectives")
    if p:
        print(f"collectives, {p['ranks']} ranks over {p['backend']}, {PROBE_ITERATIONS} in a row, us each:")
        print(f"  a step shared, empty (each decode step)        {p['exchange_empty_us']:8.1f}")
        print(f"  a step shared with a new 512-token request     {p['exchange_new_request_us']:8.1f}  "
              f"({p['step_frame_bytes']} bytes)")
        print(f"  all_sum of one token's hidden ({p['hidden']} fp16)    {p['all_sum_hidden_us']:8.1f}  "
              "(waited for; tensor parallel: 2 per layer and token)")
        print(f"mlx-lm's generate_step alone on the same {p['ranks']} shards, the lone prompts: decode "
              f"{_fmt(spread(p['mlx_lm_decode_tps']))} tok/s")


def main(argv: list[str] | None = None) -> dict | None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="synthetic:small")
    ap.add_argument("--ranks", default="1,2", help="rank counts to compare (1: an ordinary worker)")
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--sharding", default="auto")
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--gen-tokens", type=int, default=128)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--prompt-cache-bytes", type=int, default=0, help="the workers' prefix cache (default "
                    "0: off, each round's prompt is fresh anyway; -1: the engine's own default)")
    ap.add_argument("--probe-ranks", type=int, default=2, help="0: skip the collectives part")
    ap.add_argument("--hidden", type=int, default=None, help="default: the model's hidden_size")
    ap.add_argument("--only", choices=["speed", "collectives"], default=None)
    runner.add_json_arg(ap, study="group")
    ap.add_argument("--probe-rank", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.probe_rank is not None:
        probe_rank(args.probe_rank, args)
        return None
    args.ranks = [int(x) for x in args.ranks.split(",")]
    args.hidden = args.hidden or _hidden_size(args.model)
    given = {k: v for k, v in vars(args).items() if k != "probe_rank"}
    result: dict = {"machine": runner.environment(), "args": given}
    if args.only in (None, "collectives") and args.probe_ranks > 1:
        result["collectives"] = probe(args)
    if args.only in (None, "speed"):
        result["speed"] = speed(args, result.get("collectives", {}).pop("mlx_lm_ids", None))
    report(args, result)
    decode = {n: s["decode_tps"]["median"] for n, s in result.get("speed", {}).items()}
    runner.finish(result, runner.json_path(args.json, "group"),
                  {"benchmark": "mlxrt-group", "model": args.model, "decode_tps_median_by_ranks": decode})
    return result


def _hidden_size(model: str) -> int:
    from mlxrt.worker.engine import resolve_model_path

    config = json.loads((Path(resolve_model_path(model)) / "config.json").read_text())
    return int({**config.get("text_config", {}), **config}["hidden_size"])


if __name__ == "__main__":
    main()
