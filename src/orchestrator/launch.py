"""What `mlx.launch` does before it starts a distributed MLX program, done by the orchestrator.

A `Group` says how one logical worker is spread over N rank processes; `plan`
checks it, and reads the host file, before any process starts, and
`GroupPlan.launch` gives each rank, at each (re)start, what `mlx.launch`
would have given it:

========  ==========================================================================
backend   per rank
========  ==========================================================================
ring      MLX_RANK; MLX_HOSTFILE: a file holding ``[["ip:port", ...], ...]``, one list per rank
nccl      MLX_RANK, MLX_WORLD_SIZE, NCCL_HOST_IP (rank 0's ip), NCCL_PORT, CUDA_VISIBLE_DEVICES (one
          GPU each), and this process's other NCCL_* variables
jaccl     MLX_RANK, MLX_JACCL_COORDINATOR (rank 0's ip:port); MLX_IBV_DEVICES: a file of rdma names
          (jaccl-ring: and MLX_JACCL_RING=1; RDMA devices needed to the neighbours only)
auto      ring's and nccl's: the rank picks as `mlx.launch` does (nccl where CUDA is, else ring)
========  ==========================================================================

plus the host file's ``envs``. The values travel in the rank's `Hello`
(`GroupRank.env`, `.files`), and the rank sets them before it imports MLX, so
a rank on another host needs no file or variable from here. A rank on another
host is started through ``ssh`` (no tty: its stdin and stdout carry frames);
rank 0 runs on this machine, since the orchestrator talks to it over shared
memory. Ports: a free port of this machine per rank and address (probed at
each start), or ``port``, ``port + 1``, ... as `mlx.launch --starting-port`.

The host file is `mlx.launch`'s JSON: a list of hosts, or an object with
``backend``, ``envs`` and ``hosts``; a host is ``{"ssh": name, "ips": [...],
"rdma": [...]}``. MPI is refused: its ranks must be started by ``mpirun``.

Nothing here imports MLX.
"""

from __future__ import annotations

import ipaddress
import json
import os
import platform
import shlex
import socket
import sys
from dataclasses import dataclass, field
from pathlib import Path

import msgspec

from ..ipc.protocol import GROUP_BACKENDS, SHARDINGS

#: ssh gives up on a host it cannot reach after this long (s).
SSH_CONNECT_TIMEOUT_S = 10
_LOCAL_NAMES = {"127.0.0.1", "localhost", "::1"}


class HostEntry(msgspec.Struct, forbid_unknown_fields=True):
    """One host of an `mlx.launch` host file: whom to ssh into, its IPs, its RDMA devices."""

    ssh: str
    ips: list[str] = []
    rdma: list[str | list[str] | None] = []


class HostFile(msgspec.Struct, forbid_unknown_fields=True):
    hosts: list[HostEntry]
    backend: str = ""
    envs: list[str] = []


@dataclass(frozen=True, kw_only=True)
class Group:
    """How one logical worker is spread over rank processes with `mx.distributed` (docs/distributed.md).

    ranks: processes in the group (default: the host file's hosts). backend: "auto" (nccl
    where CUDA is, else ring), "ring", "jaccl", "jaccl-ring" or "nccl". hosts: an `mlx.launch` host file
    (default: every rank on this machine). sharding: "auto" (tensor parallel where mlx-lm's
    model has `shard`, else pipeline), "tensor" or "pipeline". port: the first port the ring
    or the coordinator listens on (`mlx.launch --starting-port`; default: free ports).
    python: the interpreter on other hosts (`mlx.launch --python`; default: this one's path).
    """

    ranks: int | None = None
    backend: str = "auto"
    hosts: str | os.PathLike[str] | None = None
    sharding: str = "auto"
    port: int | None = None
    python: str | None = None

    def plan(self) -> GroupPlan | None:
        """The checked plan; None for a group of one process (an ordinary worker).

        `ValueError` names the field or the host file's problem.
        """
        if self.sharding not in SHARDINGS:
            raise ValueError(f"invalid sharding={self.sharding!r}: must be one of {SHARDINGS}")
        if self.port is not None and not 1024 <= self.port <= 65535:
            raise ValueError(f"invalid port={self.port!r}: must be in [1024, 65535]")
        doc = read_host_file(self.hosts) if self.hosts is not None else None
        backend = self.backend
        if backend == "auto" and doc is not None and doc.backend:
            backend = doc.backend  # as mlx.launch: the host file's, unless one is asked for
        _check_backend(backend)
        ranks = self.ranks
        if ranks is not None and (isinstance(ranks, bool) or not isinstance(ranks, int) or ranks < 1):
            raise ValueError(f"invalid ranks={ranks!r}: must be an integer >= 1")
        if doc is None:
            ranks = ranks or 1
            hosts = [HostEntry(ssh="127.0.0.1", ips=["127.0.0.1"]) for _ in range(ranks)]
        else:
            hosts = doc.hosts
            if ranks is not None and ranks != len(hosts):
                raise ValueError(f"invalid ranks={ranks}: the host file {self.hosts} has {len(hosts)} hosts")
            ranks = len(hosts)
        if ranks == 1:
            if self != Group(ranks=self.ranks):
                raise ValueError(f"invalid ranks={ranks}: backend, hosts, sharding, port and python "
                                 "are for a worker group, which needs ranks >= 2")
            return None
        _check_hosts(hosts, backend, self.hosts)
        return GroupPlan(size=ranks, backend=backend, sharding=self.sharding, hosts=hosts,
                         envs=_parse_envs(doc.envs if doc else []), port=self.port,
                         python=self.python or sys.executable)


@dataclass(frozen=True)
class RankLaunch:
    """One rank's start: where (None: this machine), and what MLX must find set."""

    rank: int
    host: str | None
    env: dict[str, str]
    files: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True, kw_only=True)
class GroupPlan:
    """A checked `Group`: N hosts (one per rank, repeated for several ranks on one machine)."""

    size: int
    backend: str
    sharding: str
    hosts: list[HostEntry]
    envs: dict[str, str]
    port: int | None
    python: str

    def launch(self) -> list[RankLaunch]:
        """Each rank's place, environment and files, with ports chosen now."""
        env = [{**self.envs, "MLX_RANK": str(r)} for r in range(self.size)]
        files: list[dict[str, str]] = [{} for _ in range(self.size)]
        port_count = sum(len(h.ips) for h in self.hosts) + 1
        first = self.port
        ports = iter(free_ports(port_count) if first is None else range(first, first + port_count))
        if self.backend in ("ring", "auto"):
            ring = [[f"{ip}:{next(ports)}" for ip in h.ips] for h in self.hosts]
            for f in files:
                f["MLX_HOSTFILE"] = json.dumps(ring)
        if self.backend in ("nccl", "auto"):
            host_ip, port = self.hosts[0].ips[0], next(ports)
            devices = _visible_devices(self.hosts)
            # This process's NCCL settings (NCCL_NVLS_ENABLE=0, say) reach ranks on other hosts too.
            ours = {k: v for k, v in os.environ.items() if k.startswith("NCCL_")}
            for r, e in enumerate(env):
                env[r] = e = {**ours, **e}
                e.update(NCCL_HOST_IP=host_ip, NCCL_PORT=str(port), MLX_WORLD_SIZE=str(self.size),
                         CUDA_VISIBLE_DEVICES=devices[r])
        if self.backend in ("jaccl", "jaccl-ring"):
            coordinator = f"{self.hosts[0].ips[0]}:{next(ports)}"
            for r, e in enumerate(env):
                e["MLX_JACCL_COORDINATOR"] = coordinator
                if self.backend == "jaccl-ring":
                    e["MLX_JACCL_RING"] = "1"
                files[r]["MLX_IBV_DEVICES"] = json.dumps([h.rdma for h in self.hosts])
        return [RankLaunch(r, None if is_local(h.ssh) else h.ssh, env[r], files[r])
                for r, h in enumerate(self.hosts)]

    def argv(self, host: str | None, local_argv: list[str]) -> list[str]:
        """The command that starts a rank: `local_argv` here, else through ssh."""
        if host is None:
            return local_argv
        remote = shlex.join([self.python, "-m", "mlxrt.worker"])
        return ["ssh", "-T", "-o", "BatchMode=yes", "-o", f"ConnectTimeout={SSH_CONNECT_TIMEOUT_S}",
                host, remote]


def read_host_file(path: str | os.PathLike[str]) -> HostFile:
    """Parse an `mlx.launch` host file; `ValueError` naming the file and what is wrong."""
    p = Path(path).expanduser()
    try:
        raw = p.read_bytes()
    except OSError as exc:
        raise ValueError(f"invalid hosts={str(path)!r}: cannot read the host file ({exc.strerror})") from None
    try:
        doc = msgspec.json.decode(raw, type=HostFile | list[HostEntry])
    except msgspec.DecodeError as exc:
        raise ValueError(f"invalid host file {p}: {exc} (the format is mlx.launch's: "
                         '[{"ssh": "host", "ips": ["10.0.0.1"]}, ...] or {"hosts": [...]})') from None
    doc = doc if isinstance(doc, HostFile) else HostFile(hosts=doc)
    if not doc.hosts:
        raise ValueError(f"invalid host file {p}: it lists no hosts")
    return doc


def _check_backend(backend: str) -> None:
    if backend == "mpi":
        raise ValueError("invalid backend='mpi': MPI ranks must be started by mpirun, and mlxrt starts "
                         "and supervises its ranks itself; use ring (TCP, Thunderbolt), jaccl (RDMA over "
                         "Thunderbolt, macOS) or nccl (CUDA)")
    if backend not in GROUP_BACKENDS:
        raise ValueError(f"invalid backend={backend!r}: must be one of {GROUP_BACKENDS}")
    system = platform.system()
    if backend.startswith("jaccl") and system != "Darwin":
        raise ValueError(f"invalid backend={backend!r}: JACCL (RDMA over Thunderbolt) runs on macOS only, "
                         f"and this is {system}; use ring, or nccl on CUDA GPUs")
    if backend == "nccl" and system == "Darwin":
        raise ValueError("invalid backend='nccl': NCCL needs CUDA GPUs; on macOS use ring or jaccl")


def _check_hosts(hosts: list[HostEntry], backend: str, source: object) -> None:
    where = f"host file {source}" if source is not None else "hosts"
    for i, h in enumerate(hosts):
        if not h.ssh:
            raise ValueError(f"invalid {where}: host {i} has an empty 'ssh' name")
        for ip in h.ips:
            try:
                ipaddress.ip_address(ip)
            except ValueError:
                raise ValueError(f"invalid {where}: host {i} ({h.ssh}) lists {ip!r} in 'ips', which is "
                                 "not an IP address") from None
    if not is_local(hosts[0].ssh):
        raise ValueError(f"invalid {where}: the first host ({hosts[0].ssh!r}) must be this machine "
                         f"({socket.gethostname()}, localhost or 127.0.0.1): rank 0 runs beside the "
                         "orchestrator")
    if backend in ("ring", "auto"):
        missing = [h.ssh for h in hosts if not h.ips]
        if missing:
            raise ValueError(f"invalid {where}: the ring backend needs 'ips' for every host; none for "
                             f"{missing}")
    if backend in ("nccl", "jaccl", "jaccl-ring") and not hosts[0].ips:
        raise ValueError(f"invalid {where}: the {backend} backend needs rank 0's 'ips' (reachable from "
                         "every rank)")
    if backend.startswith("jaccl"):  # as mlx.launch checks
        n = len(hosts)
        for i, h in enumerate(hosts):
            if len(h.rdma) != n or h.rdma[i] is not None:
                raise ValueError(f"invalid {where}: jaccl needs 'rdma' on every host, one entry per "
                                 f"host and null for itself; host {i} ({h.ssh}) has {h.rdma}")
            peers = {(i - 1) % n, (i + 1) % n} if backend == "jaccl-ring" else set(range(n))
            missing = [hosts[j].ssh for j in sorted(peers) if j != i and h.rdma[j] is None]
            if missing:
                raise ValueError(f"invalid {where}: no RDMA device is listed from {h.ssh} to {missing}")


def _parse_envs(envs: list[str]) -> dict[str, str]:
    out = {}
    for item in envs:
        key, sep, value = item.partition("=")
        if not sep or not key or not all(c.isalnum() or c == "_" for c in key):
            raise ValueError(f"invalid host file: 'envs' entry {item!r} is not NAME=value")
        out[key] = value
    return out


def is_local(host: str) -> bool:
    """Whether `host` names this machine (no DNS lookup: a name, or one of its addresses)."""
    if host in _LOCAL_NAMES or host in (socket.gethostname(), socket.getfqdn()):
        return True
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    import psutil

    return any(a.address == host for addrs in psutil.net_if_addrs().values() for a in addrs)


def free_ports(n: int) -> list[int]:
    """`n` TCP ports free on this machine now (held together while probing, so all differ)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def local_gpus() -> list[str]:
    """The NVIDIA GPUs a worker started here may use, as CUDA_VISIBLE_DEVICES entries: this process's own
    CUDA_VISIBLE_DEVICES where set, else one per GPU the driver lists (/proc/driver/nvidia/gpus); none on
    a machine without NVIDIA's driver (a Mac, a CPU host)."""
    mine = os.environ.get("CUDA_VISIBLE_DEVICES")
    if mine is not None:
        return [d.strip() for d in mine.split(",") if d.strip()]
    try:
        return [str(i) for i in range(len(os.listdir("/proc/driver/nvidia/gpus")))]
    except OSError:
        return []


def _visible_devices(hosts: list[HostEntry]) -> list[str]:
    """CUDA_VISIBLE_DEVICES per rank: its index among the ranks of its host, through this
    process's own CUDA_VISIBLE_DEVICES where set (rank 0's host)."""
    mine = [d for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    seen: dict[str, int] = {}
    out = []
    for h in hosts:
        k = seen.get(h.ssh, 0)
        seen[h.ssh] = k + 1
        out.append(mine[k % len(mine)] if mine and is_local(h.ssh) else str(k))
    return out
