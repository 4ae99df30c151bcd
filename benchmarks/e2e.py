"""The end-to-end part of ``python -m benchmarks``: scenarios set up, warmed and timed in interleaved rounds.

`EndToEnd` holds a run's state (the live scenarios, their runs, the prompts, native's reference ids
and the token gate) and runs the single-stream rounds A B C A B C ... on the same prompt ids; the
concurrency part (benchmarks/streams.py) and the results (benchmarks/results.py) build on it.
"""

from __future__ import annotations

import argparse
from importlib import resources
from typing import Any

from . import report
from .env import default_preset
from .gate import BatchGate, Gate, first_divergence
from .measure import Run, peak_rss_bytes
from .peers import HTTP_PEERS, LlamaCpp, Ollama, http_scenarios, make_http, peer_pid
from .scenarios import Embedded, Native, Skipped

WARMUP_TOKENS = 16


def model_tokenizer(model: str) -> tuple[str, Any]:
    """`model` (a path, Hugging Face id or ``synthetic:PRESET``) as a local path, and its tokenizer."""
    from pathlib import Path

    from mlx_lm.utils import load_tokenizer
    from mlxrt.worker.engine import resolve_model_path

    path = resolve_model_path(model)
    return path, load_tokenizer(Path(path))


def make_prompt(tokenizer: Any, n: int, *, start: int = 0) -> tuple[list[int], bool]:
    """`n` ids of English text (the synthetic corpus from paragraph `start`) that survive decode -> encode.

    Text-only peers get ``decode(ids)``; ids that re-encode to themselves make that
    the same prompt. Returns the ids and whether the round trip holds.
    """
    text = resources.files("mlxrt.synthetic").joinpath("corpus.txt").read_text(encoding="utf-8")
    paragraphs = [p for p in text.split("\n\n") if p.strip()]
    cycle, i = divmod(start, len(paragraphs))
    # Past the corpus's paragraphs a prompt is numbered, so that no start repeats another's prompt (a burst
    # of --burst-rounds would otherwise hit the prefix cache).
    ids: list[int] = list(tokenizer.encode(f"{cycle}. ", add_special_tokens=False)) if cycle else []
    while len(ids) < n:  # paragraph by paragraph: a tokenizer warns on texts past its model_max_length
        ids += list(tokenizer.encode(paragraphs[i % len(paragraphs)] + "\n\n", add_special_tokens=False))
        i += 1
    ids = ids[:n]
    for _ in range(3):
        again = list(tokenizer.encode(tokenizer.decode(ids), add_special_tokens=False))
        if again == ids:
            return ids, True
        ids = again[:n]
    return ids, False


class EndToEnd:
    """A run's state, and the scenarios' set-up, warm-up and interleaved rounds; `plan` is the command
    line's `__main__.Plan` (what to run, and what was skipped before anything ran)."""

    def __init__(self, args: argparse.Namespace, plan: Any, progress: report.Progress) -> None:
        self.args, self.plan, self.say = args, plan, progress
        self.model = args.model or f"synthetic:{default_preset()}"
        self.model_path: str | None = None
        self.live: dict[str, Any] = {}
        self.runs: dict[str, list[Run]] = {}
        self.skipped: dict[str, str] = dict(plan.skipped)
        self.info: dict[str, Any] = {}
        self.tokenizer: Any = None
        self.prompt: list[int] = []  # round 0's; also the concurrency prompt
        self.prompts: list[list[int]] = []  # one per round, then the warm-up's
        self.prompt_roundtrip = False
        self.refs: list[list[int]] = []  # native's tokens, per round
        self.ref: list[int] | None = None  # round 0's
        self.token_gate: Gate | None = None  # decided after the rounds: identity or teacher forcing
        self.batch_gate: BatchGate | None = None  # for batched streams, where batching parts from native
        self.concurrency_runs: dict[str, dict[int, list[Run]]] = {}  # token-checked targets only
        self.conc_prompts: dict[int, list[list[int]]] = {}  # streams -> one prompt per stream
        self.conc_refs: dict[int, list[list[int]]] = {}  # reference tokens for those prompts, per stream
        self.conc_ref_basis: dict[int, str] = {}  # streams -> whose tokens they are: native-batch or native
        self.batch_checks: dict[int, list[dict[str, Any]]] = {}  # native-batch's streams against native's
        self.checked: dict[str, bool] = {}  # name -> token_checked, kept after close

    # -- set-up --
    def skip(self, name: str, why: str) -> None:
        self.skipped[name] = why
        self.say(f"skip {name}: {why}")

    def setup(self, name: str, factory) -> Any | None:  # type: ignore[no-untyped-def]
        self.say(f"setting up {name}")
        try:
            s = factory()
            s.setup()
        except Skipped as exc:
            self.skip(name, str(exc))
            return None
        except Exception as exc:  # a peer or scenario that fails must not stop the others
            self.skip(name, f"{type(exc).__name__}: {exc}")
            return None
        self.live[name] = s
        self.checked[name] = bool(getattr(s, "token_checked", True))
        desc = getattr(s, "describe", None)
        self.info[name] = desc() if callable(desc) else {}
        return s

    def resolve_model(self) -> bool:
        self.say(f"model {self.model} (a synthetic model is made on first use)")
        try:
            from mlxrt.orchestrator.models import resolve_model
            from mlxrt.worker.engine import resolve_model_path

            self.model_path = resolve_model_path(resolve_model(self.model))  # makes a synthetic model once
        except Exception as exc:
            why = f"model {self.model!r} cannot be used: {type(exc).__name__}: {exc}"
            for n in self.plan.scenarios + self.plan.peers:
                self.skip(n, why)
            return False
        self.say(f"model ready at {self.model_path}")
        return True

    def set_up_e2e(self) -> None:
        path = self.model_path
        assert path is not None
        native = self.setup("native", lambda: Native(path))
        if native is None:
            why = "needs the native baseline, which failed (see native)"
            for n in self.plan.scenarios[1:] + self.plan.peers:
                self.skip(n, why)
            return
        self.tokenizer = native.tokenizer
        self.make_prompts()
        http, http_why = (
            http_scenarios()
            if ({"mlxrt-http", *HTTP_PEERS} & {*self.plan.scenarios, *self.plan.peers})
            else ({}, None)
        )
        for name in self.plan.scenarios[1:]:
            if name == "mlxrt-http":
                if name in http:
                    self.setup(name, lambda: make_http(http["mlxrt-http"], path))
                else:
                    self.skip(name, http_why or "benchmarks.http_scenario has no HttpStream")
            else:
                self.setup(name, lambda n=name: Embedded(path, n.removeprefix("mlxrt-")))
        parallel = max(self.plan.concurrency or [1])
        factories = {
            **{n: lambda n=n: make_http(http[n], path) for n in HTTP_PEERS},
            "llama.cpp": lambda: LlamaCpp(
                path,
                tokenizer=self.tokenizer,
                parallel=parallel,
                ctx_per_slot=len(self.prompt) + self.args.gen_tokens,
            ),
            "ollama": lambda: Ollama(path, tokenizer=self.tokenizer),
        }
        for name in self.plan.peers:
            if name in HTTP_PEERS and name not in http:
                self.skip(name, http_why or f"benchmarks.http_scenario has no {name}")
                continue
            self.setup(name, factories[name])

    def make_prompts(self) -> None:
        """A different prompt each round (so no server's prompt cache serves a later round),
        the same for every scenario within a round; the warm-up gets one of its own."""
        made = [
            make_prompt(self.tokenizer, self.args.prompt_tokens, start=r) for r in range(self.args.rounds + 1)
        ]
        self.prompts = [ids for ids, _ in made]
        self.prompt = self.prompts[0]
        self.prompt_roundtrip = all(ok for _, ok in made)

    # -- end to end --
    def run_one(self, name: str, prompt: list[int], gen: int) -> Run | None:
        s = self.live[name]
        try:
            run = s.run(prompt, gen)
        except Exception as exc:
            self.live.pop(name).close()
            self.runs.pop(name, None)
            self.skip(name, f"failed while running: {type(exc).__name__}: {exc}")
            return None
        if run.rss_peak_bytes is None and run.peak_memory_bytes is None:
            run.rss_peak_bytes = peak_rss_bytes(peer_pid(s))  # a server scenario from elsewhere
        return run

    def e2e(self) -> None:
        if "native" not in self.live:
            return
        a = self.args
        for name in list(self.live):
            self.say(f"warm-up {name}")
            self.run_one(name, self.prompts[-1], min(WARMUP_TOKENS, a.gen_tokens))
        self.runs = {n: [] for n in self.live}
        for r in range(a.rounds):
            for name in list(self.live):
                run = self.run_one(name, self.prompts[r], a.gen_tokens)
                if run is None:
                    continue
                self.runs[name].append(run)
                self.say(
                    f"round {r + 1}/{a.rounds} {name:<14} {report._f(run.decode_tps):>7} tok/s"
                    f"  TTFT {report._f(run.ttft_ms):>6} ms  {run.n_tokens} tokens"
                )
            if "native" not in self.live:
                self.say("native failed: stopping the end-to-end rounds")
                break
        self.refs = [r.tokens for r in self.runs.get("native", [])]
        self.ref = self.refs[0] if self.refs else None
        if self.ref is not None and "native" in self.live:
            self.say("quality gate: is native decoding deterministic here? (native once more)")
            self.token_gate = Gate(self.live["native"], self.prompts[0], self.ref, a.gen_tokens)
            if not self.token_gate.deterministic:
                self.say(
                    f"native diverged from itself at token {self.token_gate.native_self_divergence}: "
                    f"checking tokens by teacher forcing (tolerance {self.token_gate.tolerance:.3f} logits)"
                )


    def _stop(self, key: str, name: str) -> None:
        """Close the live server `key`; one that fails to close (it died, say) is reported, not raised."""
        try:
            self.live.pop(key).close()
        except Exception as exc:
            self.say(f"closing {name}: {type(exc).__name__}: {exc}")


    def close(self) -> None:
        for name in list(self.live):  # one failing to close must not leak the others
            self._stop(name, name)


    def check_tokens(
        self, prompt: list[int], tokens: list[int], ref: list[int], *, batched: bool = False
    ) -> dict[str, Any]:
        """One run's tokens against native's for the same prompt (see benchmarks/gate.py); `batched`:
        checked against native-batch's ids, so by `batch_gate` where native-batch parted from native."""
        gate = (self.batch_gate if batched else None) or self.token_gate
        if gate is None:
            div = first_divergence(ref, tokens)
            return {"ok": div is None, "first_divergence": div}
        return gate.check(prompt, tokens, ref)

