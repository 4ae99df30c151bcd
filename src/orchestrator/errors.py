"""The errors a caller sees. Two kinds, never mixed: the worker is gone, or this request failed."""

from __future__ import annotations

from ..ipc.protocol import InvalidField

__all__ = ["InvalidField", "MlxrtError", "WorkerDied", "ChannelError", "ModelLoadError", "MlxrtTimeout",
           "RemoteTraceback", "RequestError", "ModelNotFoundError", "ModelFailedError", "MemoryPressureError"]


class MlxrtError(Exception):
    """Base of every mlxrt error."""


class WorkerDied(MlxrtError):
    """The worker process is gone; every request in flight on it failed with this."""


class ChannelError(WorkerDied):
    """The worker's channel carried a malformed or truncated frame; the worker was stopped."""


class ModelLoadError(MlxrtError):
    """A worker could not load its model (bad path, corrupt directory, load crash)."""


class MlxrtTimeout(MlxrtError, TimeoutError):
    """A wait ran past its limit; the message names the setting that controls it."""


class RemoteTraceback(Exception):
    """The worker-side traceback, attached as ``__cause__`` of a `RequestError`."""

    def __init__(self, tb: str) -> None:
        super().__init__(tb)
        self.tb = tb

    def __str__(self) -> str:
        return f'\n"""\n{self.tb}"""'


class RequestError(MlxrtError):
    """This request failed in the worker; the worker lives on.

    ``error_type`` is the worker's exception class name (e.g. ``PromptTooLongError``),
    ``remote_traceback`` its traceback, also chained as ``__cause__``. ``kind`` is how the worker
    classed it (`protocol.FAILURE_KINDS`: "invalid", the request's fault; "too_long", a prompt beyond
    the context; "internal", a bug) and ``field`` the request field at fault, where one is.
    """

    def __init__(self, error_type: str, message: str, remote_traceback: str = "", *, kind: str = "internal",
                 field: str | None = None) -> None:
        super().__init__(f"{error_type}: {message}")
        self.error_type = error_type
        self.message = message
        self.remote_traceback = remote_traceback
        self.kind = kind
        self.field = field
        if remote_traceback:
            self.__cause__ = RemoteTraceback(remote_traceback)


class ModelNotFoundError(ModelLoadError):
    """The model reference names no local directory and no cached or downloadable model."""


class ModelFailedError(MlxrtError):
    """The model's workers crashed too often; requests fail until `Runtime.reset(model)`."""


class MemoryPressureError(MlxrtError):
    """The machine is under critical memory pressure: new requests are refused, not started."""
