"""What every study of the harness shares: rounds, spread, the environment, and where its JSON goes.

A study (``python -m benchmarks``, ``benchmarks.recovery``, ``benchmarks.kv_cache``, ...) measures in
rounds, reports each figure as ``median [min-max]`` (`span`), writes its whole document, with the
machine, versions, commit and date beside the figures (`environment`), to a file (`--json PATH`, else
``bench-results/<study>-<timestamp>.json``), and ends its terminal output with its tables, that file's
path and one short JSON summary line for scripts (`finish`), never the document itself.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path
from typing import Any

from .env import describe
from .measure import finite, spread

RESULTS_DIR = Path("bench-results")  # git-ignored
SUMMARY_MAX_BYTES = 1024  # the last line of a study's stdout stays under this
KEPT = ("benchmark", "status", "error", "outputs")  # what a summary line never drops


def span(s: dict[str, Any] | list[float] | None, fmt: str = ".1f", *, rng: bool = True) -> str:
    """``median [min-max]`` of a `measure.spread` dict (or of a sample, spread first); ``-`` when empty.

    A sample of one has no range, so it prints the median alone.
    """
    if isinstance(s, list):
        s = spread(s)
    if not s or not s.get("n"):
        return "-"
    med, lo, hi = (format(s[k], fmt) if not math.isnan(s[k]) else "-" for k in ("median", "min", "max"))
    return f"{med} [{lo}-{hi}]" if rng and s["n"] > 1 else med


def environment() -> dict[str, Any]:
    """`env.describe()` (machine, backend, versions, commit) plus the UTC date of the run, and a note
    where a machine of two cores or fewer makes the figures a check of the harness, not a result."""
    env = describe()
    env["date"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    env["note"] = (
        "figures from a shared, busy machine are for checking the harness, not for publication"
        if (env.get("cpu_count") or 0) <= 2
        else None
    )
    return env


def add_json_arg(p: argparse.ArgumentParser, *flags: str, study: str) -> None:
    """The `--json PATH` option (plus any alias in `flags`): where the study's whole document goes."""
    p.add_argument(
        "--json",
        *flags,
        dest="json",
        metavar="PATH",
        help=f"where the JSON document goes (default {RESULTS_DIR}/{study}-<timestamp>.json)",
    )


def json_path(given: str | None, study: str | None) -> Path:
    """`given`, else a new file under bench-results/ named after the study (if any) and the time."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    return Path(given) if given else RESULTS_DIR / (f"{study}-{stamp}.json" if study else f"{stamp}.json")


def write_json(doc: dict[str, Any], path: Path) -> Path:
    """Write `doc` as one JSON document (NaN and inf as null), making the folder; returns `path`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(finite(doc), default=str, allow_nan=False) + "\n", encoding="utf-8")
    return path


def summary_line(summary: dict[str, Any]) -> str:
    """`summary` as one JSON line under `SUMMARY_MAX_BYTES`: long strings are cut, then keys dropped
    from the end (``truncated`` names them; never `KEPT`) until it fits."""
    small = {k: (v[:300] + "..." if isinstance(v, str) and len(v) > 300 else v) for k, v in summary.items()}
    line = json.dumps(finite(small), default=str, allow_nan=False)
    dropped: list[str] = []
    while len(line.encode()) >= SUMMARY_MAX_BYTES and (spare := [k for k in small if k not in KEPT]):
        dropped.append(spare[-1])
        del small[spare[-1]]
        line = json.dumps(finite({**small, "truncated": dropped}), default=str, allow_nan=False)
    return line


def finish(doc: dict[str, Any], path: Path, summary: dict[str, Any], *, out: Any = None) -> str:
    """Write `doc` to `path`, print where it went and the short summary line (with the path under
    ``outputs``) last; returns that line."""
    write_json(doc, path)
    print(f"JSON: {path}", file=out, flush=True)
    line = summary_line({**summary, "outputs": {**summary.get("outputs", {}), "json": str(path)}})
    print(line, file=out, flush=True)
    return line
