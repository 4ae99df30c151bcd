"""What a benchmark figure was measured on: machine, backend, versions, commit."""

from __future__ import annotations

import os
import platform
import subprocess
from importlib import metadata


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def git_commit() -> str | None:
    """``MLXRT_COMMIT`` where set (a tree copied to a GPU host can carry a stale ``.git``), else the
    checkout's commit, with ``-dirty`` when the tree has uncommitted changes."""
    if os.environ.get("MLXRT_COMMIT"):
        return os.environ["MLXRT_COMMIT"]
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        sha = subprocess.run(
            ["git", "rev-parse", "--short=12", "HEAD"], cwd=root, capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"], cwd=root, capture_output=True, text=True
        ).stdout.strip()
        return sha + ("-dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return os.environ.get("MLXRT_COMMIT")


def gpu_name() -> str | None:
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else None


def describe() -> dict:
    """Machine and software facts to write beside every figure."""
    import mlx.core as mx

    return {
        "platform": platform.platform(),
        "machine": platform.machine(),
        "processor": platform.processor() or None,
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "backend": backend(),
        "device": str(mx.default_device()),
        "gpu": gpu_name(),
        "versions": {
            d: _version(d)
            for d in ("mlx", "mlx-lm", "mlx-cpu", "mlx-cuda-13", "mlx-metal", "msgspec", "mlxrt")
        },
        "commit": git_commit(),
    }


def backend() -> str:
    """``metal``, ``cuda`` or ``cpu``: what MLX computes on by default here."""
    import mlx.core as mx

    if mx.default_device() != mx.gpu:
        return "cpu"
    return "metal" if mx.metal.is_available() else "cuda"


def default_preset() -> str:
    """`small` on a CPU; the real 0.5B shape where MLX has a GPU (Metal or CUDA)."""
    import mlx.core as mx

    return "qwen2.5-0.5b-4bit" if mx.default_device() == mx.gpu else "small"
