"""``--log "what changed"``: one row per benchmark run in ``benchmarks/results.tsv``.

A row is kept when its decode speed is not below the best kept row for the
same model and backend by more than the measured spread (the larger IQR of
the two runs); otherwise it is discarded. A run that raised, or failed the
token-identity gate, is a crash. Discarded and crashed rows stay in the file:
the record is of what was tried, the status says what stood.
"""

from __future__ import annotations

import csv
import math
import os
import time
from pathlib import Path
from typing import Any

COLUMNS = (
    "commit",
    "date",
    "model",
    "backend",
    "scenario",
    "decode_tps",
    "spread_tps",
    "ttft_ms",
    "status",
    "description",
)
STATUSES = ("keep", "discard", "crash")
DEFAULT_PATH = Path(__file__).with_name("results.tsv")


def read(path: Path) -> list[dict[str, str]]:
    """All rows of the record, oldest first; none when the file does not exist."""
    if not path.is_file():
        return []
    with open(path, newline="", encoding="utf-8") as f:
        return list(csv.DictReader(f, delimiter="\t"))


def _num(s: str | None) -> float:
    try:
        return float(s) if s not in (None, "") else math.nan
    except ValueError:
        return math.nan


def best_kept(rows: list[dict[str, str]], *, model: str, backend: str) -> dict[str, str] | None:
    """The kept row with the highest decode tok/s for this model and backend."""
    same = [
        r
        for r in rows
        if r.get("status") == "keep"
        and r.get("model") == model
        and r.get("backend") == backend
        and not math.isnan(_num(r.get("decode_tps")))
    ]
    return max(same, key=lambda r: _num(r["decode_tps"]), default=None)


def decide(
    rows: list[dict[str, str]], *, model: str, backend: str, decode_tps: float, spread_tps: float
) -> str:
    """``keep`` unless slower than the best kept row by more than the spread (larger IQR of the two)."""
    best = best_kept(rows, model=model, backend=backend)
    if best is None:
        return "keep"
    tolerance = max((x for x in (spread_tps, _num(best.get("spread_tps"))) if not math.isnan(x)), default=0.0)
    return "keep" if decode_tps >= _num(best["decode_tps"]) - tolerance else "discard"


def append(path: Path, row: dict[str, Any]) -> dict[str, str]:
    """Append `row` (keys from COLUMNS) to the TSV, writing the header for a new file."""
    if row.get("status") not in STATUSES:
        raise ValueError(f"invalid status={row.get('status')!r}: must be one of {STATUSES}")
    out = {k: _cell(row.get(k)) for k in COLUMNS}
    new = not path.is_file() or path.stat().st_size == 0
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a", newline="", encoding="utf-8") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS, delimiter="\t", lineterminator="\n")
        if new:
            w.writeheader()
        w.writerow(out)
    return out


def _cell(v: Any) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return ""
    if isinstance(v, float):
        return f"{v:.3f}"
    return " ".join(str(v).split())  # tabs and newlines would break the row


def record(
    path: Path,
    *,
    commit: str | None,
    model: str,
    backend: str,
    scenario: str | None,
    decode_tps: float,
    spread_tps: float,
    ttft_ms: float,
    description: str,
    crashed: bool,
) -> dict[str, str]:
    """Decide the status of this run against the record and append its row; returns the row."""
    rows = read(path)
    if crashed or math.isnan(decode_tps):
        status = "crash"
    else:
        status = decide(rows, model=model, backend=backend, decode_tps=decode_tps, spread_tps=spread_tps)
    return append(
        path,
        {
            "commit": commit or os.environ.get("MLXRT_COMMIT", "unknown"),
            "date": time.strftime("%Y-%m-%dT%H:%M:%S"),
            "model": model,
            "backend": backend,
            "scenario": scenario,
            "decode_tps": decode_tps,
            "spread_tps": spread_tps,
            "ttft_ms": ttft_ms,
            "status": status,
            "description": description,
        },
    )
