"""Restart: how fast a chat's next turn starts after its server restarts, with the disk tier and without.

Each round takes a system prompt of its own (``--prefix-tokens`` of the synthetic corpus, so no round
finds another's prefix), then, each in a fresh `Runtime` of one worker (a restart):

1. ``cold``: the first turn, with the disk tier in a new directory (nothing cached anywhere);
2. ``disk``: the next turn, sent as soon as the runtime, started again over that directory, is ready
   (the returning turn; the worker's lookup loads the prefix, or its warming has already read it);
3. ``disk-warmed``: the same, sent once the started worker has read the newest entries back into
   its memory tier while idle (`EngineOptions.prompt_cache_warm_bytes`; ``warm_s``: from ready to
   read back), as a turn a second or more after a restart finds it;
4. ``memory-only``: the same next turn, started again without a disk tier (today's restart);

steps 2-4 in an order that turns with the round, 2 and 3 each over a copy of the directory as the
first turn left it. Figures: each turn's TTFT as the caller sees it (from
the request to its first chunk: the worker's wait, the disk load and the prefill), and its cached
prompt tokens; the returning turn's tokens must equal the memory-only turn's (greedy). The disk files
were just written, so they are read from the OS's page cache, as after a server restart (not after a
reboot).

``--peers vllm-mlx`` runs the same three turns in the same round through vllm-mlx's server
(``python -m vllm_mlx.cli serve PATH --continuous-batching``, its site directory first on the path:
`benchmarks.http_scenario.vllm_mlx_site`, ``.peers/vllm-mlx`` or ``MLXRT_BENCH_VLLM_MLX_SITE``).
vllm-mlx saves its prefix cache under ``~/.cache/vllm-mlx`` when
it stops and loads all of it back before it listens, so each of its turns is a server start (HOME a
directory of the round's, so the cache is the round's alone), one streamed chat completion, and a
SIGTERM that waits for the save; its restart cost is split between ``ready_s`` (start to listening,
the load included) and the turn's TTFT. Its returning turns compare as text (it sends no ids).

``python -m benchmarks.disk_restart --model synthetic:qwen3-8b-4bit --prefix-tokens 16000``
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any

from mlxrt import EngineOptions, Runtime

from . import runner
from .e2e import make_prompt, model_tokenizer
from .http_scenario import vllm_mlx_site
from .peers import ServerProcess, free_port, sse_events

STUDY = "disk-restart"


def turn(model: str, messages: list[dict[str, str]], cache_dir: str | None, tokens: int, *,
         warm_timeout_s: float | None = None) -> dict[str, Any]:
    """One turn in a freshly started runtime; its TTFT (ms), cached tokens and ids. With
    `warm_timeout_s`, the turn is sent once the worker has read a disk entry back into memory."""
    opts = EngineOptions(prompt_cache_dir=cache_dir)
    t0 = time.perf_counter()
    warm_s = None
    with Runtime(model=model, engine=opts) as rt:
        started = time.perf_counter() - t0
        if warm_timeout_s is not None:
            deadline = time.monotonic() + warm_timeout_s
            while not any(m.disk_cache and m.disk_cache.warmed for m in rt.memory()):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"no disk entry read back within {warm_timeout_s:g} s "
                                       "(--warm-timeout-s)")
                time.sleep(0.05)
            warm_s = time.perf_counter() - t0 - started
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
            "start_s": started, "warm_s": warm_s,
            "disk_cache_hits": sum(m.disk_cache.hits for m in memory if m.disk_cache)}


VLLM_MLX_STOP_S = 300.0  # a SIGTERM'd vllm-mlx writes its whole prefix cache before it exits


def vllm_mlx_turn(model: str, messages: list[dict[str, str]], home: str, tokens: int) -> dict[str, Any]:
    """One turn through a vllm-mlx server started over `home`, then stopped (its cache saved): TTFT (ms),
    start-to-listening (s), cached tokens as it reports them, and the reply's text."""
    port = free_port()
    site = vllm_mlx_site()[0] or ""
    path = os.pathsep.join(x for x in (site, os.environ.get("PYTHONPATH", "")) if x)
    t0 = time.perf_counter()
    server = ServerProcess(
        [sys.executable, "-m", "vllm_mlx.cli", "serve", model, "--continuous-batching",
         "--host", "127.0.0.1", "--port", str(port)],
        health="/health", base=f"http://127.0.0.1:{port}", env={"HOME": home, "PYTHONPATH": path})
    ready = time.perf_counter() - t0
    first = None
    text: list[str] = []
    usage: dict[str, Any] = {}
    try:
        body = {"model": model, "messages": messages, "max_tokens": tokens, "temperature": 0.0,
                "stream": True, "stream_options": {"include_usage": True}}
        sent = time.perf_counter()
        for event in sse_events(server.base, "/v1/chat/completions", body):
            for choice in event.get("choices") or []:
                if piece := (choice.get("delta") or {}).get("content"):
                    first = first or time.perf_counter()
                    text.append(piece)
            usage = event.get("usage") or usage
    finally:
        stopping = time.perf_counter()
        server.proc.send_signal(signal.SIGTERM)
        try:
            server.proc.wait(VLLM_MLX_STOP_S)
        except subprocess.TimeoutExpired:
            print(f"vllm-mlx did not stop within {VLLM_MLX_STOP_S:g} s: {server.log_tail()}", flush=True)
        stop_s = time.perf_counter() - stopping
        server.close()
    if first is None:
        raise RuntimeError(f"vllm-mlx sent no content: {server.log_tail()}")
    return {"ttft_ms": (first - sent) * 1e3, "ready_s": ready, "stop_s": stop_s,
            "prompt_tokens": usage.get("prompt_tokens"),
            "cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens"),
            "tokens": "".join(text)}


def peer_rounds(path: str, first: list[dict[str, str]], later: list[dict[str, str]], order: list[str],
                tokens: int) -> dict[str, Any]:
    """vllm-mlx's cold, disk and memory-only turns of one round, in `order` after the cold one."""
    with tempfile.TemporaryDirectory(prefix="mlxrt-vllm-mlx-") as home:
        row: dict[str, Any] = {"cold": vllm_mlx_turn(path, first, home, tokens)}
        for name in order:
            with tempfile.TemporaryDirectory(prefix="mlxrt-vllm-mlx-") as fresh:
                row[name] = vllm_mlx_turn(path, later, home if name == "disk" else fresh, tokens)
    row["identical"] = row["disk"]["tokens"] == row["memory-only"]["tokens"]
    print(f"  vllm-mlx: cold {row['cold']['ttft_ms']:.0f} ms, disk {row['disk']['ttft_ms']:.0f} ms "
          f"(ready {row['disk']['ready_s']:.1f} s, {row['disk']['cached_tokens']} cached), memory-only "
          f"{row['memory-only']['ttft_ms']:.0f} ms (ready {row['memory-only']['ready_s']:.1f} s), "
          f"identical={row['identical']}", flush=True)
    return row


def peer_figures(rounds: list[dict[str, Any]], peer: str) -> dict[str, Any]:
    """A peer's medians over the rounds: TTFT and time to listening per turn, the disk/memory ratio."""
    v = [r[peer] for r in rounds]
    turns = ("cold", "disk", "memory-only")
    return {"ttft_ms": {n: runner.span([x[n]["ttft_ms"] for x in v], ".0f") for n in turns},
            "ready_s": {n: runner.span([x[n]["ready_s"] for x in v], ".1f") for n in turns},
            "stop_s": runner.span([x["cold"]["stop_s"] for x in v], ".1f"),
            "disk_over_memory_only": runner.span(
                [x["disk"]["ttft_ms"] / x["memory-only"]["ttft_ms"] for x in v], ".3f"),
            "identical": all(x["identical"] for x in v)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.disk_restart", description=__doc__.split("\n")[0])
    p.add_argument("--model", default="synthetic:small")
    p.add_argument("--prefix-tokens", type=int, default=3000, help="system prompt tokens (default 3000)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--tokens", type=int, default=8, help="tokens generated per turn (default 8)")
    p.add_argument("--warm-timeout-s", type=float, default=120.0,
                   help="how long the disk-warmed turn waits for its worker to read an entry back (s)")
    p.add_argument("--peers", default="", help="peers to run in the same rounds, comma-separated: vllm-mlx")
    runner.add_json_arg(p, study=STUDY)
    args = p.parse_args(argv)
    peers = {x.strip() for x in args.peers.split(",") if x.strip()}
    if peers - {"vllm-mlx"}:
        p.error(f"--peers: unknown {sorted(peers - {'vllm-mlx'})}; known: vllm-mlx")
    path, tokenizer = model_tokenizer(args.model)
    rounds: list[dict[str, Any]] = []
    for r in range(args.rounds):
        ids, _ = make_prompt(tokenizer, args.prefix_tokens, start=7 * r)
        system = tokenizer.decode(ids)
        first = [{"role": "system", "content": system}, {"role": "user", "content": f"Round {r}: hello."}]
        later = [*first, {"role": "assistant", "content": "Hello."},
                 {"role": "user", "content": "And what comes next?"}]
        turns = ["disk", "disk-warmed", "memory-only"]
        order = turns[r % 3:] + turns[: r % 3]
        with tempfile.TemporaryDirectory(prefix="mlxrt-disk-") as d:
            row: dict[str, Any] = {"cold": turn(path, first, f"{d}/first", args.tokens)}
            for name in order:
                if name == "memory-only":
                    row[name] = turn(path, later, None, args.tokens)
                    continue
                shutil.copytree(f"{d}/first", f"{d}/{name}")  # the directory as the first turn left it
                row[name] = turn(path, later, f"{d}/{name}", args.tokens,
                                 warm_timeout_s=args.warm_timeout_s if name == "disk-warmed" else None)
        disk, warm, mem = row["disk"], row["disk-warmed"], row["memory-only"]
        row["identical"] = disk["tokens"] == warm["tokens"] == mem["tokens"]
        row["cached_turns_identical"] = disk["tokens"] == warm["tokens"]  # one load, one prefill order
        print(f"round {r}: cold {row['cold']['ttft_ms']:.0f} ms, disk {disk['ttft_ms']:.0f} ms "
              f"({disk['cached_tokens']} cached), disk-warmed {warm['ttft_ms']:.0f} ms "
              f"({warm['cached_tokens']} cached, read back in {warm['warm_s']:.2f} s), "
              f"memory-only {mem['ttft_ms']:.0f} ms, identical={row['identical']}", flush=True)
        if "vllm-mlx" in peers:
            row["vllm-mlx"] = peer_rounds(path, first, later, [t for t in order if t != "disk-warmed"],
                                          args.tokens)
        rounds.append(row)
    figures = {name: runner.span([r[name]["ttft_ms"] for r in rounds], ".0f")
               for name in ("cold", "disk", "disk-warmed", "memory-only")}
    ratios = [r["disk"]["ttft_ms"] / r["memory-only"]["ttft_ms"] for r in rounds]
    warmed = [r["disk-warmed"]["ttft_ms"] / r["memory-only"]["ttft_ms"] for r in rounds]
    warm_s = runner.span([r["disk-warmed"]["warm_s"] for r in rounds], ".2f")
    print(f"\nTTFT ms, median [min-max] over {args.rounds} rounds, prompt "
          f"{rounds[0]['disk']['prompt_tokens']} tokens:")
    for name, text in figures.items():
        print(f"  {name:<12} {text}")
    print(f"  disk / memory-only: {runner.span(ratios, '.3f')}")
    print(f"  disk-warmed / memory-only: {runner.span(warmed, '.3f')} (read back {warm_s} s after ready)")
    peer_doc = {peer: peer_figures(rounds, peer) for peer in sorted(peers)}
    for peer, figs in peer_doc.items():
        print(f"{peer}, same rounds:")
        for key, val in figs.items():
            print(f"  {key:<22} {val}")
    doc = {"benchmark": STUDY, "env": runner.environment(), "args": vars(args),
           "rounds": rounds,
           "ttft_ms": figures, "disk_over_memory_only": runner.span(ratios, ".3f"),
           "warmed_over_memory_only": runner.span(warmed, ".3f"), "warm_s": warm_s, "peers": peer_doc}
    status = "ok" if all(r["identical"] for r in rounds) else "tokens differ"
    if not all(f["identical"] for f in peer_doc.values()):
        status += "; a peer's returning turns differ"
    runner.finish(doc, runner.json_path(args.json, STUDY),
                  {"benchmark": STUDY, "status": status, "ttft_ms": figures,
                   "disk_over_memory_only": runner.span(ratios, ".3f"),
                   "warmed_over_memory_only": runner.span(warmed, ".3f")})
    return 0 if status == "ok" else 1


if __name__ == "__main__":
    sys.exit(main())
