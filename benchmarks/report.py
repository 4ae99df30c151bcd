"""What a person reads: progress lines on stderr, tables on stdout, and a PNG plot."""

from __future__ import annotations

import math
import sys
import time
from pathlib import Path
from typing import Any

MB = 1024 * 1024


class Progress:
    """One line per step on stderr, stamped with the time since the start."""

    def __init__(self, stream: Any = None) -> None:
        self.t0 = time.perf_counter()
        self.stream = stream or sys.stderr

    def __call__(self, msg: str) -> None:
        s = time.perf_counter() - self.t0
        print(f"[{int(s // 60):02d}:{s % 60:04.1f}] {msg}", file=self.stream, flush=True)

    @property
    def elapsed_s(self) -> float:
        return time.perf_counter() - self.t0


def _f(x: Any, fmt: str = ".1f", none: str = "-") -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return none
    return format(x, fmt)


def _med(s: dict | None, fmt: str = ".1f", *, rng: bool = True) -> str:
    """``median [min-max]`` of a spread dict."""
    if not s or not s.get("n"):
        return "-"
    out = _f(s["median"], fmt)
    return f"{out} [{_f(s['min'], fmt)}-{_f(s['max'], fmt)}]" if rng and s["n"] > 1 else out


def header(doc: dict) -> str:
    env, cfg = doc["env"], doc["config"]
    where = env.get("gpu") or env.get("processor") or env.get("machine")
    n_prompt = doc.get("prompt", {}).get("tokens") or cfg["prompt_tokens"]
    lines = [
        f"mlxrt benchmark: {cfg['model']} on {env.get('backend')} ({where}, {env.get('cpu_count')} cores),"
        f" commit {env.get('commit')}",
        f"prompt {n_prompt} tokens, generate {cfg['gen_tokens']}, {cfg['rounds']} interleaved rounds"
        " after a warm-up, greedy, EOS off" + ("  [--quick]" if cfg.get("quick") else ""),
        "versions: " + ", ".join(f"{k} {v}" for k, v in env.get("versions", {}).items() if v),
    ]
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
    head = (
        f"{'target':<15} {'streams':>7} {'aggregate tok/s':>16} {'TTFT ms median [min-max]':>28}"
        f" {'latency s median [min-max]':>28}"
    )
    lines = [
        "concurrency (N requests at once, a prompt each; TTFT and latency include queueing for the worker)",
        head,
        "-" * len(head),
    ]
    for name, levels in conc.get("targets", {}).items():
        for n, f in levels.items():
            lines.append(
                f"{name:<15} {n:>7} {_f(f['aggregate_tps']):>16} {_med(f['ttft_ms']):>28}"
                f" {_med(f['latency_s'], '.2f'):>28}"
            )
    for name, why in conc.get("skipped", {}).items():
        lines.append(f"{name:<15} skipped: {why}")
    return "\n".join(lines)


def print_report(doc: dict, out: Any = None) -> None:
    out = out or sys.stdout
    parts = [header(doc), e2e_table(doc), components_table(doc), concurrency_table(doc)]
    gate = doc.get("gate", {})
    how = ""
    if gate.get("tolerance_logits") is not None:
        how = (
            f" [native diverged from itself at token {gate.get('native_self_divergence')}: every token"
            f" checked by teacher forcing, within {gate['tolerance_logits']:.3f} logits of the greedy choice]"
        )
    if gate.get("mismatched"):
        bad = ", ".join(gate["mismatched"])
        parts.append("QUALITY GATE FAILED: tokens differ from native in " + bad + how)
    elif gate.get("checked") and how:
        parts.append("quality gate: greedy-valid tokens in " + ", ".join(gate["checked"]) + how)
    elif gate.get("checked"):
        parts.append("quality gate: token ids identical to native in " + ", ".join(gate["checked"]))
    else:
        parts.append("quality gate: not checked (" + gate.get("why", "no baseline") + ")")
    outputs = doc.get("outputs", {})
    if outputs:
        parts.append("written: " + ", ".join(f"{k} {v}" for k, v in outputs.items() if v))
    print("\n\n".join(parts), file=out)


def plot(doc: dict, runs_ttft: dict[str, list[float]], path: Path) -> Path | None:
    """Decode tok/s per scenario with its spread, TTFT distribution, and concurrency if run."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    names = [n for n, s in doc["scenarios"].items() if s["decode_tps"].get("n")]
    conc = doc.get("concurrency", {}).get("targets", {})
    ncols = 3 if conc else 2
    fig, axes = plt.subplots(1, ncols, figsize=(5.5 * ncols, 4.2))
    if names:
        med = [doc["scenarios"][n]["decode_tps"]["median"] for n in names]
        lo = [m - doc["scenarios"][n]["decode_tps"]["min"] for n, m in zip(names, med, strict=True)]
        hi = [doc["scenarios"][n]["decode_tps"]["max"] - m for n, m in zip(names, med, strict=True)]
        axes[0].bar(names, med, yerr=[lo, hi], capsize=4, color="#4c72b0")
        axes[0].set_ylabel("decode tok/s (median, min-max)")
        if min(med) > 0 and max(med) / min(med) > 10:  # one engine far ahead: keep the others readable
            axes[0].set_yscale("log")
        axes[0].tick_params(axis="x", rotation=30)
        data = [[x for x in runs_ttft.get(n, []) if not math.isnan(x)] for n in names]
        try:
            axes[1].boxplot(data, tick_labels=names)
        except TypeError:  # matplotlib < 3.9 calls it labels
            axes[1].boxplot(data, labels=names)
        axes[1].set_ylabel("TTFT ms (per run)")
        axes[1].tick_params(axis="x", rotation=30)
    for name, levels in conc.items():
        xs = [int(n) for n in levels]
        axes[2].plot(xs, [levels[n]["aggregate_tps"] for n in levels], marker="o", label=name)
    if conc:
        axes[2].set_xscale("log", base=2)
        axes[2].set_xlabel("concurrent streams")
        axes[2].set_ylabel("aggregate tok/s")
        tops = [f["aggregate_tps"] for levels in conc.values() for f in levels.values() if f["aggregate_tps"]]
        if tops and min(tops) > 0 and max(tops) / min(tops) > 10:
            axes[2].set_yscale("log")
        axes[2].legend(fontsize=8)
    cfg = doc["config"]
    fig.suptitle(f"{cfg['model']} on {doc['env'].get('backend')} @ {doc['env'].get('commit')}", fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
