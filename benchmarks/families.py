"""``python -m benchmarks.families``: the harness on each model family, one summary row per family.

For each preset (issue 15) it runs ``python -m benchmarks`` once, in a process
of its own, with the parts the issue asks for: the single stream (native,
mlxrt over the ring and over HTTP, mlx_lm.server and the GGUF peers where
they run), N streams at once (``--streams``, 16) and the agent part (mlxrt
HTTP, mlx_lm.server and mlxrt's engine in-process). A process per family
frees each model's memory with it, and a family whose run fails loses only
its own row. Each run's JSON is reduced to one row:

- single stream: decode tok/s of mlxrt (ring, HTTP) and mlx_lm.server over
  native's in the same round (median [min-max] of the per-round ratios), and
  whether mlxrt's ids were native's (the harness's gate);
- N streams: aggregate tok/s of mlxrt HTTP over mlx_lm.server's and over
  native-batch's (one burst each), and each target's median TTFT;
- agents: aggregate tok/s over mlx_lm.server's (paired per round), the
  median TTFT of turns 2..T, and the prefix-cache hit rate: cached prompt
  tokens over prompt tokens, turns 2..T, where the server reports them.

The table goes to stdout, then the path of the JSON document (``--out`` or
``--json``: the rows, the sizes, the machine, and every family's whole harness
JSON under ``runs``) and a short summary line, each family's status
(benchmarks/runner.py). Sizes default to the CPU tiny presets' (``--sizes cpu``:
the agents' chats fit their 512-token context) or, where MLX has a GPU, the
issue's real shapes (``--sizes gpu``); any flag below overrides its size.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import MISSING, asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any

from . import agents, runner
from .env import backend
from .measure import ratio_spread, spread
from .report import Progress, _f

TINY = ("tiny", "tiny-llama", "tiny-qwen3", "tiny-qwen3-moe", "tiny-qwen3.5", "tiny-gemma3", "tiny-gpt-oss")
REAL = ("qwen2.5-7b-4bit", "llama3.1-8b-4bit", "qwen3-8b-4bit", "qwen3-30b-a3b-4bit", "qwen3.5-27b-4bit",
        "gemma3-12b-4bit", "gpt-oss-20b-4bit")
#: the families' parts (--part) and the harness's --part names each one runs
PARTS = {"single": "native,mlxrt-ring,mlxrt-http", "streams": "concurrency", "agents": "agent"}
PEERS = "mlx_lm.server,llama.cpp,ollama"
AGENT_SIZES = ("agents", "turns", "reply_tokens", "system_words", "user_words", "agent_rounds",
               "prompt_cache_bytes")
HTTP, PEER, BATCH, ENGINE = "mlxrt-http", "mlx_lm.server", "native-batch", "native-engine"
DEFAULT_TIMEOUT_S = 3600.0


@dataclass(frozen=True, kw_only=True)
class Sizes:
    """One family's workload: the harness's flags of the same names."""

    prompt_tokens: int
    gen_tokens: int
    rounds: int
    streams: str
    agents: int
    turns: int
    reply_tokens: int
    system_words: int
    user_words: int
    agent_rounds: int
    #: The agent part's prompt cache cap on every server (None: each server's own default).
    prompt_cache_bytes: int | None = None


#: The tiny presets on a 2-core CPU, about a minute a family: 4 agents x 3 turns of 16 tokens over
#: 40 + 12 words stay under their 512-token context (at most 459 tokens, gpt-oss's, whose harmony
#: preamble alone is ~120); more rounds than the harness's 5, the runs being short.
CPU = Sizes(prompt_tokens=128, gen_tokens=128, rounds=9, streams="16", agents=4, turns=3, reply_tokens=16,
            system_words=40, user_words=12, agent_rounds=5)
#: The real shapes on a GPU: the issue's 16 streams and 8 agents x 6 turns x 64 tokens over a
#: 1,500-word system prompt, prompts as the GPU batching runs had them.
GPU = Sizes(prompt_tokens=512, gen_tokens=256, rounds=5, streams="16", agents=8, turns=6, reply_tokens=64,
            system_words=1500, user_words=24, agent_rounds=2)
#: --quick: a check that every part runs on every family.
QUICK = Sizes(prompt_tokens=32, gen_tokens=32, rounds=2, streams="16", agents=2, turns=3, reply_tokens=8,
              system_words=40, user_words=12, agent_rounds=1)
PROFILES = {"cpu": CPU, "gpu": GPU}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.families",
        description="The harness (python -m benchmarks) on each model family, one summary row per family.",
    )
    p.add_argument("--presets", help=f"comma-separated synthetic presets, or model references with ':' or '/'"
                   f" (default: {','.join(TINY)} with --sizes cpu, {','.join(REAL)} with --sizes gpu)")
    p.add_argument("--sizes", choices=sorted(PROFILES),
                   help="the defaults below: cpu (tiny presets) or gpu (real shapes); default: by backend")
    p.add_argument("--quick", action="store_true", help="2 rounds of 32 tokens; 2 agents x 3 turns x 8")
    for f in Sizes.__dataclass_fields__:
        kind = str if f == "streams" else int
        own = getattr(GPU, f) is None
        p.add_argument(f"--{f.replace('_', '-')}", type=kind,
                       help="the agent part's prompt cache cap on every server (default: each server's own)"
                       if own else f"(cpu {getattr(CPU, f)}, gpu {getattr(GPU, f)})")
    p.add_argument("--part", default=",".join(PARTS),
                   help=f"comma-separated parts to run (default: all of {','.join(PARTS)}); a later run can"
                   " add a part that an earlier one left out, and --merge joins them into one row")
    p.add_argument("--peers", default=PEERS, help=f"the harness's --peers (default {PEERS})")
    p.add_argument("--agent-mlxrt-args", action="append", default=[], metavar="ARGS",
                   help="the harness's flag of that name: the agents on one more mlxrt serve, with ARGS added"
                   " (e.g. --agent-mlxrt-args=--gather-ms=0); once per variant")
    runner.add_json_arg(p, "--out", study="families")
    p.add_argument("--remove-made-models", action="store_true",
                   help="delete a synthetic model after its family's run when this run made it (the real"
                   " shapes take 64 GB together)")
    p.add_argument("--timeout-s", type=float, default=DEFAULT_TIMEOUT_S,
                   help=f"limit of one family's run, seconds (default {DEFAULT_TIMEOUT_S:g})")
    p.add_argument("--merge", nargs="+", metavar="JSON",
                   help="run nothing: join the --out documents of earlier runs (a family each, say, where a"
                   " machine is lent a few minutes at a time) into one, with its table; sizes must agree")
    args = p.parse_args(argv)
    args.parts = [n.strip() for n in args.part.split(",") if n.strip()]
    unknown = sorted(set(args.parts) - set(PARTS))
    if unknown or not args.parts:
        p.error(f"--part {args.part!r}: choose from {', '.join(PARTS)}")
    return args


def sizes_of(args: argparse.Namespace) -> tuple[str, Sizes]:
    """The profile's name and its sizes, with --quick and every size flag given applied."""
    name = args.sizes or ("cpu" if backend() == "cpu" else "gpu")
    base = QUICK if args.quick else PROFILES[name]
    given = {f: getattr(args, f) for f in Sizes.__dataclass_fields__ if getattr(args, f) is not None}
    return name, replace(base, **given)


def model_ref(preset: str) -> str:
    return preset if (":" in preset or "/" in preset) else f"synthetic:{preset}"


def harness_argv(model: str, sizes: Sizes, *, parts: list[str], peers: str, json_path: Path,
                 variants: Sequence[str] = ()) -> list[str]:
    """The ``python -m benchmarks`` command line of one family's run."""
    argv = [sys.executable, "-m", "benchmarks", "--model", model, "--part", ",".join(PARTS[p] for p in parts),
            "--peers", peers, "--workers", "1", "--no-plot", "--json", str(json_path)]
    for f, v in asdict(sizes).items():
        if f == "streams" and "streams" not in parts:
            v = "none"  # the harness runs its concurrency part wherever --streams names counts
        elif v is None or (f in AGENT_SIZES and "agents" not in parts):
            continue  # ... and its agent part wherever an agent size is given
        argv += [f"--{f.replace('_', '-')}", str(v)]
    if "agents" in parts:
        argv += [f"--agent-mlxrt-args={v}" for v in variants]
    return argv


def made_dir(model: str) -> Path | None:
    """The directory a synthetic `model` is made in, when it is not there yet (else None)."""
    from mlxrt.orchestrator.models import SYNTHETIC_PREFIX
    from mlxrt.synthetic.presets import default_model_dir, parse_synthetic

    if not model.startswith(SYNTHETIC_PREFIX):
        return None
    ref = parse_synthetic(model.removeprefix(SYNTHETIC_PREFIX))
    if ref.is_variant or ref.vocab is not None:
        return None  # made beside the preset: left alone
    d = default_model_dir(ref.preset, ref.seed)
    return None if d.exists() else d


def listen_overflows() -> int | None:
    """The kernel's count of connections dropped for a full listen backlog (Linux), else None.

    mlx_lm.server listens with Python's default backlog of 5: N streams connecting at once can
    overflow it, and a dropped connection retries after a second, which lands in its TTFT.
    """
    try:
        lines = Path("/proc/net/netstat").read_text().splitlines()
    except OSError:
        return None
    for head, vals in zip(lines[::2], lines[1::2], strict=False):
        if head.startswith("TcpExt:"):
            row = dict(zip(head.split()[1:], vals.split()[1:], strict=False))
            return int(row["ListenOverflows"]) if "ListenOverflows" in row else None
    return None


def run_family(model: str, sizes: Sizes, *, parts: list[str], peers: str, timeout_s: float, work: Path,
               say: Progress, variants: Sequence[str] = ()) -> dict[str, Any]:
    """One harness run: its JSON document (None if it wrote none), exit status, seconds, overflows."""
    path = work / f"{model.replace('/', '_').replace(':', '_')}.json"
    before = listen_overflows()
    t0 = time.perf_counter()
    try:  # the harness's progress goes straight to our stderr; its tables are in its JSON
        argv = harness_argv(model, sizes, parts=parts, peers=peers, json_path=path, variants=variants)
        proc = subprocess.run(argv, stdout=subprocess.PIPE, text=True, timeout=timeout_s)
        rc: int | str = proc.returncode
    except subprocess.TimeoutExpired:
        rc = f"did not finish within {timeout_s:g} s (--timeout-s)"
        say(f"{model}: {rc}")
    after = listen_overflows()
    doc = json.loads(path.read_text()) if path.is_file() else None
    if doc is None and isinstance(rc, int) and proc.stdout.strip():
        doc = json.loads(proc.stdout.strip().splitlines()[-1])  # a crash: the harness says why on stdout
    return {"doc": doc, "exit": rc, "elapsed_s": time.perf_counter() - t0,
            "listen_overflows": None if before is None or after is None else after - before}


# ---------------------------------------------------------------- one row


def _median(xs: list[float]) -> float | None:
    return spread(xs)["median"] if xs else None


def _div(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def single_stream(doc: dict[str, Any]) -> dict[str, Any]:
    """Decode tok/s over native's, paired per round, and whether mlxrt's ids were native's."""
    scen = doc.get("scenarios") or {}
    out: dict[str, Any] = {"native_tps": (scen.get("native") or {}).get("decode_tps")}
    for name in ("mlxrt-ring", HTTP, PEER, "llama.cpp", "ollama"):
        s = scen.get(name)
        if s is None:
            continue
        tokens = s.get("tokens") or {}
        out[name] = {
            "decode_tps": s["decode_tps"],
            "x_native": s.get("ratio_to_native"),
            "ids_identical": tokens.get("identical") if s.get("token_checked") else None,
            "agree_pct": tokens.get("agree_pct"),
        }
    return out


def streams(doc: dict[str, Any]) -> dict[str, Any]:
    """The largest stream count: aggregate tok/s and median TTFT per target, mlxrt HTTP's ratios."""
    conc = doc.get("concurrency") or {}
    levels = conc.get("levels") or []
    if not levels:
        return {"not_run": conc.get("not_run", "no stream counts")}
    n = str(max(levels))
    targets = {name: lv[n] for name, lv in (conc.get("targets") or {}).items() if n in lv}
    out: dict[str, Any] = {"streams": int(n), "skipped": conc.get("skipped") or {}}
    for name, f in targets.items():
        out[name] = {"aggregate_tps": f["aggregate_tps"], "ttft_ms_median": f["ttft_ms"]["median"],
                     "ttft_ms_p90": f["ttft_ms"]["p90"]}
    tps = {name: f["aggregate_tps"] for name, f in targets.items()}
    out["http_x_mlx_lm_server"] = _div(tps.get(HTTP), tps.get(PEER))
    out["http_x_native_batch"] = _div(tps.get(HTTP), tps.get(BATCH))
    return out


def agent_server(sv: dict[str, Any], reply_tokens: int) -> dict[str, Any]:
    """One server's agent figures; turns 2..T are the turns a prefix cache can serve."""
    later = [r for r in sv["requests"] if r["turn"] >= 2]
    counted = [r for r in later if r["cached_tokens"] is not None and r["prompt_tokens"]]
    return {
        "aggregate_tps": sv["aggregate_tps"],
        "round_tps": [r["aggregate_tps"] for r in sv["rounds"]],
        "later_turn_ttft_ms": _median([r["ttft_ms"] for r in later]),
        "first_turn_ttft_ms": _median([r["ttft_ms"] for r in sv["requests"] if r["turn"] == 1]),
        "hit_rate": sum(r["cached_tokens"] for r in counted) / sum(r["prompt_tokens"] for r in counted)
        if counted else None,
        "hit_rate_requests": len(counted),
        "short_replies": sum(r["reply_tokens"] < reply_tokens for r in sv["requests"]),  # ended early
    }


def agents_row(doc: dict[str, Any]) -> dict[str, Any]:
    ag = doc.get("agent") or {}
    if not ag.get("servers"):
        return {"not_run": ag.get("not_run") or ag.get("skipped") or "no server ran"}
    reply = ag["sizes"]["reply_tokens"]
    out: dict[str, Any] = {n: agent_server(sv, reply) for n, sv in ag["servers"].items()}
    out["skipped"] = ag.get("skipped") or {}
    out["same_replies_pct"] = ag.get("same_replies_pct")
    if HTTP in out and PEER in out:
        a, b = out[HTTP]["round_tps"], out[PEER]["round_tps"]
        out["http_x_mlx_lm_server"] = ratio_spread(a, b) if len(a) == len(b) else None
        out["later_ttft_http_x_mlx_lm_server"] = _div(out[HTTP]["later_turn_ttft_ms"],
                                                     out[PEER]["later_turn_ttft_ms"])
    for name in [n for n in out if n.startswith(HTTP + " ") and HTTP in out]:  # mlxrt serve with flags added
        a, b = out[name]["round_tps"], out[HTTP]["round_tps"]
        out[name]["x_mlxrt_http"] = ratio_spread(a, b) if len(a) == len(b) else None
    return out


def summarize(preset: str, model: str, run: dict[str, Any], parts: list[str]) -> dict[str, Any]:
    """One family's row from its harness run of `parts`."""
    doc = run["doc"] or {}
    row: dict[str, Any] = {
        "preset": preset,
        "model": model,
        "model_type": _model_type(doc.get("config", {}).get("model_path")),
        "parts": parts,
        "status": doc.get("status", "no-document"),
        "exit": run["exit"],
        "elapsed_s": run["elapsed_s"],
        "listen_overflows": run["listen_overflows"],
    }
    figures = doc.get("scenarios") or (doc.get("concurrency") or {}).get("levels") or \
        (doc.get("agent") or {}).get("servers")
    if doc.get("status") == "crash" or not figures:
        why = (doc.get("agent") or {}).get("skipped") if "agents" in parts else None  # every server failed
        row["error"] = doc.get("error") or (doc.get("skipped") or {}).get("native") or why or "no figures"
        return row
    gate = doc.get("gate") or {}
    row.update(
        gate={"passed": gate.get("passed"), "mismatched": gate.get("mismatched"), "mode": gate.get("mode"),
              "batched": gate.get("batched")},
        single=single_stream(doc) if "single" in parts else {"not_run": "not asked for (--part)"},
        streams=streams(doc),
        agents=agents_row(doc),
        skipped=doc.get("skipped") or {},
    )
    return row


def _model_type(path: str | None) -> str | None:
    try:
        return json.loads((Path(path) / "config.json").read_text()).get("model_type") if path else None
    except (OSError, ValueError):
        return None


# ---------------------------------------------------------------- the table


def _ratio(s: dict | None) -> str:
    return runner.span(s, ".2f")


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.0f}%"


def _x(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def _pair(a: Any, b: Any, fmt: str = ".0f") -> str:
    return f"{_f(a, fmt)} / {_f(b, fmt)}"


def table(rows: list[dict[str, Any]]) -> str:
    """The markdown summary: one row per family."""
    head = ("| family | `model_type` | ids = native | 1 stream: ring x native | HTTP x native | mlx_lm.server"
            " x native | N streams: HTTP tok/s | x mlx_lm.server | x native-batch | TTFT ms HTTP / mlx_lm |"
            " agents: HTTP x mlx_lm.server | later-turn TTFT ms HTTP / mlx_lm | hit rate HTTP / mlx_lm |")
    lines = [head, "|" + " --- |" * head.count(" |")]
    for r in rows:
        if "single" not in r:
            lines.append(f"| `{r['preset']}` | {r.get('model_type') or '-'} | {r['status']}: {r.get('error')}"
                         " |")
            continue
        s, c, a = r["single"], r["streams"], r["agents"]
        ids = {True: "yes", False: "**no**", None: "-"}[r["gate"]["passed"]]
        if r["gate"].get("batched") and r["gate"]["passed"]:
            ids = "greedy-valid (batches teacher-forced)"
        http_c, peer_c = c.get(HTTP) or {}, c.get(PEER) or {}
        http_a, peer_a = a.get(HTTP) or {}, a.get(PEER) or {}
        lines.append(
            f"| `{r['preset']}` | {r.get('model_type') or '-'} | {ids}"
            f" | {_ratio((s.get('mlxrt-ring') or {}).get('x_native'))}"
            f" | {_ratio((s.get(HTTP) or {}).get('x_native'))}"
            f" | {_ratio((s.get(PEER) or {}).get('x_native'))}"
            f" | {_f(http_c.get('aggregate_tps'), '.0f')}"
            f" | {_x(c.get('http_x_mlx_lm_server'))} | {_x(c.get('http_x_native_batch'))}"
            f" | {_pair(http_c.get('ttft_ms_median'), peer_c.get('ttft_ms_median'))}"
            f" | {_ratio(a.get('http_x_mlx_lm_server'))}"
            f" | {_pair(http_a.get('later_turn_ttft_ms'), peer_a.get('later_turn_ttft_ms'))}"
            f" | {_pct(http_a.get('hit_rate'))} / {_pct(peer_a.get('hit_rate'))} |"
        )
    return "\n".join(lines)


def notes(rows: list[dict[str, Any]]) -> list[str]:
    """What the table leaves out: skips, failed parts, replies cut short, dropped connections."""
    out = []
    for r in rows:
        name = r["preset"]
        if r["exit"] not in (0, None):
            out.append(f"{name}: the harness exited {r['exit']} ({r['status']})")
        for k, why in (r.get("skipped") or {}).items():
            out.append(f"{name}: {k} skipped: {why}")
        for part in PARTS:
            p = r.get(part) or {}
            if p.get("not_run"):
                out.append(f"{name}: {part} not run: {p['not_run']}")
            for k, why in (p.get("skipped") or {}).items():
                out.append(f"{name}: {part}: {k} skipped: {why}")
        for k, sv in (r.get("agents") or {}).items():
            if isinstance(sv, dict) and sv.get("short_replies"):
                out.append(f"{name}: agents: {k}: {sv['short_replies']} replies ended before their max_tokens"
                           " (the context was full)")
        for k, sv in (r.get("agents") or {}).items():
            if k.startswith(HTTP + " ") and isinstance(sv, dict):
                http = r["agents"].get(HTTP)
                if http is None:
                    out.append(f"{name}: agents: {k}: no {HTTP} figures to compare with")
                    continue
                out.append(f"{name}: agents: {k}: {_ratio(sv.get('x_mlxrt_http'))}x {HTTP}'s tok/s"
                           f" ({_f(sv['aggregate_tps'].get('median'), '.1f')} / "
                           f"{_f(http['aggregate_tps'].get('median'), '.1f')}), later-turn TTFT"
                           f" {_pair(sv['later_turn_ttft_ms'], http.get('later_turn_ttft_ms'))} ms, hit rate"
                           f" {_pct(sv['hit_rate'])} / {_pct(http.get('hit_rate'))}")
        if r.get("listen_overflows"):
            out.append(f"{name}: {r['listen_overflows']} connections dropped by a full listen backlog during"
                       " the run (mlx_lm.server listens with a backlog of 5; a dropped connection retries"
                       " after 1 s, inside its TTFT)")
    return out


def _declared(row: dict[str, Any], config: dict[str, Any]) -> list[str]:
    """The parts `row`'s run asked for; documents from before --part asked for all of them."""
    parts = row.get("parts") or config.get("parts")
    return list(PARTS) if parts is None or isinstance(parts, str) else parts


def _has(row: dict[str, Any], part: str) -> bool:
    """Whether `row` holds figures of `part` (a part asked for can still have none: not run, failed)."""
    p = row.get(part)
    if not p or p.get("not_run"):
        return False
    return part != "single" or any(k in p for k in ("mlxrt-ring", HTTP, PEER))


def _join(a: dict[str, Any], b: dict[str, Any], parts: list[str]) -> dict[str, Any]:
    """One family's row from two runs: each of `parts` from the run that has its figures."""
    out = {**a, "parts": [p for p in PARTS if p in set(a["parts"]) | set(b["parts"])]}
    took = [p for p in parts if _has(b, p)]
    for p in took:
        out[p] = b[p]
    for p in PARTS:  # `a` failed before any figure: its row has no parts at all
        if p not in out and p in b:
            out[p] = b[p]
    if "gate" in b and {"single", "streams"} & set(took):
        ga, gb = a.get("gate") or {}, b["gate"]
        passed = [g.get("passed") for g in (ga, gb) if g.get("passed") is not None]
        out["gate"] = {"passed": all(passed) if passed else None,
                       "mismatched": (ga.get("mismatched") or []) + (gb.get("mismatched") or []),
                       "mode": ga.get("mode") or gb.get("mode"),
                       "batched": ga.get("batched") or gb.get("batched")}
    out["skipped"] = {**(b.get("skipped") or {}), **(a.get("skipped") or {})}
    if took and a["status"] == "ok":  # a run that added no figure leaves the row's verdict as it was
        out.update(status=b["status"], exit=b["exit"])
    if took and "error" in b:
        out["error"] = "; ".join(str(e) for e in (a.get("error"), b["error"]) if e)
    out["elapsed_s"] = a["elapsed_s"] + b["elapsed_s"]
    if a.get("listen_overflows") is not None or b.get("listen_overflows") is not None:
        out["listen_overflows"] = (a.get("listen_overflows") or 0) + (b.get("listen_overflows") or 0)
    return out


def _config(config: dict[str, Any], key: str) -> Any:
    """`config[key]`, sizes with those added since an older run's document at their defaults."""
    if key != "sizes":
        return config.get(key)
    return {f.name: f.default for f in fields(Sizes) if f.default is not MISSING} | config.get(key, {})


def merge(docs: list[dict[str, Any]]) -> dict[str, Any]:
    """One document from several runs' (``--out``): rows, notes and runs in order; sizes must agree.

    A family in more than one run gets one row: each part from the one run that has its figures (a
    later run of the agent part alone, say, after the first run's agent part could not run). Two runs
    with figures of the same part, or a part asked for twice and run by neither, are refused.
    """
    if not docs:
        raise ValueError("nothing to merge")
    first = docs[0]["config"]
    for d in docs[1:]:
        for k in ("sizes", "peers", "profile", "quick"):
            a, b = (_config(c, k) for c in (first, d["config"]))
            if a != b:
                raise ValueError(f"the runs differ in {k}: {a!r} and {b!r}")
    rows: dict[str, dict[str, Any]] = {}
    runs: dict[str, Any] = {}
    for d in docs:
        for r in d["rows"]:
            name, declared = r["preset"], _declared(r, d["config"])
            run_key = name
            if name in rows:
                a = rows[name]
                twice = [p for p in PARTS if p in a["parts"] and p in declared]
                bad = [p for p in twice if _has(a, p) == _has(r, p)]
                if bad:
                    raise ValueError(f"{name}: {', '.join(bad)} in more than one run; each part of a family"
                                     " must come from one run")
                rows[name] = _join(a, {**r, "parts": declared}, declared)
                run_key = f"{name} ({','.join(declared)})"
            else:
                rows[name] = {**r, "parts": declared}
            for key, run in (d.get("runs") or {}).items():  # a merged document's runs, each kept
                if key == name or key.startswith(f"{name} ("):
                    key = run_key if key == name else key
                    while key in runs:
                        key += "+"
                    runs[key] = run
    parts = {p for r in rows.values() for p in r["parts"]}
    return {
        "benchmark": "mlxrt-families",
        "config": {**first, "presets": list(rows), "parts": [p for p in PARTS if p in parts]},
        "rows": list(rows.values()),
        "notes": notes(list(rows.values())),
        "env": docs[0]["env"],
        # one per run, a merged document's too: commits and versions are there to compare
        "envs": [e for d in docs for e in d.get("envs", [d["env"]])],
        "elapsed_s": sum(d["elapsed_s"] for d in docs),
        "runs": runs,
    }


def _finish(doc: dict[str, Any], runs: dict[str, Any], out: Path, head: str | None = None) -> int:
    """Write `doc` with its `runs` to `out`; print the table, the notes, its path and, last, a summary
    line: each family's status."""
    if head:
        print(head + "\n")
    print(table(doc["rows"]))
    print()
    for line in doc["notes"]:
        print(f"- {line}")
    print()
    rows = [{"preset": r["preset"], "status": r["status"]} for r in doc["rows"]]
    runner.finish({**doc, "runs": runs}, out, {"benchmark": doc.get("benchmark"), "rows": rows})
    return 0 if all(r["status"] == "ok" for r in doc["rows"]) else 1


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.merge:
        try:
            doc = merge([json.loads(Path(f).read_text()) for f in args.merge])
        except (OSError, ValueError, KeyError) as exc:
            print(f"families --merge: {exc}", file=sys.stderr)
            return 2
        runs = doc.pop("runs")
        return _finish(doc, runs, runner.json_path(args.json, "families"))
    missing = agents.client_missing() if "agents" in args.parts else None
    if missing:  # found before a long run, not after it (an H200 run once lost its agent part so)
        print(f"families: the agent part needs the openai client, and {missing} (or leave it out: --part)",
              file=sys.stderr)
        return 2
    profile, sizes = sizes_of(args)
    default = TINY if profile == "cpu" else REAL
    presets = [p.strip() for p in (args.presets or ",".join(default)).split(",") if p.strip()]
    say = Progress()
    rows, runs = [], {}
    with tempfile.TemporaryDirectory(prefix="mlxrt-families-") as tmp:
        for i, preset in enumerate(presets):
            model = model_ref(preset)
            made = made_dir(model) if args.remove_made_models else None
            say(f"family {i + 1}/{len(presets)}: {model}")
            run = run_family(model, sizes, parts=args.parts, peers=args.peers, timeout_s=args.timeout_s,
                             work=Path(tmp), say=say, variants=args.agent_mlxrt_args)
            runs[preset] = run["doc"]
            rows.append(summarize(preset, model, run, args.parts))
            say(f"{preset}: {rows[-1]['status']} in {run['elapsed_s']:.0f} s")
            if made is not None and made.exists():
                say(f"removing {made} (--remove-made-models)")
                shutil.rmtree(made)
    doc = {
        "benchmark": "mlxrt-families",
        "config": {"presets": presets, "profile": profile, "quick": args.quick, "sizes": asdict(sizes),
                   "peers": args.peers, "parts": args.parts, "agent_mlxrt_args": args.agent_mlxrt_args},
        "rows": rows,
        "notes": notes(rows),
        "env": runner.environment(),
        "elapsed_s": say.elapsed_s,
    }
    head = (f"families: {', '.join(presets)}, parts {', '.join(args.parts)} ({profile} sizes"
            f"{', quick' if args.quick else ''}): "
            + ", ".join(f"{k} {v}" for k, v in asdict(sizes).items() if v is not None))
    return _finish(doc, runs, runner.json_path(args.json, "families"), head)


if __name__ == "__main__":
    sys.exit(main())
