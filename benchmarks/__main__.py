"""``python -m benchmarks`` (``make bench``): mlxrt against native MLX and other servers.

Scenarios run in interleaved rounds (A B C A B C ...) after a warm-up, greedy,
EOS disabled, on the same prompt ids and model: native ``mlx_lm.stream_generate``,
mlxrt's embedded API over the ring and over stdio, mlxrt over HTTP, and the
peers that can run here (mlx-lm's server, llama.cpp, Ollama). Every mlxrt
scenario must produce native's token ids (the quality gate: a mismatch exits 1;
where native decoding is itself nondeterministic, as with MLX's CUDA backend,
tokens are checked by teacher forcing instead: benchmarks/gate.py).
Then the parts (``--part``): the per-component costs, measured directly; N
streams at once (``--streams``) on mlxrt, mlxrt over HTTP, mlx_lm.server and
mlx-lm's own continuous batching in-process (``native-batch``, whose ids are
the reference for mlxrt's streams); and agents holding growing multi-turn
chats over a shared system prompt (benchmarks/agents.py). Progress goes to
stderr; stdout ends with the tables, the paths of the JSON document (every
figure) and the plot, and one short JSON summary line (benchmarks/runner.py).
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from . import agents, components, records, report, runner
from .concurrency import run_level
from .env import backend, default_preset, git_commit
from .gate import BatchGate, Gate, first_divergence
from .http_scenario import connect_retries
from .measure import Run, agreement, diff_spread, peak_rss_bytes, ratio_spread, spread, text_agreement
from .peers import PEERS, LlamaCpp, Ollama, http_scenarios, make_http, peer_pid
from .scenarios import Embedded, Native, NativeBatch, Skipped

MLXRT_SCENARIOS = ("mlxrt-ring", "mlxrt-stdio", "mlxrt-http")
SCENARIOS = ("native", *MLXRT_SCENARIOS)
PARTS = ("components", "concurrency", "agent")
NATIVE_BATCH = "native-batch"
DEFAULT_CONCURRENCY = "1,4,16"
FULL_CONCURRENCY = "1,4,16,32"  # --full, and the default on a GPU
AGENT_FLAGS = (
    "agents", "turns", "reply_tokens", "system_words", "user_words", "agent_rounds", "agent_warmup_rounds",
    "prompt_cache_bytes",
)
DEFAULTS = {"prompt_tokens": 128, "gen_tokens": 128, "rounds": 5}
QUICK = {"prompt_tokens": 32, "gen_tokens": 32, "rounds": 2}
WARMUP_TOKENS = 16
CODEC_CALLS = {True: 20_000, False: 100_000}  # per pass, by --quick
OUTBOX_TOKENS = {True: 100, False: 300}
EXIT_GATE, EXIT_NO_BASELINE, EXIT_CRASH = 1, 2, 3


@dataclass
class Plan:
    """What to run, from the command line; unknown names are skipped with the reason."""

    scenarios: list[str] = field(default_factory=list)
    peers: list[str] = field(default_factory=list)
    components: bool = True
    concurrency: list[int] = field(default_factory=list)
    concurrency_note: str = ""
    agent: bool = True
    #: the HTTP peer the concurrency and agent parts compare with, unless --peers leaves it out
    http_peers: list[str] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)


def _names(s: str | None) -> list[str]:
    return [n.strip() for n in (s or "").split(",") if n.strip()]


def full_sizes(args: argparse.Namespace) -> bool:
    """The issue's full sizes (32 streams, 8 agents x 6 turns): with --full, and on a GPU."""
    return bool(args.full) or backend() != "cpu"


def agent_sizes(args: argparse.Namespace) -> agents.Sizes:
    """The agent part's sizes: the flags given, else --quick's, the full ones, or the CPU's."""
    base = agents.QUICK if args.quick else agents.FULL if full_sizes(args) else agents.CPU
    given = {k: getattr(args, k) for k in AGENT_FLAGS if getattr(args, k) is not None}
    rounds = given.pop("agent_rounds", 1)
    # On a GPU the first server to meet a shape compiles its kernels (cached on disk for the rest).
    warmup = given.pop("agent_warmup_rounds", 0 if backend() == "cpu" else 1)
    return agents.Sizes(**{**base, **given}, rounds=rounds, warmup_rounds=warmup)


def make_plan(args: argparse.Namespace) -> Plan:
    """Turn --only/--part, --peers, --streams and the agent flags into a `Plan`."""
    plan = Plan()
    choices = (*SCENARIOS, *PEERS, *PARTS, "e2e")
    peers_given = args.peers is not None
    peer_names = [] if args.peers in (None, "none", "") else _names(args.peers)
    if not peers_given:
        peer_names = list(PEERS)
    for n in peer_names:
        if n not in PEERS:
            plan.skipped[n] = f"unknown peer; choose from {', '.join(PEERS)} (or none)"
    peer_names = [n for n in peer_names if n in PEERS]
    plan.http_peers = [n for n in ("mlx_lm.server",) if not peers_given or n in peer_names]
    want_agent = any(getattr(args, k) is not None for k in AGENT_FLAGS) or bool(args.agent_mlxrt_args)
    if args.only:
        only = _names(args.only)
        for n in only:
            if n not in choices:
                plan.skipped[n] = f"unknown scenario or part; choose from {', '.join(choices)}"
        plan.scenarios = list(SCENARIOS) if "e2e" in only else [n for n in SCENARIOS if n in only]
        listed_peers = [n for n in PEERS if n in only]
        # --peers adds its peers' single-stream rounds only where --part asks for single-stream rounds:
        # `--part agent --peers mlx_lm.server` names the agent part's peer and runs nothing else.
        e2e_peers = peer_names if peers_given and (plan.scenarios or listed_peers) else []
        plan.peers = list(dict.fromkeys(listed_peers + e2e_peers))
        plan.components = "components" in only
        want_conc = "concurrency" in only or (args.concurrency not in (None, "none", ""))
        plan.agent = want_agent or "agent" in only
    else:
        plan.scenarios = list(SCENARIOS)
        plan.peers = peer_names
        want_conc = args.concurrency not in ("none", "")
    if (plan.scenarios or plan.peers or want_conc) and "native" not in plan.scenarios:
        plan.scenarios.insert(0, "native")  # the baseline and the token reference, concurrency's too
    if want_conc:
        try:
            default = FULL_CONCURRENCY if full_sizes(args) else DEFAULT_CONCURRENCY
            plan.concurrency = sorted({int(x) for x in _names(args.concurrency or default)})
        except ValueError:
            plan.skipped["concurrency"] = f"--streams {args.concurrency!r}: expected numbers like 1,4,16"
        if any(n < 1 for n in plan.concurrency):
            plan.concurrency = []
            plan.skipped["concurrency"] = f"--streams {args.concurrency!r}: stream counts must be >= 1"
    else:
        plan.concurrency_note = "not asked for (--streams none, or --part without concurrency)"
    return plan


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--model",
        help="model dir, HF id or synthetic:PRESET (default: synthetic:small on a CPU, "
        "synthetic:qwen2.5-0.5b-4bit on a GPU)",
    )
    p.add_argument("--prompt-tokens", type=int, help=f"prompt length (default {DEFAULTS['prompt_tokens']})")
    p.add_argument(
        "--gen-tokens", type=int, help=f"tokens generated per request (default {DEFAULTS['gen_tokens']})"
    )
    p.add_argument("--rounds", type=int, help=f"interleaved rounds (default {DEFAULTS['rounds']})")
    p.add_argument(
        "--streams",
        "--concurrency",
        dest="concurrency",
        metavar="N,N,...",
        help=f"stream counts of the concurrency part (default {DEFAULT_CONCURRENCY}, "
        f"{FULL_CONCURRENCY} with --full or on a GPU; none to leave the part out)",
    )
    p.add_argument("--workers", type=int, default=2, help="workers of the multi-worker concurrency target")
    p.add_argument(
        "--burst-warmup",
        type=int,
        default=None,
        help="unmeasured bursts per stream count and target before the measured one, each with prompts of"
        " its own (default: 1 on a GPU, where a target's first burst of a size compiles its shapes; 0 on a"
        " CPU)",
    )
    p.add_argument(
        "--part",
        "--only",
        dest="only",
        metavar="NAMES",
        help=f"run only these, comma-separated: parts ({','.join(PARTS)}), scenarios "
        f"({','.join(SCENARIOS)}), peers ({','.join(PEERS)}) or e2e",
    )
    sizes = ", ".join(f"{k} {agents.CPU[k]}/{agents.FULL[k]}" for k in agents.FULL)
    a = p.add_argument_group(
        "agent part", f"defaults on a CPU / with --full or on a GPU: {sizes}; --quick: smaller still"
    )
    a.add_argument("--agents", type=int, help="agents at once, each with its own conversation")
    a.add_argument("--turns", type=int, help="turns per agent (user message, then the reply)")
    a.add_argument("--reply-tokens", type=int, help="tokens per reply (max_tokens; EOS off where it can be)")
    a.add_argument("--system-words", type=int, help="words of the shared system prompt")
    a.add_argument(
        "--user-words", type=int, help=f"words of each user message (default {agents.USER_WORDS})"
    )
    a.add_argument("--agent-rounds", type=int, help="rounds, the servers alternating (default 1)")
    a.add_argument(
        "--agent-warmup-rounds",
        type=int,
        help="unmeasured rounds on every server first, each with its own system prompt (default: 1 on a"
        " GPU, where the first server to meet a shape pays its kernel compilation; 0 on a CPU)",
    )
    a.add_argument(
        "--prompt-cache-bytes",
        type=int,
        metavar="BYTES",
        help="the prompt cache's byte cap on every server of the part (mlxrt serve's and mlx_lm.server's"
        " flag of that name, which on mlx_lm.server counts the running batch too; default: each"
        " server's own)",
    )
    a.add_argument(
        "--agent-mlxrt-args",
        action="append",
        type=shlex.split,
        default=[],
        metavar="ARGS",
        help="also run the agents on mlxrt serve started with ARGS added, alternating with the others in the"
        " same rounds (an A/B of a serve flag, e.g. --agent-mlxrt-args=--gather-ms=0); once per variant",
    )
    p.add_argument(
        "--full",
        action="store_true",
        help=f"the full sizes on a CPU too: streams {FULL_CONCURRENCY}, agents "
        + " x ".join(str(agents.FULL[k]) for k in ("agents", "turns", "reply_tokens"))
        + f" tokens over {agents.FULL['system_words']} words",
    )
    p.add_argument("--peers", help=f"comma-separated peers to try (default: all of {','.join(PEERS)}; none)")
    p.add_argument(
        "--json", help="JSON output path (default bench-results/<timestamp>.json; the PNG goes beside)"
    )
    p.add_argument("--log", metavar="WHAT_CHANGED", help="append a row to the results record (--results-tsv)")
    p.add_argument("--results-tsv", default=str(records.DEFAULT_PATH), help="the record --log appends to")
    p.add_argument("--quick", action="store_true", help="fewer rounds, shorter prompt and generation")
    p.add_argument("--no-plot", action="store_true", help="skip the PNG plot")
    args = p.parse_args(argv)
    base = QUICK if args.quick else DEFAULTS
    for k, v in base.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    for k in ("prompt_tokens", "gen_tokens", "rounds", "workers", *AGENT_FLAGS):
        if getattr(args, k) is not None and getattr(args, k) < 1:
            p.error(f"--{k.replace('_', '-')} must be >= 1")  # a cache cap of 0 is not "off" everywhere
    variants = [agents.variant_name(v) for v in args.agent_mlxrt_args]
    if not all(args.agent_mlxrt_args) or len(set(variants)) < len(variants):
        p.error("--agent-mlxrt-args: each variant names serve flags to add, and differs from the others")
    return args


def make_prompt(tokenizer: Any, n: int, *, start: int = 0) -> tuple[list[int], bool]:
    """`n` ids of English text (the synthetic corpus from paragraph `start`) that survive decode -> encode.

    Text-only peers get ``decode(ids)``; ids that re-encode to themselves make that
    the same prompt. Returns the ids and whether the round trip holds.
    """
    text = resources.files("mlxrt.worker").joinpath("corpus.txt").read_text(encoding="utf-8")
    paragraphs = [p for p in text.split("\n\n") if p.strip()]
    ids: list[int] = []
    i = start
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


class Suite:
    """One benchmark run: sets scenarios up, times them, and builds the JSON document."""

    def __init__(self, args: argparse.Namespace, plan: Plan, progress: report.Progress) -> None:
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
            if ({"mlxrt-http", "mlx_lm.server"} & {*self.plan.scenarios, *self.plan.peers})
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
            "mlx_lm.server": lambda: make_http(http["mlx_lm.server"], path),
            "llama.cpp": lambda: LlamaCpp(
                path,
                tokenizer=self.tokenizer,
                parallel=parallel,
                ctx_per_slot=len(self.prompt) + self.args.gen_tokens,
            ),
            "ollama": lambda: Ollama(path, tokenizer=self.tokenizer),
        }
        for name in self.plan.peers:
            if name == "mlx_lm.server" and name not in http:
                self.skip(name, http_why or "benchmarks.http_scenario has no MlxLmServer")
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

    # -- concurrency --
    def concurrency_targets(self) -> list[tuple[str, Any]]:
        """mlxrt in-process (1 and --workers workers), over HTTP, the peers, and native-batch."""
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
        targets += [(n, self.live[n]) for n in ("mlxrt-http", *PEERS) if n in self.live]
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
        fresh = k  # the next prompt index no one has been sent
        for n in levels:  # level by level, the targets in turn: A B C at 1 stream, A B C at 4, ...
            for name, s in targets:
                if name in out["skipped"]:
                    continue
                self.say(f"concurrency {name}: {n} stream(s)")
                try:
                    for _ in range(warm):  # prompts never sent before: no prefix-cache hit
                        burst = [make_prompt(self.tokenizer, self.args.prompt_tokens, start=fresh + i)[0]
                                 for i in range(n)]
                        fresh += n
                        run_level(s, burst, self.args.gen_tokens)
                    retried = connect_retries.value
                    figures, runs = run_level(s, self.conc_prompts[n], self.args.gen_tokens)
                    figures["connect_retries"] = connect_retries.value - retried
                except Exception as exc:  # e.g. out of memory at 32 streams: the smaller counts stand
                    out["skipped"][name] = f"failed at {n} streams: {type(exc).__name__}: {exc}"
                    self.say(f"skip concurrency {name}: {out['skipped'][name]}")
                    self.release(name, s)
                    continue
                if n == levels[-1]:
                    self.release(name, s)
                if name == NATIVE_BATCH:
                    self.conc_refs[n] = [r.tokens for r in runs]
                    self.conc_ref_basis[n] = NATIVE_BATCH
                elif getattr(s, "token_checked", True):
                    self.concurrency_runs.setdefault(name, {})[n] = runs
                out["targets"].setdefault(name, {})[str(n)] = figures
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

    def _stop(self, key: str, name: str) -> None:
        """Close the live server `key`; one that fails to close (it died, say) is reported, not raised."""
        try:
            self.live.pop(key).close()
        except Exception as exc:
            self.say(f"closing {name}: {type(exc).__name__}: {exc}")

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

    # -- agents --
    def agent(self) -> dict[str, Any]:
        """The agent part on mlxrt serve and the HTTP peer (benchmarks/agents.py)."""
        if not self.plan.agent:
            return {"not_run": "not asked for (--part without agent)"}
        if self.model_path is None:
            return {"not_run": self.skipped.get("native", "the model could not be used")}
        tokenizer = self.tokenizer
        if tokenizer is None:  # no end-to-end rounds: the tokenizer only counts the system prompt's tokens
            from mlx_lm.utils import load_tokenizer

            tokenizer = load_tokenizer(Path(self.model_path))
        sizes = agent_sizes(self.args)
        return agents.run_part(
            self.model_path,
            sizes,
            servers=["mlxrt-http", *self.plan.http_peers, agents.NATIVE],
            say=self.say,
            tokenizer=tokenizer,
            variants=self.args.agent_mlxrt_args,
        )

    # -- components --
    def components(self) -> dict[str, Any]:
        q = self.args.quick
        out: dict[str, Any] = {"skipped": {}}
        if self.plan.components:
            parts = {
                "transport": ("transport microbenchmark (ring vs pipe)", lambda: components.transport(True)),
                "codec": ("msgspec codec", lambda: components.codec(CODEC_CALLS[q])),
                "outbox": ("outbox flush delay", lambda: components.outbox(OUTBOX_TOKENS[q])),
            }
            for key, (label, measure_it) in parts.items():
                self.say(f"components: {label}")
                try:
                    out[key] = measure_it()
                except ImportError as exc:
                    out["skipped"][key] = f"not available ({exc})"
                except Exception as exc:  # one component failing must not lose the others
                    out["skipped"][key] = f"{type(exc).__name__}: {exc}"
                if key in out["skipped"]:
                    self.say(f"skip component {key}: {out['skipped'][key]}")
        http_base = next((n for n in ("mlxrt-ring", "mlxrt-stdio") if self.runs.get(n)), None)
        out.update(components.from_runs(self.runs, http_base))
        if "mlxrt-http" not in self.runs:
            out["skipped"]["http_sse"] = self.skipped.get("mlxrt-http", "mlxrt-http was not run")
        out["largest"] = report.largest_component(out)
        return out

    def close(self) -> None:
        for name in list(self.live):  # one failing to close must not leak the others
            self._stop(name, name)

    # -- results --
    def scenario_doc(self, name: str, rs: list[Run]) -> dict[str, Any]:
        checked = self.checked.get(name, True)
        native = self.runs.get("native", [])
        tps = [r.decode_tps for r in rs]
        ttft = [r.ttft_ms for r in rs]
        paired = len(native) == len(rs) and name != "native"
        peaks = [r.peak_memory_bytes for r in rs if r.peak_memory_bytes]
        rss = [r.rss_peak_bytes for r in rs if r.rss_peak_bytes]
        doc: dict[str, Any] = {
            "token_checked": checked,
            "info": self.info.get(name, {}),
            "decode_tps": spread(tps),
            "ttft_ms": spread(ttft),
            "prompt_tps": spread([r.prompt_tps for r in rs]),
            "itl_p50_ms": spread([r.summary()["itl_p50_ms"] for r in rs]),
            "itl_p99_ms": spread([r.summary()["itl_p99_ms"] for r in rs]),
            "peak_memory_bytes": max(peaks) if peaks else None,
            "rss_peak_bytes": max(rss) if rss else None,
            "engine_decode_tps": spread([r.engine.get("decode_tps") or float("nan") for r in rs]),
            "engine_per_token_ms": spread([r.engine.get("per_token_ms") or float("nan") for r in rs]),
            "ratio_to_native": ratio_spread(tps, [r.decode_tps for r in native])
            if paired
            else (spread([1.0] * len(rs)) if name == "native" else None),
            "ttft_overhead_ms": diff_spread(ttft, [r.ttft_ms for r in native]) if paired else None,
            "runs": [r.summary() for r in rs],
        }
        if self.refs and len(rs) == len(self.refs):
            if name == "native":
                doc["tokens"] = {"identical": True, "reference": True}
            elif checked:
                checks = [
                    self.check_tokens(self.prompts[i], r.tokens, ref)
                    for i, (r, ref) in enumerate(zip(rs, self.refs, strict=True))
                ]
                doc["tokens"] = {
                    "identical": all(c["first_divergence"] is None for c in checks),
                    "passed": all(c["ok"] for c in checks),
                    "per_round": checks,
                }
            else:
                ag = [self.agreement(r, ref) for r, ref in zip(rs, self.refs, strict=True)]
                pcts = [a["agree_pct"] for a in ag if a["agree_pct"] is not None]
                doc["tokens"] = {
                    "agree_pct": min(pcts) if pcts else None,
                    "first_divergence": ag[0]["first_divergence"],
                    "basis": ag[0]["basis"],
                }
        return doc

    def agreement(self, run: Run, ref: list[int]) -> dict[str, Any]:
        if run.text is not None and not run.tokens:
            return text_agreement(self.tokenizer.decode, ref, run.text)
        if not run.tokens or min(run.tokens) < 0:  # a peer that returned neither ids nor text
            return {
                "agree_pct": None,
                "first_divergence": None,
                "basis": "none: the peer returned no ids or text",
            }
        return agreement(ref, run.tokens)

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

    def gate(self, scen: dict[str, Any]) -> dict[str, Any]:
        if self.ref is None:
            return {"passed": None, "checked": [], "mismatched": [], "why": "native did not run"}
        checked = [n for n, s in scen.items() if s["token_checked"] and n != "native"]
        bad = [n for n in checked if not scen[n].get("tokens", {}).get("passed")]
        unchecked = []
        streams: dict[str, dict[str, Any]] = {}  # per target and stream count: the streams that failed
        for name, levels in self.concurrency_runs.items():  # each stream must get its own prompt's tokens
            if not all(n in self.conc_refs for n in levels):
                unchecked.append(f"{name} under concurrency")  # no reference ids (a failed part, say)
                continue
            checked.append(f"{name} under concurrency")
            for n, rs in levels.items():
                batched = self.conc_ref_basis.get(n) == NATIVE_BATCH  # against native-batch's ids
                checks = [
                    {"stream": i, **self.check_tokens(prompt, r.tokens, ref, batched=batched)}
                    for i, (prompt, r, ref) in enumerate(zip(self.conc_prompts[n], rs, self.conc_refs[n],
                                                             strict=True))
                ]
                worst = [c["max_deficit"] for c in checks if "max_deficit" in c]
                streams.setdefault(name, {})[str(n)] = {
                    "failed": [c for c in checks if not c["ok"]],
                    "max_deficit": max(worst) if worst else None,  # teacher-forced checks only
                }
            if any(lv["failed"] for lv in streams[name].values()):
                bad.append(f"{name} under concurrency")
        if self.batch_checks:  # the reference itself: native-batch's streams are native's
            checked.append(f"{NATIVE_BATCH} under concurrency")
            if not all(c["ok"] for cs in self.batch_checks.values() for c in cs):
                bad.append(f"{NATIVE_BATCH} under concurrency")
        mode = self.token_gate.describe() if self.token_gate else {"mode": "identical ids"}
        if self.batch_gate is not None:
            mode["batched"] = self.batch_gate.describe()
        extra = {k: v for k, v in (("unchecked", unchecked), ("streams", streams)) if v}
        return {"passed": not bad, "checked": checked, "mismatched": bad, **mode, **extra}

    def document(self, conc: dict[str, Any], comp: dict[str, Any], agent: dict[str, Any]) -> dict[str, Any]:
        scen = {n: self.scenario_doc(n, rs) for n, rs in self.runs.items() if rs}
        a = self.args
        return {
            "benchmark": "mlxrt-bench",
            "config": {
                "model": self.model,
                "model_path": self.model_path,
                "prompt_tokens": a.prompt_tokens,
                "gen_tokens": a.gen_tokens,
                "rounds": a.rounds,
                "quick": a.quick,
                "scenarios": self.plan.scenarios,
                "peers": self.plan.peers,
                "components": self.plan.components,
                "concurrency": self.plan.concurrency,
                "workers": a.workers,
                "agent": asdict(agent_sizes(a)) if self.plan.agent else None,
                "agent_mlxrt_args": a.agent_mlxrt_args if self.plan.agent else None,
                "full": a.full,
            },
            "prompt": {
                "tokens": len(self.prompt),
                "roundtrip": self.prompt_roundtrip,
                "per_round": "a different corpus paragraph each round, the same for every scenario",
            },
            "scenarios": scen,
            "skipped": self.skipped,
            "components": comp,
            "concurrency": conc,
            "agent": agent,
            "gate": self.gate(scen)
            if "native" in scen
            else {
                "passed": None,
                "checked": [],
                "mismatched": [],
                "why": self.skipped.get("native", "native not run"),
            },
            "env": runner.environment(),
        }


def _kept(part: str, run: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """A part's document, or why it is not there where it raised: the parts measured before it stand
    (an H200 run once lost its single-stream figures to the 16-stream part running out of memory)."""
    try:
        return run()
    except Exception as exc:
        traceback.print_exc()
        return {"not_run": f"the {part} part failed: {type(exc).__name__}: {exc}"}


def run_suite(args: argparse.Namespace, plan: Plan, say: report.Progress) -> tuple[dict[str, Any], Suite]:
    suite = Suite(args, plan, say)
    conc: dict[str, Any] = {}
    agent: dict[str, Any] = {"not_run": "not asked for (--part without agent)"}
    wanted = plan.scenarios or plan.peers or plan.concurrency or plan.agent
    try:
        if wanted and suite.resolve_model():
            if plan.scenarios or plan.peers:
                suite.set_up_e2e()
                suite.e2e()
            conc = _kept("concurrency", suite.concurrency)
            suite.close()  # the agent part starts servers of its own: free the others' memory first
            agent = _kept("agent", suite.agent)
        else:
            why = f"model {suite.model!r} cannot be used"
            conc = {"not_run": why if plan.concurrency else plan.concurrency_note}
            if plan.agent:
                agent = {"not_run": why}
    finally:
        suite.close()
    comp = suite.components()
    return suite.document(conc, comp, agent), suite


def write_outputs(doc: dict[str, Any], suite: Suite | None, args: argparse.Namespace) -> None:
    """The JSON document to --json (default bench-results/<timestamp>.json), the plot beside it."""
    jpath = runner.json_path(args.json, None)
    doc.setdefault("outputs", {})["json"] = str(jpath)
    if suite is not None and not args.no_plot:
        ttft = {n: [r.ttft_ms for r in rs] for n, rs in suite.runs.items()}
        png = report.plot(doc, ttft, jpath.with_suffix(".png"))
        doc["outputs"]["png"] = str(png) if png else None
    runner.write_json(doc, jpath)


def summary(doc: dict[str, Any]) -> dict[str, Any]:
    """The last line of stdout, for scripts: status, the gate's verdict, the headline and where the
    document went (the document itself is tens of KB)."""
    out = {k: doc[k] for k in ("benchmark", "status", "error", "elapsed_s") if k in doc}
    gate = doc.get("gate")
    if gate:
        out["gate"] = {k: gate.get(k) for k in ("passed", "mismatched")}
    head = next((n for n in MLXRT_SCENARIOS if n in doc.get("scenarios", {})), None)
    if head:
        s = doc["scenarios"][head]
        out["headline"] = {"scenario": head, "decode_tps": s["decode_tps"]["median"],
                           "ratio_to_native": (s.get("ratio_to_native") or {}).get("median")}
    if doc.get("record"):
        out["record"] = doc["record"].get("status")
    out["outputs"] = doc.get("outputs", {})
    return out


def log_record(
    doc: dict[str, Any] | None, args: argparse.Namespace, *, crashed: bool
) -> dict[str, str] | None:
    """Append this run to the results record; the headline is the first mlxrt scenario that ran.

    Returns the row, or None when a run that did not crash has no mlxrt figure to record.
    """
    scen = (doc or {}).get("scenarios", {})
    head = next((n for n in MLXRT_SCENARIOS if n in scen), None)
    if head is None and not crashed:
        return None
    d = scen[head]["decode_tps"] if head else {}
    env = (doc or {}).get("env") or {}
    nan = float("nan")
    return records.record(
        Path(args.results_tsv),
        commit=env.get("commit") or git_commit(),
        model=args.model or f"synthetic:{default_preset()}",
        backend=str(env.get("backend") or backend()),
        scenario=head,
        decode_tps=d.get("median", nan) if d else nan,
        spread_tps=(d["p75"] - d["p25"]) if d and d.get("n") else nan,
        ttft_ms=scen[head]["ttft_ms"]["median"] if head else nan,
        description=args.log,
        crashed=crashed,
    )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from mlxrt import logs

    # stdout carries the tables and the JSON line: library logs go to stderr, warnings and up.
    logs.configure(level=os.environ.get("MLXRT_LOG_LEVEL", "warning"))
    plan = make_plan(args)
    say = report.Progress()
    for name, why in plan.skipped.items():
        say(f"skip {name}: {why}")
    try:
        doc, suite = run_suite(args, plan, say)
    except Exception as exc:
        traceback.print_exc()
        doc = {
            "benchmark": "mlxrt-bench",
            "status": "crash",
            "error": f"{type(exc).__name__}: {exc}",
            "skipped": plan.skipped,
        }
        if args.log:
            doc["record"] = log_record(None, args, crashed=True)
        write_outputs(doc, None, args)
        print(runner.summary_line(summary(doc)))
        return EXIT_CRASH
    gate = doc["gate"]
    doc["status"] = "ok" if gate["passed"] else "token-mismatch" if gate["passed"] is False else "no-baseline"
    if not (plan.scenarios or plan.peers):
        doc["status"] = "ok"  # components or concurrency only: nothing to gate
    doc["elapsed_s"] = say.elapsed_s
    doc["outputs"] = {}
    if args.log:
        doc["record"] = log_record(doc, args, crashed=doc["status"] == "token-mismatch")
        if doc["record"] is None:
            say("--log: no mlxrt end-to-end figure in this run; nothing appended")
        else:
            doc["outputs"]["tsv"] = f"{args.results_tsv} ({doc['record']['status']})"
    write_outputs(doc, suite, args)
    report.print_report(doc)
    print(runner.summary_line(summary(doc)))
    if doc["status"] == "token-mismatch":
        return EXIT_GATE
    return EXIT_NO_BASELINE if doc["status"] == "no-baseline" else 0


if __name__ == "__main__":
    sys.exit(main())
