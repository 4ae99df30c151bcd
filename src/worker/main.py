"""The worker process: handshake, then serve requests on one MLX thread (the loop: `serve.py`).

::

    orchestrator                      worker process
    ------------                      ------------------------------------------
    stdin  --Hello/Generate/Cancel--> reader thread --> Server (queue, cancel flags)
                                                          |
                                                     main thread = MLX thread
                                                     Engine.submit/cancel/step (batch), per token:
                                                          | outbox.token() (never blocks)
    stdout/ring <---Ready/Tokens/Done--- sent by the MLX thread itself when the
                                         channel takes it at once, else by the
                                         writer thread (drains and coalesces)
    stderr  <---JSON log lines--------- structlog

The process claims its stdin and stdout for frames before MLX is imported:
fd 1 is pointed at stderr, so a stray print, from Python or C, lands in the
orchestrator's log instead of corrupting the channel. EOF on stdin means the
orchestrator is gone: the worker cancels what it was doing and exits. A
thread polling the parent pid is the second line (a re-parented worker
exits too). No PR_SET_PDEATHSIG: it fires when the *thread* that spawned the
worker exits, and AsyncRuntime spawns from a pool thread.

A Hello with ``group`` makes this process one rank of a worker group
(`group.py`): rank 0 serves as above, each engine step shared with the other
ranks; the others only follow.
"""

from __future__ import annotations

import os
import sys
import threading
import time
import traceback

from ..ipc.channel import ChannelClosed, Receiver, Sender
from ..ipc.protocol import PROTOCOL_VERSION, Attached, Fatal, Hello, Ready, worker_codec
from ..ipc.stdio import PipeReceiver, PipeSender
from .group import join
from .hf_index import remember_transformers_index
from .serve import Outbox, Server

DEFAULT_HELLO_TIMEOUT_S = 30.0


def _claim_stdio() -> tuple[int, int]:
    """Keep private copies of fds 0 and 1 for frames; point fd 1 at stderr, fd 0 at /dev/null."""
    in_fd, out_fd = os.dup(0), os.dup(1)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    return in_fd, out_fd


def _read_loop(rx: Receiver, server: Server, log) -> None:
    codec = worker_codec()
    try:
        while True:
            server.on_message(codec.decode(rx.recv()))
    except ChannelClosed:
        pass
    except Exception as exc:  # a bad frame from the orchestrator: stop rather than guess
        log.error("worker.bad_frame", error=repr(exc))
    server.on_eof()


def _watch_parent(server: Server, log, interval_s: float = 1.0) -> None:
    """Second line behind stdin EOF: exit if the orchestrator is gone (re-parented)."""
    parent = os.getppid()
    while os.getppid() == parent:
        time.sleep(interval_s)
    log.warning("worker.orphaned", parent=parent)
    server.on_eof()


def _fatal(tx: Sender, exc: BaseException) -> None:
    msg = Fatal(error_type=type(exc).__name__, message=str(exc), traceback=traceback.format_exc())
    try:
        tx.send(worker_codec().encode(msg))
    except ChannelClosed:
        pass


def _open_channel(hello: Hello, out_fd: int) -> Sender:
    if hello.transport == "ring":
        from ..ipc.ring import attach_ring

        if hello.ring is None:
            raise ValueError("Hello asks for the ring transport but carries no ring spec")
        tx = attach_ring(hello.ring)
        os.close(out_fd)
        # Before the (possibly long) model load, so the name is unlinked at once.
        tx.send(worker_codec().encode(Attached(os.getpid())))
        return tx
    return PipeSender(out_fd)


def _hide_torch() -> None:
    """Keep transformers from importing PyTorch into the worker, unless MLXRT_WORKER_TORCH=1.

    mlx-lm loads tokenizers through transformers, which imports PyTorch whenever
    it is installed (transformers 5 has no switch for it): 10.6 s of every worker
    start on an H100 host (docs/benchmarks/gpu-h100-recovery.md). Nothing in
    mlx-lm needs it. A None entry in sys.modules makes `find_spec("torch")`
    return None, so transformers sees no PyTorch and `import torch` fails cleanly.
    """
    if os.environ.get("MLXRT_WORKER_TORCH") != "1" and "torch" not in sys.modules:
        sys.modules["torch"] = None  # type: ignore[assignment]


def _vision_model(path: str, log) -> bool:
    """Whether `path` is a vision-language model this worker can serve with mlx-vlm; without the
    ``vision`` extra it is served as text by mlx-lm, said once in the log."""
    from .vision import is_vision_model

    if not is_vision_model(path):
        return False
    try:
        import mlx_vlm  # noqa: F401
    except ImportError:
        log.warning("worker.vision_unavailable", path=path, hint="pip install 'mlxrt[vision]' for images")
        return False
    return True


def _ready(hello: Hello, engine) -> Ready:
    import mlx.core as mx
    import mlx_lm

    return Ready(
        protocol=PROTOCOL_VERSION,
        pid=os.getpid(),
        model=hello.model,
        context_length=engine.model_context,
        vocab_size=engine.vocab_size,
        load_s=engine.load_s,
        warmup_s=engine.warmup_s,
        mlx_version=mx.__version__,
        mlx_lm_version=mlx_lm.__version__,
        device=str(mx.default_device()),
        capabilities=engine.capabilities,
        path=engine.path,
        decode_concurrency=getattr(engine, "decode_concurrency", 0),
    )


def main() -> None:
    in_fd, out_fd = _claim_stdio()
    from .. import logs

    logs.configure(json=True)
    import structlog

    log = structlog.get_logger("mlxrt.worker")
    rx = PipeReceiver(in_fd)
    codec = worker_codec()
    timeout = float(os.environ.get("MLXRT_HELLO_TIMEOUT_S", DEFAULT_HELLO_TIMEOUT_S))
    try:
        hello = codec.decode(rx.recv(timeout=timeout))
        if not isinstance(hello, Hello) or hello.protocol != PROTOCOL_VERSION:
            raise ValueError(f"bad handshake {hello!r}: this worker speaks protocol {PROTOCOL_VERSION}")
    except Exception as exc:
        _fatal(PipeSender(out_fd), exc)
        os._exit(2)
    try:
        tx = _open_channel(hello, out_fd)
    except Exception as exc:
        log.error("worker.channel_failed", transport=hello.transport, error=repr(exc))
        _fatal(PipeSender(out_fd), exc)
        os._exit(2)
    group = None
    try:
        started = time.perf_counter()
        _hide_torch()
        remember_transformers_index()  # 0.3 s of CPU a start: transformers' table of models, from disk
        if hello.group is not None:  # before MLX is imported: it sets what MLX reads (CUDA_VISIBLE_DEVICES)
            group = join(hello.group, tx, log)
        from .embed import Embedder, embedding_spec, local_model_path
        from .engine import Engine

        import_s = time.perf_counter() - started
        path = local_model_path(hello.model)
        spec = embedding_spec(path)  # an embedding model's worker embeds and never generates
        vision = spec is None and group is None and _vision_model(path, log)
        if vision:  # images in chat messages, on mlx-vlm (docs/vision.md)
            from .vision import VisionEngine

            engine = VisionEngine(path, cache_limit_bytes=hello.cache_limit_bytes, options=hello.engine,
                                  prompt_cache_share=hello.prompt_cache_share)
        elif spec is None:
            engine = Engine(path, cache_limit_bytes=hello.cache_limit_bytes, options=hello.engine,
                            group=group, prompt_cache_share=hello.prompt_cache_share)
        elif group is not None:
            raise ValueError("an embedding model runs in one process, not in a group (ranks=1)")
        else:
            engine = Embedder(path, spec, cache_limit_bytes=hello.cache_limit_bytes, options=hello.engine)
        engine.warmup(hello.warmup_tokens)
    except Exception as exc:
        log.error("worker.load_failed", model=hello.model, error=repr(exc))
        _fatal(tx, exc)
        tx.close()
        os._exit(1)
    if group is not None and group.rank > 0:
        group.follow(engine, tx, _ready(hello, engine), rx)  # never returns
    outbox = Outbox(tx)
    outbox.message(_ready(hello, engine))
    log.info("worker.ready", model=hello.model, import_s=round(import_s, 3), load_s=round(engine.load_s, 3),
             warmup_s=round(engine.warmup_s, 3),
             prompt_cache_bytes=getattr(engine, "prompt_cache_bytes", None))  # an Embedder caches none
    server = Server(engine, outbox) if group is None else group.leader(engine, outbox)
    threading.Thread(target=_read_loop, args=(rx, server, log), name="mlxrt-reader", daemon=True).start()
    threading.Thread(target=_watch_parent, args=(server, log), name="mlxrt-parent", daemon=True).start()
    server.serve_forever()
    outbox.close()
    tx.close()
    log.info("worker.exit")
    # Skip interpreter teardown: MLX's threads can make it slow, and there is nothing left to flush.
    os._exit(0)
