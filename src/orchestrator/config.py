"""Timeouts and limits, read once from arguments or ``MLXRT_*`` environment variables."""

from __future__ import annotations

import os
from dataclasses import dataclass

DEFAULT_READY_TIMEOUT_S = 300.0
DEFAULT_TOKEN_TIMEOUT_S = 300.0
DEFAULT_SHUTDOWN_TIMEOUT_S = 10.0
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
    """Every wait the orchestrator makes, in seconds, with the variable that sets it."""

    ready_s: float = DEFAULT_READY_TIMEOUT_S
    token_s: float = DEFAULT_TOKEN_TIMEOUT_S
    shutdown_s: float = DEFAULT_SHUTDOWN_TIMEOUT_S

    @classmethod
    def from_env(cls) -> Timeouts:
        return cls(
            ready_s=_env_float("MLXRT_READY_TIMEOUT_S", DEFAULT_READY_TIMEOUT_S),
            token_s=_env_float("MLXRT_TOKEN_TIMEOUT_S", DEFAULT_TOKEN_TIMEOUT_S),
            shutdown_s=_env_float("MLXRT_SHUTDOWN_TIMEOUT_S", DEFAULT_SHUTDOWN_TIMEOUT_S),
        )
