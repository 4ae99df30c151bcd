"""Prometheus metrics of the HTTP server, in a registry of its own.

prometheus_client rather than a hand-written exposition: histograms (cumulative
buckets, ``_sum``/``_count``), label escaping and the content type are easy to
get subtly wrong, and the library is small and pure Python. Nothing here runs
per token: counters move once per request, worker gauges are read at scrape.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from ..handle import WorkerInfo, WorkerMemory

#: Reported even when zero, so the series exist; any other state a worker reports is added.
WORKER_STATES = ("starting", "ready", "busy", "draining", "dead", "failed", "unloaded", "stopped")
TTFT_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
DECODE_BUCKETS_TPS = (1, 5, 10, 25, 50, 100, 200, 400, 800, 1600, 3200, 6400)
GAP_BUCKETS_S = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class _Workers:
    """Worker gauges, read from the runtime at each scrape."""

    def __init__(self, workers: Callable[[], list[WorkerInfo]]) -> None:
        self._workers = workers

    def describe(self) -> list[Metric]:
        return []  # collected lazily: the runtime may not be started when this is registered

    def collect(self) -> Iterator[Metric]:
        workers = self._workers()
        states = GaugeMetricFamily("mlxrt_workers", "Worker processes by model and state.",
                                   labels=["model", "state"])
        counts: dict[tuple[str, str], int] = {}
        for w in workers:
            for s in WORKER_STATES:
                counts.setdefault((w.model, s), 0)
            counts[(w.model, w.state)] = counts.get((w.model, w.state), 0) + 1
        for (model, state), n in sorted(counts.items()):
            states.add_metric([model, state], n)
        yield states
        spares = GaugeMetricFamily("mlxrt_spare_workers", "Hot spares standing by ready, by model.",
                                   labels=["model"])
        standing: dict[str, int] = {}
        for w in workers:
            if w.spare:
                standing[w.model] = standing.get(w.model, 0) + (w.state == "ready")
        for model, n in sorted(standing.items()):
            spares.add_metric([model], n)
        yield spares
        restarts = CounterMetricFamily("mlxrt_worker_restarts", "Times each worker was restarted.",
                                       labels=["model", "worker"])
        resumes = CounterMetricFamily("mlxrt_worker_resumes",
                                      "Requests that went on after a worker of this place died.",
                                      labels=["model", "worker"])
        tokens = CounterMetricFamily("mlxrt_worker_tokens", "Tokens each worker has produced.",
                                     labels=["model", "worker"])
        in_flight = GaugeMetricFamily("mlxrt_worker_in_flight", "Requests in flight on each worker.",
                                      labels=["model", "worker"])
        batch = GaugeMetricFamily("mlxrt_worker_batch_size", "Sequences in each worker's batch.",
                                  labels=["model", "worker"])
        queued = GaugeMetricFamily("mlxrt_worker_queued",
                                   "Requests waiting for a place in each worker's batch.",
                                   labels=["model", "worker"])
        for w in workers:
            restarts.add_metric([w.model, w.name], w.restarts)
            resumes.add_metric([w.model, w.name], w.resumes)
            tokens.add_metric([w.model, w.name], w.tokens)
            in_flight.add_metric([w.model, w.name], w.in_flight)
            batch.add_metric([w.model, w.name], w.batch_size)
            queued.add_metric([w.model, w.name], w.queued)
        yield restarts
        yield resumes
        yield tokens
        yield in_flight
        yield batch
        yield queued


class _Caches:
    """Each worker's prefix cache and its disk tier, from the memory reports read at the scrape (one
    round trip per worker, `AsyncRuntime.memory`); the disk tier is shared by a model's workers, so each
    of them reports the same bytes and entries, and its own hits and writes."""

    def __init__(self) -> None:
        self.reports: list[WorkerMemory] = []

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        labels = ["model", "worker"]
        series = [
            (GaugeMetricFamily, "mlxrt_prompt_cache_bytes", "Bytes held by each worker's prefix cache.",
             lambda m: m.prompt_cache_bytes),
            (CounterMetricFamily, "mlxrt_prompt_cache_hits", "Prefix cache lookups that found a prefix.",
             lambda m: m.prompt_cache_hits),
            (GaugeMetricFamily, "mlxrt_prompt_cache_disk_bytes", "Bytes of the prefix cache's disk tier.",
             lambda m: m.disk_cache and m.disk_cache.nbytes),
            (GaugeMetricFamily, "mlxrt_prompt_cache_disk_entries", "Entries of the prefix cache's disk tier.",
             lambda m: m.disk_cache and m.disk_cache.entries),
            (CounterMetricFamily, "mlxrt_prompt_cache_disk_hits", "Prefixes each worker loaded from disk.",
             lambda m: m.disk_cache and m.disk_cache.hits),
            (CounterMetricFamily, "mlxrt_prompt_cache_disk_writes", "Entries each worker wrote to disk.",
             lambda m: m.disk_cache and m.disk_cache.writes),
            (CounterMetricFamily, "mlxrt_prompt_cache_disk_skipped",
             "Writes refused while the disk writer was behind (those prefixes stayed in memory, to be "
             "written as they leave it).",
             lambda m: m.disk_cache and m.disk_cache.skipped),
            (CounterMetricFamily, "mlxrt_prompt_cache_disk_evicted_writes",
             "Prefixes written to disk as they left the memory tier.",
             lambda m: m.disk_cache and m.disk_cache.evicted_writes),
            (CounterMetricFamily, "mlxrt_prompt_cache_disk_lost",
             "Prefixes that left the memory tier while the disk writer was full of others: on neither tier.",
             lambda m: m.disk_cache and m.disk_cache.lost),
            (CounterMetricFamily, "mlxrt_prompt_cache_disk_warmed",
             "Disk entries each worker read back into its memory tier while idle after it started.",
             lambda m: m.disk_cache and m.disk_cache.warmed),
            (CounterMetricFamily, "mlxrt_prompt_cache_disk_removed",
             "Disk entries each worker removed as corrupt, foreign or unreadable.",
             lambda m: m.disk_cache and m.disk_cache.removed),
        ]
        for kind, name, doc, value in series:
            family = kind(name, doc, labels=labels)
            for m in self.reports:
                family.add_metric([m.model, m.name], value(m) or 0)
            yield family


class Metrics:
    """Every series the server exports; `render()` gives the text exposition."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self, workers: Callable[[], list[WorkerInfo]]) -> None:
        self.registry = r = CollectorRegistry()
        self.requests = Counter("mlxrt_http_requests", "HTTP requests by endpoint and status code.",
                                ["endpoint", "status"], registry=r)
        self.in_progress = Gauge("mlxrt_http_requests_in_progress", "HTTP requests being served.",
                                 registry=r)
        self.tokens = Counter("mlxrt_generated_tokens", "Tokens sent to clients.", ["model"], registry=r)
        self.finished = Counter("mlxrt_generations",
                                "Generations by how they ended: stop, length, disconnected, error.",
                                ["model", "reason"], registry=r)
        self.ttft = Histogram("mlxrt_time_to_first_token_seconds",
                              "Time from request arrival to the first token, in the server.",
                              ["model"], buckets=TTFT_BUCKETS_S, registry=r)
        self.prompt_tokens = Counter("mlxrt_prompt_tokens", "Prompt tokens of finished generations.",
                                     ["model"], registry=r)
        self.cached_tokens = Counter("mlxrt_cached_prompt_tokens",
                                     "Prompt tokens served from the workers' prefix caches.",
                                     ["model"], registry=r)
        self.draft_tokens = Counter("mlxrt_draft_tokens",
                                    "Tokens proposed by draft models (speculative decoding).", ["model"],
                                    registry=r)
        self.draft_accepted = Counter("mlxrt_draft_accepted_tokens",
                                      "Drafted tokens the target accepted (the acceptance rate: "
                                      "this over mlxrt_draft_tokens).",
                                      ["model"], registry=r)
        self.decode_rate = Histogram("mlxrt_decode_tokens_per_second",
                                     "Decode rate of each generation, as the worker measured it.",
                                     ["model"], buckets=DECODE_BUCKETS_TPS, registry=r)
        self.decode_gap = Histogram("mlxrt_decode_longest_gap_seconds",
                                    "Longest time between two tokens of each generation, as the worker "
                                    "measured it (a stall behind other prompts' prefill shows here).",
                                    ["model"], buckets=GAP_BUCKETS_S, registry=r)
        self.embedded_inputs = Counter("mlxrt_embedded_inputs", "Inputs embedded and sent to clients.",
                                       ["model"], registry=r)
        self.embedded_tokens = Counter("mlxrt_embedded_tokens", "Tokens of the inputs embedded.",
                                       ["model"], registry=r)
        r.register(_Workers(workers))
        self._caches = _Caches()
        r.register(self._caches)

    def render(self, memory: list[WorkerMemory] | None = None) -> bytes:
        """The exposition; `memory`: the workers' memory reports read for this scrape (their caches)."""
        self._caches.reports = memory or []
        return generate_latest(self.registry)
