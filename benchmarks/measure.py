"""Client-side timing shared by every scenario, so all are measured the same way.

A scenario yields lists of token ids as they arrive; `time_stream` stamps
each arrival. Decode speed is counted from token counts, not chunks.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field


@dataclass
class Run:
    """One request as the client saw it."""

    tokens: list[int]
    ttft_ms: float
    decode_tps: float
    total_s: float
    itl_ms: list[float] = field(repr=False, default_factory=list)

    def summary(self) -> dict:
        d = asdict(self)
        d.pop("tokens")
        d.pop("itl_ms")
        d["n_tokens"] = len(self.tokens)
        d["itl_p50_ms"] = percentile(self.itl_ms, 50)
        d["itl_p99_ms"] = percentile(self.itl_ms, 99)
        return d


def time_stream(start: float, chunks: Iterable[list[int]]) -> Run:
    """Consume `chunks` (token-id lists) started at `start` (perf_counter); return a `Run`."""
    tokens: list[int] = []
    itl: list[float] = []
    t_first = t_prev = 0.0
    n_first = 0
    for ids in chunks:
        if not ids:
            continue
        now = time.perf_counter()
        if not tokens:
            t_first, n_first = now, len(ids)
        else:
            gap = (now - t_prev) * 1e3 / len(ids)
            itl.extend([gap] * len(ids))
        t_prev = now
        tokens.extend(ids)
    end = time.perf_counter()
    decoded = len(tokens) - n_first
    span = t_prev - t_first
    return Run(
        tokens=tokens,
        ttft_ms=(t_first - start) * 1e3 if tokens else float("nan"),
        decode_tps=decoded / span if decoded > 0 and span > 0 else float("nan"),
        total_s=end - start,
        itl_ms=itl,
    )


def percentile(xs: list[float], q: float) -> float:
    """The q-th percentile (0-100) by linear interpolation; NaN for no data."""
    if not xs:
        return float("nan")
    s = sorted(xs)
    k = (len(s) - 1) * q / 100
    lo = int(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def spread(xs: list[float]) -> dict:
    """Median and spread of a sample: min, max, p25, p75 and relative IQR."""
    if not xs:
        return {"median": float("nan"), "min": float("nan"), "max": float("nan"), "n": 0}
    med = statistics.median(xs)
    p25, p75 = percentile(xs, 25), percentile(xs, 75)
    return {
        "median": med,
        "min": min(xs),
        "max": max(xs),
        "p25": p25,
        "p75": p75,
        "iqr_rel": (p75 - p25) / med if med else float("nan"),
        "n": len(xs),
    }


def ratio_spread(num: list[float], den: list[float]) -> dict:
    """Per-round ratios num[i]/den[i] (paired by round), summarised with `spread`."""
    return spread([a / b for a, b in zip(num, den, strict=True) if b])
