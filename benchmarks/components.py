"""Per-component costs, each measured directly rather than inferred from end-to-end figures.

- transport: ring vs pipe one-way latency (`benchmarks.transport`, its own child process)
- codec: msgspec encode and decode of a one-token `Tokens` frame with the wire codecs
- outbox: time from the MLX thread's ``Outbox.token()`` to the frame written to a pipe
  (the worker's writer thread, in-process)
- worker loop: the worker's own per-token time against native's, paired by round
- HTTP/SSE: mlxrt-http's client per-token time against the embedded API's, paired by round

The first three run without a model; the last two come from the end-to-end rounds.
All are in µs per token.
"""

from __future__ import annotations

import math
import os
import statistics
import subprocess
import sys
import threading
import time
from typing import Any

from .measure import Run, diff_spread, percentile

_DRAIN = "import os\nwhile os.read(0, 1 << 16):\n    pass\n"
DEFAULT_OUTBOX_GAP_S = 0.002  # paced like a fast decode loop; the writer is idle when a token comes


def transport(quick: bool) -> dict[str, Any]:
    """One-way frame latency, ring and pipe (µs), from `benchmarks.transport`; raises ImportError."""
    from . import transport as tb  # needs mlxrt.ipc.ring

    raw = tb.run(quick)
    lat = raw["latency_us"]
    out: dict[str, Any] = {}
    for tr in ("ring", "pipe"):
        for mode in ("blocked", "spin"):
            s = lat[tr][mode]["32"]
            out[f"{tr}_{mode}_p50_us"] = s["p50"]
            out[f"{tr}_{mode}_p99_us"] = s["p99"]
    out["raw"] = raw
    return out


def codec(n: int) -> dict[str, Any]:
    """µs per `Tokens` frame (1 token, and 8 coalesced) through the wire codecs, median of 5 passes."""
    from mlxrt.ipc.protocol import Tokens, orchestrator_codec, worker_codec

    enc, dec = worker_codec(), orchestrator_codec()
    out: dict[str, Any] = {}
    for k in (1, 8):
        msg = Tokens(1234, list(range(1000, 1000 + k)), " word" * k)
        frame = enc.encode(msg)
        e = [_per_call_us(lambda m=msg: enc.encode(m), n) for _ in range(5)]
        d = [_per_call_us(lambda f=frame: dec.decode(f), n) for _ in range(5)]
        out[f"encode_us_{k}tok"] = statistics.median(e)
        out[f"decode_us_{k}tok"] = statistics.median(d)
        out[f"frame_bytes_{k}tok"] = len(frame)
    return out


def _per_call_us(fn, n: int) -> float:  # type: ignore[no-untyped-def]
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t0) / n * 1e6


class _StampingSender:
    """Wraps a sender; stamps each frame when it has been written, by ``send`` or ``try_send``."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.sent: list[tuple[float, bytes, int]] = []  # (written at, frame, sending thread)

    def send(self, frame: bytes) -> None:
        self.inner.send(frame)
        self.sent.append((time.perf_counter(), bytes(frame), threading.get_ident()))

    def try_send(self, frame: bytes) -> bool:
        ok = self.inner.try_send(frame)
        if ok:
            self.sent.append((time.perf_counter(), bytes(frame), threading.get_ident()))
        return bool(ok)

    def __getattr__(self, name: str) -> Any:  # anything else the Outbox may use
        return getattr(self.inner, name)


def outbox(n: int, *, gap_s: float = DEFAULT_OUTBOX_GAP_S) -> dict[str, Any]:
    """Delay (µs) from ``Outbox.token()`` to its frame written to a pipe: paced, and in a burst.

    Paced: one token every `gap_s`, as a decode loop would, so the Outbox is idle
    when each token comes: the delay is whatever path it takes then (a hand-off
    to the writer thread, or a direct write), with its encode and write. Burst:
    tokens back to back; queued tokens are coalesced, so tokens per frame shows
    the batching. ``direct_share`` is the fraction of frames written by the
    calling thread itself (``try_send``) rather than by the writer thread.
    """
    return {"paced": _outbox_pass(n, gap_s), "burst": _outbox_pass(n * 10, 0.0), "gap_s": gap_s}


def _outbox_pass(n: int, gap_s: float) -> dict[str, Any]:
    from mlxrt.ipc.protocol import orchestrator_codec
    from mlxrt.ipc.stdio import PipeSender
    from mlxrt.worker.serve import Outbox

    r, w = os.pipe()
    # The reader is another process, as the orchestrator is: a reader thread here would
    # contend for this process's GIL and inflate the very delay being measured.
    reader = subprocess.Popen([sys.executable, "-c", _DRAIN], stdin=r)
    os.close(r)
    tx = _StampingSender(PipeSender(w))
    box = Outbox(tx)  # type: ignore[arg-type]
    called = [0.0] * n
    try:
        for i in range(n):
            called[i] = time.perf_counter()
            box.token(1, i, "x")
            if gap_s:
                time.sleep(gap_s)
        box.close()
    finally:
        tx.close()
        reader.wait(10)
    dec = orchestrator_codec()
    delays = []
    for t, frame, _ in tx.sent:
        for tok in dec.decode(frame).token_ids:  # type: ignore[attr-defined]
            delays.append((t - called[tok]) * 1e6)
    me = threading.get_ident()
    return {
        "p50_us": percentile(delays, 50),
        "p99_us": percentile(delays, 99),
        "tokens": n,
        "frames": len(tx.sent),
        "tokens_per_frame": n / len(tx.sent) if tx.sent else math.nan,
        "direct_share": sum(1 for *_, who in tx.sent if who == me) / len(tx.sent) if tx.sent else math.nan,
    }


def per_token_us(runs: list[Run], *, engine: bool = False) -> list[float]:
    """µs per decoded token of each run: client-side, or the engine's own (`engine=True`)."""
    out = []
    for r in runs:
        ms = r.engine.get("per_token_ms") if engine else r.per_token_ms
        out.append(ms * 1e3 if ms is not None and ms > 0 else math.nan)
    return out


def from_runs(runs: dict[str, list[Run]], http_base: str | None) -> dict[str, Any]:
    """The components that come out of the end-to-end rounds (µs/token, paired by round).

    worker_loop[T]: mlxrt-T's worker per-token time minus native's in the same round.
    e2e_gap[S]: scenario S's client per-token time minus native's.
    http_sse: mlxrt-http's client per-token time minus `http_base`'s (the embedded API).
    """
    out: dict[str, Any] = {"worker_loop_us": {}, "e2e_gap_us": {}}
    native = runs.get("native")
    if native:
        base = per_token_us(native)
        for name, rs in runs.items():
            if name == "native" or len(rs) != len(native):
                continue
            out["e2e_gap_us"][name] = diff_spread(per_token_us(rs), base)
            if name.startswith("mlxrt-") and name != "mlxrt-http" and any(r.engine for r in rs):
                out["worker_loop_us"][name] = diff_spread(per_token_us(rs, engine=True), base)
    http = runs.get("mlxrt-http")
    if http and http_base and http_base in runs:
        out["http_sse_us"] = diff_spread(per_token_us(http), per_token_us(runs[http_base]))
        out["http_sse_vs"] = http_base
    return out
