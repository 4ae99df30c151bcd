"""Turn a user's model reference into what a worker loads, without importing MLX.

Accepted: a local model directory; a Hugging Face id (``org/name``), resolved
to its snapshot in the local Hugging Face cache when there, else passed on for
mlx-lm to download; ``synthetic:PRESET[:SEED]``, made by the worker on demand.
"""

from __future__ import annotations

import os
from pathlib import Path

from .errors import ModelLoadError, ModelNotFoundError

SYNTHETIC_PREFIX = "synthetic:"


def hf_cache_dir() -> Path:
    """The Hugging Face hub cache, honouring HF_HUB_CACHE and HF_HOME."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"])
    home = os.environ.get("HF_HOME") or os.path.join(os.path.expanduser("~"), ".cache", "huggingface")
    return Path(home) / "hub"


def _looks_like_path(ref: str) -> bool:
    return ref.startswith(("/", ".", "~")) or ref.count("/") != 1 or os.sep != "/" and os.sep in ref


def cached_snapshot(repo_id: str) -> Path | None:
    """The snapshot directory of `repo_id` in the HF cache (the one refs/main names), if any."""
    repo = hf_cache_dir() / ("models--" + repo_id.replace("/", "--"))
    snapshots = repo / "snapshots"
    if not snapshots.is_dir():
        return None
    ref = repo / "refs" / "main"
    if ref.is_file():
        snap = snapshots / ref.read_text().strip()
        if (snap / "config.json").is_file():
            return snap
    found = sorted(p for p in snapshots.iterdir() if (p / "config.json").is_file())
    return found[-1] if found else None


def resolve_model(ref: str) -> str:
    """What the worker should load for `ref`; raises `ModelNotFoundError` for missing paths."""
    if not ref:
        raise ModelNotFoundError("empty model reference")
    if ref.startswith(SYNTHETIC_PREFIX):
        return ref
    path = Path(ref).expanduser()
    if path.exists():
        if not path.is_dir():
            raise ModelLoadError(f"model path {path} is not a directory")
        if not (path / "config.json").is_file():
            raise ModelLoadError(f"model directory {path} has no config.json")
        return str(path.resolve())
    if _looks_like_path(ref):
        raise ModelNotFoundError(f"model directory {ref!r} does not exist")
    snap = cached_snapshot(ref)
    return str(snap) if snap is not None else ref
