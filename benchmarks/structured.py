"""``python -m benchmarks.structured``: what structured output costs, in-process on the worker's `Engine`.

- compile: building llguidance's tokenizer (once per worker), checking a
  typical schema at the edge (no tokenizer), compiling it against the
  tokenizer, and its first mask (llguidance builds lexer states lazily);
- replies: a few to a typical schema, and whether the complete ones parse;
- decode: the aggregate decode rate of N streams, all constrained by a JSON
  schema vs all unconstrained, A/B interleaved over rounds, greedy, EOS off.
  The rate is counted over the window in which all N sequences decode
  together (from the last first token to the first last token), so a reply
  that completes early does not change the batch being measured; the schema
  asks for at least 50 array items, so replies run to max_tokens.

A table goes to stdout, then the path of the JSON document (``--json``,
benchmarks/runner.py) and a short summary line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

from mlxrt.ipc.protocol import EngineOptions, Generate, Grammar, SamplingParams
from mlxrt.synthetic.build import ensure_model
from mlxrt.worker.engine import Engine
from mlxrt.worker.grammar import GrammarCache, _compile

from . import runner
from .measure import ratio_spread, spread

TYPICAL = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 40},
        "date": {"type": "string", "format": "date"},
        "temperature_c": {"type": "number", "minimum": -90, "maximum": 60},
        "conditions": {"enum": ["sunny", "cloudy", "rain", "snow", "storm"]},
        "wind": {"type": "object", "properties": {"speed_kmh": {"type": "number", "minimum": 0},
                                                  "direction": {"enum": ["N", "E", "S", "W"]}},
                 "required": ["speed_kmh", "direction"], "additionalProperties": False},
        "alerts": {"type": "array", "items": {"type": "string", "maxLength": 80}, "maxItems": 5},
    },
    "required": ["city", "date", "temperature_c", "conditions", "wind"],
    "additionalProperties": False,
}
#: Rows of small objects, at least 50: a reply that cannot complete within the benchmark's max_tokens.
LONG = {"type": "array", "minItems": 50, "items": {
    "type": "object", "additionalProperties": False, "required": ["id", "ok", "tag"],
    "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 999}, "ok": {"type": "boolean"},
                   "tag": {"enum": ["alpha", "beta", "gamma"]}}}}
PROMPT = "Write the weather report for the coast as JSON, one row per station:"


class Clock:
    """A listener that times every token of every request."""

    def __init__(self) -> None:
        self.times: dict[int, list[float]] = {}
        self.reasons: dict[int, str] = {}

    def started(self, req_id: int) -> None:
        pass

    def token(self, req_id: int, token: int, text: str) -> None:
        self.times.setdefault(req_id, []).append(time.perf_counter())

    def done(self, req_id: int, stats, text: str) -> None:
        self.reasons[req_id] = stats.finish_reason

    def failed(self, req_id: int, exc: BaseException) -> None:
        raise exc


def decode_rate(engine: Engine, streams: int, tokens: int, grammar: Grammar | None) -> tuple[float, int]:
    """Tokens/s of `streams` sequences decoding together, and how many replies completed early."""
    clock = Clock()
    for i in range(streams):
        params = SamplingParams(max_tokens=tokens, ignore_eos=True, grammar=grammar)
        engine.submit(Generate(id=i, prompt=f"{PROMPT} {i}", params=params), clock)
    while engine.busy:
        engine.step()
    start = max(ts[0] for ts in clock.times.values())
    end = min(ts[-1] for ts in clock.times.values())
    n = sum(1 for ts in clock.times.values() for t in ts if start < t <= end)
    early = sum(1 for r in clock.reasons.values() if r != "length")
    return n / (end - start), early


def validity(engine: Engine, replies: int, tokens: int) -> dict[str, int]:
    """Replies to the typical schema, greedy and sampled: how many ended how, and how many parsed."""
    grammar = Grammar(kind="json_schema", source=json.dumps(TYPICAL))
    clock = Texts()
    for i in range(replies):
        params = SamplingParams(max_tokens=tokens, grammar=grammar, temperature=0.0 if i % 2 else 1.0, seed=i)
        engine.submit(Generate(id=i, prompt=f"{PROMPT} {i}", params=params), clock)
    while engine.busy:
        engine.step()
    counts = {"stop": 0, "length": 0, "other": 0, "parsed": 0}
    for i, reason in clock.reasons.items():
        counts[reason if reason in counts else "other"] += 1
        if reason == "stop":
            reply = json.loads(clock.text[i])
            counts["parsed"] += set(TYPICAL["required"]) <= set(reply)
    return counts


class Texts(Clock):
    def __init__(self) -> None:
        super().__init__()
        self.text: dict[int, str] = {}

    def token(self, req_id: int, token: int, text: str) -> None:
        self.text[req_id] = self.text.get(req_id, "") + text

    def done(self, req_id: int, stats, text: str) -> None:
        self.token(req_id, -1, text)
        self.reasons[req_id] = stats.finish_reason


def compile_figures(engine: Engine, repeats: int) -> dict[str, float]:
    """Milliseconds: llguidance's tokenizer, the edge check, a compile and its first mask (medians)."""
    from mlxrt.orchestrator.structured import _problem

    fresh = GrammarCache(engine.tokenizer, engine.vocab_size, engine.tokenizer.eos_token_ids)
    t0 = time.perf_counter()
    llt = fresh.tokenizer()
    tokenizer_ms = (time.perf_counter() - t0) * 1e3
    grammar = Grammar(kind="json_schema", source=json.dumps(TYPICAL))
    check, comp, first = [], [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        assert _problem.__wrapped__(grammar.kind, grammar.source) == ""
        t1 = time.perf_counter()
        matcher = _compile(llt, grammar)
        t2 = time.perf_counter()
        matcher.compute_bitmask()
        t3 = time.perf_counter()
        check.append((t1 - t0) * 1e3)
        comp.append((t2 - t1) * 1e3)
        first.append((t3 - t2) * 1e3)
    return {"tokenizer_ms": tokenizer_ms, "check_ms": statistics.median(check),
            "compile_ms": statistics.median(comp), "first_mask_ms": statistics.median(first)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.structured", description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="small", help="synthetic preset (default small)")
    p.add_argument("--streams", default="1,16", help="comma-separated stream counts (default 1,16)")
    p.add_argument("--tokens", type=int, default=128, help="max_tokens per stream (default 128)")
    p.add_argument("--rounds", type=int, default=5, help="interleaved A/B rounds (default 5)")
    p.add_argument("--cpu", action="store_true", help="run on MLX's CPU backend even where a GPU is")
    runner.add_json_arg(p, study="structured")
    args = p.parse_args(argv)
    if args.cpu:
        import mlx.core as mx

        mx.set_default_device(mx.cpu)
    levels = [int(s) for s in args.streams.split(",")]
    engine = Engine(str(ensure_model(args.preset)), options=EngineOptions(decode_concurrency=max(levels),
                                                                            prompt_cache_bytes=0))
    engine.warmup(16)
    grammar = Grammar(kind="json_schema", source=json.dumps(LONG))
    decode_rate(engine, 1, 8, grammar)  # compile LONG and warm its lexer outside the measurement
    out: dict = {"preset": args.preset, "tokens": args.tokens, "rounds": args.rounds,
                 "compile": compile_figures(engine, 20), "decode": {}, "env": runner.environment(),
                 "typical_schema_replies": validity(engine, 8, 256)}
    for n in levels:
        rates: dict[str, list[float]] = {"plain": [], "json_schema": []}
        early = 0
        for r in range(args.rounds):
            order = ["plain", "json_schema"] if r % 2 == 0 else ["json_schema", "plain"]
            for mode in order:
                rate, done = decode_rate(engine, n, args.tokens, grammar if mode == "json_schema" else None)
                rates[mode].append(rate)
                early += done if mode == "json_schema" else 0
            print(f"streams={n} round {r + 1}: plain {rates['plain'][-1]:.1f} tok/s, "
                  f"json_schema {rates['json_schema'][-1]:.1f} tok/s", file=sys.stderr)
        out["decode"][str(n)] = {
            "plain_tps": spread(rates["plain"]), "json_schema_tps": spread(rates["json_schema"]),
            "ratio": ratio_spread(rates["json_schema"], rates["plain"]), "completed_early": early,
        }
    print("| streams | unconstrained tok/s | json_schema tok/s | ratio, median [min-max] |")
    print("|---|---|---|---|")
    for n, d in out["decode"].items():
        r = d["ratio"]
        print(f"| {n} | {d['plain_tps']['median']:.1f} | {d['json_schema_tps']['median']:.1f} | "
              f"{runner.span(r, '.3f')} |")
    print(f"\ntypical schema, 8 replies of at most 256 tokens: {out['typical_schema_replies']}")
    c = out["compile"]
    print(f"\ncompile (ms): tokenizer {c['tokenizer_ms']:.1f}, edge check {c['check_ms']:.2f}, "
          f"compile {c['compile_ms']:.2f}, first mask {c['first_mask_ms']:.2f}")
    ratios = {n: d["ratio"]["median"] for n, d in out["decode"].items()}
    runner.finish(out, runner.json_path(args.json, "structured"),
                  {"benchmark": "mlxrt-structured", "preset": args.preset, "ratio_median_by_streams": ratios})
    return 0


if __name__ == "__main__":
    sys.exit(main())
