"""``python -m benchmarks`` (``make bench``): mlxrt against native MLX and other servers.

Scenarios run in interleaved rounds (A B C A B C ...) after a warm-up, greedy,
EOS disabled, on the same prompt ids and model: native ``mlx_lm.stream_generate``,
mlxrt's embedded API over the ring and over stdio, mlxrt over HTTP, and the
peers that can run here (mlx-lm's server, vllm-mlx, llama.cpp, Ollama). Every mlxrt
scenario must produce native's token ids (the quality gate: a mismatch exits 1;
where native decoding is itself nondeterministic, as with MLX's CUDA backend,
tokens are checked by teacher forcing instead: benchmarks/gate.py).
Then the parts (``--part``): the per-component costs, measured directly; N
streams at once (``--streams``) on mlxrt, mlxrt over HTTP, mlx_lm.server, vllm-mlx and
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
from pathlib import Path
from typing import Any

from . import agents, components, records, report, runner
from .env import backend, default_preset, git_commit
from .peers import HTTP_PEERS, PEERS
from .report import NATIVE_BATCH as NATIVE_BATCH  # the reference of the concurrency part's ids
from .results import Results

MLXRT_SCENARIOS = ("mlxrt-ring", "mlxrt-stdio", "mlxrt-http")
SCENARIOS = ("native", *MLXRT_SCENARIOS)
PARTS = ("components", "concurrency", "agent")
DEFAULT_CONCURRENCY = "1,4,16"
FULL_CONCURRENCY = "1,4,16,32"  # --full, and the default on a GPU
AGENT_FLAGS = (
    "agents", "turns", "reply_tokens", "system_words", "user_words", "agent_rounds", "agent_warmup_rounds",
    "prompt_cache_bytes",
)
DEFAULTS = {"prompt_tokens": 128, "gen_tokens": 128, "rounds": 5}
QUICK = {"prompt_tokens": 32, "gen_tokens": 32, "rounds": 2}
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
    #: the HTTP peers the concurrency and agent parts compare with, unless --peers leaves them out
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
    plan.http_peers = [n for n in HTTP_PEERS if not peers_given or n in peer_names]
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
        want_conc = ("concurrency" in only or args.concurrency not in (None, "none", "")
                     or bool(args.burst_mlxrt_args))  # a burst variant asks for the bursts
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
        "--burst-rounds",
        type=int,
        default=1,
        help="measured bursts per stream count and target, the targets in turn round by round (A B C A B C),"
        " each round's prompts its own; the first round's tokens are checked, every round is timed and"
        " reported against native-batch's in the same round (default 1)",
    )
    p.add_argument(
        "--burst-mlxrt-args",
        action="append",
        type=shlex.split,
        default=[],
        metavar="ARGS",
        help="also run the bursts on mlxrt serve started with ARGS added, in turn with the other targets in"
        " the same rounds (an A/B of a serve flag or, as leading NAME=value words, of its environment, e.g."
        " --burst-mlxrt-args=--prompt-concurrency=32); once per variant",
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
        " flag of that name, which on mlx_lm.server counts the running batch too; vllm-mlx's"
        " --cache-memory-mb; default: each server's own)",
    )
    a.add_argument(
        "--agent-mlxrt-args",
        action="append",
        type=shlex.split,
        default=[],
        metavar="ARGS",
        help="also run the agents on mlxrt serve started with ARGS added, alternating with the others in the"
        " same rounds (an A/B of a serve flag, e.g. --agent-mlxrt-args=--gather-ms=0, or of its environment:"
        " leading NAME=value words); once per variant",
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
    for flag in ("agent_mlxrt_args", "burst_mlxrt_args"):
        given = getattr(args, flag)
        variants = [agents.variant_name(v) for v in given]
        if not all(given) or len(set(variants)) < len(variants):
            p.error(f"--{flag.replace('_', '-')}: each variant names serve flags or environment to add, and"
                    " differs from the others")
    if args.burst_mlxrt_args and args.concurrency in ("none", ""):
        p.error("--burst-mlxrt-args: its variants run in the concurrency part, which --streams none drops")
    return args


class Suite(Results):
    """One benchmark run: the end-to-end rounds (benchmarks/e2e.py), the concurrency part
    (benchmarks/streams.py), the agents and the components, and the JSON document (benchmarks/results.py)."""

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
                "burst_mlxrt_args": a.burst_mlxrt_args if self.plan.concurrency else None,
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
