"""``python -m benchmarks.grammar_step``: the grammar's share of one decode step at N constrained rows.

In-process, no model forward pass: each step takes random logits (N, V),
runs every row's `Constraint` as mlx-lm's batch step does (row by row), then
concatenates the rows and samples greedily, and times the step to the sampled
ids. Three ways, interleaved step by step on the same logits (so all sample
the same ids):

- none: no grammar (the concatenation and the sampling alone);
- per_row: each row advances its matcher and computes and expands its own mask
  (what every step did before `StepMasks`; still a row's first step and the
  single-stream path);
- batched: `StepMasks` advances all the rows and fills all their bitmasks
  through llguidance's executor, and expands them in one gather.

The grammar's cost per step is a way's time minus none's. The schema is
`benchmarks.structured.LONG` (an array of at least 50 objects); a row whose
grammar completes starts over. A table goes to stdout, then the path of the JSON document
(``--json``, benchmarks/runner.py) and a short summary line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import mlx.core as mx
from mlxrt.ipc.protocol import EngineOptions, Grammar
from mlxrt.synthetic.build import ensure_model
from mlxrt.worker.engine import Engine
from mlxrt.worker.grammar import GrammarCache, StepMasks

from . import runner
from .measure import spread
from .structured import LONG

WAYS = ("none", "per_row", "batched")


class Rows:
    """N constrained rows fed one way, with the ids they sampled so far."""

    def __init__(self, grammars: GrammarCache, grammar: Grammar, n: int, way: str) -> None:
        self.grammars, self.grammar, self.way = grammars, grammar, way
        self.cons = [grammars.constraint(grammar) for _ in range(n)]
        self.last: list[int] = [0] * n
        self.masks = StepMasks()

    def step(self, logits: mx.array) -> list[int]:
        """One step's masking and greedy sampling; the sampled ids."""
        rows = [logits[i : i + 1] for i in range(logits.shape[0])]
        if self.way != "none":
            if self.way == "batched":
                ready = [c for c in self.cons if c.batchable]
                self.masks.plan(ready, mx.array([self.last[self.cons.index(c)] for c in ready]))
            rows = [c(mx.array([self.last[i]]), rows[i]) for i, c in enumerate(self.cons)]
            self.masks.clear()
        ids = mx.argmax(mx.concatenate(rows), axis=-1).tolist()
        self.last = ids
        for i, c in enumerate(self.cons):
            if c.finish_reason is not None:  # complete (or dead): a fresh row in its place
                self.cons[i] = self.grammars.constraint(self.grammar)
        return ids


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.grammar_step", description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="small", help="synthetic preset (its tokenizer; default small)")
    p.add_argument("--rows", type=int, default=16, help="constrained rows per step (default 16)")
    p.add_argument("--steps", type=int, default=200, help="timed steps per way (default 200)")
    runner.add_json_arg(p, study="grammar-step")
    args = p.parse_args(argv)
    engine = Engine(str(ensure_model(args.preset)), options=EngineOptions(prompt_cache_bytes=0))
    grammar = Grammar(kind="json_schema", source=json.dumps(LONG))
    ways = {w: Rows(engine.grammars, grammar, args.rows, w) for w in WAYS}
    mx.random.seed(0)
    times: dict[str, list[float]] = {w: [] for w in WAYS}
    for step in range(args.steps + 10):
        logits = mx.random.normal((args.rows, engine.vocab_size))
        mx.eval(logits)
        for w in WAYS if step % 2 else reversed(WAYS):
            t0 = time.perf_counter()
            ways[w].step(logits)
            if step >= 10:  # the first steps build lexer states and compile the MLX ops
                times[w].append((time.perf_counter() - t0) * 1e3)
    base = statistics.median(times["none"])
    out = {"preset": args.preset, "rows": args.rows, "steps": args.steps, "env": runner.environment(),
           "step_ms": {w: spread(times[w]) for w in WAYS},
           "grammar_ms": {w: statistics.median(times[w]) - base for w in WAYS[1:]}}
    print("| way | step ms, median [min-max] | grammar ms per step (median - none) |")
    print("|---|---|---|")
    for w in WAYS:
        s = out["step_ms"][w]
        extra = f"{out['grammar_ms'][w]:.2f}" if w != "none" else "-"
        print(f"| {w} | {runner.span(s, '.2f')} | {extra} |")
    runner.finish(out, runner.json_path(args.json, "grammar-step"),
                  {"benchmark": "mlxrt-grammar-step", "rows": args.rows, "grammar_ms": out["grammar_ms"]})
    return 0


if __name__ == "__main__":
    sys.exit(main())
