"""Timeouts and limits, read once from arguments or ``MLXRT_*`` environment variables."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

from ..ipc.protocol import DEFAULT_COLLECTIVE_TIMEOUT_S, EngineOptions

DEFAULT_READY_TIMEOUT_S = 300.0
DEFAULT_TOKEN_TIMEOUT_S = 300.0
DEFAULT_SHUTDOWN_TIMEOUT_S = 10.0
#: As long as a load may take: a request that arrives while its model loads must outlive the load.
DEFAULT_QUEUE_TIMEOUT_S = 300.0
#: A worker reads its input on a thread of its own: a pipe full this long means it is hung.
DEFAULT_SEND_TIMEOUT_S = 30.0
DEFAULT_WARMUP_TOKENS = 4


def _env_float(name: str, default: float) -> float:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not a number") from None
    if value <= 0:
        raise ValueError(f"{name}={raw!r} must be > 0")
    return value


@dataclass(frozen=True, kw_only=True)
class Timeouts:
    """Every wait the orchestrator makes, in seconds, with the variable that sets it.

    ready_s: a worker's start (MLXRT_READY_TIMEOUT_S). token_s: the gap between a
    request's events (MLXRT_TOKEN_TIMEOUT_S). shutdown_s: a worker's exit
    (MLXRT_SHUTDOWN_TIMEOUT_S). queue_s: from a request's submission until a worker
    takes it, while it waits for one (queued, or replayed after a crash;
    MLXRT_QUEUE_TIMEOUT_S). send_s: one frame's write to a worker's input; a worker
    that does not read it that long is killed (MLXRT_SEND_TIMEOUT_S). collective_s: in a
    worker group, the longest a rank waits on the others (connecting, or one engine step)
    before it exits and the group is stopped (MLXRT_COLLECTIVE_TIMEOUT_S).
    """

    ready_s: float = DEFAULT_READY_TIMEOUT_S
    token_s: float = DEFAULT_TOKEN_TIMEOUT_S
    shutdown_s: float = DEFAULT_SHUTDOWN_TIMEOUT_S
    queue_s: float = DEFAULT_QUEUE_TIMEOUT_S
    send_s: float = DEFAULT_SEND_TIMEOUT_S
    collective_s: float = DEFAULT_COLLECTIVE_TIMEOUT_S

    @classmethod
    def from_env(cls) -> Timeouts:
        return cls(
            ready_s=_env_float("MLXRT_READY_TIMEOUT_S", DEFAULT_READY_TIMEOUT_S),
            token_s=_env_float("MLXRT_TOKEN_TIMEOUT_S", DEFAULT_TOKEN_TIMEOUT_S),
            shutdown_s=_env_float("MLXRT_SHUTDOWN_TIMEOUT_S", DEFAULT_SHUTDOWN_TIMEOUT_S),
            queue_s=_env_float("MLXRT_QUEUE_TIMEOUT_S", DEFAULT_QUEUE_TIMEOUT_S),
            send_s=_env_float("MLXRT_SEND_TIMEOUT_S", DEFAULT_SEND_TIMEOUT_S),
            collective_s=_env_float("MLXRT_COLLECTIVE_TIMEOUT_S", DEFAULT_COLLECTIVE_TIMEOUT_S),
        )


DEFAULT_BACKOFF_INITIAL_S = 0.5
DEFAULT_BACKOFF_MAX_S = 30.0
DEFAULT_MAX_CRASHES = 5
DEFAULT_MAX_RESUMES = 2
DEFAULT_CRASH_WINDOW_S = 60.0
DEFAULT_MONITOR_INTERVAL_S = 1.0


def _env_opt_float(name: str) -> float | None:
    raw = os.environ.get(name)
    if raw is None or raw == "" or raw.lower() == "none":
        return None
    try:
        return float(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not a number") from None


@dataclass(frozen=True, kw_only=True)
class Supervision:
    """How workers are restarted, unloaded and protected from memory pressure.

    A worker that dies is restarted after ``backoff_initial_s``, doubling per
    crash up to ``backoff_max_s``; ``max_crashes`` crashes within
    ``crash_window_s`` mark the model failed until `Runtime.reset`. With
    ``keep_alive_s`` set, a worker idle that long is unloaded and reloaded on
    the next request (None: never).
    """

    restart: bool = True
    backoff_initial_s: float = DEFAULT_BACKOFF_INITIAL_S
    backoff_max_s: float = DEFAULT_BACKOFF_MAX_S
    max_crashes: int = DEFAULT_MAX_CRASHES
    crash_window_s: float = DEFAULT_CRASH_WINDOW_S
    #: How many times one request goes on after its worker died (`Slot`); the next death fails it.
    max_resumes: int = DEFAULT_MAX_RESUMES
    keep_alive_s: float | None = None
    monitor_interval_s: float = DEFAULT_MONITOR_INTERVAL_S
    #: Clear workers' MLX caches under "warning" memory pressure.
    clear_cache_on_warning: bool = True
    #: Refuse new requests under "critical" memory pressure.
    refuse_on_critical: bool = True
    #: Reads the memory-pressure level; None: the OS's own signal (`monitor.read_memory`).
    memory_level: Callable[[], str] | None = None

    @classmethod
    def from_env(cls) -> Supervision:
        return cls(
            backoff_initial_s=_env_float("MLXRT_BACKOFF_INITIAL_S", DEFAULT_BACKOFF_INITIAL_S),
            backoff_max_s=_env_float("MLXRT_BACKOFF_MAX_S", DEFAULT_BACKOFF_MAX_S),
            max_crashes=int(_env_float("MLXRT_MAX_CRASHES", DEFAULT_MAX_CRASHES)),
            crash_window_s=_env_float("MLXRT_CRASH_WINDOW_S", DEFAULT_CRASH_WINDOW_S),
            max_resumes=_env_int("MLXRT_MAX_RESUMES", DEFAULT_MAX_RESUMES),
            keep_alive_s=_env_opt_float("MLXRT_KEEP_ALIVE_S"),
            monitor_interval_s=_env_float("MLXRT_MONITOR_INTERVAL_S", DEFAULT_MONITOR_INTERVAL_S),
        )


def _env_opt_int(name: str, default: int | None) -> int | None:
    """`_env_int` for an option whose default is None (the worker decides)."""
    return default if not os.environ.get(name) else _env_int(name, 0)


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not an integer") from None


def engine_from_env() -> EngineOptions:
    """The engine options the ``MLXRT_*`` variables set, defaults elsewhere (an explicit
    `EngineOptions` given to `Runtime` is used as is).

    MLXRT_DECODE_CONCURRENCY, MLXRT_PROMPT_CONCURRENCY, MLXRT_PREFILL_STEP_SIZE,
    MLXRT_PROMPT_CACHE_BYTES (0 turns prefix reuse off), MLXRT_SINGLE_STREAM (0: a lone request
    goes through the batch too), MLXRT_EMBED_BATCH_TOKENS (an embedding model's padded tokens per pass),
    MLXRT_GATHER_MS (how long new requests are held back after a wave of replies, 0: not at all),
    MLXRT_BURST_MS (on an idle worker, how long no new request must have come before a burst is
    admitted, 0: at once),
    MLXRT_PROMPT_CACHE_DIR and MLXRT_PROMPT_CACHE_DISK_BYTES (the prefix cache's disk tier; unset: none),
    MLXRT_PREFILL_BUDGET_MS (prefill time between two decode steps, 0: mlx-lm's own prefill).
    """
    b = EngineOptions()
    return EngineOptions(
        decode_concurrency=_env_opt_int("MLXRT_DECODE_CONCURRENCY", b.decode_concurrency),
        prompt_concurrency=_env_opt_int("MLXRT_PROMPT_CONCURRENCY", b.prompt_concurrency),
        prefill_step_size=_env_int("MLXRT_PREFILL_STEP_SIZE", b.prefill_step_size),
        prompt_cache_bytes=_env_opt_int("MLXRT_PROMPT_CACHE_BYTES", b.prompt_cache_bytes),
        single_stream=bool(_env_int("MLXRT_SINGLE_STREAM", int(b.single_stream))),
        embed_batch_tokens=_env_int("MLXRT_EMBED_BATCH_TOKENS", b.embed_batch_tokens),
        gather_ms=_env_int("MLXRT_GATHER_MS", b.gather_ms),
        burst_ms=_env_opt_int("MLXRT_BURST_MS", b.burst_ms),
        prompt_cache_dir=os.environ.get("MLXRT_PROMPT_CACHE_DIR") or None,
        prompt_cache_disk_bytes=_env_int("MLXRT_PROMPT_CACHE_DISK_BYTES", b.prompt_cache_disk_bytes),
        prefill_budget_ms=_env_opt_int("MLXRT_PREFILL_BUDGET_MS", b.prefill_budget_ms),
        prompt_cache_warm_bytes=_env_opt_int("MLXRT_PROMPT_CACHE_WARM_BYTES", b.prompt_cache_warm_bytes),
    ).validate()
