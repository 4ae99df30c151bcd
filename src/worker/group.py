r"""One rank of a worker group: a model sharded over N processes with `mx.distributed`, in lockstep.

::

    orchestrator            rank 0 (main.py + LeaderServer)              rank k > 0 (follow)
    ------------            -------------------------------              -------------------
    Generate/Cancel  --->   Server queue; each iteration:                each iteration:
                            Step{generate, cancel, clear_cache, stop}
                            --all_sum (Lockstep.exchange)-->             the step rank 0 shared
                            apply the step shared last iteration,        last iteration: submit,
                            Engine.step()                                cancel, Engine.step()
                                 \________ the model's own collectives (tensor or pipeline) ________/
    <--- Tokens/Done  ---   rank 0's listener                            output dropped

Every rank loads its shard with mlx-lm's `sharded_load` (tensor parallel where
the model has `shard`, else pipeline) and runs an `Engine` of its own. Rank 0
alone talks to the orchestrator, exactly as a single worker does; each
iteration it hands what its engine is to do to the other ranks, and every
rank, rank 0 included, applies it at the next iteration, so every rank makes
the same model calls in the same order and the model's collectives meet.
This is what `mlx_lm.server` does for distributed serving
(`ResponseGenerator._share_object`), with msgspec frames instead of pickle,
one collective per step rather than two (the frame rides in a fixed-size
head, `HEAD_BYTES`; a longer one takes a second), on the model's own stream,
and one iteration late, so that no rank waits for it (`Lockstep`). An idle
rank 0 still shares an empty step every `heartbeat_s`. MLX's collectives wait
by polling, so where every rank runs on this machine the others sleep on a
semaphore rank 0 posts as it shares each step (`ipc/wake.py`) before they
join that step's collective: an idle group costs no core.

The ranks agree on one random seed when they join, so their samplers draw the
same tokens, and the prefix cache evicts by the group's bytes (`total`).

How a rank ends, and what the orchestrator sees (`orchestrator/group.py`):

- a `Step` with ``stop`` (rank 0 got Shutdown, or lost the orchestrator): all exit 0;
- a wait on the others longer than `collective_timeout_s` (one engine step),
  or `connect_timeout_s` (joining): the `Watchdog` ends the rank with
  `EXIT_COLLECTIVE_TIMEOUT`;
- a failed collective (a peer is gone) or a failed engine step: `abort`,
  exit `EXIT_GROUP_FAILED`; a step that failed on one rank may not have
  failed on the others, so the ranks can no longer be trusted to agree;
- a rank whose orchestrator is gone (stdin EOF) waits `EOF_GRACE_S` for rank
  0's stop, then exits.

Any rank's exit makes the orchestrator stop the whole group: one `WorkerDied`.
"""

from __future__ import annotations

import os
import platform
import secrets
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from ..ipc.channel import ChannelClosed, Receiver, Sender
from ..ipc.protocol import (
    EXIT_COLLECTIVE_TIMEOUT,
    EXIT_GROUP_FAILED,
    Fatal,
    GroupRank,
    Ready,
    Stats,
    Step,
    step_codec,
    worker_codec,
)
from ..ipc.wake import Wake
from .serve import Server

#: A step's frame up to this size (with its 4-byte length) costs one all_sum: every decode step's,
#: and a new request's unless its prompt is long.
HEAD_BYTES = 4096
#: A rank whose orchestrator is gone waits this long for rank 0's stop before it exits alone.
EOF_GRACE_S = 5.0
#: MLX's NCCL backend (0.32.4) has all_sum, all_gather and reduce-scatter, but no send/recv.
NCCL_HAS_SEND_RECV = False
_EMPTY = Step()


class GroupError(RuntimeError):
    """This rank cannot join its group, or the model cannot be sharded as asked."""


class Watchdog:
    """Ends the process when one wait on the other ranks lasts longer than its limit
    (`timeout_s`, or the one `arm` was given).

    A rank blocked in a collective cannot be interrupted from Python; exiting is what
    frees it, and tells the orchestrator (its pipe closes).
    """

    def __init__(self, timeout_s: float, expire: Callable[[str, float], None]) -> None:
        self.timeout_s = timeout_s
        self._expire = expire
        self._since: float | None = None
        self._what = ""
        self._limit = timeout_s
        threading.Thread(target=self._watch, name="mlxrt-watchdog", daemon=True).start()

    def arm(self, what: str, timeout_s: float | None = None) -> None:
        self._what = what
        self._limit = self.timeout_s if timeout_s is None else timeout_s
        self._since = time.monotonic()

    def disarm(self) -> None:
        self._since = None

    def _watch(self) -> None:
        tick = min(1.0, self.timeout_s / 4)
        while True:
            time.sleep(tick)
            since = self._since
            if since is not None and time.monotonic() - since > self._limit:
                self._expire(self._what, self._limit)


class RankGroup:
    """This process's rank of a worker group, and the collectives the engine's lockstep needs."""

    def __init__(self, spec: GroupRank, world, backend: str, log, watchdog: Watchdog) -> None:
        self.spec = spec
        self.world = world
        self.rank = world.rank()
        self.size = world.size()
        self.backend = backend
        self.watchdog = watchdog
        self._log = log
        self._codec = step_codec()
        #: Where every rank is on this machine: rank 0 posts as it shares a step, the others wait on it
        #: before reading one (ipc/wake.py), so that an idle rank sleeps instead of polling.
        self.wake = Wake(spec.wake) if spec.wake else None

    # -- what the engine asks of the group --------------------------------------------------
    def load(self, path: str):
        """Load this rank's shard with mlx-lm's `sharded_load`: (model, tokenizer, config)."""
        from mlx_lm.utils import sharded_load

        mode = plan_sharding(path, self.spec.sharding, self.size, self.backend)
        world = self.world
        with _collectives_off_cpu(self.backend == "nccl"):
            return sharded_load(path, pipeline_group=world if mode == "pipeline" else None,
                                tensor_group=world if mode == "tensor" else None, return_config=True)

    def total(self, n: int) -> int:
        """The sum of `n` over the ranks (every rank calls this at the same point)."""
        import mlx.core as mx

        return int(self._all_sum(mx.array([n], dtype=mx.int64)).item())

    def abort(self, exc: BaseException) -> None:
        """A collective or an engine step failed: end this rank, and with it the group."""
        self._log.error("group.failed", rank=self.rank, error=repr(exc),
                        traceback="".join(traceback.format_exception(exc)))
        sys.stderr.flush()
        os._exit(EXIT_GROUP_FAILED)

    def agree_seed(self) -> int:
        """Rank 0's random seed, for every rank."""
        import mlx.core as mx

        mine = secrets.randbits(62) if self.rank == 0 else 0
        return int(self._all_sum(mx.array([mine], dtype=mx.int64)).item())

    def _all_sum(self, x):
        """On the stream the model runs on: a rank's collectives must meet the others' in program
        order, and a token already queued (`mx.async_eval`) holds the model's own on that stream."""
        import mlx.core as mx
        from mlx_lm.generate import generation_stream

        return mx.distributed.all_sum(x, group=self.world, stream=generation_stream)

    # -- serving ----------------------------------------------------------------------------
    def leader(self, engine, outbox) -> LeaderServer:
        """Rank 0's server: a single worker's, each engine step shared with the other ranks."""
        return LeaderServer(engine, outbox, self)

    def follow(self, engine, tx: Sender, ready: Ready, rx: Receiver) -> None:
        """Rank k > 0: tell the orchestrator it is ready, then do what rank 0 does, step by step,
        until rank 0 says stop. Never returns."""
        tx.send(worker_codec().encode(ready))
        threading.Thread(target=_exit_after_eof, args=(rx, self._log), name="mlxrt-eof",
                         daemon=True).start()
        drop = _Drop()
        dog = self.watchdog
        lockstep = Lockstep(self)
        try:
            while True:
                dog.arm("waiting for rank 0's next step")
                step = lockstep.exchange(None)
                if step.stop:
                    break
                apply_step(engine, step, drop)
                engine.step()
                dog.disarm()
        except Exception as exc:  # a peer is gone: the collective failed
            self.abort(exc)
        dog.disarm()
        engine.cancel_all()
        self._log.info("worker.exit", rank=self.rank)
        sys.stderr.flush()
        os._exit(0)


class Lockstep:
    """Rank 0's steps, handed to every rank one iteration late, so that rank 0 never waits for it.

    Each iteration every rank calls `exchange` once, then applies what it returns and steps
    its engine. ``exchange(step)`` queues this iteration's share of rank 0's `step` (an
    all_sum of `HEAD_BYTES`: rank 0's frame, zeros from the others, evaluated asynchronously)
    and returns the step shared the iteration before. A rank reads that one only now, when
    it is done: it sits on the model's stream between the token the last engine step read
    and the one it queued (`mx.async_eval`), so reading it makes no rank wait for the model,
    and rank 0, which knows its own steps, reads nothing. A frame longer than the head goes
    in a second all_sum at the start of the next iteration, on every rank in the same
    place: the others learn its length only from the head.
    """

    def __init__(self, group: RankGroup) -> None:
        self._group = group
        self._lead = group.rank == 0
        self._codec = step_codec()
        #: The last iteration's share: its all_sum (in flight), rank 0's step and frame.
        self._head = None
        self._step: Step = _EMPTY
        self._payload = b""
        self._keep: tuple = ()

    def exchange(self, step: Step | None) -> Step:
        """Share `step` (rank 0; None: nothing to do; the others pass None); return the step the
        last iteration shared, to apply now. A stop step ends the exchange (nothing more is shared)."""
        import mlx.core as mx

        previous = self._finish()
        if previous.stop:
            return previous
        payload = self._codec.encode(step) if self._lead and step is not None else b""
        head = np.zeros(HEAD_BYTES, np.uint8)
        if self._lead:
            head[:4] = np.frombuffer(len(payload).to_bytes(4, "little"), np.uint8)
            part = payload[: HEAD_BYTES - 4]
            head[4 : 4 + len(part)] = np.frombuffer(part, np.uint8)
        wake = self._group.wake
        if wake is not None and not self._lead:
            # Asleep until rank 0 shares this iteration's step: a queued collective polls from the
            # moment MLX runs it. Past the limit, poll as before (the watchdog still watches).
            wake.wait(self._group.spec.collective_timeout_s)
        self._head = self._group._all_sum(mx.array(head))
        mx.async_eval(self._head)
        if wake is not None and self._lead:  # the others may now join this iteration's collective
            wake.post(self._group.size - 1)
        self._keep = (self._head, *self._keep[:1])  # rank 0 reads none of its shares: hold them a while
        self._step, self._payload = step or _EMPTY, payload
        return previous

    def _finish(self) -> Step:
        """The step shared last iteration: its tail exchanged if it was long, decoded on ranks k > 0."""
        import mlx.core as mx

        if self._head is None:
            return _EMPTY
        room = HEAD_BYTES - 4
        if self._lead:
            n = len(self._payload)
            if n > room:
                tail = self._group._all_sum(mx.array(np.frombuffer(self._payload[room:], np.uint8)))
                mx.async_eval(tail)
                self._keep = (tail, *self._keep)
            self._head = None
            return self._step
        got = np.array(self._head)
        self._head = None
        n = int.from_bytes(got[:4].tobytes(), "little")
        if n == 0:
            return _EMPTY
        data = got[4 : 4 + min(n, room)].tobytes()
        if n > room:
            data += np.array(self._group._all_sum(mx.zeros(n - room, mx.uint8))).tobytes()
        return self._codec.decode(data)


class _Expiry:
    """What the watchdog does when it fires: log, tell the orchestrator with a Fatal while it
    still waits for this rank's Ready (`tx`), exit."""

    def __init__(self, spec: GroupRank, log, tx: Sender | None) -> None:
        self.spec, self.log, self.tx = spec, log, tx

    def __call__(self, what: str, limit_s: float) -> None:
        spec = self.spec
        why = (f"rank {spec.rank} of {spec.size} waited more than {limit_s:g} s on the other ranks "
               f"({what}; set MLXRT_COLLECTIVE_TIMEOUT_S)")
        self.log.error("group.collective_timeout", reason=why)
        tx = self.tx
        if tx is not None:
            try:
                tx.send(worker_codec().encode(Fatal(error_type="GroupTimeout", message=why)), timeout=1.0)
            except (ChannelClosed, TimeoutError, OSError):
                pass
        sys.stderr.flush()
        os._exit(EXIT_COLLECTIVE_TIMEOUT)


class LeaderServer(Server):
    """Rank 0's `Server`: each engine step's work goes to every rank (`Lockstep`), and every rank,
    this one included, applies it at the next iteration. Follow-ups of a wave of replies are
    held back and admitted together (`Gather`), as a single worker's are."""

    def __init__(self, engine, outbox, group: RankGroup) -> None:
        super().__init__(engine, outbox)
        self._group = group

    def serve_forever(self) -> None:
        try:
            self._serve()
        except Exception as exc:  # a collective failed: a peer is gone
            self._group.abort(exc)

    def _serve(self) -> None:
        engine, group = self._engine, self._group
        dog = group.watchdog
        heartbeat = group.spec.heartbeat_s
        lockstep = Lockstep(group)
        last_inbox: list = []  # the requests of the step shared last iteration, with their arrival
        last_work = False  # that step had work: apply it at once, without waiting for more
        while True:
            with self._cond:
                held = self._held(time.perf_counter(), busy=last_work)
                if not ((self._inbox and not held) or self._cancels or self._stopping or self._clear_cache
                        or engine.busy or last_work):
                    # Then an empty step, so the others know rank 0 lives; a hold ends by its deadline.
                    self._cond.wait(min(held, heartbeat) if held else heartbeat)
                    held = self._held(time.perf_counter(), busy=last_work)
                stopping, inbox, cancels, clear, dropped = self._take(held)
            for req in dropped:  # cancelled while held back: it never reached any rank's engine
                self.done(req.id, Stats(finish_reason="cancelled"), "")
            work = bool(inbox or cancels or clear or stopping)
            mine = Step(generate=[r for r, _ in inbox], cancel=cancels, clear_cache=clear, stop=stopping)
            dog.arm("an iteration of the group")
            step = lockstep.exchange(mine if work else None)
            if step.stop:
                dog.disarm()
                self._end_all(last_inbox + list(inbox))
                return
            apply_step(engine, step, self, arrived={r.id: t for r, t in last_inbox})
            last_inbox, last_work = list(inbox), work
            self._ended = 0
            engine.step()
            self._gather.ended(self._ended, time.perf_counter())
            dog.disarm()


def apply_step(engine, step: Step, listener, arrived: dict[int, float] | None = None) -> None:
    """Do to `engine` what rank 0 shared, in the same order on every rank (`arrived`: when rank 0
    got each request, for its stats)."""
    if step.clear_cache:
        engine.clear_cache()
    for req in step.generate:
        engine.submit(req, listener, queued_at=(arrived or {}).get(req.id))
    for req_id in step.cancel:
        engine.cancel(req_id)


class _Drop:
    """The listener of ranks k > 0: rank 0 alone reports to the orchestrator."""

    def started(self, req_id: int) -> None:
        pass

    def token(self, req_id: int, token: int, text: str, reasoning: str = "", calls=None, **extra) -> None:
        pass  # extra: a choice's logprob and index (n > 1, log-probabilities)

    def done(self, req_id: int, stats: Stats, text: str, reasoning: str = "", calls=None, **extra) -> None:
        pass  # extra: a choice's index and whether it is the last

    def failed(self, req_id: int, exc: BaseException) -> None:
        pass


def _exit_after_eof(rx: Receiver, log) -> None:
    """Rank k > 0 gets nothing on its stdin; EOF there means the orchestrator is gone."""
    try:
        while True:
            rx.recv()
    except Exception:  # EOF, or a broken pipe: the same
        pass
    time.sleep(EOF_GRACE_S)  # rank 0 lost the orchestrator too, and normally stops the group first
    log.warning("worker.orphaned")
    sys.stderr.flush()
    os._exit(0)


# -- joining ------------------------------------------------------------------------------------


def join(spec: GroupRank, tx: Sender, log) -> RankGroup:
    """Set what `mlx.launch` would have set, start MLX's backend (within the collective timeout),
    agree on a random seed. Raises `GroupError` when this rank cannot join.

    Called before anything imports MLX: MLX reads some of these variables when it starts.
    """
    log = log.bind(rank=spec.rank)
    mlx_was_imported = "mlx.core" in sys.modules
    written = _apply_env(spec)
    try:
        import mlx.core as mx

        backend = resolve_backend(spec.backend)
        if backend == "nccl":
            _use_own_gpu(spec, mlx_was_imported)
        expiry = _Expiry(spec, log, tx)
        dog = Watchdog(spec.collective_timeout_s, expiry)
        dog.arm(f"connecting over {backend}", spec.connect_timeout_s)
        try:
            world = mx.distributed.init(strict=True, backend=backend)
        except RuntimeError as exc:
            raise GroupError(f"rank {spec.rank} could not start MLX's {backend!r} backend: {exc} "
                             f"(connecting waits up to {spec.connect_timeout_s:g} s: set "
                             "MLXRT_COLLECTIVE_TIMEOUT_S)") from exc
        if (world.rank(), world.size()) != (spec.rank, spec.size):
            raise GroupError(f"MLX's {backend!r} backend made this process rank {world.rank()} of "
                             f"{world.size()}; the orchestrator meant rank {spec.rank} of {spec.size}")
        from .sequence import share_seeds

        group = RankGroup(spec, world, backend, log, dog)
        share_seeds(group.agree_seed())
        dog.disarm()
        expiry.tx = None  # from now on the orchestrator learns of a timeout from the exit code
        log.info("group.joined", size=world.size(), backend=backend, device=str(mx.default_device()))
        return group
    finally:
        for path in written:
            Path(path).unlink(missing_ok=True)


def _use_own_gpu(spec: GroupRank, mlx_was_imported: bool) -> None:
    """Make MLX's default device the GPU that MLX's NCCL backend gives this rank (`rank % devices`,
    of those CUDA_VISIBLE_DEVICES shows), before anything makes a stream on another one.

    mlx-lm makes its generation stream on the default device when it is imported, and NCCL's
    communicator must be on the device of the arrays it reduces: with them on two GPUs, the first
    all_sum fails with 'unhandled cuda error'. `GroupError` if MLX was imported before this rank's
    CUDA_VISIBLE_DEVICES was set: CUDA read the variable then, and both ranks may share one GPU.
    """
    import mlx.core as mx

    if mlx_was_imported and "CUDA_VISIBLE_DEVICES" in spec.env:
        raise GroupError(f"rank {spec.rank}: MLX was imported before this rank set CUDA_VISIBLE_DEVICES="
                         f"{spec.env['CUDA_VISIBLE_DEVICES']}, so CUDA may not honour it; join the group "
                         "before importing mlx or mlx_lm")
    count = mx.device_count(mx.gpu)
    if count < 1:
        raise GroupError(f"rank {spec.rank}: backend 'nccl' needs a CUDA GPU, and MLX sees none "
                         f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '(unset)')})")
    mx.set_default_device(mx.Device(mx.gpu, spec.rank % count))


@contextmanager
def _collectives_off_cpu(on: bool) -> Iterator[None]:
    """While inside (and `on`), a collective asked for on the CPU stream runs on the default stream
    instead: mlx-lm's `sharded_load` ends with a barrier on `mx.cpu`, which MLX's NCCL backend
    cannot run (NCCL works on GPU streams; MLX fails with 'There is no Stream(gpu, N) in current
    thread', from the CPU stream's thread)."""
    import mlx.core as mx

    if not on:
        yield
        return
    original = mx.distributed.all_sum

    def all_sum(x, *args, stream=None, **kwargs):
        cpu = (isinstance(stream, mx.DeviceType) and stream == mx.cpu) or (
            isinstance(stream, mx.Device) and stream.type == mx.cpu)
        return original(x, *args, stream=None if cpu else stream, **kwargs)

    mx.distributed.all_sum = all_sum
    try:
        yield
    finally:
        mx.distributed.all_sum = original


def resolve_backend(backend: str) -> str:
    """`backend`, or for "auto" `mlx.launch`'s choice (nccl where CUDA is, else ring); `GroupError`
    if this MLX cannot run it here."""
    import mlx.core as mx

    if backend == "auto":
        backend = "nccl" if mx.cuda.is_available() else "ring"
    backend = "jaccl" if backend == "jaccl-ring" else backend  # the ring is MLX_JACCL_RING=1
    if not mx.distributed.is_available(backend):
        raise GroupError(
            f"backend {backend!r} is not available in this MLX build on {platform.system()} "
            f"(mx.distributed.is_available({backend!r}) is False); ring runs everywhere, jaccl needs "
            "macOS with RDMA over Thunderbolt, nccl needs MLX's CUDA build"
        )
    return backend


def _apply_env(spec: GroupRank) -> list[str]:
    """Set `spec.env`, and write each of `spec.files` to a temporary file its variable names;
    return the files' paths (MLX reads them while it starts its backend).

    Where NCCL may run, and unless set already: NCCL_DEBUG=WARN, so that a failed NCCL call leaves
    NCCL's own reason on stderr (MLX reports only its code, e.g. 'unhandled cuda error'), and
    MLX_NCCL_TIMEOUT (ms) just under the connect timeout, so that a rank k > 0 that cannot reach
    rank 0 fails with MLX's reason before the watchdog ends it without one.
    """
    os.environ.update(spec.env)
    if spec.backend in ("nccl", "auto"):
        os.environ.setdefault("NCCL_DEBUG", "WARN")
        os.environ.setdefault("MLX_NCCL_TIMEOUT", str(int(spec.connect_timeout_s * 900)))
    written = []
    for var, content in spec.files.items():
        fd, path = tempfile.mkstemp(prefix=f"mlxrt-{var.lower()}-", suffix=".json")
        with os.fdopen(fd, "w") as f:
            f.write(content)
        os.environ[var] = path
        written.append(path)
    return written


def plan_sharding(path: str, sharding: str, size: int, backend: str = "ring") -> str:
    """"tensor" or "pipeline" for this model over `size` ranks; `GroupError` naming the reason when
    the model cannot be split that way.

    "auto" is `sharded_load`'s choice (tensor parallel where mlx-lm's model has `shard`, else
    pipeline), except that a model whose attention heads do not divide among the ranks goes
    to the pipeline where it can. Over NCCL it is tensor parallel: mlx-lm's pipeline passes
    activations with send/recv, which MLX's NCCL backend does not have (`NCCL_HAS_SEND_RECV`).
    """
    import json

    from mlx_lm.utils import load_model


    config_file = Path(path) / "config.json"
    if not config_file.is_file():  # a hub id mlx-lm downloads: let sharded_load choose and check
        return "auto"
    config = json.loads(config_file.read_text())
    kind = config.get("model_type", "?")
    model, _ = load_model(Path(path), lazy=True, strict=False)  # no weight is read: as sharded_load does
    tensor_ok = hasattr(model, "shard")
    pipeline_ok = hasattr(model, "model") and hasattr(model.model, "pipeline")
    text = {**config.get("text_config", {}), **config}
    uneven = next((f"{f}={text[f]}" for f in ("num_attention_heads", "num_key_value_heads")
                   if isinstance(text.get(f), int) and text[f] % size), None)
    if sharding == "auto":
        if not (tensor_ok or pipeline_ok):
            raise GroupError(f"model {path} ({kind}) cannot be sharded: mlx-lm's {kind} has neither "
                             "tensor parallelism (`shard`) nor pipeline parallelism (`pipeline`)")
        piped = pipeline_ok and (backend != "nccl" or NCCL_HAS_SEND_RECV)
        sharding = "tensor" if tensor_ok and not (uneven and piped) else "pipeline"
    if sharding == "pipeline" and backend == "nccl" and not NCCL_HAS_SEND_RECV:
        import mlx.core as mx

        raise GroupError(f"model {path} cannot be sharded by pipeline parallelism over NCCL with MLX "
                         f"{mx.__version__}: mlx-lm's pipeline passes activations with send/recv, which "
                         "MLX's NCCL backend does not implement ('[nccl] Send not supported'); "
                         + ("use sharding='tensor'" if tensor_ok and not uneven else "use backend='ring'"))
    if sharding == "tensor":
        if not tensor_ok:
            hint = "; try sharding='pipeline'" if pipeline_ok else ""
            raise GroupError(f"model {path} ({kind}) cannot be sharded by tensor parallelism: "
                             f"mlx-lm's {kind} has no `shard`{hint}")
        if uneven:
            raise GroupError(f"model {path} cannot be sharded over {size} ranks by tensor "
                             f"parallelism: {uneven} is not a multiple of {size}")
        return "tensor"
    if not pipeline_ok:
        hint = "; try sharding='tensor'" if tensor_ok else ""
        raise GroupError(f"model {path} ({kind}) cannot be sharded by pipeline parallelism: "
                         f"mlx-lm's {kind} has no `pipeline`{hint}")
    layers = len(model.layers)
    if layers < size:
        raise GroupError(f"model {path} has {layers} layers: too few for a pipeline of {size} ranks")
    return "pipeline"
