"""Eviction: more chat sessions than the prefix cache's memory tier holds, with the disk tier and without.

``--sessions`` chats, each under a system prompt of its own (``--prefix-tokens`` of the synthetic corpus),
take their first turn one after another, then their second turn in the same order, in one runtime whose
memory tier holds only a few of them (``--memory-bytes``): by the time a chat returns, the memory tier
has evicted it. Two runtimes take the same turns, one with the disk tier (a new directory) and one
without (memory only); which goes first alternates by round. Figures: the returning turns' TTFT as the
caller sees it and their hit rate (cached prompt tokens over prompt tokens); the two arms' tokens must
be equal (greedy).

``python -m benchmarks.disk_evict --model synthetic:small --sessions 8 --prefix-tokens 3000``
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

STUDY = "disk-evict"


#: The disk tier's counters each run reports (DiskCacheReport).
DISK_COUNTS = ("hits", "writes", "skipped", "evicted_writes")


def one_arm(model: str, chats: list[list[dict[str, str]]], memory_bytes: int, cache_dir: str | None,
            tokens: int) -> list[dict[str, Any]]:
    """Every chat's first turn, then every chat's second, in one runtime; the second turns' figures."""
    opts = EngineOptions(prompt_cache_bytes=memory_bytes, prompt_cache_dir=cache_dir)
    with Runtime(model=model, engine=opts) as rt:
        rt.generate("warm up", max_tokens=2)
        for msgs in chats:
            rt.generate(msgs, max_tokens=tokens, temperature=0.0, ignore_eos=True)
        out = []
        for msgs in chats:
            later = [*msgs, {"role": "assistant", "content": "Hello."},
                     {"role": "user", "content": "And what comes next?"}]
            sent = time.perf_counter()
            stream = rt.stream(later, max_tokens=tokens, temperature=0.0, ignore_eos=True)
            first, ids = None, []
            for chunk in stream:
                first = first or time.perf_counter()
                ids += chunk.tokens
            s = stream.stats
            out.append({"ttft_ms": (first - sent) * 1e3, "cached_tokens": s.cached_tokens,
                        "prompt_tokens": s.prompt_tokens, "tokens": ids})
        disk = [m.disk_cache for m in rt.memory() if m.disk_cache]
        for row in out:  # the run's totals, on each row
            row.update({f"disk_{k}": sum(getattr(d, k) for d in disk) for k in DISK_COUNTS})
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.disk_evict", description=__doc__.split("\n")[0])
    p.add_argument("--model", default="synthetic:small")
    p.add_argument("--sessions", type=int, default=8)
    p.add_argument("--prefix-tokens", type=int, default=3000, help="each chat's system prompt (default 3000)")
    p.add_argument("--memory-bytes", type=int, default=16 << 20, help="the memory tier's cap (16 MiB)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--tokens", type=int, default=8, help="tokens generated per turn (default 8)")
    runner.add_json_arg(p, study=STUDY)
    args = p.parse_args(argv)
    path, tokenizer = model_tokenizer(args.model)
    arms: dict[str, list[dict[str, Any]]] = {"disk": [], "memory-only": []}
    identical = True
    for r in range(args.rounds):
        chats = []
        for s in range(args.sessions):
            ids, _ = make_prompt(tokenizer, args.prefix_tokens, start=101 * r + 13 * s)
            chats.append([{"role": "system", "content": tokenizer.decode(ids)},
                          {"role": "user", "content": f"Session {s}: hello."}])
        got = {}
        for name in (["disk", "memory-only"] if r % 2 == 0 else ["memory-only", "disk"]):
            with tempfile.TemporaryDirectory(prefix="mlxrt-evict-") as d:
                disk = d if name == "disk" else None
                got[name] = one_arm(path, chats, args.memory_bytes, disk, args.tokens)
            arms[name] += got[name]
        identical &= [x["tokens"] for x in got["disk"]] == [x["tokens"] for x in got["memory-only"]]
        print(f"round {r}: " + ", ".join(
            f"{n} TTFT {runner.span([x['ttft_ms'] for x in got[n]], '.0f')} ms" for n in got), flush=True)
    figures = {}
    for name, rows in arms.items():
        cached, prompt = (sum(x[k] for x in rows) for k in ("cached_tokens", "prompt_tokens"))
        ttft = runner.span([x["ttft_ms"] for x in rows], ".0f")
        figures[name] = {"ttft_ms": ttft, "hit_rate": cached / prompt}
    print(f"\nreturning turns, {args.sessions} sessions x {args.rounds} rounds, memory tier "
          f"{args.memory_bytes / 2**20:.0f} MiB, prompt {arms['disk'][0]['prompt_tokens']} tokens:")
    for name, f in figures.items():
        last = arms[name][-1]
        disk = {k: last[f"disk_{k}"] for k in DISK_COUNTS} if name == "disk" else ""
        print(f"  {name:<12} TTFT {f['ttft_ms']} ms, hit rate {f['hit_rate']:.2f} {disk}")
    doc = {"benchmark": STUDY, "env": runner.environment(), "args": vars(args), "figures": figures,
           "turns": {n: [{k: v for k, v in x.items() if k != "tokens"} for x in rows]
                     for n, rows in arms.items()},
           "identical": identical}
    status = "ok" if identical else "tokens differ"
    runner.finish(doc, runner.json_path(args.json, STUDY), {"benchmark": STUDY, "status": status,
                                                            "figures": figures})
    return 0 if identical else 1


if __name__ == "__main__":
    sys.exit(main())
