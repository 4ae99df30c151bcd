"""The concurrency part of ``python -m benchmarks``: N streams at once on every target, level by level.

Each stream count runs on mlxrt in-process (one worker and ``--workers``), over HTTP, the HTTP peers
and native-batch (mlx-lm's own batching in-process, whose ids are the reference for mlxrt's streams),
the targets in turn; each server is stopped once its last stream count has run. ``--burst-rounds N``
measures N bursts per stream count, the targets in turn round by round (each round starting one
further along), each round's prompts its own;
the report pairs every round with native-batch's (one burst is one sample: runs of the same build on a
GPU moved 0.70-1.24x native-batch at 16 streams, docs/benchmarks/gpu-h200-s13.md).
``--burst-mlxrt-args ARGS`` adds mlxrt serve started with ARGS (serve flags, or leading NAME=value words
for its environment) as one more target, named as the agent part names its variants: an A/B in the
same rounds.
"""

from __future__ import annotations

from typing import Any

from . import report
from .agents import turns, variant_name
from .concurrency import run_level
from .e2e import WARMUP_TOKENS, EndToEnd, make_prompt
from .env import backend
from .gate import BatchGate
from .http_scenario import connect_retries
from .peers import PEERS, http_scenarios, make_http
from .report import NATIVE_BATCH
from .scenarios import Embedded, NativeBatch


class Streams(EndToEnd):
    """The concurrency part on top of the end-to-end state: targets, bursts, reference ids."""

    def concurrency_targets(self) -> list[tuple[str, Any]]:
        """mlxrt in-process (1 and --workers workers), over HTTP (as is, and with each --burst-mlxrt-args
        variant), the peers, and native-batch."""
        path = self.model_path
        assert path is not None
        targets: list[tuple[str, Any]] = []
        one = next((n for n in ("mlxrt-ring", "mlxrt-stdio") if n in self.live), None)
        if one:
            targets.append((f"mlxrt-w1 ({one.removeprefix('mlxrt-')})", self.live[one]))
        elif (s := self.setup("mlxrt-w1", lambda: Embedded(path, "auto", name="mlxrt-w1"))) is not None:
            targets.append(("mlxrt-w1", s))
        w = self.args.workers
        if w > 1:
            s = self.setup(f"mlxrt-w{w}", lambda: Embedded(path, "auto", workers=w, name=f"mlxrt-w{w}"))
            if s is not None:
                targets.append((f"mlxrt-w{w}", s))
        http, http_why = http_scenarios()
        for name in ("mlxrt-http", *self.plan.http_peers):  # servers the end-to-end rounds did not start
            if name in self.live or name in self.skipped:
                continue
            if name in http:
                self.setup(name, lambda n=name: make_http(http[n], path))
            else:
                self.skip(name, http_why or f"benchmarks.http_scenario has no {name}")
        variants = []  # --burst-mlxrt-args: mlxrt serve with flags or environment added, in the same rounds
        for extra in self.args.burst_mlxrt_args:
            name = variant_name(extra)
            if "mlxrt-http" not in http:
                self.skip(name, http_why or "benchmarks.http_scenario has no mlxrt-http")
            elif self.setup(name, lambda e=extra: http["mlxrt-http"](path, extra_args=e)) is not None:
                variants.append(name)
        targets += [(n, self.live[n]) for n in ("mlxrt-http", *variants, *PEERS) if n in self.live]
        native = self.live.get("native")
        model = native.model if native is not None else None
        s = self.setup(NATIVE_BATCH, lambda: NativeBatch(path, model=model))
        if s is not None:
            targets.append((NATIVE_BATCH, s))
        return targets

    def concurrency(self) -> dict[str, Any]:
        levels = self.plan.concurrency
        if not levels:
            return {"not_run": self.plan.concurrency_note or self.skipped.get("concurrency", "")}
        if self.model_path is None or not self.prompt:  # no native run: no prompt, nothing to check against
            return {"not_run": self.skipped.get("native", "native did not run")}
        out: dict[str, Any] = {"levels": levels, "targets": {}, "skipped": {}}
        targets = self.concurrency_targets()
        k = self.args.rounds + 1  # past the end-to-end prompts: no prompt is ever sent twice
        for n in levels:
            self.conc_prompts[n] = [
                make_prompt(self.tokenizer, self.args.prompt_tokens, start=k + i)[0] for i in range(n)
            ]
            k += n
        for name, s in targets:  # those set up here have not served a request yet
            self.say(f"warm-up {name}")
            try:
                s.run(self.prompts[-1], min(WARMUP_TOKENS, self.args.gen_tokens))
            except Exception as exc:
                out["skipped"][name] = f"failed to warm up: {type(exc).__name__}: {exc}"
                self.say(f"skip concurrency {name}: {out['skipped'][name]}")
                self.release(name, s)
        warm = self.args.burst_warmup
        warm = (0 if backend() == "cpu" else 1) if warm is None else warm
        out["burst_warmup"] = warm
        rounds = max(1, self.args.burst_rounds)
        out["burst_rounds"] = rounds
        fresh = k  # the next prompt index no one has been sent

        def new_burst(n: int) -> list[list[int]]:  # prompts never sent before: no prefix-cache hit
            nonlocal fresh
            fresh += n
            return [make_prompt(self.tokenizer, self.args.prompt_tokens, start=fresh - n + i)[0]
                    for i in range(n)]

        for n in levels:  # level by level, the targets in turn: A B C at 1 stream, A B C at 4, ...
            # Round r > 0 (--burst-rounds): the same prompts for every target, new to all of them, once each
            # has had round r - 1 (A B C, B C A, C A B); timed, not token-checked.
            bursts = [self.conc_prompts[n]] + [new_burst(n) for _ in range(rounds - 1)]
            for r, prompts in enumerate(bursts):
                for name, s in turns(targets, r):  # each round starts one target further along
                    if name in out["skipped"]:
                        continue
                    of = f", round {r + 1}/{rounds}" if rounds > 1 else ""
                    self.say(f"concurrency {name}: {n} stream(s){of}")
                    try:
                        for _ in range(warm if r == 0 else 0):
                            run_level(s, new_burst(n), self.args.gen_tokens)
                        retried = connect_retries.value
                        figures, runs = run_level(s, prompts, self.args.gen_tokens)
                        figures["connect_retries"] = connect_retries.value - retried
                    except Exception as exc:  # e.g. out of memory at 32 streams: the smaller counts stand
                        out["skipped"][name] = f"failed at {n} streams: {type(exc).__name__}: {exc}"
                        self.say(f"skip concurrency {name}: {out['skipped'][name]}")
                        self.release(name, s)
                        continue
                    if n == levels[-1] and r == rounds - 1:
                        self.release(name, s)
                    if r == 0:
                        if name == NATIVE_BATCH:
                            self.conc_refs[n] = [run.tokens for run in runs]
                            self.conc_ref_basis[n] = NATIVE_BATCH
                        elif getattr(s, "token_checked", True):
                            self.concurrency_runs.setdefault(name, {})[n] = runs
                        out["targets"].setdefault(name, {})[str(n)] = figures
                    if rounds > 1:
                        out["targets"][name][str(n)].setdefault("rounds", []).append({
                            "aggregate_tps": figures["aggregate_tps"],
                            "ttft_ms": figures["ttft_ms"]["median"],
                            "latency_s": figures["latency_s"]["median"],
                        })
                    ttft = figures["ttft_ms"]
                    retries = figures["connect_retries"]
                    self.say(
                        f"  {report._f(figures['aggregate_tps'])} tok/s aggregate, TTFT median "
                        f"{report._f(ttft['median'])} ms, p90 {report._f(ttft['p90'])} ms"
                        + (f", {retries} connection(s) retried after a reset" if retries else "")
                    )
        self.concurrency_references()
        out["reference"] = {str(n): b for n, b in self.conc_ref_basis.items()}
        out["native_batch_vs_native"] = {str(n): c for n, c in self.batch_checks.items()}
        return out

    def release(self, name: str, s: Any) -> None:
        """Stop a concurrency target's server once it has run its last stream count: a process keeps
        the memory of its largest burst (MLX's buffer cache, its prompt cache), and the targets after
        it would run short (a 27B model's ring worker at 16 streams left the next three out of GPU
        memory). native-batch shares the harness's process and model with native: it stays."""
        if name == NATIVE_BATCH:
            return
        key = next((k for k, v in self.live.items() if v is s), None)
        if key is not None:
            self.say(f"stopping {name}: its concurrency runs are done")
            self._stop(key, name)


    def concurrency_references(self) -> None:
        """The reference ids of every concurrency stream: native-batch's at the same stream count,
        or native's one prompt at a time where native-batch did not run. native-batch's first and
        last streams are checked against native's own (a crossed or shifted batch shows there)."""
        native = self.live.get("native")
        if native is None:
            return
        todo = {n: p for n, p in self.conc_prompts.items() if n not in self.conc_refs}
        if self.concurrency_runs and todo:
            self.say(f"native references for {sum(len(p) for p in todo.values())} concurrency prompts")
            for n, prompts in todo.items():
                self.conc_refs[n] = [native.run(p, self.args.gen_tokens).tokens for p in prompts]
                self.conc_ref_basis[n] = "native"
        batched = [n for n, b in self.conc_ref_basis.items() if b == NATIVE_BATCH]
        if batched:
            self.say(f"native-batch against native: first and last stream at {', '.join(map(str, batched))}")
        alone = {
            (n, i): native.run(self.conc_prompts[n][i], self.args.gen_tokens).tokens
            for n in batched
            for i in sorted({0, n - 1})
        }

        def check_batches() -> None:
            self.batch_checks = {n: [] for n in batched}
            for (n, i), ref in alone.items():
                got = self.check_tokens(self.conc_prompts[n][i], self.conc_refs[n][i], ref, batched=True)
                self.batch_checks[n].append({"stream": i, **got})

        check_batches()
        exact = self.token_gate is None or self.token_gate.deterministic
        parted = [c["first_divergence"] for cs in self.batch_checks.values() for c in cs if not c["ok"]]
        model = getattr(native, "model", None)  # a stand-in native without one keeps identity
        if exact and parted and model is not None:
            self.batch_gate = BatchGate(
                model, [(self.conc_prompts[n][i], self.conc_refs[n][i]) for n, i in alone], min(parted)
            )
            self.say(
                f"native-batch parted from native at token {min(parted)}: checking batched streams by teacher"
                f" forcing (tolerance {self.batch_gate.tolerance:.3f} logits)"
            )
            check_batches()

