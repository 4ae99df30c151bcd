"""N streams at once against one target: aggregate tokens/s and each stream's TTFT.

Every stream sends its own prompt (greedy, EOS off, the same length), from its
own thread, at the same moment (a barrier). Distinct prompts keep a server's
prompt cache from serving one stream with another's prefill, and let the
token check catch streams whose tokens were crossed. A worker serves its
requests one at a time, so with more streams than workers the later ones
queue: their TTFT includes that wait, and that is what a client sees.
"""

from __future__ import annotations

import threading
from typing import Any

from .measure import Run, spread


def run_level(scenario: Any, prompts: list[list[int]], gen_tokens: int) -> tuple[dict[str, Any], list[Run]]:
    """Run one request per prompt on `scenario`, all at once; return the figures and the runs, in order.

    aggregate_tps: all generated tokens over the window from the first request to
    the last token. ttft_ms and latency_s (request to last token): spread over the
    streams, queueing included.
    """
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
    done = [r for r in runs if r is not None]
    window = max(r.ended_at for r in done) - min(r.started_at for r in done)
    tokens = sum(r.n_tokens for r in done)
    figures = {
        "streams": streams,
        "aggregate_tps": tokens / window if window > 0 else float("nan"),
        "window_s": window,
        "tokens": tokens,
        "ttft_ms": spread([r.ttft_ms for r in done]),
        "latency_s": spread([r.total_s for r in done]),  # request to last token, queueing included
        # client-side; a stream whose tokens queued up behind a busy client thread reads as a burst
        "per_stream_decode_tps": spread([r.decode_tps for r in done]),
    }
    return figures, done
