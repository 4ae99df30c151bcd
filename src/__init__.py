"""mlxrt: run MLX language models in supervised worker processes.

    from mlxrt import Runtime
    with Runtime(model="synthetic:tiny") as rt:
        print(rt.generate("Hello", max_tokens=16).text)
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .ipc.protocol import EngineOptions, Grammar, SamplingParams, Stats, ToolCall
    from .orchestrator.config import Supervision, Timeouts
    from .orchestrator.errors import (
        ChannelError,
        InvalidField,
        MemoryPressureError,
        MlxrtError,
        MlxrtTimeout,
        ModelFailedError,
        ModelLoadError,
        ModelNotFoundError,
        RequestError,
        WorkerDied,
    )
    from .orchestrator.handle import RankInfo, WorkerInfo, WorkerMemory
    from .orchestrator.launch import Group
    from .orchestrator.options import ModelSpec
    from .orchestrator.request import Request
    from .orchestrator.runtime import AsyncRuntime, AsyncStream, Chunk, Completion, Runtime, Stream

# The public names, imported on first use: a worker process (`mlxrt.worker`) or a ring self-test child
# imports this package too and never needs the orchestrator, about 0.25 s of CPU at each start.
_SOURCES = {
    "EngineOptions": "ipc.protocol",
    "Grammar": "ipc.protocol",
    "SamplingParams": "ipc.protocol",
    "Stats": "ipc.protocol",
    "ToolCall": "ipc.protocol",
    "Supervision": "orchestrator.config",
    "Timeouts": "orchestrator.config",
    "ChannelError": "orchestrator.errors",
    "InvalidField": "orchestrator.errors",
    "MemoryPressureError": "orchestrator.errors",
    "MlxrtError": "orchestrator.errors",
    "MlxrtTimeout": "orchestrator.errors",
    "ModelFailedError": "orchestrator.errors",
    "ModelLoadError": "orchestrator.errors",
    "ModelNotFoundError": "orchestrator.errors",
    "RequestError": "orchestrator.errors",
    "WorkerDied": "orchestrator.errors",
    "RankInfo": "orchestrator.handle",
    "WorkerInfo": "orchestrator.handle",
    "WorkerMemory": "orchestrator.handle",
    "Group": "orchestrator.launch",
    "ModelSpec": "orchestrator.options",
    "Request": "orchestrator.request",
    "AsyncRuntime": "orchestrator.runtime",
    "AsyncStream": "orchestrator.runtime",
    "Chunk": "orchestrator.runtime",
    "Completion": "orchestrator.runtime",
    "Runtime": "orchestrator.runtime",
    "Stream": "orchestrator.runtime",
}

__version__ = "0.1.0"

__all__ = [
    "EngineOptions",
    "Grammar",
    "Group",
    "AsyncRuntime",
    "AsyncStream",
    "ChannelError",
    "InvalidField",
    "Request",
    "MemoryPressureError",
    "Chunk",
    "Completion",
    "MlxrtError",
    "MlxrtTimeout",
    "ModelFailedError",
    "ModelLoadError",
    "ModelNotFoundError",
    "ModelSpec",
    "RequestError",
    "RankInfo",
    "Runtime",
    "SamplingParams",
    "Stats",
    "Stream",
    "Supervision",
    "Timeouts",
    "ToolCall",
    "WorkerDied",
    "WorkerInfo",
    "WorkerMemory",
]


def __getattr__(name: str) -> object:
    """Import a public name's module when the name is first asked for (PEP 562)."""
    module = _SOURCES.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module("." + module, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_SOURCES})
