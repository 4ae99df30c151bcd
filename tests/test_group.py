"""Worker groups: the tiny model over two rank processes on 127.0.0.1, MLX's ring backend."""

from __future__ import annotations

import json
import os
import platform
import shutil
import signal
import socket
import time
from concurrent.futures import ThreadPoolExecutor

import psutil
import pytest
from mlxrt import Group, ModelLoadError, ModelSpec, Runtime, Supervision, Timeouts, WorkerDied
from mlxrt.ipc.protocol import EngineOptions
from mlxrt.orchestrator.launch import GroupPlan, HostEntry
from mlxrt.orchestrator.runtime import build_request
from mlxrt.worker.engine import Engine
from mlxrt.worker.group import GroupError, plan_sharding
from support import assert_stopped, run_batch, run_with_deadline

REQUESTS = [
    ("Once upon a time", {"max_tokens": 20}),
    ("The harbour was quiet that night and the boats " * 6, {"max_tokens": 12}),
    ([5, 17, 42, 99, 3, 250], {"max_tokens": 16}),
    ([{"role": "system", "content": "You explain the tides."},
      {"role": "user", "content": "Tell me about the weather."}], {"max_tokens": 18}),
    ("A seeded one", {"max_tokens": 16, "temperature": 0.9, "seed": 5}),
    ("With a penalty",
     {"max_tokens": 16, "repetition_penalty": 1.3, "top_k": 8, "temperature": 0.7, "seed": 1}),
    # A frame longer than the lockstep's head: its tail takes a second collective.
    ("A long frame", {"max_tokens": 12, "stop": ["words the tiny model never writes " * 200]}),
]
#: A prefix cache of a few entries: the ranks must agree on every eviction.
SMALL_CACHE = EngineOptions(decode_concurrency=8, prompt_cache_bytes=256 << 10)


def concurrently(fn, items):
    with ThreadPoolExecutor(len(items)) as pool:
        return list(pool.map(fn, items))


def generate_all(rt):
    return [rt.generate(p, ignore_eos=True, **kw).tokens for p, kw in REQUESTS]


@pytest.fixture(scope="module")
def single(tiny_model):
    """Each request's ids from one process (the worker's engine, in-process): the reference."""
    engine = Engine(tiny_model)
    reqs = [build_request(i, p, {**kw, "ignore_eos": True}) for i, (p, kw) in enumerate(REQUESTS, 1)]
    return [run_batch(engine, [r]).ids[r.id] for r in reqs]


@pytest.fixture(scope="module", params=["tensor", "pipeline"])
def group(request, tiny_model):
    rt = Runtime(model=tiny_model, ranks=2, backend="ring", sharding=request.param, transport="ring",
                 engine=SMALL_CACHE)
    pids = [r.pid for r in rt.workers[0].ranks]
    yield rt
    rt.close()
    assert_stopped(pids)


def test_group_ids_equal_one_process(group, single):
    """A 2-rank group gives one process's ids (greedy and seeded), alone and in a batch."""
    assert generate_all(group) == single
    together = concurrently(lambda r: group.generate(r[0], ignore_eos=True, **r[1]), REQUESTS)
    assert [c.tokens for c in together] == single
    assert max(c.stats.mean_batch_size for c in together) > 1
    (m,) = group.memory()
    assert 0 < m.prompt_cache_bytes <= SMALL_CACHE.prompt_cache_bytes


def test_choices_and_logprobs_in_a_group(group, single):
    """n > 1 and log-probabilities reach every rank's listener: the group serves them (it died on
    them once, when rank k > 0's listener did not take a choice's keywords)."""
    prompt, params = REQUESTS[0]  # greedy
    c = group.generate(prompt, ignore_eos=True, n=2, logprobs=2, **params)
    assert [ch.tokens for ch in c.choices] == [single[0]] * 2
    assert c.logprobs and len(c.logprobs) == len(c.tokens)
    assert group.workers[0].restarts == 0


def test_workers_show_the_group_and_its_ranks(group):
    """rt.workers lists the group once, with each rank's pid and host; rank 0 is the worker's pid."""
    (w,) = group.workers
    assert [r.rank for r in w.ranks] == [0, 1]
    assert w.pid == w.ranks[0].pid and w.ranks[0].pid != w.ranks[1].pid
    assert all(r.host == socket.gethostname() and r.state == "ready" for r in w.ranks)
    assert all(psutil.pid_exists(r.pid) for r in w.ranks)


def test_an_idle_groups_ranks_sleep_instead_of_polling(group, single):
    """Between requests rank k > 0 waits for rank 0's next step in the OS (the wake-up semaphore), not
    in MLX's collective, which polls: it used a whole core while the group sat idle. Requests still
    get one process's ids after the idle spell."""
    group.generate("Before the idle spell", max_tokens=4)
    procs = [psutil.Process(r.pid) for r in group.workers[0].ranks]
    before, t0 = [sum(p.cpu_times()[:2]) for p in procs], time.monotonic()
    time.sleep(3.0)  # three of rank 0's heartbeats
    spell = time.monotonic() - t0
    used = sum(procs[1].cpu_times()[:2]) - before[1]
    assert used < 0.25 * spell, f"rank 1 used {used / spell:.2f} of a core while idle"
    assert group.generate(REQUESTS[0][0], ignore_eos=True, **REQUESTS[0][1]).tokens == single[0]


def test_cancel_keeps_the_ranks_in_step(group):
    """A cancelled stream ends as cancelled; the next requests still get one process's ids."""
    want = group.generate("After the cancel", max_tokens=8, ignore_eos=True).tokens
    stream = group.stream("This one is cancelled", max_tokens=400, ignore_eos=True)
    chunks = iter(stream)
    next(chunks)
    next(chunks)
    stream.cancel()
    list(chunks)
    assert stream.finish_reason == "cancelled" and stream.stats.generation_tokens < 400
    assert group.generate("After the cancel", max_tokens=8, ignore_eos=True).tokens == want


def _wait_ready(rt, restarts: int, limit_s: float = 120.0):
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        (w,) = rt.workers
        if w.state == "ready" and w.restarts == restarts:
            return w
        time.sleep(0.1)
    raise AssertionError(f"the group did not restart within {limit_s} s: {rt.workers}")


def _streams_fail(streams, match: str) -> None:
    for chunks in streams:
        with pytest.raises(WorkerDied, match=match):
            for _ in chunks:
                pass


def _streams_of(rt, n: int) -> list:
    streams = [iter(rt.stream(f"Stream {i}", max_tokens=4000, ignore_eos=True)) for i in range(n)]
    for chunks in streams:
        next(chunks)
    return streams


def test_a_rank_killed_or_stalled_mid_stream_ends_the_group_as_one(tiny_model):
    """Resumes off: rank 1 SIGKILLed, then (in the restarted group) SIGSTOPped mid-stream: WorkerDied for
    every stream (the stall named as a collective timeout), every rank stopped, the group restarted
    after the first."""
    with Runtime(model=tiny_model, ranks=2, transport="ring", timeouts=Timeouts(collective_s=3),
                 supervision=Supervision(backoff_initial_s=0.1, max_resumes=0)) as rt:
        first = [r.pid for r in rt.workers[0].ranks]
        streams = _streams_of(rt, 3)
        os.kill(first[1], signal.SIGKILL)
        run_with_deadline(lambda: _streams_fail(streams, "rank 1 .* was killed by SIGKILL"), 30)
        assert_stopped(first)
        second = [r.pid for r in _wait_ready(rt, restarts=1).ranks]
        assert not set(second) & set(first)
        streams = _streams_of(rt, 2)
        os.kill(second[1], signal.SIGSTOP)
        run_with_deadline(lambda: _streams_fail(streams, "MLXRT_COLLECTIVE_TIMEOUT_S"), 60)
        assert_stopped(second)


def test_a_stream_goes_on_after_its_group_dies(tiny_model):
    """Rank 1 SIGKILLed mid-stream: the group restarts as one and the stream goes on on it, with the
    greedy tokens an uninterrupted run gives, counted once."""
    with Runtime(model=tiny_model, ranks=2, transport="ring", timeouts=Timeouts(collective_s=10),
                 supervision=Supervision(backoff_initial_s=0.1)) as rt:
        whole = rt.generate("A group that dies", max_tokens=200, ignore_eos=True)
        stream = rt.stream("A group that dies", max_tokens=200, ignore_eos=True)
        ids = list(next(stream).tokens)
        os.kill(rt.workers[0].ranks[1].pid, signal.SIGKILL)
        ids += [t for chunk in run_with_deadline(lambda: list(stream), 120) for t in chunk.tokens]
        assert rt.workers[0].resumes == 1
    assert ids == whole.tokens and stream.stats.resumes == 1 and stream.stats.generation_tokens == 200


def _host_file(tmp_path, content) -> str:
    path = tmp_path / "hosts.json"
    path.write_text(content if isinstance(content, str) else json.dumps(content))
    return str(path)


LOCAL = {"ssh": "127.0.0.1", "ips": ["127.0.0.1"]}


@pytest.mark.parametrize("content, kwargs, message", [
    ("{not json", {}, "invalid host file .*JSON is malformed"),
    ([LOCAL, {"ssh": "127.0.0.1"}], {}, "ring backend needs 'ips'"),
    ([LOCAL, {"ssh": "127.0.0.1", "ips": ["not-an-ip"]}], {}, "'not-an-ip' .* not an IP address"),
    ([{"ssh": "elsewhere.invalid", "ips": ["10.0.0.1"]}, LOCAL], {}, "first host .* must be this machine"),
    ([LOCAL, LOCAL], {"ranks": 3}, "host file .* has 2 hosts"),
    ([LOCAL, LOCAL], {"backend": "mpi"}, "mpirun"),
])
def test_a_bad_host_file_is_refused_before_any_rank_starts(tmp_path, tiny_model, content, kwargs, message):
    """A host file that does not parse, or cannot work, is a ValueError naming it; nothing starts."""
    before = psutil.Process().children()
    with pytest.raises(ValueError, match=message):
        Runtime(model=tiny_model, hosts=_host_file(tmp_path, content), **kwargs)
    assert psutil.Process().children() == before


@pytest.mark.skipif(shutil.which("ssh") is None, reason="no ssh client here")
def test_an_unreachable_host_is_a_clear_error(tmp_path, tiny_model):
    """A host ssh cannot reach fails the start with ssh's own words; rank 0 is stopped."""
    hosts = _host_file(tmp_path, [LOCAL, {"ssh": "mlxrt-unreachable.invalid", "ips": ["127.0.0.1"]}])
    with pytest.raises(ModelLoadError, match="rank 1 .*mlxrt-unreachable.invalid.*exited with code 255"):
        run_with_deadline(lambda: Runtime(model=tiny_model, hosts=hosts, transport="stdio",
                                          supervision=Supervision(restart=False)), 60)


@pytest.mark.skipif(platform.system() == "Darwin", reason="JACCL exists on macOS")
def test_jaccl_off_macos_is_refused_before_any_rank_starts(tiny_model):
    """backend='jaccl' on Linux: a ValueError saying it needs macOS, before any process starts."""
    before = psutil.Process().children()
    with pytest.raises(ValueError, match="jaccl.*macOS only"):
        Runtime(model=tiny_model, ranks=2, backend="jaccl")
    assert psutil.Process().children() == before


def test_a_backend_this_mlx_lacks_fails_in_the_ranks(tiny_model):
    """backend='nccl' where MLX has no NCCL: every rank refuses it at once, the start fails with why."""
    import mlx.core as mx

    if mx.distributed.is_available("nccl"):
        pytest.skip("this MLX has NCCL")
    with pytest.raises(ModelLoadError, match="backend 'nccl' is not available"):
        run_with_deadline(lambda: Runtime(model=tiny_model, ranks=2, backend="nccl", transport="stdio",
                                          supervision=Supervision(restart=False)), 60)


def test_a_model_that_cannot_be_sharded_so_is_a_clear_error():
    """A model mlx-lm cannot split the way asked (Llama has no pipeline): ModelLoadError saying why."""
    with pytest.raises(ModelLoadError, match="cannot be sharded by pipeline parallelism.*sharding='tensor'"):
        run_with_deadline(lambda: Runtime(model="synthetic:tiny-llama", ranks=2, sharding="pipeline",
                                          transport="stdio", supervision=Supervision(restart=False)), 120)


def test_nccl_shards_by_tensor_and_refuses_the_pipeline_with_why(tiny_model):
    """MLX's NCCL backend has no send/recv, which mlx-lm's pipeline uses: over NCCL "auto" is tensor
    parallel and "pipeline" fails naming the reason; other backends keep their choice."""
    assert plan_sharding(tiny_model, "auto", 2, "nccl") == "tensor"
    assert plan_sharding(tiny_model, "pipeline", 2, "ring") == "pipeline"
    with pytest.raises(GroupError, match="pipeline parallelism over NCCL.*send/recv.*sharding='tensor'"):
        plan_sharding(tiny_model, "pipeline", 2, "nccl")


def test_options_sharded_load_cannot_honour_are_a_clear_error(tiny_model):
    """A template override (or an adapter, or a draft) is not applied by sharded_load: the group
    refuses it at load, naming the option, rather than serving without it."""
    template = "{% for m in messages %}{{ m.content }}{% endfor %}"
    with pytest.raises(ModelLoadError, match="chat_template: not supported for a worker group"):
        run_with_deadline(lambda: Runtime(model=ModelSpec(tiny_model, chat_template=template), ranks=2,
                                          transport="stdio", supervision=Supervision(restart=False)), 120)


def test_the_plan_gives_each_rank_what_mlx_launch_would(monkeypatch):
    """Ring: MLX_RANK and one MLX_HOSTFILE of ip:port lists; nccl: rank 0's address, a port, a GPU each,
    and this process's NCCL_* settings."""
    ring = Group(ranks=2, backend="ring", port=40100).plan()
    assert isinstance(ring, GroupPlan)
    launches = ring.launch()
    assert [(x.rank, x.host, x.env["MLX_RANK"]) for x in launches] == [(0, None, "0"), (1, None, "1")]
    assert {x.files["MLX_HOSTFILE"] for x in launches} == {'[["127.0.0.1:40100"], ["127.0.0.1:40101"]]'}
    nccl = GroupPlan(size=2, backend="nccl", sharding="auto", hosts=[HostEntry(**LOCAL)] * 2, envs={},
                     port=40200, python="python")
    monkeypatch.setenv("NCCL_NVLS_ENABLE", "0")  # a host's NCCL setting reaches every rank, here or not
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    envs = [x.env for x in nccl.launch()]
    assert [e["CUDA_VISIBLE_DEVICES"] for e in envs] == ["0", "1"]
    assert [e["NCCL_NVLS_ENABLE"] for e in envs] == ["0", "0"]
    coordinator = {(e["NCCL_HOST_IP"], e["NCCL_PORT"], e["MLX_WORLD_SIZE"]) for e in envs}
    assert coordinator == {("127.0.0.1", "40200", "2")}
    remote = GroupPlan(size=2, backend="ring", sharding="auto",
                       hosts=[HostEntry(**LOCAL), HostEntry(ssh="mac2", ips=["10.0.0.2"])], envs={},
                       port=None, python="/opt/py/bin/python")
    assert remote.argv("mac2", ["unused"])[-2:] == ["mac2", "/opt/py/bin/python -m mlxrt.worker"]


def test_cli_flags_make_the_group():
    """mlxrt's --ranks, --backend, --hosts and --pipeline give the runtime that Group; none, no group."""
    from mlxrt.cli import _group, build_parser

    argv = ["serve", "-m", "x", "--ranks", "2", "--backend", "ring", "--hosts", "h.json", "--pipeline"]
    assert _group(build_parser().parse_args(argv)) == Group(ranks=2, backend="ring", hosts="h.json",
                                                            sharding="pipeline")
    assert _group(build_parser().parse_args(["serve", "-m", "x"])) is None


def test_a_jaccl_host_file_is_checked_as_mlx_launch_checks_it(tmp_path, monkeypatch):
    """jaccl needs an RDMA device to every other host (jaccl-ring: to its neighbours), null to itself."""
    monkeypatch.setattr(platform, "system", lambda: "Darwin")
    four = [{"ssh": "127.0.0.1" if i == 0 else f"mac{i}", "ips": [f"10.0.0.{i + 1}"],
             "rdma": [f"rdma_en{j}" if (j - i) % 4 in (1, 3) else None for j in range(4)]} for i in range(4)]
    plan = Group(hosts=_host_file(tmp_path, four), backend="jaccl-ring").plan()
    assert plan is not None
    launches = plan.launch()
    assert [x.host for x in launches] == [None, "mac1", "mac2", "mac3"]
    assert {(x.env["MLX_JACCL_COORDINATOR"].split(":")[0], x.env["MLX_JACCL_RING"]) for x in launches} == {
        ("10.0.0.1", "1")}
    assert json.loads(launches[2].files["MLX_IBV_DEVICES"])[0] == [None, "rdma_en1", None, "rdma_en3"]
    with pytest.raises(ValueError, match="no RDMA device is listed from 127.0.0.1 to \\['mac2'\\]"):
        Group(hosts=_host_file(tmp_path, four), backend="jaccl").plan()
