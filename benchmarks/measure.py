"""Client-side timing and statistics shared by every scenario, so all are measured the same way.

A scenario reports arrivals (how many tokens came, and when) to an `Arrivals`;
decode speed is counted from token counts, not chunks. Statistics are medians
with their spread; ratios and differences between scenarios are paired by round.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Run:
    """One request as the client saw it (times in ms, speeds in tokens/s, memory in bytes)."""

    tokens: list[int]
    prompt_tokens: int
    ttft_ms: float
    decode_tps: float
    total_s: float
    itl_ms: list[float] = field(repr=False, default_factory=list)
    n_tokens: int = -1  # generated tokens; equals len(tokens) unless the peer only reports a count
    peak_memory_bytes: int | None = None  # MLX's peak allocation (native, mlxrt workers)
    rss_peak_bytes: int | None = None  # peak resident memory of the serving process tree
    #: figures the engine measured itself (worker Stats, Ollama eval_*, llama.cpp timings)
    engine: dict[str, Any] = field(default_factory=dict)
    text: str | None = None  # the generated text, for peers that return no ids
    #: The longest wait between two arrivals, ms: what the client saw stall. `itl_ms` spreads a chunk's wait
    #: over its tokens (k tokens after 1 s: k gaps of 1/k s), so its max can understate a stall.
    longest_gap_ms: float = 0.0
    started_at: float = 0.0  # perf_counter() at the request, for concurrency windows
    ended_at: float = 0.0

    def __post_init__(self) -> None:
        if self.n_tokens < 0:
            self.n_tokens = len(self.tokens)

    @property
    def prompt_tps(self) -> float:
        """Prompt tokens per second as the client sees it: prompt tokens over TTFT."""
        return self.prompt_tokens / (self.ttft_ms / 1e3) if self.ttft_ms > 0 else math.nan

    @property
    def per_token_ms(self) -> float:
        """Client-side time per decoded token (the inverse of decode_tps)."""
        return 1e3 / self.decode_tps if self.decode_tps > 0 else math.nan

    def summary(self) -> dict[str, Any]:
        """The run's figures for the JSON document (no token lists)."""
        return {
            "ttft_ms": self.ttft_ms,
            "decode_tps": self.decode_tps,
            "prompt_tps": self.prompt_tps,
            "prompt_tokens": self.prompt_tokens,
            "n_tokens": self.n_tokens,
            "total_s": self.total_s,
            "itl_p50_ms": percentile(self.itl_ms, 50),
            "itl_p99_ms": percentile(self.itl_ms, 99),
            "peak_memory_bytes": self.peak_memory_bytes,
            "rss_peak_bytes": self.rss_peak_bytes,
            "engine": self.engine,
        }


class Arrivals:
    """Stamps token arrivals for one request started at `start` (a perf_counter() value)."""

    def __init__(self, start: float) -> None:
        self.start = start
        self.tokens: list[int] = []
        self.itl_ms: list[float] = []
        self.n = 0
        self.n_first = 0
        self.t_first = self.t_prev = 0.0
        self.longest_gap_ms = 0.0

    def add(self, ids: list[int] | None = None, *, count: int | None = None) -> None:
        """Record tokens that arrived now: their ids, or only how many (text-only peers)."""
        n = len(ids) if ids is not None else (count or 0)
        if n <= 0:
            return
        now = time.perf_counter()
        if self.n == 0:
            self.t_first, self.n_first = now, n
        else:
            wait = (now - self.t_prev) * 1e3
            self.longest_gap_ms = max(self.longest_gap_ms, wait)
            self.itl_ms.extend([wait / n] * n)  # a chunk of k tokens: k equal gaps
        self.t_prev = now
        self.n += n
        if ids is not None:
            self.tokens.extend(ids)

    def run(self, *, prompt_tokens: int, n_tokens: int | None = None, tokens: list[int] | None = None) -> Run:
        """The finished `Run`; `n_tokens` overrides the count where the peer reports the true one."""
        end = time.perf_counter()
        n = self.n if n_tokens is None else n_tokens
        decoded = n - (self.n_first if n_tokens is None else min(1, n))
        span = self.t_prev - self.t_first
        return Run(
            tokens=self.tokens if tokens is None else tokens,
            prompt_tokens=prompt_tokens,
            ttft_ms=(self.t_first - self.start) * 1e3 if self.n else math.nan,
            decode_tps=decoded / span if decoded > 0 and span > 0 else math.nan,
            total_s=end - self.start,
            itl_ms=self.itl_ms,
            n_tokens=n,
            longest_gap_ms=self.longest_gap_ms,
            started_at=self.start,
            ended_at=end,
        )


def time_stream(start: float, chunks: Iterable[list[int]], *, prompt_tokens: int) -> Run:
    """Consume `chunks` (token-id lists) of a request started at `start`; return its `Run`."""
    arr = Arrivals(start)
    for ids in chunks:
        arr.add(ids)
    return arr.run(prompt_tokens=prompt_tokens)


def percentile(xs: list[float], q: float) -> float:
    """The q-th percentile (0-100) by linear interpolation; NaN for no data."""
    xs = [x for x in xs if not math.isnan(x)]
    if not xs:
        return math.nan
    s = sorted(xs)
    k = (len(s) - 1) * q / 100
    lo = int(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def spread(xs: list[float]) -> dict[str, float]:
    """Median and spread of a sample: min, max, p25, p75, p90 and IQR relative to the median.

    NaNs (a run that produced no figure) are left out; `n` counts what remains.
    """
    xs = [x for x in xs if x is not None and not math.isnan(x)]
    if not xs:
        return {
            "median": math.nan,
            "min": math.nan,
            "max": math.nan,
            "p25": math.nan,
            "p75": math.nan,
            "p90": math.nan,
            "iqr_rel": math.nan,
            "n": 0,
        }
    med = statistics.median(xs)
    p25, p75 = percentile(xs, 25), percentile(xs, 75)
    return {
        "median": med,
        "min": min(xs),
        "max": max(xs),
        "p25": p25,
        "p75": p75,
        "p90": percentile(xs, 90),
        "iqr_rel": (p75 - p25) / abs(med) if med else math.nan,
        "n": len(xs),
    }


def ratio_spread(num: list[float], den: list[float]) -> dict[str, float]:
    """Per-round ratios num[i]/den[i] (paired by round), summarised with `spread`."""
    return spread([a / b for a, b in zip(num, den, strict=True) if b and not math.isnan(b)])


def diff_spread(a: list[float], b: list[float]) -> dict[str, float]:
    """Per-round differences a[i]-b[i] (paired by round), summarised with `spread`."""
    return spread([x - y for x, y in zip(a, b, strict=True)])


def agreement(ref: list[int], got: list[int]) -> dict[str, Any]:
    """How long `got` follows `ref`: the share of ref's tokens before the first divergence.

    Greedy decoding diverges for good at the first differing token (every later
    token sees a different context), so only the common prefix is meaningful.
    """
    first = next((i for i, (a, b) in enumerate(zip(ref, got, strict=False)) if a != b), None)
    if first is None and len(ref) != len(got):
        first = min(len(ref), len(got))
    matched = len(ref) if first is None else first
    return {
        "agree_pct": 100.0 * matched / len(ref) if ref else 100.0,
        "first_divergence": first,
        "basis": "ids",
    }


def text_agreement(decode: Callable[[list[int]], str], ref: list[int], text: str) -> dict[str, Any]:
    """`agreement` for a peer that returns only text: how many of ref's tokens spell a prefix of `text`."""
    matched = 0
    for k in range(1, len(ref) + 1):
        piece = decode(ref[:k])
        if text.startswith(piece):
            matched = k
        elif not piece.endswith("\ufffd"):  # a prefix cut inside a UTF-8 sequence proves nothing yet
            break
    first = None if matched == len(ref) and len(text) == len(decode(ref)) else matched
    return {
        "agree_pct": 100.0 * matched / len(ref) if ref else 100.0,
        "first_divergence": first,
        "basis": "text",
    }


def finite(o: object) -> object:
    """NaN and infinities become None, recursively: the JSON document must be strict JSON."""
    if isinstance(o, float) and not math.isfinite(o):
        return None
    if isinstance(o, dict):
        return {k: finite(v) for k, v in o.items()}
    if isinstance(o, list | tuple):
        return [finite(v) for v in o]
    return o


def peak_rss_bytes(pid: int | None) -> int | None:
    """Peak resident memory of `pid` and its descendants (Linux VmHWM, summed), else current RSS.

    A server's workers are its children (mlxrt serve), so the tree is what it costs.
    """
    if pid is None:
        return None
    try:
        import psutil

        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except Exception:
        return None
    total = 0
    for p in procs:
        hwm = _vm_hwm(p.pid)
        if hwm is None:
            try:
                hwm = int(p.memory_info().rss)
            except Exception:
                continue
        total += hwm
    return total or None


def _vm_hwm(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None
