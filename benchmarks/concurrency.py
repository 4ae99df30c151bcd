"""N streams at once against one target: aggregate tokens/s and each stream's TTFT.

Every stream sends its own prompt (greedy, EOS off, the same length), from its
own thread, at the same moment (a barrier). Distinct prompts keep a server's
prompt cache from serving one stream with another's prefill, and let the
token check catch streams whose tokens were crossed. A worker that serves its
requests one at a time makes the later ones queue: their TTFT includes that
wait, and that is what a client sees. A target with ``run_batch`` (the
in-process ``native-batch`` baseline) gets all the prompts in one call instead.
"""

from __future__ import annotations

import threading
from typing import Any

from .measure import Run, spread


def run_level(scenario: Any, prompts: list[list[int]], gen_tokens: int) -> tuple[dict[str, Any], list[Run]]:
    """Run one request per prompt on `scenario`, all at once; return the figures and the runs, in order."""
    batch = getattr(scenario, "run_batch", None)
    runs = batch(prompts, gen_tokens) if callable(batch) else run_threads(scenario, prompts, gen_tokens)
    return level_figures(runs), runs


def run_threads(scenario: Any, prompts: list[Any], gen_tokens: int) -> list[Any]:
    """``scenario.run`` once per prompt, each from its own thread, released together by a barrier."""
    streams = len(prompts)
    barrier = threading.Barrier(streams)
    runs: list[Run | None] = [None] * streams
    errors: list[BaseException] = []

    def one(i: int) -> None:
        barrier.wait()
        try:
            runs[i] = scenario.run(prompts[i], gen_tokens)
        except BaseException as exc:  # reported below, after every thread is joined
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(streams)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return [r for r in runs if r is not None]


def level_figures(runs: list[Run]) -> dict[str, Any]:
    """The figures of one stream count.

    aggregate_tps: all generated tokens over the window from the first request to
    the last token. ttft_ms (with its p90) and latency_s (request to last token):
    spread over the streams, queueing included. worker_queue_ms (arrival in the
    worker to admission) and worker_ttft_ms (admission to first token), where
    the target reports them.
    """
    window = max(r.ended_at for r in runs) - min(r.started_at for r in runs)
    tokens = sum(r.n_tokens for r in runs)
    worker = {  # where a TTFT went, for targets whose worker reports it (mlxrt's Python API)
        f"worker_{key}": spread([r.engine[key] for r in runs])
        for key in ("queue_ms", "ttft_ms")
        if all(r.engine.get(key) is not None for r in runs)
    }
    return {
        "streams": len(runs),
        "aggregate_tps": tokens / window if window > 0 else float("nan"),
        "window_s": window,
        "tokens": tokens,
        "ttft_ms": spread([r.ttft_ms for r in runs]),
        "latency_s": spread([r.total_s for r in runs]),  # request to last token, queueing included
        # client-side; a stream whose tokens queued up behind a busy client thread reads as a burst
        "per_stream_decode_tps": spread([r.decode_tps for r in runs]),
        **worker,
    }
