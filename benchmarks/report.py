"""What a person reads: progress lines on stderr, tables on stdout, and a PNG plot."""

from __future__ import annotations

import math
import sys
import time
from pathlib import Path
from typing import Any

from .runner import span

MB = 1024 * 1024
NATIVE_BATCH = "native-batch"


class Progress:
    """One line per step on stderr, stamped with the time since the start."""

    def __init__(self, stream: Any = None) -> None:
        self.t0 = time.perf_counter()
        self.stream = stream or sys.stderr

    def __call__(self, msg: str) -> None:
        tenths = round((time.perf_counter() - self.t0) * 10)  # rounded first: never "[06:60.0]"
        print(f"[{tenths // 600:02d}:{tenths % 600 / 10:04.1f}] {msg}", file=self.stream, flush=True)

    @property
    def elapsed_s(self) -> float:
        return time.perf_counter() - self.t0


def _f(x: Any, fmt: str = ".1f", none: str = "-") -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return none
    return format(x, fmt)


_med = span  # ``median [min-max]`` of a spread dict, as every study prints it


def header(doc: dict) -> str:
    env, cfg = doc["env"], doc["config"]
    where = env.get("gpu") or env.get("processor") or env.get("machine")
    n_prompt = doc.get("prompt", {}).get("tokens") or cfg["prompt_tokens"]
    lines = [
        f"mlxrt benchmark: {cfg['model']} on {env.get('backend')} ({where}, {env.get('cpu_count')} cores),"
        f" commit {env.get('commit')}",
    ]
    if cfg.get("scenarios") or cfg.get("peers"):  # the end-to-end rounds' (and concurrency's) settings
        lines.append(
            f"prompt {n_prompt} tokens, generate {cfg['gen_tokens']}, {cfg['rounds']} interleaved rounds"
            " after a warm-up, greedy, EOS off" + ("  [--quick]" if cfg.get("quick") else "")
        )
    lines.append("versions: " + ", ".join(f"{k} {v}" for k, v in env.get("versions", {}).items() if v))
    if env.get("note"):
        lines.append(env["note"])
    return "\n".join(lines)


def e2e_table(doc: dict) -> str:
    head = (
        f"{'scenario':<15} {'decode tok/s':>22} {'x native':>20} {'TTFT ms':>21} {'prompt tok/s':>12}"
        f" {'ITL p50/p99 ms':>15} {'MLX MB':>7} {'RSS MB':>7}  tokens"
    )
    lines = ["end to end (median [min-max] over rounds; x native paired per round)", head, "-" * len(head)]
    for name, s in doc["scenarios"].items():
        itl = f"{_f(s['itl_p50_ms']['median'], '.2f')}/{_f(s['itl_p99_ms']['median'], '.2f')}"
        mem, rss = s.get("peak_memory_bytes"), s.get("rss_peak_bytes")
        lines.append(
            f"{name:<15} {_med(s['decode_tps']):>22} {_med(s.get('ratio_to_native'), '.3f'):>20}"
            f" {_med(s['ttft_ms']):>21} {_f(s['prompt_tps']['median'], '.0f'):>12} {itl:>15}"
            f" {_f(mem / MB if mem else None, '.0f'):>7} {_f(rss / MB if rss else None, '.0f'):>7}"
            f"  {_tokens_cell(s)}"
        )
    for name, why in doc["skipped"].items():
        lines.append(f"{name:<15} skipped: {why}")
    lines.append(
        "MLX MB: MLX's peak allocation (native in-process; the worker's own for mlxrt)."
        " RSS MB: peak resident memory of the serving processes (mlxrt workers; a server and its children)."
    )
    return "\n".join(lines)


def _tokens_cell(s: dict) -> str:
    t = s.get("tokens", {})
    if t.get("identical") is True:
        return "same"
    if t.get("passed") is True:
        divs = [c["first_divergence"] for c in t.get("per_round", []) if c["first_divergence"] is not None]
        return f"greedy-valid (ids part from native's at {min(divs)}+)" if divs else "same"
    if t.get("identical") is False:
        return "DIFFERENT"
    if "agree_pct" in t:
        if t["agree_pct"] is None:
            return "not compared (no ids or text back)"
        return f"agree {_f(t['agree_pct'], '.0f')}% (not gated)"
    return "-"


def components_table(doc: dict) -> str:
    comp = doc.get("components", {})
    lines = [
        "where the microseconds go (µs per decoded token; 'paired' = per-round difference, median [min-max])"
    ]
    for label, value, note in component_rows(comp):
        lines.append(f"  {label:<46} {value:>24}  {note}")
    largest = comp.get("largest")
    if largest:
        lines.append(f"  largest measured component: {largest['component']} ({largest['us']:.1f} µs/token)")
    for name, why in comp.get("skipped", {}).items():
        lines.append(f"  {name}: skipped: {why}")
    return "\n".join(lines)


def _signed(s: dict | None) -> str:
    if not s or not s.get("n"):
        return "-"
    return f"{s['median']:+.1f} [{s['min']:+.1f}..{s['max']:+.1f}]" if s["n"] > 1 else f"{s['median']:+.1f}"


def component_rows(comp: dict) -> list[tuple[str, str, str]]:
    """(label, value, note) rows of the 'where the microseconds go' table."""
    rows: list[tuple[str, str, str]] = []
    for name, s in comp.get("e2e_gap_us", {}).items():
        rows.append((f"end-to-end gap vs native: {name}", _signed(s), "paired, client clock"))
    for name, s in comp.get("worker_loop_us", {}).items():
        rows.append((f"worker loop vs native: {name}", _signed(s), "paired, worker's own clock"))
    t = comp.get("transport")
    if t:
        for tr in ("ring", "pipe"):
            rows.append(
                (
                    f"transport one-way, 32 B frame: {tr}",
                    f"{t[f'{tr}_blocked_p50_us']:.1f} (p99 {t[f'{tr}_blocked_p99_us']:.1f})",
                    f"consumer asleep; spinning: {t[f'{tr}_spin_p50_us']:.1f}",
                )
            )
    c = comp.get("codec")
    if c:
        rows.append(
            (
                "msgspec encode + decode, 1-token frame",
                f"{c['encode_us_1tok'] + c['decode_us_1tok']:.2f}",
                f"encode {c['encode_us_1tok']:.2f} + decode {c['decode_us_1tok']:.2f}; "
                f"8 tokens/frame: {(c['encode_us_8tok'] + c['decode_us_8tok']) / 8:.2f} per token",
            )
        )
    o = comp.get("outbox")
    if o:
        p = o["paced"]
        rows.append(
            (
                "outbox token() -> frame written (paced)",
                f"{p['p50_us']:.1f} (p99 {p['p99_us']:.1f})",
                f"latency; {100 * p['direct_share']:.0f}% written by the caller itself;"
                f" burst: {o['burst']['tokens_per_frame']:.1f} tokens/frame",
            )
        )
    if "http_sse_us" in comp:
        rows.append(
            (
                f"HTTP/SSE vs embedded ({comp.get('http_sse_vs')})",
                _signed(comp["http_sse_us"]),
                "paired, client clock",
            )
        )
    return rows


def largest_component(comp: dict) -> dict[str, Any] | None:
    """The component with the largest median µs/token among those measured directly."""
    cands: list[tuple[str, float]] = []
    for name, s in comp.get("worker_loop_us", {}).items():
        if s.get("n"):
            cands.append((f"worker loop ({name})", s["median"]))
    t = comp.get("transport")
    if t:
        cands += [(f"transport ({tr}, one-way)", t[f"{tr}_blocked_p50_us"]) for tr in ("ring", "pipe")]
    c = comp.get("codec")
    if c:
        cands.append(("msgspec encode + decode", c["encode_us_1tok"] + c["decode_us_1tok"]))
    o = comp.get("outbox")
    if o:
        cands.append(("outbox flush delay", o["paced"]["p50_us"]))
    h = comp.get("http_sse_us")
    if h and h.get("n"):
        cands.append(("HTTP/SSE", h["median"]))
    cands = [(n, v) for n, v in cands if v is not None and not math.isnan(v)]
    if not cands:
        return None
    name, us = max(cands, key=lambda nv: nv[1])
    return {"component": name, "us": us}


def concurrency_table(doc: dict) -> str:
    conc = doc.get("concurrency", {})
    if conc.get("not_run"):
        return f"concurrency: not run ({conc['not_run']})"
    w = _name_width(conc)
    head = (
        f"{'target':<{w}} {'streams':>7} {'aggregate tok/s':>16} {'TTFT ms median':>15} {'p90':>9}"
        f" {'[min-max]':>19} {'latency s median [min-max]':>28}"
    )
    lines = [
        "concurrency (N requests at once, a prompt each; TTFT and latency include queueing;"
        f" {NATIVE_BATCH}: mlx-lm's BatchGenerator in-process)",
        head,
        "-" * len(head),
    ]
    targets = conc.get("targets", {})
    for n in conc.get("levels", []):  # grouped by stream count, as they ran
        for name, levels in targets.items():
            f = levels.get(str(n))
            if f is None:
                continue
            t = f["ttft_ms"]
            rng = f"[{_f(t['min'])}-{_f(t['max'])}]" if t.get("n", 0) > 1 else ""
            lines.append(
                f"{name:<{w}} {n:>7} {_f(f['aggregate_tps']):>16} {_f(t['median']):>15} {_f(t.get('p90')):>9}"
                f" {rng:>19} {_med(f['latency_s'], '.2f'):>28}"
            )
    lines += _burst_rounds(conc)
    for name, why in conc.get("skipped", {}).items():
        lines.append(f"{name:<{w}} skipped: {why}")
    ref = conc.get("reference", {})
    if ref:
        lines.append(
            "token reference per stream count: "
            + ", ".join(f"{n} streams: {basis}" for n, basis in ref.items())
        )
    checks = conc.get("native_batch_vs_native", {})
    if checks:
        cells = []
        for n, cs in checks.items():
            bad = [c["first_divergence"] for c in cs if not c["ok"]]
            cells.append(f"{n}: " + (f"DIFFERENT at token {bad[0]}" if bad else "same"))
        lines.append(f"{NATIVE_BATCH} first/last stream vs native one at a time: " + ", ".join(cells))
    return "\n".join(lines)


def _name_width(conc: dict) -> int:
    """The concurrency lines' name column: as wide as the longest target (a --burst-mlxrt-args variant's
    name carries its flags)."""
    return max([16, *map(len, conc.get("targets", {})), *map(len, conc.get("skipped", {}))])


def _burst_rounds(conc: dict) -> list[str]:
    """With --burst-rounds: each target's rounds against native-batch's in the same round, paired (a ratio
    per round), as median [min-max]; the table above shows the first round."""
    rounds = conc.get("burst_rounds", 1)
    targets = conc.get("targets", {})
    if rounds < 2:
        return []
    w = _name_width(conc)
    lines = [f"over {rounds} rounds (the first checked, all timed), median [min-max] of each round's figure;"
             f" x {NATIVE_BATCH}: paired by round"]
    for n in conc.get("levels", []):
        ref = targets.get(NATIVE_BATCH, {}).get(str(n), {}).get("rounds", [])
        for name, levels in targets.items():
            got = levels.get(str(n), {}).get("rounds", [])
            if not got:
                continue
            line = (f"{name:<{w}} {n:>7} {span([g['aggregate_tps'] for g in got]):>24} tok/s, TTFT"
                    f" {span([g['ttft_ms'] for g in got], '.0f')} ms")
            pairs = list(zip(got, ref, strict=False))
            if name != NATIVE_BATCH and pairs:
                tps = span([g["aggregate_tps"] / b["aggregate_tps"] for g, b in pairs], ".2f")
                ttft = span([g["ttft_ms"] / b["ttft_ms"] for g, b in pairs], ".2f")
                line += f"; x {NATIVE_BATCH} {tps}, TTFT x {ttft}"
            lines.append(line)
    return lines


def agent_table(doc: dict) -> str:
    ag = doc.get("agent") or {}
    if ag.get("not_run") and not ag.get("servers"):
        return f"agents: not run ({ag['not_run']})"
    z = ag["sizes"]
    sp = ag.get("system_prompt", {})
    tok = f" ({sp['tokens']} tokens)" if sp.get("tokens") else ""
    user = f", {z['user_words']}-word user messages" if z.get("user_words") else ""
    lines = [
        f"agents: {z['agents']} agents at once x {z['turns']} turns, {z['reply_tokens']}-token replies,"
        f" one shared system prompt of {z['system_words']} words{tok}{user}, {z['rounds']} round(s)",
        "TTFT median [min-max] over agents; x uncached = that over the uncached TTFT (each agent's final-turn"
        " prompt alone on a fresh cache-off server); cached = usage.prompt_tokens_details.cached_tokens",
    ]
    w = max([14, *map(len, ag.get("servers", {})), *map(len, ag.get("skipped", {}))])
    head = (
        f"{'server':<{w}} {'turn':>9} {'prompt tok':>10} {'cached tok':>16} {'TTFT ms median [min-max]':>30}"
        f" {'x uncached':>10} {'reply tok':>9}"
    )
    lines += [head, "-" * len(head)]
    for name, sv in ag.get("servers", {}).items():
        for t in sv["turns"]:
            cached = _med(t["cached_tokens"], ".0f") if t["cached_tokens"] else "not reported"
            lo, hi = (t.get("reply_tokens") or {}).get("min"), (t.get("reply_tokens") or {}).get("max")
            reply = f"{lo}" if lo == hi else f"{lo}-{hi}"
            lines.append(
                f"{name:<{w}} {t['turn']:>9} {_f(t['prompt_tokens']['median'], '.0f'):>10} {cached:>16}"
                f" {_med(t['ttft_ms']):>30} {_f(t['ttft_vs_uncached'], '.2f'):>10} {reply:>9}"
            )
        u = sv.get("uncached")
        if u:
            cached = _med(u["cached_tokens"], ".0f") if u["cached_tokens"].get("n") else "not reported"
            lines.append(
                f"{name:<{w}} {'uncached':>9} {_f(u['prompt_tokens']['median'], '.0f'):>10} {cached:>16}"
                f" {_med(u['ttft_ms']):>30} {'1.00':>10} {'1':>9}"
            )
        else:
            lines.append(f"{name:<{w}} {'uncached':>9} skipped: {sv.get('uncached_skipped')}")
        lines.append(
            f"{name:<{w}} {'aggregate':>9} {_med(sv['aggregate_tps'])} tok/s (reply tokens / wall time),"
            f" wall {_med(sv['wall_s'], '.1f')} s"
        )
    same = ag.get("same_replies_pct") or {}
    if same:
        lines.append(
            f"replies identical to {ag['same_replies_vs']}'s: "
            + ", ".join(f"{n} {_f(v, '.0f')}%" for n, v in same.items())
        )
    for name, why in ag.get("skipped", {}).items():
        lines.append(f"{name:<{w}} skipped: {why}")
    if ag.get("not_run"):
        lines.append(f"not run: {ag['not_run']}")
    return "\n".join(lines)


def gate_line(doc: dict) -> str:
    """The report's verdict of the quality gate, with how the tokens were checked."""
    gate = doc.get("gate", {})
    how = ""
    if gate.get("tolerance_logits") is not None:
        how = (
            f" [native diverged from itself at token {gate.get('native_self_divergence')}: every token"
            f" checked by teacher forcing, within {gate['tolerance_logits']:.3f} logits of the greedy choice]"
        )
    if gate.get("batched"):
        b = gate["batched"]
        how += (
            f" [{NATIVE_BATCH} parted from native at token {b.get('batch_divergence')}: batched streams"
            f" checked by teacher forcing, within {b['tolerance_logits']:.3f} logits of the greedy choice]"
        )
    batch = NATIVE_BATCH in (doc.get("concurrency", {}).get("reference") or {}).values()
    ref = (
        f" (under concurrency: mlxrt's streams against {NATIVE_BATCH}'s at the same stream count,"
        f" {NATIVE_BATCH}'s first and last against native one at a time)"
        if batch
        else ""
    )
    if gate.get("mismatched"):
        bad = ", ".join(gate["mismatched"])
        line = "QUALITY GATE FAILED: tokens differ from native in " + bad + ref + how
    elif gate.get("checked") and how:
        line = "quality gate: greedy-valid tokens in " + ", ".join(gate["checked"]) + how
    elif gate.get("checked"):
        line = "quality gate: token ids identical to native in " + ", ".join(gate["checked"]) + ref
    else:
        line = "quality gate: not checked (" + gate.get("why", "no baseline") + ")"
    failed = [
        f"{name} at {n}: {len(lv['failed'])} of {n} streams"
        + (f", max deficit {lv['max_deficit']:.3f} logits" if lv.get("max_deficit") is not None else "")
        for name, levels in (gate.get("streams") or {}).items()
        for n, lv in levels.items()
        if lv["failed"]
    ]
    if failed:
        line += "; failed under concurrency: " + "; ".join(failed)
    unchecked = gate.get("unchecked")
    return line + (f"; not checked, no reference ids: {', '.join(unchecked)}" if unchecked else "")


def print_report(doc: dict, out: Any = None) -> None:
    out = out or sys.stdout
    parts = [header(doc)]
    if doc.get("scenarios") or doc.get("config", {}).get("scenarios"):
        parts.append(e2e_table(doc))
    if doc.get("config", {}).get("components") or component_rows(doc.get("components", {})):
        parts.append(components_table(doc))
    parts += [concurrency_table(doc), agent_table(doc)]
    parts.append(gate_line(doc))
    outputs = doc.get("outputs", {})
    if outputs:
        parts.append("written: " + ", ".join(f"{k} {v}" for k, v in outputs.items() if v))
    print("\n\n".join(parts), file=out)


def plot(doc: dict, runs_ttft: dict[str, list[float]], path: Path) -> Path | None:
    """Decode tok/s per scenario with its spread, TTFT distribution, concurrency and agents if run."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    names = [n for n, s in doc["scenarios"].items() if s["decode_tps"].get("n")]
    conc = doc.get("concurrency", {}).get("targets", {})
    agent = (doc.get("agent") or {}).get("servers", {})
    ncols = (2 if names else 0) + bool(conc) + bool(agent)
    if not ncols:
        return None
    fig, axes = plt.subplots(1, ncols, figsize=(5.5 * ncols, 4.2), squeeze=False)
    free = list(axes[0])
    if names:
        _plot_e2e(doc, runs_ttft, names, free.pop(0), free.pop(0))
    if conc:
        _plot_concurrency(conc, free.pop(0))
    if agent:
        _plot_agent(agent, free.pop(0))
    cfg = doc["config"]
    fig.suptitle(f"{cfg['model']} on {doc['env'].get('backend')} @ {doc['env'].get('commit')}", fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _plot_e2e(doc: dict, runs_ttft: dict[str, list[float]], names: list[str], ax0: Any, ax1: Any) -> None:
    med = [doc["scenarios"][n]["decode_tps"]["median"] for n in names]
    lo = [m - doc["scenarios"][n]["decode_tps"]["min"] for n, m in zip(names, med, strict=True)]
    hi = [doc["scenarios"][n]["decode_tps"]["max"] - m for n, m in zip(names, med, strict=True)]
    ax0.bar(names, med, yerr=[lo, hi], capsize=4, color="#4c72b0")
    ax0.set_ylabel("decode tok/s (median, min-max)")
    if min(med) > 0 and max(med) / min(med) > 10:  # one engine far ahead: keep the others readable
        ax0.set_yscale("log")
    ax0.tick_params(axis="x", rotation=30)
    data = [[x for x in runs_ttft.get(n, []) if not math.isnan(x)] for n in names]
    try:
        ax1.boxplot(data, tick_labels=names)
    except TypeError:  # matplotlib < 3.9 calls it labels
        ax1.boxplot(data, labels=names)
    ax1.set_ylabel("TTFT ms (per run)")
    ax1.tick_params(axis="x", rotation=30)


def _plot_concurrency(conc: dict, ax: Any) -> None:
    for name, levels in conc.items():
        xs = [int(n) for n in levels]
        ax.plot(xs, [levels[n]["aggregate_tps"] for n in levels], marker="o", label=name)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("concurrent streams")
    ax.set_ylabel("aggregate tok/s")
    tops = [f["aggregate_tps"] for levels in conc.values() for f in levels.values() if f["aggregate_tps"]]
    if tops and min(tops) > 0 and max(tops) / min(tops) > 10:
        ax.set_yscale("log")
    ax.legend(fontsize=8)


def _plot_agent(servers: dict, ax: Any) -> None:
    for name, sv in servers.items():
        turns = [t["turn"] for t in sv["turns"]]
        line = ax.plot(turns, [t["ttft_ms"]["median"] for t in sv["turns"]], marker="o", label=name)[0]
        lo = [t["ttft_ms"]["min"] for t in sv["turns"]]
        hi = [t["ttft_ms"]["max"] for t in sv["turns"]]
        ax.fill_between(turns, lo, hi, alpha=0.15, color=line.get_color())
        if sv.get("uncached"):
            ax.axhline(sv["uncached"]["ttft_ms"]["median"], ls="--", color=line.get_color(), lw=1)
    ax.set_xticks(sorted({t["turn"] for sv in servers.values() for t in sv["turns"]}))
    ax.set_ylim(bottom=0)
    ax.set_xlabel("turn (dashed: uncached final turn, alone)")
    ax.set_ylabel("agent TTFT ms (median, min-max)")
    ax.legend(fontsize=8)
