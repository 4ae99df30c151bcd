"""A crash storm with the breaker relaxed: every request ends, in a result or a clear error, within its
deadline; the pool serves afterwards; no worker process and no shared-memory segment is left."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # `benchmarks` is a top-level folder of the checkout, not an installed package
    sys.path.insert(0, str(ROOT))

from benchmarks.storm import run_storm, summary  # noqa: E402

STORM_S = 15.0
QUEUE_S = 3.0
#: Once a worker runs it, a request of at most 48 tokens on tiny takes well under a second: this only
#: catches requests that waited for restarts past their deadline, or hung.
ANSWER_ALLOWANCE_S = 8.0
#: The errors a caller may get in a storm, each naming what happened or the setting that bounds it.
CLEAR = {"WorkerDied": "died", "ChannelError": "worker", "MlxrtTimeout": "MLXRT_QUEUE_TIMEOUT_S"}


def test_crash_storm_every_request_ends(tiny_model):
    """Workers SIGKILLed every 0.3-1.2 s under streamed and non-streamed load from 4 threads: no request
    hangs, each error is a clear one, none outlives its queue deadline plus a generation allowance."""
    record = run_storm("synthetic:tiny", seconds=STORM_S, workers=2, threads=4, queue_s=QUEUE_S)
    figures = summary(record)
    print(figures)  # the storm's figures, for the log of a failing run
    assert record.hung == 0, f"{record.hung} client threads still inside a request: a hang"
    assert len(record.kills) >= 8, "the storm did not happen"
    outcomes = record.outcomes()
    assert outcomes.get("ok", 0) > 0, f"no request succeeded in the storm: {outcomes}"
    # Kills met requests in flight: each went on on another worker or ended in a clear error. How many went
    # each way follows the machine's speed (in four runs here today none ended in an error): not asserted.
    errors = sum(outcomes.values()) - outcomes["ok"]
    assert record.resumes + errors > 0, "no kill met a request in flight"
    assert {r.streamed for r in record.requests} == {True, False}
    for r in record.requests:
        assert r.outcome == "ok" or r.outcome in CLEAR, f"unclear error: {r.outcome}: {r.message}"
        assert r.outcome == "ok" or CLEAR[r.outcome] in r.message, r.message
        assert r.waited_s < QUEUE_S + ANSWER_ALLOWANCE_S, f"request ended only after {r.waited_s:.1f} s"
    assert record.recovered, "no request succeeded after the storm"
    assert record.orphans == [] and record.segments_left == []
