"""``python -m benchmarks``: end-to-end decode speed of mlxrt against native MLX.

Scenarios run in interleaved rounds (A B C A B C ...) after a warm-up, greedy,
EOS disabled, on the same prompt ids; every mlxrt scenario must produce the
native token ids (the quality gate: a mismatch fails the run). The last line
of stdout is one JSON document with every figure.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys

from .env import default_preset, describe
from .measure import ratio_spread, spread
from .scenarios import Embedded, Native, Skipped

SCENARIOS = ("native", "mlxrt-ring", "mlxrt-stdio")


def make_scenario(name: str, model: str):
    if name == "native":
        return Native(model)
    if name.startswith("mlxrt-"):
        return Embedded(model, name.removeprefix("mlxrt-"))
    raise ValueError(f"unknown scenario {name!r}; choose from {SCENARIOS}")


def prompt_ids(n: int, vocab: int, seed: int = 0) -> list[int]:
    """`n` seeded pseudo-random ids from the low part of the vocabulary (real merges)."""
    rng = random.Random(seed)
    return [rng.randrange(10, max(11, min(vocab, 2000))) for _ in range(n)]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__)
    p.add_argument("--model", help="model dir, HF id or synthetic:PRESET (default: by backend)")
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--gen-tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--only", help=f"comma-separated scenarios from {','.join(SCENARIOS)}")
    p.add_argument("--json", help="also write the JSON document to this path")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    model = args.model or f"synthetic:{default_preset()}"
    from mlxrt.worker.engine import resolve_model_path

    path = resolve_model_path(model)
    names = args.only.split(",") if args.only else list(SCENARIOS)
    if "native" not in names:
        names.insert(0, "native")  # the baseline and the token reference
    scenarios, skipped = [], {}
    for name in names:
        try:
            s = make_scenario(name, path)
            s.setup()
            scenarios.append(s)
        except (Skipped, Exception) as exc:  # report and go on with the others
            skipped[name] = f"{type(exc).__name__}: {exc}"
            print(f"skip {name}: {skipped[name]}", file=sys.stderr)
    native = scenarios[0]
    vocab = len(native.tokenizer.vocab) if hasattr(native.tokenizer, "vocab") else 2000
    ids = prompt_ids(args.prompt_tokens, vocab)
    runs: dict[str, list] = {s.name: [] for s in scenarios}
    try:
        for s in scenarios:
            s.run(ids, min(16, args.gen_tokens))  # warm-up
        for r in range(args.rounds):
            for s in scenarios:
                runs[s.name].append(s.run(ids, args.gen_tokens))
            print(f"round {r + 1}/{args.rounds} done", file=sys.stderr)
    finally:
        for s in scenarios:
            s.close()
    result = summarize(runs, skipped, args, model)
    print_table(result)
    doc = json.dumps(_finite(result), default=str, allow_nan=False)
    if args.json:
        with open(args.json, "w") as f:
            f.write(doc + "\n")
    print(doc)
    return 0 if result["tokens_identical"] else 1


def summarize(runs: dict[str, list], skipped: dict, args: argparse.Namespace, model: str) -> dict:
    ref = runs["native"][0].tokens
    base_tps = [r.decode_tps for r in runs["native"]]
    base_ttft = [r.ttft_ms for r in runs["native"]]
    scenarios = {}
    identical = True
    for name, rs in runs.items():
        same = all(r.tokens == ref for r in rs)
        identical &= same
        tps = [r.decode_tps for r in rs]
        ttft = [r.ttft_ms for r in rs]
        scenarios[name] = {
            "decode_tps": spread(tps),
            "ttft_ms": spread(ttft),
            "ratio_to_native": ratio_spread(tps, base_tps),
            "ttft_overhead_ms": spread([a - b for a, b in zip(ttft, base_ttft, strict=True)]),
            "tokens_identical": same,
            "runs": [r.summary() for r in rs],
        }
    return {
        "benchmark": "mlxrt-e2e",
        "model": model,
        "prompt_tokens": args.prompt_tokens,
        "gen_tokens": args.gen_tokens,
        "rounds": args.rounds,
        "scenarios": scenarios,
        "skipped": skipped,
        "tokens_identical": identical,
        "env": describe(),
    }


def print_table(result: dict) -> None:
    head = f"{'scenario':<14} {'decode tok/s':>22} {'x native':>18} {'TTFT ms':>16} {'TTFT +ms':>9} tokens"
    print(head)
    print("-" * len(head))
    for name, s in result["scenarios"].items():
        d, r, t, o = s["decode_tps"], s["ratio_to_native"], s["ttft_ms"], s["ttft_overhead_ms"]
        print(
            f"{name:<14} {d['median']:>8.1f} [{d['min']:.1f}-{d['max']:.1f}]".ljust(38)
            + f" {r['median']:>6.3f} [{r['min']:.3f}-{r['max']:.3f}]".ljust(19)
            + f" {t['median']:>7.2f} [{t['min']:.1f}-{t['max']:.1f}]".ljust(17)
            + f" {o['median']:>+8.2f} {'same' if s['tokens_identical'] else 'DIFFERENT'}"
        )
    for name, why in result["skipped"].items():
        print(f"{name:<14} skipped: {why}")


def _finite(o: object) -> object:
    """NaN and infinities become null: the JSON document must be strict JSON."""
    if isinstance(o, float) and not math.isfinite(o):
        return None
    if isinstance(o, dict):
        return {k: _finite(v) for k, v in o.items()}
    if isinstance(o, list):
        return [_finite(v) for v in o]
    return o


if __name__ == "__main__":
    sys.exit(main())
