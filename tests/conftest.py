"""Shared fixtures: the tiny synthetic model, an in-process reference, leak checks."""

from __future__ import annotations

import glob
import json
import os

import httpx
import ollama
import openai
import pytest
from support import SCRIPT, SHM_GLOB, child_pids, created_here, still_alive


@pytest.fixture(scope="session")
def tiny_model() -> str:
    """Path of the `tiny` synthetic model, made once per cache."""
    from mlxrt.worker.synthetic import ensure_model

    return str(ensure_model("tiny"))


@pytest.fixture(scope="session")
def reference(tiny_model):
    """The tiny model loaded in-process with mlx-lm: the token reference."""
    from mlx_lm import load

    return load(tiny_model)


@pytest.fixture(scope="module")
def scripted_env():
    """The scripted worker's script (support.SCRIPT), in the environment the workers inherit."""
    old = os.environ.get("SCRIPTED_REPLIES")
    os.environ["SCRIPTED_REPLIES"] = json.dumps(SCRIPT)
    yield
    if old is None:
        del os.environ["SCRIPTED_REPLIES"]
    else:
        os.environ["SCRIPTED_REPLIES"] = old


@pytest.fixture(autouse=True)
def no_leaks():
    """Every test must leave no process it started and no shared-memory segment behind.

    Processes of module-scoped fixtures (started before the test) are checked
    when their own fixture closes them, by `assert_stopped`.
    """
    before = set(glob.glob(SHM_GLOB))
    kids_before = child_pids()
    yield
    alive = still_alive(child_pids() - kids_before)
    for p in alive:
        p.kill()
    assert not alive, f"processes outlived the test: {[p.pid for p in alive]}"
    leaked = {p for p in set(glob.glob(SHM_GLOB)) - before if created_here(p)}
    for path in leaked:
        os.unlink(path)
    assert not leaked, f"shared memory left behind: {sorted(leaked)}"


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
