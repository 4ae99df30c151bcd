"""A worker group as the orchestrator sees it: one logical worker made of N rank processes.

::

    GroupHandle (a WorkerHandle)          processes (one process group, rank 0 leads it)
    ----------------------------          ---------------------------------------------
    rank 0's channel: Hello, Generate ... rank 0   serves the worker protocol, as one worker
      <-- Ready, Tokens, Done                 |  mx.distributed: each engine step's work, the
    per other rank: Hello on stdin;           |  model's own collectives
      a watcher reads Ready / Fatal / EOF  rank k   (here, or on another host through ssh)

Rank 0 is this handle's own process, so everything a `WorkerHandle` does
(dispatch, cancel, ping, the send timeout, the death path) works unchanged
through it; the other ranks only need starting, watching and stopping
(`worker/group.py` has their side). The group lives and dies as one:

- any other rank's exit (EOF on its stdout: the kernel says so) kills the
  group, rank 0 included, with the reason recorded first; rank 0's reader
  thread then sees EOF and fails every request in flight with that
  `WorkerDied` (or, during start-up, `wait_ready` raises it as a
  `ModelLoadError`);
- rank 0's own exit (SIGKILL, a collective timeout: exit code
  `EXIT_COLLECTIVE_TIMEOUT`, a lost peer: `EXIT_GROUP_FAILED`) kills the
  other ranks before the requests are failed, so none is left waiting
  inside a collective;
- stop: Shutdown to rank 0, which tells the others through the group; each
  rank gets `Timeouts.shutdown_s`, then SIGKILL.

Killing is a SIGKILL to the process group (while rank 0, its leader, is not
yet reaped, so the group id cannot have been reused), then to each rank's
process (a rank over ssh is its ssh client, whose end closes the remote
rank's stdin: it exits too). The `Slot` above restarts the group as it would
a worker, with the same backoff and breaker.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
from collections import deque
from dataclasses import dataclass, field, replace

import msgspec
import structlog

from ..ipc import wake
from ..ipc.channel import ChannelClosed, ChannelCorrupt
from ..ipc.protocol import (
    DEFAULT_HEARTBEAT_S,
    EXIT_COLLECTIVE_TIMEOUT,
    EXIT_GROUP_FAILED,
    MIN_CONNECT_TIMEOUT_S,
    PROTOCOL_VERSION,
    Fatal,
    GroupRank,
    Hello,
    Ready,
    orchestrator_codec,
)
from ..ipc.stdio import PipeReceiver, PipeSender
from .errors import MlxrtTimeout, ModelLoadError, WorkerDied
from .handle import RankInfo, WorkerHandle, WorkerInfo, pump_stderr
from .launch import GroupPlan, RankLaunch

log = structlog.get_logger("mlxrt.orchestrator")


@dataclass
class _Rank:
    """A rank k > 0, as its watcher sees it."""

    rank: int
    host: str
    proc: subprocess.Popen
    tx: PipeSender
    #: Its pid on its host: the local process's until its Ready says (a rank over ssh).
    pid: int
    state: str = "starting"
    fatal: str = ""
    tail: deque[str] = field(default_factory=lambda: deque(maxlen=40))
    threads: list[threading.Thread] = field(default_factory=list)


class GroupHandle(WorkerHandle):
    """A worker group behind the `WorkerHandle` interface: rank 0 is the handle's process."""

    def __init__(self, model: str, *, plan: GroupPlan, **kwargs) -> None:
        self.plan = plan
        self._ranks: list[_Rank] = []
        self._launch: list[RankLaunch] = []
        #: Stopping or killed on purpose, or already dying: a rank's exit is expected.
        self._ending = False
        #: The wake-up semaphore's name until every rank has opened it (`_forget_wake`).
        self._wake: str | None = None
        super().__init__(model, **kwargs)

    # -- start ----------------------------------------------------------------------------
    def _spawn(self, warmup_tokens: int, cache_limit_bytes: int | None) -> None:
        self._launch = self.plan.launch()
        # Ranks on this machine wait for rank 0's steps in the OS, not polling (ipc/wake.py).
        self._wake = wake.create() if all(spec.host is None for spec in self._launch) else None
        try:
            super()._spawn(warmup_tokens, cache_limit_bytes)  # rank 0, through the two hooks below
            for spec in self._launch[1:]:
                self._ranks.append(self._start_rank(spec, warmup_tokens, cache_limit_bytes))
        except (OSError, subprocess.SubprocessError) as exc:  # no ssh, say, or rank 0 already gone
            self._forget_wake()
            self.kill()
            raise ModelLoadError(f"worker group for model {self.model!r}: could not start rank "
                                 f"{len(self._ranks) + 1}: {exc}") from exc

    def _forget_wake(self) -> None:
        """Unlink the wake-up semaphore's name: every rank has opened it, or none will."""
        if self._wake is not None:
            wake.unlink(self._wake)
            self._wake = None

    def _hello_extra(self) -> dict:
        return {"group": self._rank_spec(self._launch[0])}

    def _popen_extra(self) -> dict:
        return _session(None)

    def _rank_spec(self, spec: RankLaunch) -> GroupRank:
        return GroupRank(rank=spec.rank, size=self.plan.size, backend=self.plan.backend,
                         sharding=self.plan.sharding, env=spec.env, files=spec.files,
                         collective_timeout_s=self._timeouts.collective_s, heartbeat_s=DEFAULT_HEARTBEAT_S,
                         connect_timeout_s=max(self._timeouts.collective_s, MIN_CONNECT_TIMEOUT_S),
                         wake=self._wake)

    def _start_rank(self, spec: RankLaunch, warmup_tokens: int, cache_limit_bytes: int | None) -> _Rank:
        proc = subprocess.Popen(
            self.plan.argv(spec.host, self._argv),
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, bufsize=0,
            **_session(self.pid),
        )
        tx = PipeSender(os.dup(proc.stdin.fileno()))
        rank = _Rank(spec.rank, spec.host or socket.gethostname(), proc, tx, proc.pid)
        proc.stdin.close()
        rx = PipeReceiver(os.dup(proc.stdout.fileno()))
        proc.stdout.close()
        name = f"{self.name}.r{spec.rank}"
        rank.threads = [
            threading.Thread(target=pump_stderr, args=(proc.stderr, rank.tail, name),
                             name=f"mlxrt-{name}-stderr", daemon=True),
            threading.Thread(target=self._watch, args=(rank, rx), name=f"mlxrt-{name}-watch", daemon=True),
        ]
        for t in rank.threads:
            t.start()
        hello = Hello(protocol=PROTOCOL_VERSION, model=self.model, worker_id=name, transport="stdio",
                      warmup_tokens=warmup_tokens, cache_limit_bytes=cache_limit_bytes, engine=self.engine,
                      group=self._rank_spec(spec), prompt_cache_share=self.prompt_cache_share)
        try:
            rank.tx.send(self._codec.encode(hello), timeout=self._timeouts.send_s)
        except (ChannelClosed, TimeoutError):
            pass  # it already exited: its watcher says how
        return rank

    def wait_ready(self) -> Ready:
        """Rank 0's Ready (it comes after every rank has loaded its shard and warmed up in step).

        When another rank failed first, the error is that rank's.
        """
        try:
            ready = super().wait_ready()
        except (ModelLoadError, MlxrtTimeout) as exc:
            self._forget_wake()
            self.kill()
            why = self._kill_reason
            # No cause: rank 0 sent a Fatal saying why; else it was killed for another rank's failure.
            if why is None or (isinstance(exc, ModelLoadError) and exc.__cause__ is None):
                raise
            raise ModelLoadError(f"worker group for model {self.model!r} failed to start: {why}") from exc
        self._forget_wake()  # rank 0 is ready after every rank joined, so each has it open
        return ready

    # -- the other ranks ----------------------------------------------------------------------
    def _watch(self, rank: _Rank, rx: PipeReceiver) -> None:
        """Read a rank's Ready or Fatal; at EOF (it exited), stop the group unless it is ending."""
        codec = orchestrator_codec()
        try:
            while True:
                msg = codec.decode(rx.recv())
                if isinstance(msg, Ready):
                    rank.pid, rank.state = msg.pid, "ready"
                elif isinstance(msg, Fatal):
                    rank.fatal = f"{msg.error_type}: {msg.message}"
        except (ChannelClosed, ChannelCorrupt, msgspec.DecodeError, OSError):
            pass
        rx.close()
        code = _reap(rank.proc, 1.0)
        rank.state = "exited"
        if self._ending:
            return
        rank.threads[0].join(1.0)  # its last stderr lines (ssh's error) are read before they are quoted
        why = f"failed: {rank.fatal}" if rank.fatal else _exit_text(code, self._timeouts.collective_s)
        if not rank.fatal and code not in (None, EXIT_COLLECTIVE_TIMEOUT, EXIT_GROUP_FAILED) and code > 0:
            why += f": {_tail(rank.tail)}"  # its own words (an ssh error, a crash)
        reason = WorkerDied(f"rank {rank.rank} of worker {self.name} (pid {rank.pid} on {rank.host}) {why}; "
                            "the group was stopped")
        with self._lock:
            if self._kill_reason is None:
                self._kill_reason = reason
        log.error("group.rank_exit", worker=self.name, rank=rank.rank, pid=rank.pid, host=rank.host,
                  code=code, reason=str(reason))
        self._kill_all()

    def _kill_all(self) -> None:
        """SIGKILL every rank: the process group, then each process."""
        self._forget_wake()
        if self.proc.returncode is None:  # the leader is not reaped: the group id is still ours
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        for proc in [self.proc, *(r.proc for r in self._ranks)]:
            if proc.poll() is None:
                proc.kill()

    def _reap_ranks(self, timeout: float) -> None:
        """Wait for the other ranks to exit (SIGKILL past `timeout` s); release their pipes."""
        for r in self._ranks:
            if _reap(r.proc, timeout) is None:
                r.proc.kill()
                r.proc.wait()
            r.tx.close()
        for r in self._ranks:
            for t in r.threads:
                t.join(5.0)

    # -- end ------------------------------------------------------------------------------------
    def stop(self, timeout: float | None = None) -> None:
        """Shutdown to rank 0, which stops the others through the group; then as a worker's stop."""
        self._ending = True
        super().stop(timeout)
        self._reap_ranks(self._timeouts.shutdown_s if timeout is None else timeout)

    def kill(self) -> None:
        self._ending = True
        self._kill_all()
        super().kill()
        self._reap_ranks(1.0)

    def _die(self, error: WorkerDied | None) -> None:
        """Rank 0 is gone: stop the others first (they may be waiting inside a collective), then
        end the requests in flight as a worker's death does, with the group's story."""
        with self._lock:
            stopping = self._state == "stopping"
        self._ending = True
        if stopping:  # rank 0 told the others to stop before it exited: `stop` waits for them
            super()._die(error)
            return
        if error is None and self._kill_reason is None:
            code = self._exit_code()
            self._kill_reason = WorkerDied(self._death_story(code))
        self._kill_all()
        super()._die(error)
        self._reap_ranks(1.0)

    def _death_story(self, code: int | None) -> str:
        t = self._timeouts.collective_s
        mine = _exit_text(code, t)
        if code is not None and code > 0 and code not in (EXIT_COLLECTIVE_TIMEOUT, EXIT_GROUP_FAILED):
            mine += f": {self._last_stderr(4)}"  # its own words (NCCL's reason, a crash)
        parts = [f"rank 0 (pid {self.pid}) {mine}"]
        for r in self._ranks:
            c = r.proc.poll()
            parts.append(f"rank {r.rank} (pid {r.pid} on {r.host}) "
                         + ("was still running" if c is None else _exit_text(c, t)))
        return f"worker {self.name} (a group of {self.plan.size} ranks) died: " + "; ".join(parts)

    # -- reports --------------------------------------------------------------------------------
    def info(self) -> WorkerInfo:
        state = self._state if self._state in ("starting", "ready", "stopping") else "exited"
        ranks = [RankInfo(0, self.pid, socket.gethostname(), state)]
        ranks += [RankInfo(r.rank, r.pid, r.host, r.state) for r in self._ranks]
        return replace(super().info(), ranks=tuple(ranks))


def _session(leader: int | None) -> dict:
    """Popen arguments: rank 0 leads a new process group, the others join it (Python 3.11+; on 3.10
    each leads its own, and is killed by its pid)."""
    if sys.version_info >= (3, 11):
        return {"process_group": 0 if leader is None else leader}
    return {"start_new_session": True}


def _reap(proc: subprocess.Popen, timeout: float) -> int | None:
    try:
        return proc.wait(timeout)
    except subprocess.TimeoutExpired:
        return None


def _exit_text(code: int | None, collective_s: float) -> str:
    if code is None:
        return "did not exit"
    if code == EXIT_COLLECTIVE_TIMEOUT:
        return (f"exited: it waited on the other ranks more than {collective_s:g} s "
                "(set MLXRT_COLLECTIVE_TIMEOUT_S)")
    if code == EXIT_GROUP_FAILED:
        return "exited: a collective or an engine step failed (a rank gone?)"
    if code < 0:
        return f"was killed by {signal.Signals(-code).name}"
    return f"exited with code {code}"


def _tail(lines: deque[str], n: int = 4) -> str:
    tail = list(lines)[-n:]
    return " | ".join(tail) if tail else "(no output)"
