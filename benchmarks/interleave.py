"""A long prompt among running streams (issue 28's shape): does it freeze the others?

``python -m benchmarks.interleave [--model synthetic:small] [--b-tokens 3500] [--rounds 3]``:
stream A decodes `--a-tokens` tokens; `--b-after-s` after A a long prompt B arrives (`--b-tokens`
tokens, 8 to generate); `--c-after-s` after B a short request C (`--c-tokens` tokens, 8 to generate).
Every prompt is distinct (its own corpus paragraph), so no prefix is reused. Per target, round by
round (targets interleaved within a round): A's longest gap between two tokens, C's and B's TTFT in
the mix and alone. Targets: mlxrt's engine in-process (the prefill scheduler at its default budget; on
CUDA its chunks on the grid of `prefill.ChunkSizer`), the same engine with ``prefill_budget_ms=0``
(mlx-lm's prefill), mlx-lm's `BatchGenerator`, ``mlxrt serve`` and the peers of ``--peers``:
``mlx_lm.server`` and vllm-mlx (``--no-http`` leaves the servers out, ``--no-in-process`` the others).
Greedy, EOS off.
``--alone`` times only B alone: what the scheduler's smaller chunks cost a lone long prompt.

Writes the whole document to ``--out`` and ends with the table, that path and a one-line summary.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from .env import describe
from .peers import HTTP_PEERS

GEN_B = GEN_C = 8
IN_PROCESS_TARGETS = 3  # `make_targets`' first: a servers-only run gives each server the same prompts


class _Times:
    """A listener that stamps each request's tokens (perf_counter seconds)."""

    def __init__(self) -> None:
        self.tokens: dict[int, list[float]] = {}
        self.stats: dict[int, Any] = {}

    def started(self, req_id: int) -> None:
        pass

    def token(self, req_id: int, *args, **kwargs) -> None:
        self.tokens.setdefault(req_id, []).append(time.perf_counter())

    def done(self, req_id: int, stats: Any, *args, **kwargs) -> None:
        self.stats[req_id] = stats

    def failed(self, req_id: int, exc: BaseException) -> None:
        raise exc


def _figures(arrived: dict[str, float], tokens: dict[str, list[float]]) -> dict[str, float]:
    """A's longest gap and each request's TTFT, ms, from arrival times and token times (seconds)."""
    out = {f"ttft_{k}_ms": (tokens[k][0] - arrived[k]) * 1e3 for k in tokens}
    a = tokens.get("a", [])
    out["a_longest_gap_ms"] = max((t1 - t0 for t0, t1 in zip(a, a[1:], strict=False)), default=0.0) * 1e3
    return out


def _schedule(spec: dict[str, tuple[float, list[int], int]], submit: Callable, step: Callable,
              busy: Callable[[], bool]) -> dict[str, float]:
    """Submit each request at its offset (s) while stepping an in-process generator; arrival times."""
    t0, arrived = time.perf_counter(), {}
    pending = sorted(spec.items(), key=lambda kv: kv[1][0])
    while pending or busy():
        now = time.perf_counter()
        while pending and t0 + pending[0][1][0] <= now:
            name, (_, ids, n) = pending.pop(0)
            arrived[name] = time.perf_counter()
            submit(name, ids, n)
        if busy():
            step()
        elif pending:
            time.sleep(max(0.0, min(0.005, t0 + pending[0][1][0] - now)))
    return arrived


class EngineTarget:
    """mlxrt's `Engine` in-process, stepped on this thread."""

    def __init__(self, name: str, model: str, budget_ms: int | None) -> None:
        from mlxrt.ipc.protocol import EngineOptions
        from mlxrt.worker.engine import Engine

        opts = EngineOptions(prompt_cache_bytes=0)
        if budget_ms is not None:
            opts = EngineOptions(prompt_cache_bytes=0, prefill_budget_ms=budget_ms)
        self.name, self.engine = name, Engine(model, options=opts)

    def run(self, spec: dict[str, tuple[float, list[int], int]]) -> dict[str, float]:
        from mlxrt.ipc.protocol import Generate, SamplingParams

        rec, ids_of = _Times(), {}

        def submit(name: str, ids: list[int], n: int) -> None:
            ids_of[len(ids_of)] = name
            self.engine.submit(Generate(id=len(ids_of) - 1, prompt_ids=ids,
                                        params=SamplingParams(max_tokens=n, ignore_eos=True)), rec)

        arrived = _schedule(spec, submit, self.engine.step, lambda: self.engine.busy)
        out = _figures(arrived, {ids_of[i]: t for i, t in rec.tokens.items()})
        b = next((s for i, s in rec.stats.items() if ids_of[i] == "b"), None)
        if b is not None and self.engine.scheduled:  # mlx-lm's prefill (budget 0) counts neither
            # Where B's TTFT went: its own chunks, and its wait behind other prompts' chunks; the rest is
            # the others' decode steps and the steps' own costs.
            out |= {"prefill_b_ms": b.prefill_ms, "prefill_wait_b_ms": b.prefill_wait_ms}
        return out

    def close(self) -> None:
        pass


class BatchGeneratorTarget:
    """mlx-lm's `BatchGenerator` in-process with mlx_lm.server's defaults, stepped on this thread."""

    name = "mlx-lm BatchGenerator"

    def __init__(self, model: str) -> None:
        from mlx_lm import load

        self.model, _ = load(model)

    def run(self, spec: dict[str, tuple[float, list[int], int]]) -> dict[str, float]:
        from mlx_lm.generate import BatchGenerator

        gen = BatchGenerator(self.model, completion_batch_size=32, prefill_batch_size=8)
        names: dict[int, str] = {}
        tokens: dict[str, list[float]] = {}
        live: set[int] = set()

        def submit(name: str, ids: list[int], n: int) -> None:
            (uid,) = gen.insert([ids], max_tokens=[n])
            names[uid] = name
            live.add(uid)

        def step() -> None:
            _, responses = gen.next()
            now = time.perf_counter()
            for r in responses:
                tokens.setdefault(names[r.uid], []).append(now)
                if r.finish_reason is not None:
                    live.discard(r.uid)

        try:
            arrived = _schedule(spec, submit, step, lambda: bool(live))
        finally:
            gen.close()
        return _figures(arrived, tokens)

    def close(self) -> None:
        pass


class HttpTarget:
    """A server from `benchmarks.http_scenario`, each request on its own thread at its offset."""

    def __init__(self, server: Any) -> None:
        self.server, self.name = server, server.name
        server.setup()

    def run(self, spec: dict[str, tuple[float, list[int], int]]) -> dict[str, float]:
        runs: dict[str, Any] = {}
        errors: list[BaseException] = []

        def one(name: str, delay: float, ids: list[int], n: int) -> None:
            time.sleep(delay)
            try:
                runs[name] = self.server.run(ids, n)
            except BaseException as exc:  # noqa: BLE001  # reported after the join
                errors.append(exc)

        threads = [threading.Thread(target=one, args=(k, *v)) for k, v in spec.items()]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
        out = {f"ttft_{k}_ms": r.ttft_ms for k, r in runs.items()}
        if "a" in runs:  # between arrivals: a chunk of several tokens after a stall is one wait, not several
            out["a_longest_gap_ms"] = runs["a"].longest_gap_ms
        return out

    def close(self) -> None:
        self.server.close()


def make_targets(model: str, model_path: str, http: bool, peers: list[str], skipped: dict[str, str],
                 targets: list[Any], *, in_process: bool = True) -> None:
    """Append the targets to `targets` as each is ready (the caller closes those there, whatever happens);
    a peer that cannot run here is left out, and why is put in `skipped`."""
    if in_process:
        targets += [EngineTarget("mlxrt engine", model, None),  # auto: the scheduler, on every backend
                    EngineTarget("mlxrt engine, budget 0", model, 0), BatchGeneratorTarget(model_path)]
    if http:
        from .http_scenario import HttpStream
        from .peers import http_scenarios
        from .scenarios import Skipped

        targets.append(HttpTarget(HttpStream(model_path)))
        classes, why = http_scenarios()
        for name in peers:
            try:
                if name not in classes:
                    raise Skipped(why or f"benchmarks.http_scenario has no {name}")
                targets.append(HttpTarget(classes[name](model_path)))
            except Skipped as exc:
                skipped[name] = str(exc)
                print(f"{name}: skipped: {exc}", file=sys.stderr, flush=True)


def run_rounds(args: argparse.Namespace) -> dict[str, Any]:
    from .e2e import make_prompt, model_tokenizer

    path, tok = model_tokenizer(args.model)
    skipped: dict[str, str] = {}
    targets: list[Any] = []
    try:
        make_targets(args.model, path, args.http, args.peers, skipped, targets, in_process=args.in_process)
        rows: dict[str, list[dict[str, float]]] = {t.name: [] for t in targets}
        for r in range(args.rounds):
            for k, t in enumerate(targets, start=0 if args.in_process else IN_PROCESS_TARGETS):
                base = 1000 * r + 100 * k  # paragraphs of their own: no prefix shared with any other
                a = make_prompt(tok, args.a_prompt_tokens, start=base)[0]
                b = make_prompt(tok, args.b_tokens, start=base + 10)[0]
                c = make_prompt(tok, args.c_tokens, start=base + 60)[0]
                b1 = make_prompt(tok, args.b_tokens, start=base + 70)[0]
                c1 = make_prompt(tok, args.c_tokens, start=base + 95)[0]
                alone = t.run({"b": (0.0, b1, GEN_B)})
                mixed = {"ttft_b_alone_ms": alone["ttft_b_ms"]}
                if "prefill_b_ms" in alone:
                    mixed["prefill_b_alone_ms"] = alone["prefill_b_ms"]
                if not args.alone:
                    mixed |= t.run({"a": (0.0, a, args.a_tokens), "b": (args.b_after_s, b, GEN_B),
                                    "c": (args.b_after_s + args.c_after_s, c, GEN_C)})
                    mixed["ttft_c_alone_ms"] = t.run({"c": (0.0, c1, GEN_C)})["ttft_c_ms"]
                rows[t.name].append(mixed)
                print(f"round {r} {t.name}: " + ", ".join(f"{k}={v:.0f}" for k, v in mixed.items()),
                      file=sys.stderr, flush=True)
    finally:
        for t in targets:
            t.close()
    medians = {name: {k: statistics.median(x[k] for x in runs) for k in runs[0]}
               for name, runs in rows.items() if runs}
    return {"benchmark": "mlxrt-interleave", "config": vars(args), "rounds": rows, "medians": medians,
            "skipped": skipped, "servers": {t.name: t.server.describe() for t in targets
                                            if isinstance(t, HttpTarget)}, "env": describe()}


def table(doc: dict[str, Any]) -> str:
    if doc["config"]["alone"]:
        return "\n".join(["| target | B's TTFT alone |", "| --- | --- |"] + [
            f"| {name} | {m['ttft_b_alone_ms'] / 1e3:.2f} s |" for name, m in doc["medians"].items()])
    lines = ["| target | A's longest gap | C's TTFT (alone) | B's TTFT (alone) |",
             "| --- | --- | --- | --- |"]
    for name, m in doc["medians"].items():
        lines.append(f"| {name} | {m['a_longest_gap_ms'] / 1e3:.2f} s | {m['ttft_c_ms'] / 1e3:.2f} s "
                     f"({m['ttft_c_alone_ms'] / 1e3:.2f} s) | {m['ttft_b_ms'] / 1e3:.2f} s "
                     f"({m['ttft_b_alone_ms'] / 1e3:.2f} s) |")
    return "\n".join(lines)


def _peers(text: str) -> list[str]:
    names = [] if text == "none" else [n.strip() for n in text.split(",") if n.strip()]
    if unknown := [n for n in names if n not in HTTP_PEERS]:
        raise argparse.ArgumentTypeError(f"unknown peer {', '.join(unknown)}; choose from "
                                         f"{', '.join(HTTP_PEERS)} (or none)")
    return names


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.interleave", description=__doc__.split("\n")[0])
    p.add_argument("--model", default="synthetic:small")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--a-prompt-tokens", type=int, default=64)
    p.add_argument("--a-tokens", type=int, default=400)
    p.add_argument("--b-tokens", type=int, default=3500)
    p.add_argument("--c-tokens", type=int, default=60, help="about 40 words")
    p.add_argument("--b-after-s", type=float, default=1.0)
    p.add_argument("--c-after-s", type=float, default=0.3)
    p.add_argument("--no-http", dest="http", action="store_false", help="in-process targets only")
    p.add_argument("--peers", type=_peers, default=list(HTTP_PEERS),
                   help="the MLX servers beside mlxrt serve, comma-separated, or none (default: "
                        "mlx_lm.server,vllm-mlx; vllm-mlx runs from its own site directory, see "
                        "benchmarks.http_scenario.vllm_mlx_site, and is skipped with the reason where it "
                        "has none)")
    p.add_argument("--no-in-process", dest="in_process", action="store_false",
                   help="the servers only: on one GPU, four MLX processes of an 8B model and a 25k-token B "
                        "ran out of its memory (docs/benchmarks/gpu-h200-s21.md)")
    p.add_argument("--alone", action="store_true", help="only B, alone: what the chunk size costs")
    p.add_argument("--out", default="interleave.json")
    args = p.parse_args(argv)
    if not (args.http or args.in_process):
        p.error("--no-http with --no-in-process leaves nothing to run")
    doc = run_rounds(args)
    with open(args.out, "w") as f:
        json.dump(doc, f, indent=1)
    print(table(doc))
    print(args.out)
    short = {n: {k: round(v) for k, v in m.items()} for n, m in doc["medians"].items()}
    print(json.dumps({"benchmark": "interleave", "medians_ms": short})[:1000])
    return 0


if __name__ == "__main__":
    sys.exit(main())
