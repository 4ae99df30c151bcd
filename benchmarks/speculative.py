"""Speculative decoding: decode speed-up against acceptance rate, in-process, one request at a time.

``python -m benchmarks.speculative [--target REF] [--draft REF ...] [--force P ...] [--rounds N]``

One `Engine` on the target; each draft is loaded once and swapped in
(`Engine.draft`), so every configuration decodes the same prompt on the same
loaded target, interleaved round by round with the plain run (no draft). Decode
tok/s and acceptance come from the engine's own `Stats`; the speed-up is paired
with the plain run of the same round. Greedy, EOS off, prefix cache off.

Two kinds of point:

- ``--draft REF``: the acceptance a draft gets by itself (synthetic drafts:
  ``synthetic:small?layers=1``, ``?noise=0.05``; the target itself, 1.0), ids
  checked identical to the plain run's.
- ``--force P`` with the first ``--draft``: acceptance set to about P. Random
  weights make a real draft's acceptance near zero, so a logits processor
  forces a fixed token at a fraction P of positions (chosen by position, so the
  draft and the target agree there) and leaves the rest to the models. The
  plain run gets the same processor, so the comparison is fair, and the costs
  (a draft call per proposal, one target call per round) are the real ones.
  P = 1 is the ceiling for that draft's cost.

Each drafted point runs under each ``--policy``: ``always`` drafts every round
(the draft's own cost and gain, as mlx-lm's ``speculative_generate_step``);
``adaptive`` (the worker's default) drafts while drafting is measured faster,
its `DraftPolicy` kept across the rounds of that point as a worker keeps it
across requests.

The table goes to stdout, then the path of the JSON document (``--json``,
benchmarks/runner.py) and a short summary line.
"""

from __future__ import annotations

import argparse
import statistics

import mlx.core as mx
from mlx_lm.utils import load
from mlxrt.ipc.protocol import EngineOptions, Generate, SamplingParams
from mlxrt.worker.draft_policy import DraftPolicy
from mlxrt.worker.engine import Engine, device_name, resolve_model_path
from mlxrt.worker.solo import Draft

from . import runner
from .env import default_preset


class _Box:
    """A listener keeping the request's ids and stats."""

    def __init__(self) -> None:
        self.ids: list[int] = []
        self.stats = None

    def started(self, req_id: int) -> None:
        pass

    def token(self, req_id: int, token: int, *args, **kwargs) -> None:
        self.ids.append(token)

    def done(self, req_id: int, stats, *args, **kwargs) -> None:
        self.stats = stats

    def failed(self, req_id: int, exc: BaseException) -> None:
        raise exc


def forcing(p: float, vocab: int):
    """A processor forcing a position-determined token at a fraction `p` of positions."""
    positions = mx.arange(vocab)
    span = max(vocab - 512, 1)  # keep clear of the special tokens at the top

    def processor(context, logits):
        n = context.shape[-1]
        if (n * 2654435761) % 1000 >= p * 1000:
            return logits
        # Added to the logits, not in their place: the model's forward pass must still be computed.
        return logits + mx.where(positions == (n * 7919) % span, 0.0, -1e9).astype(logits.dtype)[None]

    return processor


def decode(engine: Engine, ids: list[int], tokens: int, processor=None) -> _Box:
    box = _Box()
    params = SamplingParams(max_tokens=tokens, ignore_eos=True)
    engine.submit(Generate(id=1, prompt_ids=ids, params=params), box)
    if processor is not None:
        engine._waiting[-1].processors.append(processor)
    while engine.busy:
        engine.step()
    return box


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.speculative", description=__doc__.split("\n")[0])
    ap.add_argument("--target", default=None,
                    help="target model (default: synthetic:small, or the 0.5B shape on a GPU)")
    ap.add_argument("--draft", action="append", default=None, help="a draft model; repeat for several")
    ap.add_argument("--force", type=float, action="append", default=None,
                    help="forced acceptance fractions, with the first draft (e.g. 1.0 0.8 0.6)")
    ap.add_argument("--num-draft-tokens", type=int, default=3)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--policy", default="always,adaptive",
                    help="draft policies to run each drafted point under (always, adaptive)")
    runner.add_json_arg(ap, study="speculative")
    a = ap.parse_args(argv)
    policies = a.policy.split(",")
    target = a.target or f"synthetic:{default_preset()}"
    drafts = a.draft or [f"{target}?layers=1", f"{target}?noise=0.05", target]
    engine = Engine(resolve_model_path(target), options=EngineOptions(prompt_cache_bytes=0))
    loaded = {d: load(resolve_model_path(d))[0] for d in drafts}
    unit = engine.tokenizer.encode("The tide came in over the rocks while the gulls argued. ")
    ids = (unit * (a.prompt_tokens // len(unit) + 1))[: a.prompt_tokens]

    configs: list[tuple[str, str | None, float | None]] = [("plain", None, None)]
    configs += [(f"{d} [{w}]", d, None) for d in drafts for w in policies]
    for p in a.force or []:
        configs += [(f"plain, forced {p:g}", None, p)]
        configs += [(f"{drafts[0]}, forced {p:g} [{w}]", drafts[0], p) for w in policies]
    # One policy per drafted point, kept across its rounds as a worker keeps it across requests.
    policy = {c[0]: DraftPolicy(adaptive=c[0].endswith("[adaptive]")) for c in configs}
    tps: dict[str, list[float]] = {c[0]: [] for c in configs}
    rate: dict[str, list[float]] = {c[0]: [] for c in configs}
    same: dict[str, bool] = {c[0]: True for c in configs}
    plain_ids: dict[float | None, list[int]] = {}
    for r in range(a.rounds + 1):
        for name, draft, p in configs:
            engine.draft = None if draft is None else Draft(loaded[draft], a.num_draft_tokens, policy[name])
            box = decode(engine, ids, a.tokens, None if p is None else forcing(p, engine.vocab_size))
            if draft is None:
                plain_ids[p] = box.ids
            else:
                same[name] &= box.ids == plain_ids[p]
            if r:  # the first round compiles and warms: not measured
                tps[name].append(box.stats.decode_tps)
                rate[name].append(box.stats.acceptance_rate)
            else:  # nor learnt from: a worker's policy starts after its warm-up
                policy[name].reset()
    engine.draft = None

    speedup = {}
    for name, _, p in configs:
        base = "plain" if p is None else f"plain, forced {p:g}"
        speedup[name] = [x / b for x, b in zip(tps[name], tps[base], strict=True)]
    print(f"target {target} on {device_name()}, {a.rounds} rounds, {a.prompt_tokens}-token prompt, "
          f"{a.tokens} tokens, num_draft_tokens {a.num_draft_tokens}; median [min-max]")
    print(f"{'configuration':60} {'acceptance':>10} {'decode tok/s':>22} {'speed-up, paired':>22}  ids")
    for name, _, _ in configs:
        t, s = tps[name], speedup[name]
        print(f"{name:60} {statistics.median(rate[name]):10.3f} {runner.span(t):>22} "
              f"{runner.span(s, '.3f'):>22}  {'same' if same[name] else 'DIFFERENT'}")
    result = {"target": target, "drafts": drafts, "num_draft_tokens": a.num_draft_tokens,
              "prompt_tokens": a.prompt_tokens, "tokens": a.tokens, "decode_tps": tps, "acceptance": rate,
              "speedup": speedup, "ids_same": same, "policies": policies,
              "windows": {n: {"drafting": pol.windows[True], "plain": pol.windows[False]}
                          for n, pol in policy.items() if pol.adaptive},
              "env": runner.environment()}
    medians = {name: statistics.median(s) for name, s in speedup.items()}
    runner.finish(result, runner.json_path(a.json, "speculative"),
                  {"benchmark": "mlxrt-speculative", "target": target, "speedup_median": medians})
    return result


if __name__ == "__main__":
    main()
