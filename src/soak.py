"""Soak: hours of mixed load through `Runtime`, sampled every second, judged at the end.

::

    K loader threads --stream()--> Runtime --> W worker processes
         | one row per request                      ^
         v                                          | SIGKILL every --chaos s (optional)
    requests.csv          sampler thread ------------+
                            | tok/s, TTFT, RSS of every process, rt.memory(),
                            | read_memory(), read_thermal(), errors, restarts
                            v
                     samples.csv, workers.csv --> summary.json, soak.png, exit code

The harness runs in the orchestrator process, so its own memory counts in the
orchestrator's RSS: rows go straight to disk and only four numbers per sample
stay in memory (compact arrays), so a long run does not look like a leak.
Thresholds and how to read the results: docs/soak.md.
"""

from __future__ import annotations

import argparse
import array
import bisect
import csv
import dataclasses
import json
import math
import os
import random
import signal
import sys
import threading
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import structlog

from .orchestrator.monitor import read_memory, read_thermal, sample_processes

log = structlog.get_logger("mlxrt.soak")

DEFAULT_MODEL = "synthetic:small"
DEFAULT_MINUTES = 10.0
DEFAULT_STREAMS = 4
DEFAULT_SAMPLE_S = 1.0
DEFAULT_MAX_LEAK_MB_PER_HOUR = 100.0  # MB = 2**20 bytes; short runs are noisy, see docs/soak.md
DEFAULT_MIN_THROUGHPUT_RATIO = 0.75
DEFAULT_MAX_ERRORS = 0
DEFAULT_PROMPT_WORDS = (8, 400)
DEFAULT_MAX_TOKENS = (16, 192)
DEFAULT_DRAIN_S = 120.0  # how long loaders get to finish their last request at the end
WARMUP_FRACTION = 0.2
WARMUP_MIN_S = 60.0
WARMUP_MAX_FRACTION = 0.5  # short runs still keep half their samples for the slope
# Below this much post-warm-up time the slope is mostly allocator noise (2 MB in 12 s reads as 600 MB/h):
# it is reported, not enforced.
MIN_LEAK_WINDOW_S = 300.0
# Warm-up lasts until RSS settles: until the slope over the next SETTLE_WINDOW_S of samples is within the
# leak limit (kernel compilation for each new prompt shape, caches filling up); never past half the run.
SETTLE_WINDOW_S = 60.0
MB = 1 << 20

SAMPLE_COLUMNS = (
    "t_s", "tokens_total", "tok_s", "requests_ok", "requests_active", "ttft_ms_p50", "ttft_ms_p95",
    "req_tok_s_p50", "errors_unexpected", "errors_worker_died", "restarts", "kills", "workers_ready",
    "rss_orchestrator_bytes", "rss_workers_bytes", "rss_total_bytes", "mlx_active_bytes",
    "mlx_peak_bytes", "mlx_cache_bytes", "memory_level", "memory_available_bytes", "memory_source",
    "thermal_level", "thermal_celsius", "thermal_source",
)
WORKER_COLUMNS = (
    "t_s", "name", "pid", "state", "restarts", "in_flight", "rss_bytes", "mlx_active_bytes",
    "mlx_peak_bytes", "mlx_cache_bytes",
)
REQUEST_COLUMNS = (
    "t_start_s", "stream", "prompt_words", "max_tokens", "tokens", "ttft_ms", "tok_s", "duration_s",
    "outcome", "error",
)


@dataclass(frozen=True, kw_only=True)
class SoakConfig:
    """One soak run. Thresholds set to None are reported but not enforced."""

    model: str = DEFAULT_MODEL
    minutes: float = DEFAULT_MINUTES
    streams: int = DEFAULT_STREAMS
    workers: int = 1
    transport: str = "auto"
    out: Path | None = None  # default: soak-results/<UTC timestamp>
    chaos_s: float | None = None
    max_leak_mb_per_hour: float | None = DEFAULT_MAX_LEAK_MB_PER_HOUR
    min_throughput_ratio: float | None = DEFAULT_MIN_THROUGHPUT_RATIO
    max_errors: int | None = DEFAULT_MAX_ERRORS
    sample_s: float = DEFAULT_SAMPLE_S
    seed: int = 0
    prompt_words: tuple[int, int] = DEFAULT_PROMPT_WORDS
    max_tokens: tuple[int, int] = DEFAULT_MAX_TOKENS
    drain_s: float = DEFAULT_DRAIN_S
    plot: bool = True

    def validate(self) -> None:
        """Raise ValueError naming the first bad field."""
        if not self.minutes > 0:
            raise ValueError(f"invalid minutes={self.minutes!r}: must be > 0")
        if self.streams < 1 or self.workers < 1:
            raise ValueError(f"invalid streams={self.streams}/workers={self.workers}: must be >= 1")
        if not self.sample_s > 0:
            raise ValueError(f"invalid sample_s={self.sample_s!r}: must be > 0")
        if self.chaos_s is not None and not self.chaos_s > 0:
            raise ValueError(f"invalid chaos_s={self.chaos_s!r}: must be > 0")
        for name in ("prompt_words", "max_tokens"):
            lo, hi = getattr(self, name)
            if not 1 <= lo <= hi:
                raise ValueError(f"invalid {name}=({lo}, {hi}): need 1 <= low <= high")


@dataclass
class SoakSummary:
    """What a soak found; `failures` lists every crossed threshold, `exit_code` is 0 only without any."""

    model: str
    transport: str
    streams: int
    workers: int
    duration_s: float
    samples: int
    failed_samples: int
    requests_started: int
    requests_ok: int
    tokens_total: int
    tok_s_mean: float | None
    ttft_ms_p50: float | None
    ttft_ms_p95: float | None
    req_tok_s_p50: float | None
    errors_unexpected: int
    errors_worker_died: int
    errors_by_type: dict[str, int]
    hung: int
    restarts: int
    kills: list[dict]
    recovered: bool | None
    warmup_s: float
    leak_mb_per_hour: float | None
    leak_stderr_mb_per_hour: float | None
    leak_orchestrator_mb_per_hour: float | None
    leak_gated_on: str
    rss_total_mb_start: float | None
    rss_total_mb_end: float | None
    rss_total_mb_max: float | None
    throughput_first_tok_s: float | None
    throughput_last_tok_s: float | None
    throughput_ratio: float | None
    memory_levels: dict[str, int]
    thermal_levels: dict[str, int]
    thresholds: dict[str, Any]
    files: dict[str, str]
    plot_note: str
    failures: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return not self.failures

    @property
    def exit_code(self) -> int:
        return 0 if self.passed else 1

    def to_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "passed": self.passed, "exit_code": self.exit_code}


# ---- the math -----------------------------------------------------------------


def least_squares_slope(ts: Sequence[float], ys: Sequence[float]) -> tuple[float, float] | None:
    """Slope of the least-squares line through (ts, ys), in y-units per t-unit, and its standard error.

    None with fewer than three points or no spread in `ts`.
    """
    n = len(ts)
    if n < 3 or n != len(ys):
        return None
    mt, my = sum(ts) / n, sum(ys) / n
    sxx = sum((t - mt) ** 2 for t in ts)
    if sxx == 0:
        return None
    slope = sum((t - mt) * (y - my) for t, y in zip(ts, ys, strict=True)) / sxx
    resid = sum((y - my - slope * (t - mt)) ** 2 for t, y in zip(ts, ys, strict=True))
    return slope, math.sqrt(resid / (n - 2) / sxx)


def warmup_seconds(duration_s: float) -> float:
    """Samples before this are left out of the leak slope: 20 % of the run, at least a minute,
    at most half the run."""
    return min(max(WARMUP_FRACTION * duration_s, WARMUP_MIN_S), WARMUP_MAX_FRACTION * duration_s)


def settled_after(ts: Sequence[float], rss_bytes: Sequence[float], *, start_s: float, end_s: float,
                  limit_mb_per_hour: float) -> float:
    """The first sample time in [start_s, end_s] from which RSS rises no faster than the limit over
    the next `SETTLE_WINDOW_S` (least squares over those samples); `end_s` if there is none.

    A step (kernels compiled for new shapes) and the climb that trails it end there; a leak never
    does, so it is judged on what is left of the run.
    """
    lo = bisect.bisect_left(ts, start_s)
    for i in range(lo, len(ts)):
        if ts[i] > end_s:
            break
        j = bisect.bisect_right(ts, ts[i] + SETTLE_WINDOW_S, lo=i)
        pairs = [(t, y) for t, y in zip(ts[i:j], rss_bytes[i:j], strict=True) if not math.isnan(y)]
        fit = least_squares_slope([t for t, _ in pairs], [y for _, y in pairs])
        if fit is None or fit[0] * 3600 / MB <= limit_mb_per_hour:
            return ts[i]
    return end_s


def leak_warmup_s(ts: Sequence[float], rss_bytes: Sequence[float], duration_s: float,
                  limit_mb_per_hour: float | None) -> float:
    """Where the leak slope starts: after `warmup_seconds`, and after RSS settled (`settled_after`,
    measured against the leak limit; not looked for with no limit), at most half the run."""
    fixed = warmup_seconds(duration_s)
    if limit_mb_per_hour is None:
        return fixed
    return settled_after(ts, rss_bytes, start_s=fixed, end_s=max(fixed, WARMUP_MAX_FRACTION * duration_s),
                         limit_mb_per_hour=limit_mb_per_hour)


def leak_mb_per_hour(ts: Sequence[float], rss_bytes: Sequence[float], warmup_s: float
                     ) -> tuple[float, float] | None:
    """Memory slope after warm-up in MB/hour (MB = 2**20 bytes) and its standard error;
    None with too few samples."""
    pairs = [(t, y) for t, y in zip(ts, rss_bytes, strict=True) if t >= warmup_s and not math.isnan(y)]
    fit = least_squares_slope([t for t, _ in pairs], [y for _, y in pairs])
    if fit is None:
        return None
    return fit[0] * 3600 / MB, fit[1] * 3600 / MB


def window_rate(ts: Sequence[float], cumulative: Sequence[float], start: float, end: float) -> float | None:
    """Average rate of a cumulative counter over [start, end], from the samples inside it; None if < 2."""
    inside = [i for i, t in enumerate(ts) if start <= t <= end]
    if len(inside) < 2:
        return None
    i, j = inside[0], inside[-1]
    if ts[j] <= ts[i]:
        return None
    return (cumulative[j] - cumulative[i]) / (ts[j] - ts[i])


def throughput_thirds(ts: Sequence[float], tokens: Sequence[float]) -> tuple[float | None, float | None]:
    """Tokens/s in the first and in the last third of the sampled time span."""
    if len(ts) < 2:
        return None, None
    t0, t1 = ts[0], ts[-1]
    third = (t1 - t0) / 3
    return window_rate(ts, tokens, t0, t0 + third), window_rate(ts, tokens, t1 - third, t1)


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0..100) by linear interpolation; None for no values."""
    if not values:
        return None
    xs = sorted(values)
    k = (len(xs) - 1) * q / 100
    lo = math.floor(k)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def verdict(summary: SoakSummary, config: SoakConfig) -> list[str]:
    """Every threshold `summary` crosses, each naming the option that sets it."""
    out = []
    leak = {"orchestrator": summary.leak_orchestrator_mb_per_hour,
            "total": summary.leak_mb_per_hour}.get(summary.leak_gated_on)
    if config.max_leak_mb_per_hour is not None and leak is not None and leak > config.max_leak_mb_per_hour:
        out.append(f"{summary.leak_gated_on} memory grew {leak:.1f} MB/h after warm-up "
                   f"(limit {config.max_leak_mb_per_hour:g}, --max-leak-mb-per-hour)")
    ratio = summary.throughput_ratio
    if config.min_throughput_ratio is not None and ratio is not None and ratio < config.min_throughput_ratio:
        out.append(f"throughput fell to {ratio:.2f}x of the first third in the last third "
                   f"(limit {config.min_throughput_ratio:g}, --min-throughput-ratio)")
    if config.max_errors is not None and summary.errors_unexpected > config.max_errors:
        kinds = ", ".join(f"{k}: {v}" for k, v in sorted(summary.errors_by_type.items()))
        out.append(f"{summary.errors_unexpected} unexpected errors ({kinds}) "
                   f"(limit {config.max_errors}, --max-errors)")
    if summary.hung:
        out.append(f"{summary.hung} requests still running {config.drain_s:g} s after the end")
    if summary.recovered is False:
        out.append("the pool did not serve a request after the last kill (--chaos)")
    if summary.requests_ok == 0:
        out.append("no request completed")
    if summary.failed_samples:
        out.append(f"{summary.failed_samples} samples could not be taken (see the soak.sample_failed log)")
    return out


# ---- the load ------------------------------------------------------------------


class Tally:
    """Counters shared by loaders and sampler; request rows go to disk, never into memory."""

    def __init__(self, streams: int, requests_csv: Any) -> None:
        self.tokens = [0] * streams  # one writer per slot: no lock on the hot path
        self.active = [False] * streams
        self.lock = threading.Lock()
        self.started = 0
        self.ok = 0
        self.unexpected = 0
        self.worker_died = 0
        self.by_type: Counter[str] = Counter()
        self.ttft_ms: list[float] = []  # since the last sample; the sampler swaps it out
        self.req_tok_s: list[float] = []
        self._file = requests_csv
        self._rows = csv.writer(requests_csv)
        self._rows.writerow(REQUEST_COLUMNS)
        self.closed = False  # set before the file closes: a hung loader's late row is dropped

    def record(self, row: list[Any], *, outcome: str, expected: bool, ttft_ms: float | None,
               tok_s: float | None) -> None:
        with self.lock:
            if outcome == "ok":
                self.ok += 1
                if ttft_ms is not None:
                    self.ttft_ms.append(ttft_ms)
                if tok_s is not None:
                    self.req_tok_s.append(tok_s)
            elif expected:
                self.worker_died += 1
            else:
                self.unexpected += 1
                self.by_type[outcome] += 1
            if not self.closed:
                self._rows.writerow(row)

    def flush(self) -> None:
        with self.lock:
            if not self.closed:
                self._file.flush()

    def take_latencies(self) -> tuple[list[float], list[float]]:
        with self.lock:
            out = self.ttft_ms, self.req_tok_s
            self.ttft_ms, self.req_tok_s = [], []
        return out


def load_corpus() -> list[str]:
    """Words to cut prompts from: the text the synthetic tokenizers are trained on."""
    from importlib import resources

    try:
        text = resources.files("mlxrt.synthetic").joinpath("corpus.txt").read_text(encoding="utf-8")
    except (FileNotFoundError, ModuleNotFoundError):
        text = "the quick brown fox jumps over the lazy dog while a soak test keeps running " * 20
    return text.split()


def _loader(rt: Any, config: SoakConfig, idx: int, words: list[str], tally: Tally, t0: float,
            stop: threading.Event, chaos: bool) -> None:
    """Send requests back to back until `stop`; every outcome is one row and one count."""
    from . import MlxrtError, WorkerDied

    rng = random.Random(config.seed * 1000 + idx)
    while not stop.is_set():
        n_words = rng.randint(*config.prompt_words)
        start = rng.randrange(max(1, len(words) - n_words))
        prompt = " ".join(words[start:start + n_words])
        max_tokens = rng.randint(*config.max_tokens)
        greedy = rng.random() < 0.5
        params = {"max_tokens": max_tokens, "ignore_eos": True,
                  "temperature": 0.0 if greedy else 0.8, "seed": rng.randrange(1 << 30)}
        with tally.lock:
            tally.started += 1
        tally.active[idx] = True
        t_start = time.monotonic()
        first: float | None = None
        n = 0
        outcome, error, expected = "ok", "", False
        try:
            with rt.stream(prompt, **params) as stream:
                for chunk in stream:
                    if chunk.tokens:
                        if first is None:
                            first = time.monotonic()
                        n += len(chunk.tokens)
                        tally.tokens[idx] += len(chunk.tokens)
        except WorkerDied as exc:  # expected only when we are the ones killing workers
            outcome, error, expected = type(exc).__name__, str(exc), chaos
        except MlxrtError as exc:
            outcome, error = type(exc).__name__, str(exc)
        except Exception as exc:  # not a clear mlxrt error: always a finding
            outcome, error = f"unclear:{type(exc).__name__}", repr(exc)
        t_end = time.monotonic()
        tally.active[idx] = False
        ttft_ms = (first - t_start) * 1000 if first is not None else None
        tok_s = (n - 1) / (t_end - first) if first is not None and n > 1 and t_end > first else None
        tally.record(
            [round(t_start - t0, 3), idx, n_words, max_tokens, n, _r(ttft_ms), _r(tok_s),
             round(t_end - t_start, 3), outcome, error[:200]],
            outcome=outcome, expected=expected, ttft_ms=ttft_ms, tok_s=tok_s,
        )
        if outcome != "ok":
            stop.wait(0.2)  # a pool with no live worker fails fast: do not spin


def _chaos(rt: Any, every_s: float, rng: random.Random, t0: float, stop: threading.Event,
           kills: list[dict]) -> None:
    """SIGKILL one random live worker every `every_s` seconds; only our own children are touched."""
    import psutil

    me = os.getpid()
    while not stop.wait(every_s):
        try:
            live = [w for w in rt.workers if w.pid > 0 and w.state not in ("dead", "failed", "unloaded")]
        except Exception as exc:  # keep killing on schedule; the runtime's bug shows up elsewhere
            log.error("soak.chaos_failed", error=repr(exc))
            continue
        rng.shuffle(live)
        for w in live:
            try:
                if psutil.Process(w.pid).ppid() != me:
                    continue  # the pid was reused by someone else's process
                os.kill(w.pid, signal.SIGKILL)
            except (psutil.NoSuchProcess, ProcessLookupError):
                continue
            kills.append({"t_s": round(time.monotonic() - t0, 3), "pid": w.pid, "name": w.name,
                          "state": w.state})
            log.info("soak.kill", pid=w.pid, worker=w.name, state=w.state)
            break


# ---- sampling -------------------------------------------------------------------


class Sampler:
    """Once per `sample_s`: one row of samples.csv, one row per worker in workers.csv."""

    def __init__(self, rt: Any, tally: Tally, kills: list[dict], samples_csv: Any, workers_csv: Any,
                 t0: float) -> None:
        self.rt, self.tally, self.kills, self.t0 = rt, tally, kills, t0
        self.samples = csv.writer(samples_csv)
        self.samples.writerow(SAMPLE_COLUMNS)
        self.workers = csv.writer(workers_csv)
        self.workers.writerow(WORKER_COLUMNS)
        self._files = (samples_csv, workers_csv)
        # The only per-sample state kept in memory: for the slope and the thirds.
        self.ts = array.array("d")
        self.rss_total = array.array("d")
        self.rss_orch = array.array("d")
        self.tokens = array.array("d")
        self.memory_levels: Counter[str] = Counter()
        self.thermal_levels: Counter[str] = Counter()
        self.restarts = 0
        self.failed_samples = 0
        self._last = (0.0, 0)  # (seconds since t0, tokens) of the last sample

    def run(self, stop: threading.Event, every_s: float) -> None:
        next_t = time.monotonic() + every_s
        while not stop.wait(max(0.0, next_t - time.monotonic())):
            try:
                self.sample()
            except Exception as exc:  # one bad sample must not end hours of sampling
                self.failed_samples += 1
                log.error("soak.sample_failed", error=repr(exc))
            next_t += every_s
            if next_t < time.monotonic():  # fell behind (a slow rt.memory()): skip, do not burst
                next_t = time.monotonic() + every_s

    def sample(self) -> None:
        t = time.monotonic() - self.t0
        t_r = round(t, 3)
        tokens = sum(self.tally.tokens)
        last_t, last_tokens = self._last
        self._last = (t_r, tokens)
        # From the row's own time and count: a reader of samples.csv gets the same rate from them.
        tok_s = (tokens - last_tokens) / (t_r - last_t) if t_r > last_t else 0.0
        ttfts, rates = self.tally.take_latencies()
        workers = self.rt.workers
        self.restarts = sum(getattr(w, "restarts", 0) for w in workers)
        pids = [w.pid for w in workers if w.pid > 0]
        rss = sample_processes([os.getpid(), *pids])
        rss_orch = rss.get(os.getpid(), 0)
        rss_workers = sum(v for pid, v in rss.items() if pid != os.getpid())
        mlx = self._mlx_memory()
        mem = _safe(read_memory)
        therm = _safe(read_thermal)
        mem_level = mem.level if mem else "unavailable"
        therm_level = therm.level if therm else "unavailable"
        self.memory_levels[mem_level] += 1
        self.thermal_levels[therm_level] += 1
        mlx_sum = {k: (sum(getattr(m, k) for m in mlx.values()) if mlx is not None else None)
                   for k in ("active_bytes", "peak_bytes", "cache_bytes")}
        self.samples.writerow([
            t_r, tokens, _r(tok_s), self.tally.ok, sum(self.tally.active), _r(percentile(ttfts, 50)),
            _r(percentile(ttfts, 95)), _r(percentile(rates, 50)), self.tally.unexpected,
            self.tally.worker_died, self.restarts, len(self.kills),
            sum(w.state in ("ready", "busy") for w in workers), rss_orch, rss_workers,
            rss_orch + rss_workers, _blank(mlx_sum["active_bytes"]), _blank(mlx_sum["peak_bytes"]),
            _blank(mlx_sum["cache_bytes"]), mem_level, mem.available_bytes if mem else "",
            mem.source if mem else "", therm_level, _blank(therm.celsius if therm else None),
            therm.source if therm else "",
        ])
        for w in workers:
            m = mlx.get(w.pid) if mlx else None
            self.workers.writerow([
                t_r, w.name, w.pid, w.state, getattr(w, "restarts", 0), w.in_flight, _blank(rss.get(w.pid)),
                _blank(m and m.active_bytes), _blank(m and m.peak_bytes), _blank(m and m.cache_bytes),
            ])
        for f in self._files:
            f.flush()
        self.tally.flush()  # so a long run can be watched (tail -f) while it goes
        self.ts.append(t)
        self.rss_total.append(float(rss_orch + rss_workers))
        self.rss_orch.append(float(rss_orch))
        self.tokens.append(float(tokens))

    def _mlx_memory(self) -> dict[int, Any] | None:
        """MLX memory per worker pid from `rt.memory()`; None until the runtime has it."""
        from . import MlxrtError

        memory = getattr(self.rt, "memory", None)
        if memory is None:
            return None
        try:
            return {m.pid: m for m in memory()}
        except MlxrtError:  # a worker died mid-ping: this sample has no MLX figures
            return None


def _safe(read: Any) -> Any:
    try:
        return read()
    except Exception:  # a reader bug must not end an hours-long run; the row says unavailable
        return None


def _r(x: float | None, nd: int = 2) -> float | str:
    return "" if x is None else round(x, nd)


def _blank(x: Any) -> Any:
    return "" if x is None else x


# ---- the run --------------------------------------------------------------------


def _runtime_kwargs(config: SoakConfig) -> dict[str, Any]:
    """Under chaos, kills are deliberate: keep the crash-loop breaker from tripping on them."""
    kwargs: dict[str, Any] = {"workers": config.workers, "transport": config.transport}
    if config.chaos_s is None:
        return kwargs
    try:
        from .orchestrator.config import Supervision  # type: ignore[attr-defined]
    except ImportError:
        return kwargs
    base = Supervision.from_env()
    per_window = math.ceil(base.crash_window_s / config.chaos_s) + 2
    kwargs["supervision"] = dataclasses.replace(base, max_crashes=max(base.max_crashes, per_window))
    return kwargs


def default_out_dir() -> Path:
    return Path("soak-results") / time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())


def run_soak(config: SoakConfig, *, progress: Any = None) -> SoakSummary:
    """Run the soak described by `config`, write its files under `config.out`, return the summary.

    `progress(line)` is called with one human line per minute, if given.
    """
    from . import Runtime

    config.validate()
    out = Path(config.out or default_out_dir())
    out.mkdir(parents=True, exist_ok=True)
    files = {name: str(out / name) for name in
             ("samples.csv", "workers.csv", "requests.csv", "summary.json", "soak.png")}
    words = load_corpus()
    chaos = config.chaos_s is not None
    stop_load, stop_sampling = threading.Event(), threading.Event()
    kills: list[dict] = []
    with open(files["samples.csv"], "w", newline="") as samples_f, \
         open(files["workers.csv"], "w", newline="") as workers_f, \
         open(files["requests.csv"], "w", newline="") as requests_f:
        tally = Tally(config.streams, requests_f)
        rt = Runtime(model=config.model, **_runtime_kwargs(config))
        try:
            t0 = time.monotonic()
            sampler = Sampler(rt, tally, kills, samples_f, workers_f, t0)
            threads = [threading.Thread(target=_loader, name=f"soak-load-{i}", daemon=True,
                                        args=(rt, config, i, words, tally, t0, stop_load, chaos))
                       for i in range(config.streams)]
            threads.append(threading.Thread(target=sampler.run, args=(stop_sampling, config.sample_s),
                                            name="soak-sampler", daemon=True))
            if chaos:
                assert config.chaos_s is not None
                threads.append(threading.Thread(
                    target=_chaos, name="soak-chaos", daemon=True,
                    args=(rt, config.chaos_s, random.Random(config.seed), t0, stop_load, kills)))
            for th in threads:
                th.start()
            _wait_for_end(t0 + config.minutes * 60, t0, tally, progress)
            stop_load.set()
            deadline = time.monotonic() + config.drain_s
            for th in threads[: config.streams]:
                th.join(max(0.0, deadline - time.monotonic()))
            hung = sum(th.is_alive() for th in threads[: config.streams])
            stop_sampling.set()
            threads[config.streams].join()
            sampler.sample()  # the final state, after the drain
            recovered = _probe(rt) if chaos else None
            transport = rt.transport
        finally:
            stop_load.set()
            stop_sampling.set()
            rt.close()
            with tally.lock:
                tally.closed = True
    summary = _summarize(config, sampler, tally, kills, hung, recovered, transport, files)
    summary.plot_note = write_plot(out / "soak.png", files, kills) if config.plot else "disabled"
    if not summary.plot_note.startswith("written"):
        summary.files.pop("soak.png")
    Path(files["summary.json"]).write_text(json.dumps(summary.to_dict(), indent=2) + "\n")
    return summary


def _wait_for_end(end: float, t0: float, tally: Tally, progress: Any) -> None:
    next_report = t0 + 60
    while (now := time.monotonic()) < end:
        time.sleep(min(1.0, end - now))
        if progress is not None and time.monotonic() >= next_report:
            next_report += 60
            progress(f"soak: {(time.monotonic() - t0) / 60:.0f} min, {tally.ok} requests, "
                     f"{sum(tally.tokens)} tokens, {tally.unexpected} unexpected errors, "
                     f"{tally.worker_died} WorkerDied")


def _probe(rt: Any) -> bool:
    """After the last kill, one request must succeed: the pool recovered."""
    try:
        return len(rt.generate("Recovery probe after chaos", max_tokens=4, ignore_eos=True).tokens) == 4
    except Exception:  # MlxrtError or worse: either way the pool did not recover
        return False


def _summarize(config: SoakConfig, s: Sampler, tally: Tally, kills: list[dict], hung: int,
               recovered: bool | None, transport: str, files: dict[str, str]) -> SoakSummary:
    duration = s.ts[-1] if len(s.ts) else 0.0
    # Warm-up ends once the RSS the threshold applies to has settled: the orchestrator's under chaos.
    gated = s.rss_orch if kills else s.rss_total
    warm = leak_warmup_s(s.ts, gated, duration, config.max_leak_mb_per_hour)
    total = leak_mb_per_hour(s.ts, s.rss_total, warm)
    orch = leak_mb_per_hour(s.ts, s.rss_orch, warm)
    first, last = throughput_thirds(s.ts, s.tokens)
    ttfts, rates = _request_latencies(Path(files["requests.csv"]))
    summary = SoakSummary(
        model=config.model, transport=transport, streams=config.streams, workers=config.workers,
        duration_s=round(duration, 1), samples=len(s.ts), failed_samples=s.failed_samples,
        requests_started=tally.started,
        requests_ok=tally.ok, tokens_total=int(sum(tally.tokens)),
        tok_s_mean=_opt(sum(tally.tokens) / duration if duration else None),
        ttft_ms_p50=_opt(percentile(ttfts, 50)), ttft_ms_p95=_opt(percentile(ttfts, 95)),
        req_tok_s_p50=_opt(percentile(rates, 50)), errors_unexpected=tally.unexpected,
        errors_worker_died=tally.worker_died, errors_by_type=dict(tally.by_type), hung=hung,
        restarts=s.restarts, kills=kills, recovered=recovered, warmup_s=round(warm, 1),
        leak_mb_per_hour=_opt(total and total[0]), leak_stderr_mb_per_hour=_opt(total and total[1]),
        leak_orchestrator_mb_per_hour=_opt(orch and orch[0]),
        leak_gated_on=_leak_gate(duration - warm, bool(kills)),
        rss_total_mb_start=_opt(s.rss_total[0] / MB if len(s.rss_total) else None),
        rss_total_mb_end=_opt(s.rss_total[-1] / MB if len(s.rss_total) else None),
        rss_total_mb_max=_opt(max(s.rss_total) / MB if len(s.rss_total) else None),
        throughput_first_tok_s=_opt(first), throughput_last_tok_s=_opt(last),
        throughput_ratio=_opt(last / first if first and last is not None else None, 3),
        memory_levels=dict(s.memory_levels), thermal_levels=dict(s.thermal_levels),
        thresholds={"max_leak_mb_per_hour": config.max_leak_mb_per_hour,
                    "min_throughput_ratio": config.min_throughput_ratio, "max_errors": config.max_errors},
        files=dict(files), plot_note="",
    )
    summary.failures = verdict(summary, config)
    return summary


def _leak_gate(window_s: float, killed: bool) -> str:
    """Which RSS the leak threshold applies to: "total", "orchestrator", or why none."""
    if window_s < MIN_LEAK_WINDOW_S:
        return f"none (post-warm-up window {window_s:.0f} s < {MIN_LEAK_WINDOW_S:.0f} s)"
    # Restarted workers start small and regrow: under chaos only the orchestrator's slope means "leak".
    return "orchestrator" if killed else "total"


def _opt(x: float | None, nd: int = 2) -> float | None:
    return None if x is None else round(x, nd)


def _request_latencies(path: Path) -> tuple[list[float], list[float]]:
    """TTFT (ms) and decode tok/s of every successful request, read back from requests.csv."""
    ttfts, rates = [], []
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            if row["outcome"] != "ok":
                continue
            if row["ttft_ms"]:
                ttfts.append(float(row["ttft_ms"]))
            if row["tok_s"]:
                rates.append(float(row["tok_s"]))
    return ttfts, rates


# ---- the plot ---------------------------------------------------------------------

PLOT_SMOOTH_SAMPLES = 30


def _rolling_mean(values: list[float], window: int) -> list[float]:
    """Trailing mean over up to `window` values, NaNs skipped."""
    out = []
    for i in range(len(values)):
        xs = [v for v in values[max(0, i - window + 1): i + 1] if not math.isnan(v)]
        out.append(sum(xs) / len(xs) if xs else math.nan)
    return out


_LEVEL_Y = {"normal": 0, "nominal": 0, "fair": 1, "warning": 2, "serious": 2, "critical": 3}


def write_plot(path: Path, files: dict[str, str], kills: list[dict]) -> str:
    """tok/s, memory and pressure/thermal over time as a PNG; says why when it cannot."""
    try:
        from matplotlib.figure import Figure
    except ImportError:
        return "skipped: matplotlib is not installed (pip install 'mlxrt[bench]')"
    with open(files["samples.csv"], newline="") as f:
        rows = list(csv.DictReader(f))
    if len(rows) < 2:
        return "skipped: fewer than two samples"
    minutes = [float(r["t_s"]) / 60 for r in rows]

    def col(name: str, scale: float = 1.0) -> list[float]:
        return [float(r[name]) / scale if r[name] != "" else math.nan for r in rows]

    fig = Figure(figsize=(10, 9), layout="constrained")
    ax_tok, ax_mem, ax_lvl = fig.subplots(3, 1, sharex=True)
    tok_s = col("tok_s")
    ax_tok.plot(minutes, tok_s, lw=0.5, alpha=0.4, color="tab:blue", label="aggregate tok/s")
    ax_tok.plot(minutes, _rolling_mean(tok_s, PLOT_SMOOTH_SAMPLES), lw=1.5, color="tab:blue",
                label=f"aggregate, mean of {PLOT_SMOOTH_SAMPLES} samples")
    ax_tok.plot(minutes, col("req_tok_s_p50"), ".", ms=3, color="tab:orange",
                label="per-request decode tok/s (p50 of the interval)")
    ax_tok.set_ylabel("tokens/s")
    ax_tok.legend(loc="upper right", fontsize=8)
    for name, label in (("rss_total_bytes", "RSS total"), ("rss_orchestrator_bytes", "RSS orchestrator"),
                        ("rss_workers_bytes", "RSS workers"), ("mlx_active_bytes", "MLX active"),
                        ("mlx_cache_bytes", "MLX cache")):
        ax_mem.plot(minutes, col(name, MB), lw=0.8, label=label)
    ax_mem.set_ylabel("MB")
    ax_mem.legend(loc="upper left", fontsize=8)
    ax_lvl.step(minutes, [_LEVEL_Y.get(r["memory_level"], math.nan) for r in rows], where="post",
                label="memory pressure")
    thermal = [_LEVEL_Y.get(r["thermal_level"], math.nan) for r in rows]
    no_thermal = all(math.isnan(y) for y in thermal)
    ax_lvl.step(minutes, thermal, where="post",
                label="thermal (unavailable on this host)" if no_thermal else "thermal")
    ax_lvl.set_yticks([0, 1, 2, 3], ["normal/nominal", "fair", "warning/serious", "critical"])
    ax_lvl.set_ylim(-0.5, 3.5)
    ax_lvl.set_xlabel("minutes")
    ax_lvl.legend(loc="upper left", fontsize=8)
    celsius = col("thermal_celsius")
    if any(not math.isnan(c) for c in celsius):
        ax_c = ax_lvl.twinx()
        ax_c.plot(minutes, celsius, color="tab:red", lw=0.8)
        ax_c.set_ylabel("°C (hottest sensor)")
    for k in kills:
        for ax in (ax_tok, ax_mem, ax_lvl):
            ax.axvline(k["t_s"] / 60, color="grey", lw=0.5, ls="--")
    fig.suptitle("mlxrt soak" + (f" ({len(kills)} workers killed, dashed)" if kills else ""))
    fig.savefig(path, dpi=100)
    return f"written: {path}"


# ---- the command line --------------------------------------------------------------


def add_parser(sub: Any) -> None:
    """Add the ``soak`` subcommand to the CLI's subparsers."""
    sk = sub.add_parser("soak", help="sustained load, sampled, with pass/fail thresholds (docs/soak.md)")
    sk.add_argument("--model", "-m", default=DEFAULT_MODEL, help=f"default: {DEFAULT_MODEL}")
    sk.add_argument("--minutes", type=float, default=DEFAULT_MINUTES, help=f"default: {DEFAULT_MINUTES:g}")
    sk.add_argument("--streams", type=int, default=DEFAULT_STREAMS, help="concurrent request loops")
    sk.add_argument("--workers", type=int, default=1, help="worker processes")
    sk.add_argument("--transport", choices=["auto", "ring", "stdio"], default="auto")
    sk.add_argument("--out", type=Path, default=None, help="directory for the results "
                    "(default: soak-results/<UTC time>)")
    sk.add_argument("--chaos", type=float, default=None, metavar="SECONDS",
                    help="SIGKILL a random worker this often; WorkerDied is then expected")
    sk.add_argument("--max-leak-mb-per-hour", type=_limit(float), default=DEFAULT_MAX_LEAK_MB_PER_HOUR,
                    help=f"RSS slope after warm-up, MB=2^20 (default {DEFAULT_MAX_LEAK_MB_PER_HOUR:g}; "
                    "'none' turns a check off)")
    sk.add_argument("--min-throughput-ratio", type=_limit(float), default=DEFAULT_MIN_THROUGHPUT_RATIO,
                    help=f"last third tok/s over first third (default {DEFAULT_MIN_THROUGHPUT_RATIO:g})")
    sk.add_argument("--max-errors", type=_limit(int), default=DEFAULT_MAX_ERRORS,
                    help="unexpected request errors allowed (default 0)")
    sk.add_argument("--sample-s", type=float, default=DEFAULT_SAMPLE_S, help="sampling period")
    sk.add_argument("--seed", type=int, default=0, help="seeds prompts, lengths and chaos picks")
    sk.add_argument("--prompt-words", type=_range, default=DEFAULT_PROMPT_WORDS, metavar="LO:HI")
    sk.add_argument("--max-tokens", type=_range, default=DEFAULT_MAX_TOKENS, metavar="LO:HI")
    sk.add_argument("--no-plot", action="store_true", help="skip soak.png")
    sk.set_defaults(func=cli_main)


def _limit(kind: type) -> Any:
    def parse(text: str) -> Any:
        return None if text.lower() in ("none", "off") else kind(text)

    parse.__name__ = kind.__name__
    return parse


def _range(text: str) -> tuple[int, int]:
    lo, _, hi = text.partition(":")
    return int(lo), int(hi or lo)


def cli_main(args: argparse.Namespace) -> int:
    """``mlxrt soak``: 0 when every threshold held, 1 when one was crossed, 2 when it could not run."""
    from . import MlxrtError

    config = SoakConfig(
        model=args.model, minutes=args.minutes, streams=args.streams, workers=args.workers,
        transport=args.transport, out=args.out, chaos_s=args.chaos,
        max_leak_mb_per_hour=args.max_leak_mb_per_hour, min_throughput_ratio=args.min_throughput_ratio,
        max_errors=args.max_errors, sample_s=args.sample_s, seed=args.seed,
        prompt_words=args.prompt_words, max_tokens=args.max_tokens, plot=not args.no_plot,
    )
    try:
        summary = run_soak(config, progress=lambda line: print(line, file=sys.stderr, flush=True))
    except (MlxrtError, ValueError) as exc:
        print(f"mlxrt: error: {exc}", file=sys.stderr)
        return 2
    print(format_summary(summary))
    print(json.dumps(summary.to_dict()))
    return summary.exit_code


def format_summary(s: SoakSummary) -> str:
    """The human report: one aligned line per figure, then the verdict."""

    def fmt(x: Any, unit: str = "") -> str:
        return "n/a" if x is None else f"{x}{unit}"

    lines = [
        ("model / transport", f"{s.model} / {s.transport}, {s.workers} worker(s), {s.streams} streams"),
        ("duration", f"{s.duration_s} s, {s.samples} samples"
                     + (f", {s.failed_samples} failed" if s.failed_samples else "")),
        ("requests", f"{s.requests_ok} ok of {s.requests_started}, {s.tokens_total} tokens, "
                     f"{fmt(s.tok_s_mean)} tok/s mean"),
        ("TTFT p50 / p95", f"{fmt(s.ttft_ms_p50, ' ms')} / {fmt(s.ttft_ms_p95, ' ms')}"),
        ("per-request tok/s p50", fmt(s.req_tok_s_p50)),
        ("throughput first / last third", f"{fmt(s.throughput_first_tok_s)} / {fmt(s.throughput_last_tok_s)} "
                                          f"tok/s, ratio {fmt(s.throughput_ratio)}"),
        ("RSS total start / end / max", f"{fmt(s.rss_total_mb_start)} / {fmt(s.rss_total_mb_end)} / "
                                        f"{fmt(s.rss_total_mb_max)} MB"),
        ("memory slope after warm-up", f"{fmt(s.leak_mb_per_hour)} ± {fmt(s.leak_stderr_mb_per_hour)} MB/h "
                                       f"total, {fmt(s.leak_orchestrator_mb_per_hour)} MB/h orchestrator "
                                       f"(warm-up {s.warmup_s} s; gated on {s.leak_gated_on})"),
        ("errors", f"{s.errors_unexpected} unexpected {s.errors_by_type or ''}, "
                   f"{s.errors_worker_died} WorkerDied under chaos, {s.hung} hung"),
        ("restarts / kills", f"{s.restarts} / {len(s.kills)}"
                             + ("" if s.recovered is None else f", recovered: {s.recovered}")),
        ("memory pressure samples", str(s.memory_levels)),
        ("thermal samples", str(s.thermal_levels)),
        ("plot", s.plot_note),
        ("results", str(Path(s.files["summary.json"]).parent)),
    ]
    width = max(len(k) for k, _ in lines)
    body = "\n".join(f"{k:<{width}}  {v}" for k, v in lines)
    verdict_line = "PASS" if s.passed else "FAIL\n" + "\n".join(f"  - {f}" for f in s.failures)
    return f"{body}\n{'verdict':<{width}}  {verdict_line}"
