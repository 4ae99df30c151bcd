"""mlxrt: run MLX language models in supervised worker processes.

    from mlxrt import Runtime
    with Runtime(model="synthetic:tiny") as rt:
        print(rt.generate("Hello", max_tokens=16).text)
"""

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
