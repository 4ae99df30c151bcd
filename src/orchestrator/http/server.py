"""``mlxrt serve``: start the workers, then the HTTP server over them, in this process.

The workers are loaded before the port is bound, so a listening server can
serve at once and a model that fails to load is an exit status, not a server
that answers 503 forever. SIGINT and SIGTERM stop uvicorn gracefully (open
streams get `GRACEFUL_SHUTDOWN_S`), then the workers.
"""

from __future__ import annotations

import asyncio
import signal
import sys
from collections.abc import Mapping
from pathlib import Path

import uvicorn

from ...ipc.protocol import EngineOptions
from ..launch import Group
from ..models import SYNTHETIC_PREFIX
from ..runtime import AsyncRuntime
from .app import create_app
from .config import ServerConfig

GRACEFUL_SHUTDOWN_S = 5


def model_name(ref: str) -> str:
    """A bare ``--model``'s name: a directory's name, else the HF id or synthetic ref itself."""
    if ref.startswith(SYNTHETIC_PREFIX):
        return ref
    path = Path(ref).expanduser()
    if path.exists() or ref.startswith(("/", ".", "~")) or ref.count("/") != 1:
        return path.resolve().name or ref
    return ref


def parse_model_specs(specs: list[str]) -> dict[str, str]:
    """``--model`` values (``name=path`` or a bare path) as ``{name: path}``; ValueError on clashes."""
    models: dict[str, str] = {}
    for spec in specs:
        name, sep, ref = spec.partition("=")
        if not sep or not name or "/" in name or name.startswith(("~", ".")):
            name, ref = model_name(spec), spec  # a bare path, possibly with '=' in it
        if not ref:
            raise ValueError(f"--model {spec!r}: no path after '='")
        if name in models:
            raise ValueError(f"--model {spec!r}: the name {name!r} is given twice (use name=path)")
        models[name] = ref
    if not models:
        raise ValueError("--model: give at least one model")
    return models


def serve(
    models: Mapping[str, str],
    *,
    config: ServerConfig,
    workers: int = 1,
    transport: str = "auto",
    log_level: str = "warning",
    engine: EngineOptions | None = None,
    spares: int = 0,
    group: Group | None = None,
) -> None:
    """Serve `models` until SIGINT or SIGTERM; raises the runtime's errors if a model fails to load.

    `group`: each model's workers are worker groups of that shape (docs/distributed.md).
    """

    async def main() -> None:
        groups = {name: group for name in models} if group is not None else None
        runtime = AsyncRuntime(models=dict(models), workers=workers, transport=transport, engine=engine,
                               spares=spares, groups=groups)
        async with runtime as rt:
            app = create_app(rt, config, model_refs=models)
            server = uvicorn.Server(uvicorn.Config(
                app, host=config.host, port=config.port, log_level=log_level, access_log=False,
                lifespan="off", server_header=False, timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
            ))
            _stop_on_signals(server)
            task = asyncio.ensure_future(server.serve())
            while not server.started and not task.done():
                await asyncio.sleep(0.05)
            if server.started:
                print(f"mlxrt serve: listening on http://{config.host}:{config.port} "
                      f"(models: {', '.join(rt.models)}; transport: {rt.transport})",
                      file=sys.stderr, flush=True)
            await task

    try:
        import uvloop  # the faster loop where it is installed (Linux, macOS)
    except ImportError:
        asyncio.run(main())
    else:
        uvloop.run(main())


def _stop_on_signals(server: uvicorn.Server) -> None:
    """Handlers uvicorn restores and re-raises into after a graceful stop: they only ask it to exit,
    so the runtime's ``async with`` still stops the workers."""

    def ask_exit(signum, frame) -> None:
        server.should_exit = True

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, ask_exit)

