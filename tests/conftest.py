"""Shared fixtures: the tiny synthetic model, an in-process reference, leak checks."""

from __future__ import annotations

import glob
import os

import httpx
import ollama
import openai
import psutil
import pytest

SHM_GLOB = "/dev/shm/mlxrt-*"
TRANSPORTS = ["stdio", "ring"]


@pytest.fixture(scope="session")
def tiny_model() -> str:
    """Path of the `tiny` synthetic model, made once per cache."""
    from mlxrt.synthetic.build import ensure_model

    return str(ensure_model("tiny"))


@pytest.fixture(scope="session")
def reference(tiny_model):
    """The tiny model loaded in-process with mlx-lm: the token reference."""
    from mlx_lm import load

    return load(tiny_model)


def created_here(path: str, pid: int | None = None) -> bool:
    """True if the ring header at `path` names this process (or `pid`) as its creator.

    Other programs on the machine may use rings at the same time; only ours count.
    """
    from mlxrt.ipc import ring

    try:
        with open(path, "rb") as f:
            head = f.read(ring._IDENTITY.size)
    except OSError:
        return False
    if len(head) < ring._IDENTITY.size:
        return False  # being created by someone right now: not a leak of ours
    return ring._IDENTITY.unpack(head)[ring._CREATOR_PID // 8] == (pid or os.getpid())


def _children() -> set[int]:
    return {p.pid for p in psutil.Process().children(recursive=True)}


def _live(pids: set[int]) -> list[psutil.Process]:
    procs = []
    for pid in pids:
        try:
            procs.append(psutil.Process(pid))
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(procs, timeout=10)
    return [p for p in alive if p.status() != psutil.STATUS_ZOMBIE]


@pytest.fixture(autouse=True)
def no_leaks():
    """Every test must leave no process it started and no shared-memory segment behind.

    Processes of module-scoped fixtures (started before the test) are checked
    when their own fixture closes them, by `assert_stopped`.
    """
    before = set(glob.glob(SHM_GLOB))
    kids_before = _children()
    yield
    alive = _live(_children() - kids_before)
    for p in alive:
        p.kill()
    assert not alive, f"processes outlived the test: {[p.pid for p in alive]}"
    leaked = {p for p in set(glob.glob(SHM_GLOB)) - before if created_here(p)}
    for path in leaked:
        os.unlink(path)
    assert not leaked, f"shared memory left behind: {sorted(leaked)}"


def assert_stopped(pids: list[int]) -> None:
    """Fail if any of `pids` is still running (after a grace period)."""
    alive = _live(set(pids))
    for p in alive:
        p.kill()
    assert not alive, f"workers outlived their runtime: {[p.pid for p in alive]}"


# ---- clients of a module's `srv` (a ServerThread fixture each HTTP test module defines) ----

@pytest.fixture(scope="module")
def http(srv):
    """Raw HTTP to the module's server."""
    with httpx.Client(base_url=srv.url, timeout=60) as client:
        yield client


@pytest.fixture(scope="module")
def oai(srv):
    """The official openai client, pointed at the module's server."""
    with openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0) as client:
        yield client


@pytest.fixture(scope="module")
def oll(srv):
    """The official ollama client, pointed at the module's server."""
    with ollama.Client(host=srv.url) as client:
        yield client
