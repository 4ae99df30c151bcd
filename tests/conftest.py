"""Shared fixtures: the tiny synthetic model, an in-process reference, the servers HTTP tests share,
leak checks. Helpers live in support.py."""

from __future__ import annotations

import gc
import glob
import json
import os

import pytest
from mlxrt.worker.hf_index import remember_transformers_index

# support.py (mlx-lm, transformers, the HTTP stack) and the clients are imported where a fixture needs
# them: pytest-xdist's controller loads this file too, before it starts its pytest processes.
remember_transformers_index()  # before support imports mlx-lm: 0.3 s of CPU in every pytest process

# `mlxrt serve` keeps a disk tier in the user's cache by default: a server a test starts keeps none (it
# would carry prefixes from one test, or one run, to the next) unless the test gives one itself.
os.environ.setdefault("MLXRT_PROMPT_CACHE_DISK_BYTES", "0")


# ---- how `make test` shares the files among its pytest processes (--dist loadfile) ----

# The modules that only send requests to `scripted_server` (five scripted workers): one unit of work, so
# one pytest process runs them all and the server starts once, not once per process.
SCRIPTED_SERVER_MODULES = {"test_anthropic", "test_responses", "test_tools_http"}
# Files that take longest (seconds of a fresh-clone run), started first: a process free early takes the
# next file, so the last files to start are short ones and the processes end together.
SLOWEST_FIRST = ["test_bench", "test_faults", "test_supervisor", "test_engine", "test_vision", "test_group",
                 "test_resume", "test_http", "test_bench_peers",
                 "test_agent_clis", "scripted_server", "test_ring", "test_batching", "test_speculative",
                 "test_options", "test_soak", "test_synthetic", "test_client_compat", "test_spares",
                 "test_prompt_file", "test_embeddings", "test_runtime", "test_kv_options",
                 "test_forced_tools", "test_structured", "test_storm", "test_scheduler", "test_disk_cache"]


# Slow modules with no module-scoped fixture: each test is a unit of its own, so their tests (many of them
# start processes and wait on them) spread over every pytest process instead of queueing in one.
ONE_TEST_UNITS = {"test_bench", "test_faults", "test_supervisor", "test_http", "test_ring", "test_soak",
                  "test_spares", "test_prompt_file"}


def _module(nodeid: str) -> str:
    return nodeid.split("::", 1)[0].rpartition("/")[2].removesuffix(".py")


def _unit(nodeid: str) -> str:
    """The unit of work a test belongs to: its module, "scripted_server" for the modules sharing it, or
    the test itself in ONE_TEST_UNITS."""
    module = _module(nodeid)
    if module in ONE_TEST_UNITS:
        return nodeid
    return "scripted_server" if module in SCRIPTED_SERVER_MODULES else module


def pytest_collection_modifyitems(config, items):
    """Units slowest first (pytest-xdist hands them out in this order); a module's tests keep theirs."""
    def group(nodeid: str) -> str:
        return "scripted_server" if _module(nodeid) in SCRIPTED_SERVER_MODULES else _module(nodeid)

    rank = {name: i for i, name in enumerate(SLOWEST_FIRST)}
    first_seen: dict[str, int] = {}
    for item in items:
        first_seen.setdefault(group(item.nodeid), len(first_seen))
    items.sort(key=lambda it: (rank.get(group(it.nodeid), len(rank)), first_seen[group(it.nodeid)]))


@pytest.hookimpl(tryfirst=True, optionalhook=True)  # before pytest-xdist's own loadfile scheduler
def pytest_xdist_make_scheduler(config, log):
    """--dist loadfile in the units `_unit` names (pytest-xdist 3.8's loadgroup no longer groups under
    pytest 9, whose node ids it cannot tag)."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class ModuleUnits(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return _unit(nodeid)

    return ModuleUnits(config, log)


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


@pytest.fixture(scope="session")
def scripted_env():
    """The scripted worker's script (support.SCRIPT), in the environment the workers inherit."""
    from support import SCRIPT

    old = os.environ.get("SCRIPTED_REPLIES")
    os.environ["SCRIPTED_REPLIES"] = json.dumps(SCRIPT)
    yield
    if old is None:
        del os.environ["SCRIPTED_REPLIES"]
    else:
        os.environ["SCRIPTED_REPLIES"] = old


# Names the HTTP tests use; "tiny" and "qwen2.5" are both the tiny preset (test_anthropic and test_responses
# send "tiny" prompts no marker matches; test_tools_http calls the same model "qwen2.5").
SCRIPTED_PRESETS = {"tiny": "tiny", "qwen3": "tiny-qwen3", "gpt-oss": "tiny-gpt-oss", "qwen2.5": "tiny",
                    "llama": "tiny-llama", "gemma3": "tiny-gemma3"}


@pytest.fixture(scope="session")
def scripted_server(scripted_env):
    """One server over scripted workers of five families, shared by the modules that only send it requests;
    its workers are checked gone when the session ends."""
    from mlxrt.synthetic.build import ensure_model
    from support import SCRIPTED, running

    with running({n: str(ensure_model(p)) for n, p in SCRIPTED_PRESETS.items()}, _worker_argv=SCRIPTED) as s:
        yield s


@pytest.fixture(scope="session")
def srv(tiny_model):
    """One server on the tiny model (named "tiny"), shared by the modules that only send it requests
    (a module that needs another server defines its own `srv`); its workers are checked gone at the end."""
    from support import running

    with running({"tiny": tiny_model}) as s:
        yield s


@pytest.fixture(autouse=True)
def no_leaks():
    """Every test must leave no process it started and no shared-memory segment behind.

    Processes of module- and session-scoped fixtures (started before the test) are checked
    when their own fixture closes them, by `assert_stopped`. Under pytest-xdist (make test) each
    pytest process checks its own children and the segments it created.
    """
    from support import SHM_GLOB, child_pids, created_here, still_alive

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


# ---- clients of `srv` (the session's tiny server, or the ServerThread a module defines) ----

@pytest.fixture(scope="module")
def http(srv):
    """Raw HTTP to the module's server."""
    import httpx

    with httpx.Client(base_url=srv.url, timeout=60) as client:
        yield client


@pytest.fixture(scope="module")
def oai(srv):
    """The official openai client, pointed at the module's server."""
    import openai

    with openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0) as client:
        yield client


@pytest.fixture(scope="module")
def oll(srv):
    """The official ollama client, pointed at the module's server."""
    import ollama

    with ollama.Client(host=srv.url) as client:
        yield client


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config):
    """Leave the objects of the session out of the collections Python runs as it exits: with the suite's
    imports (mlx-lm, transformers, anthropic, ...) they took 1.1-1.3 s of CPU in each pytest process."""
    gc.freeze()
