"""Restart: how fast a chat's next turn starts after its server restarts, with the disk tier and without.

Each round takes a system prompt of its own (``--prefix-tokens`` of the synthetic corpus, so no round
finds another's prefix), then, each in a fresh `Runtime` of one worker (a restart):

1. ``cold``: the first turn, with the disk tier in a new directory (nothing cached anywhere);
2. ``disk``: the next turn, the runtime started again over that directory (the returning turn);
3. ``memory-only``: the same next turn, started again without a disk tier (today's restart);

steps 2 and 3 alternating which goes first. Figures: each turn's TTFT as the caller sees it (from
the request to its first chunk: the worker's wait, the disk load and the prefill), and its cached
prompt tokens; the returning turn's tokens must equal the memory-only turn's (greedy). The disk files
were just written, so they are read from the OS's page cache, as after a server restart (not after a
reboot).

``python -m benchmarks.disk_restart --model synthetic:qwen3-8b-4bit --prefix-tokens 16000``
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from typing import Any

from mlxrt import EngineOptions, Runtime

from . import runner
from .e2e import make_prompt, model_tokenizer

STUDY = "disk-restart"


def turn(model: str, messages: list[dict[str, str]], cache_dir: str | None, tokens: int) -> dict[str, Any]:
    """One turn in a freshly started runtime; its TTFT (ms), cached tokens and ids."""
    opts = EngineOptions(prompt_cache_dir=cache_dir)
    t0 = time.perf_counter()
    with Runtime(model=model, engine=opts) as rt:
        started = time.perf_counter() - t0
        sent = time.perf_counter()
        stream = rt.stream(messages, max_tokens=tokens, temperature=0.0, ignore_eos=True)
        ids: list[int] = []
        first = None
        for chunk in stream:
            first = first or time.perf_counter()
            ids += chunk.tokens
        memory = rt.memory()
    stats = stream.stats
    assert stats is not None and first is not None
    return {"ttft_ms": (first - sent) * 1e3, "worker_queue_ms": stats.queue_ms,
            "worker_ttft_ms": stats.ttft_ms,
            "cached_tokens": stats.cached_tokens, "prompt_tokens": stats.prompt_tokens, "tokens": ids,
            "start_s": started, "disk_cache_hits": sum(m.disk_cache.hits for m in memory if m.disk_cache)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.disk_restart", description=__doc__.split("\n")[0])
    p.add_argument("--model", default="synthetic:small")
    p.add_argument("--prefix-tokens", type=int, default=3000, help="system prompt tokens (default 3000)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--tokens", type=int, default=8, help="tokens generated per turn (default 8)")
    runner.add_json_arg(p, study=STUDY)
    args = p.parse_args(argv)
    path, tokenizer = model_tokenizer(args.model)
    rounds: list[dict[str, Any]] = []
    for r in range(args.rounds):
        ids, _ = make_prompt(tokenizer, args.prefix_tokens, start=7 * r)
        system = tokenizer.decode(ids)
        first = [{"role": "system", "content": system}, {"role": "user", "content": f"Round {r}: hello."}]
        later = [*first, {"role": "assistant", "content": "Hello."},
                 {"role": "user", "content": "And what comes next?"}]
        with tempfile.TemporaryDirectory(prefix="mlxrt-disk-") as d:
            row = {"cold": turn(path, first, d, args.tokens)}
            order = ["disk", "memory-only"] if r % 2 == 0 else ["memory-only", "disk"]
            for name in order:
                row[name] = turn(path, later, d if name == "disk" else None, args.tokens)
        row["identical"] = row["disk"]["tokens"] == row["memory-only"]["tokens"]
        rounds.append(row)
        print(f"round {r}: cold {row['cold']['ttft_ms']:.0f} ms, disk {row['disk']['ttft_ms']:.0f} ms "
              f"({row['disk']['cached_tokens']} cached), memory-only {row['memory-only']['ttft_ms']:.0f} ms, "
              f"identical={row['identical']}", flush=True)
    figures = {name: runner.span([r[name]["ttft_ms"] for r in rounds], ".0f")
               for name in ("cold", "disk", "memory-only")}
    ratios = [r["disk"]["ttft_ms"] / r["memory-only"]["ttft_ms"] for r in rounds
              if r["memory-only"]["ttft_ms"]]
    print(f"\nTTFT ms, median [min-max] over {args.rounds} rounds, prompt "
          f"{rounds[0]['disk']['prompt_tokens']} tokens:")
    for name, text in figures.items():
        print(f"  {name:<12} {text}")
    print(f"  disk / memory-only: {runner.span(ratios, '.3f')}")
    doc = {"benchmark": STUDY, "env": runner.environment(), "args": vars(args),
           "rounds": [{k: ({kk: vv for kk, vv in v.items() if kk != "tokens"} if isinstance(v, dict) else v)
                       for k, v in r.items()} for r in rounds],
           "ttft_ms": figures, "disk_over_memory_only": runner.span(ratios, ".3f")}
    status = "ok" if all(r["identical"] for r in rounds) else "tokens differ"
    runner.finish(doc, runner.json_path(args.json, STUDY),
                  {"benchmark": STUDY, "status": status, "ttft_ms": figures,
                   "disk_over_memory_only": runner.span(ratios, ".3f")})
    return 0 if status == "ok" else 1


if __name__ == "__main__":
    sys.exit(main())
