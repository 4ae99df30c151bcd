"""``python -m benchmarks.resume``: a stream whose worker is SIGKILLed mid-reply, and how long it pauses.

Each sample starts a fresh runtime (every kill a first crash, the default supervision policy: 0.5 s
backoff, `MLXRT_MAX_RESUMES` 2), warms it, streams a greedy reply of ``--tokens`` tokens once whole (the
reference, and the warm decode rate), then again, SIGKILLing the worker after ``--after`` chunks. The
figure is the pause: from the kill to the resumed stream's next token; each sample says whether the
resumed reply equals the reference, and where it first differs if not. Without a spare it is the
restart (backoff, process start, model load, warm-up) plus the prefill of prompt and reply so far;
with one (``--spares 0,1`` measures both, interleaved A B A B) the spare takes the slot at once and
prefills. Each sample also says where the pause went: until the killed process had exited (its pipes
and ring report the death only then), and in the resuming worker. The JSON document goes to
``--json`` (benchmarks/runner.py); stdout ends with the figures, its path and a short summary line.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import time

from . import runner
from .gate import first_divergence
from .measure import spread

PROMPT = "Write a long story about a lighthouse keeper and the ships she guides through the winter storms."


def watch_exit(pid: int, since: float, out: dict) -> threading.Thread:
    """A thread that sets ``out["exit_s"]``: seconds from `since` (perf_counter) until `pid` has exited
    (a zombie or gone, per /proc, polled each ms): the killed process's teardown, which its pipes and
    ring only report at its end. Linux only (elsewhere the figure is left out); a process already gone
    when it starts counts as exited then."""
    def poll() -> None:
        stat = f"/proc/{pid}/stat"
        while time.perf_counter() - since < 30:
            try:
                with open(stat) as f:
                    state = f.read().rpartition(")")[2].split()[0]
            except OSError:
                state = "gone"
            if state in ("Z", "X", "gone"):
                out["exit_s"] = time.perf_counter() - since
                return
            time.sleep(0.001)

    t = threading.Thread(target=poll, daemon=True)
    if sys.platform == "linux":
        t.start()
    return t


def one_sample(model: str, transport: str, spares: int, tokens: int, after: int) -> dict:
    from mlxrt import Runtime

    with Runtime(model=model, transport=transport, spares=spares) as rt:
        rt.generate("warm up", max_tokens=8)
        t0 = time.perf_counter()
        whole = rt.generate(PROMPT, max_tokens=tokens, ignore_eos=True)
        whole_s = time.perf_counter() - t0
        active, *standby = rt.workers
        got: list[int] = []
        gaps: list[float] = []
        teardown: dict = {}  # the killed process's exit, from `watch_exit`
        exited: threading.Thread | None = None
        killed_at = resumed_at = last = killed_wall = 0.0
        stream = rt.stream(PROMPT, max_tokens=tokens, ignore_eos=True)
        for i, chunk in enumerate(stream):
            now = time.perf_counter()
            if killed_at and not resumed_at:
                resumed_at = now
            elif last:
                gaps.append(now - last)
            last = now
            got += chunk.tokens
            if i + 1 == after:
                killed_at, killed_wall = time.perf_counter(), time.time()
                os.kill(active.pid, signal.SIGKILL)
                exited = watch_exit(active.pid, killed_at, teardown)
        w = rt.workers[0]
        assert stream.stats.resumes == 1 and w.resumes == 1
        assert not standby or w.pid == standby[0].pid, "the spare did not take over"
        st = stream.stats  # the resumed worker's: its queue, then from its admission of the request
        if exited is not None and exited.ident is not None:
            exited.join(30)
        return {"pause_s": resumed_at - killed_at, "token_gap_s": sorted(gaps)[len(gaps) // 2],
                "worker_queue_ms": st.queue_ms, "worker_ttft_ms": st.ttft_ms,
                "worker_prefill_ms": st.prefill_ms,
                "killed_exit_ms": teardown.get("exit_s", float("nan")) * 1e3, "killed_at_unix": killed_wall,
                "whole_s": whole_s, "spares": spares, "transport": rt.transport, "tokens": len(got),
                "prompt_tokens": whole.stats.prompt_tokens, "identical": got == whole.tokens,
                "first_difference": first_divergence(got, whole.tokens)}


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",")]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.resume", description=__doc__)
    p.add_argument("--model", default="synthetic:small")
    p.add_argument("--samples", type=int, default=3, help="per --spares value")
    p.add_argument("--transport", default="auto")
    p.add_argument("--spares", type=_ints, default=[0, 1], help="comma-separated (default 0,1)")
    p.add_argument("--tokens", type=int, default=200, help="the reply's length")
    p.add_argument("--after", type=int, default=50, help="chunks received before the kill")
    runner.add_json_arg(p, study="resume")
    args = p.parse_args(argv)
    samples: dict[int, list[dict]] = {n: [] for n in args.spares}
    for i in range(args.samples):
        for n in args.spares:  # interleaved, so drift on a shared machine hits both alike
            one = one_sample(args.model, args.transport, n, args.tokens, args.after)
            samples[n].append(one)
            print(f"sample {i + 1}/{args.samples}, spares={n}: pause {one['pause_s'] * 1e3:.0f} ms; the "
                  f"killed process exited after {one['killed_exit_ms']:.0f} ms; in the resuming worker: "
                  f"queued {one['worker_queue_ms']:.0f} ms, then to its first token "
                  f"{one['worker_ttft_ms']:.0f} ms (prefill {one['worker_prefill_ms']:.0f} ms)",
                  file=sys.stderr)
    results = {}
    for n, got in samples.items():
        pause = spread([x["pause_s"] * 1e3 for x in got])
        gap = spread([x["token_gap_s"] * 1e3 for x in got])
        differ = [x["first_difference"] for x in got if not x["identical"]]
        results[str(n)] = {"pause_ms": pause, "token_gap_ms": gap, "samples": got}
        print(f"SIGKILL mid-stream -> the resumed stream's next token, {args.model}, {got[0]['transport']}, "
              f"spares={n}: {runner.span(pause, '.0f')} ms (a token otherwise every "
              f"{runner.span(gap, '.1f')} ms); tokens identical in {sum(x['identical'] for x in got)}/"
              f"{len(got)} (first differences at {differ})",
              flush=True)
    doc = {"benchmark": "mlxrt-resume", "model": args.model, "tokens": args.tokens, "after": args.after,
           "by_spares": results, "env": runner.environment()}
    summary = {"benchmark": doc["benchmark"], "model": args.model,
               "pause_ms_median_by_spares": {n: r["pause_ms"]["median"] for n, r in results.items()}}
    identical = all(x["identical"] for got in samples.values() for x in got)
    runner.finish(doc, runner.json_path(args.json, "resume"), {**summary, "status": "ok" if identical
                                                                else "tokens differ"})
    return 0 if identical else 1


if __name__ == "__main__":
    sys.exit(main())
