"""The things the harness times: native in-process MLX (one stream, and mlx-lm's
continuous batching) and mlxrt's embedded API.

Every scenario has ``name``, ``token_checked`` (its ids must equal native's:
the quality gate), ``setup()``, ``run(prompt_ids, gen_tokens) -> Run`` and
``close()``; all run greedy with EOS disabled on the same prompt ids. Peers
(other servers) live in `benchmarks.peers` and keep the same interface.
"""

from __future__ import annotations

import time
from typing import Any, Protocol

from .measure import Arrivals, Run, peak_rss_bytes, time_stream


class Skipped(Exception):
    """A scenario or peer that cannot run here; the message says why."""


class Scenario(Protocol):
    name: str
    token_checked: bool

    def setup(self) -> None: ...

    def run(self, prompt_ids: list[int], gen_tokens: int) -> Run: ...

    def close(self) -> None: ...


class Native:
    """In-process ``mlx_lm.stream_generate``: the baseline and the token reference."""

    name = "native"
    token_checked = True

    def __init__(self, model_path: str) -> None:
        self.model_path = model_path
        self.model: Any = None
        self.tokenizer: Any = None

    def setup(self) -> None:
        from mlx_lm import load

        self.model, self.tokenizer = load(self.model_path)
        self.tokenizer.eos_token_ids = set()  # EOS disabled: every run makes gen_tokens tokens

    def run(self, prompt_ids: list[int], gen_tokens: int) -> Run:
        import mlx.core as mx
        from mlx_lm import stream_generate

        mx.reset_peak_memory()
        start = time.perf_counter()
        arr = Arrivals(start)
        last = None
        for r in stream_generate(self.model, self.tokenizer, prompt_ids, max_tokens=gen_tokens):
            arr.add([r.token])
            last = r
        run = arr.run(prompt_tokens=len(prompt_ids))
        run.peak_memory_bytes = int(mx.get_peak_memory())
        run.engine = {
            "per_token_ms": run.per_token_ms,  # in-process: the client's clock is the engine's
            "prompt_tps": last.prompt_tps if last is not None else None,
            "decode_tps": last.generation_tps if last is not None else None,
        }
        return run

    def close(self) -> None:
        self.model = self.tokenizer = None


#: mlx_lm.server's defaults (--decode-concurrency, --prompt-concurrency), so both batch alike.
DEFAULT_COMPLETION_BATCH = 32
DEFAULT_PREFILL_BATCH = 8


class NativeBatch:
    """mlx-lm's continuous batching (`BatchGenerator`) in-process: the batched baseline.

    ``run_batch`` inserts every prompt at once (the streams arrive together, as
    the concurrency part's barrier makes them) and steps the generator until all
    are done: greedy, no stop tokens, so each stream makes exactly `gen_tokens`.
    A stream's TTFT runs from the insert to its first token; its clock stops at
    its own last token. Batch sizes are mlx_lm.server's defaults.
    """

    name = "native-batch"
    token_checked = True

    def __init__(
        self,
        model_path: str,
        *,
        model: Any = None,
        completion_batch: int = DEFAULT_COMPLETION_BATCH,
        prefill_batch: int = DEFAULT_PREFILL_BATCH,
    ) -> None:
        self.model_path = model_path
        self.model = model  # native's, when it is loaded already: one copy of the weights
        self.completion_batch = completion_batch
        self.prefill_batch = prefill_batch

    def setup(self) -> None:
        if self.model is None:
            from mlx_lm import load

            self.model, _ = load(self.model_path)

    def run(self, prompt_ids: list[int], gen_tokens: int) -> Run:
        return self.run_batch([prompt_ids], gen_tokens)[0]

    def run_batch(self, prompts: list[list[int]], gen_tokens: int) -> list[Run]:
        """One `Run` per prompt, in order, all generated together."""
        import mlx.core as mx
        from mlx_lm.generate import BatchGenerator

        mx.reset_peak_memory()
        gen = BatchGenerator(
            self.model,
            max_tokens=gen_tokens,
            completion_batch_size=self.completion_batch,
            prefill_batch_size=self.prefill_batch,
        )
        try:
            start = time.perf_counter()
            uids = gen.insert(prompts, [gen_tokens] * len(prompts))
            arrivals = {uid: Arrivals(start) for uid in uids}
            with gen.stats() as stats:
                while responses := gen.next_generated():
                    for r in responses:
                        arrivals[r.uid].add([r.token])
        finally:
            gen.close()
        peak = int(mx.get_peak_memory())
        runs = []
        for uid, prompt in zip(uids, prompts, strict=True):
            arr = arrivals[uid]
            run = arr.run(prompt_tokens=len(prompt))
            run.ended_at = arr.t_prev  # its own last token, not the end of the whole batch
            run.total_s = arr.t_prev - start
            run.peak_memory_bytes = peak
            run.engine = {
                "prompt_tps": stats.prompt_tps,  # the whole batch's, from BatchGenerator.stats()
                "decode_tps": stats.generation_tps,
                "per_token_ms": run.per_token_ms,
            }
            runs.append(run)
        return runs

    def describe(self) -> dict[str, Any]:
        return {
            "engine": "mlx_lm.generate.BatchGenerator",
            "completion_batch_size": self.completion_batch,
            "prefill_batch_size": self.prefill_batch,
        }

    def close(self) -> None:
        self.model = None


def worker_figures(stats: Any) -> dict[str, Any]:
    """The worker's own Stats as engine figures; per_token_ms spans first to last token."""
    n = stats.generation_tokens
    return {
        "ttft_ms": stats.ttft_ms,
        "prompt_tps": stats.prompt_tps,
        "decode_tps": stats.decode_tps,
        "decode_ms": stats.decode_ms,
        "generation_tokens": n,
        "per_token_ms": stats.decode_ms / (n - 1) if n > 1 else None,
        "queue_ms": stats.queue_ms,
    }


class Embedded:
    """mlxrt's Python API (`mlxrt.Runtime`) over a given transport, with `workers` workers."""

    token_checked = True

    def __init__(self, model_path: str, transport: str, *, workers: int = 1, name: str | None = None) -> None:
        self.name = name or f"mlxrt-{transport}"
        self.model_path = model_path
        self.transport = transport
        self.workers = workers
        self.rt: Any = None

    def setup(self) -> None:
        from mlxrt import Runtime

        self.rt = Runtime(model=self.model_path, transport=self.transport, workers=self.workers)
        if self.transport != "auto" and self.rt.transport != self.transport:
            got = self.rt.transport
            self.rt.close()
            self.rt = None
            raise Skipped(f"asked for {self.transport}, runtime chose {got}")

    def run(self, prompt_ids: list[int], gen_tokens: int) -> Run:
        start = time.perf_counter()
        stream = self.rt.stream(prompt_ids, max_tokens=gen_tokens, ignore_eos=True)
        run = time_stream(start, (c.tokens for c in stream), prompt_tokens=len(prompt_ids))
        if stream.stats is not None:
            run.peak_memory_bytes = stream.stats.peak_memory_bytes
            run.engine = worker_figures(stream.stats)
        rss = [peak_rss_bytes(w.pid) for w in self.rt.workers]
        run.rss_peak_bytes = sum(r for r in rss if r) or None
        return run

    def describe(self) -> dict[str, Any]:
        return {"transport": self.rt.transport if self.rt else self.transport, "workers": self.workers}

    def close(self) -> None:
        if self.rt is not None:
            self.rt.close()
            self.rt = None
