"""Bad input and faults: each ends in a clear error, never a hang, never an orphan process."""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
from pathlib import Path

import pytest
from mlxrt import (
    ChannelError,
    MlxrtTimeout,
    ModelFailedError,
    ModelLoadError,
    ModelNotFoundError,
    Runtime,
    Supervision,
    Timeouts,
    WorkerDied,
)
from support import TRANSPORTS, created_here, run_with_deadline

FAKE = [sys.executable, str(Path(__file__).with_name("fake_worker.py"))]


def test_unknown_model_path_is_a_clear_error():
    """A model directory that does not exist fails in Runtime() with the path in the message."""
    with pytest.raises(ModelNotFoundError, match="/no/such/model"):
        Runtime(model="/no/such/model")


def test_directory_without_config_is_a_clear_error(tmp_path):
    """A directory that is not a model directory is refused before any worker starts."""
    with pytest.raises(ModelLoadError, match="config.json"):
        Runtime(model=str(tmp_path))


@pytest.mark.parametrize("breakage", ["bad_json", "no_weights", "bad_weights"])
def test_corrupt_model_directory_is_a_clear_error(tmp_path, tiny_model, breakage):
    """A corrupt model directory: ModelLoadError naming the model; the worker does not linger."""
    bad = tmp_path / "model"
    bad.mkdir()
    for f in Path(tiny_model).iterdir():
        if f.is_file():
            (bad / f.name).write_bytes(f.read_bytes())
    if breakage == "bad_json":
        (bad / "config.json").write_text("{not json")
    elif breakage == "no_weights":
        for f in bad.glob("*.safetensors"):
            f.unlink()
    else:
        for f in bad.glob("*.safetensors"):
            f.write_bytes(b"\0" * 64)
    with pytest.raises(ModelLoadError, match="failed to start|exited before"):
        Runtime(model=str(bad), transport="stdio")


@pytest.mark.parametrize("change, message", [
    ({"model_type": "no_such_arch"}, "Model type no_such_arch not supported"),
    ({"num_hidden_layers": 3}, "Missing 11 parameters"),
    ({"hidden_size": 128}, r"Expected shape \(2048, 128\) but received shape \(2048, 64\)"),
], ids=["unknown-architecture", "more-layers-than-weights", "wider-than-weights"])
def test_config_that_does_not_match_the_model_is_a_clear_error(tmp_path, change, message):
    """A config.json for an architecture mlx-lm does not know, or whose shapes the weights do not
    match: the worker's Fatal reaches the caller as ModelLoadError with mlx-lm's reason, at once."""
    from mlxrt.synthetic.build import ensure_model

    bad = tmp_path / "model"
    bad.mkdir()
    for f in ensure_model("tiny-qwen3").iterdir():
        if f.is_file():
            (bad / f.name).write_bytes(f.read_bytes())
    config = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**config, **change}))
    with pytest.raises(ModelLoadError, match=f"failed to start: ValueError: {message}"):
        run_with_deadline(lambda: Runtime(model=str(bad), transport="stdio"), 120)


def test_unknown_synthetic_preset_is_a_clear_error():
    """An unknown synthetic preset name fails in Runtime() and says so."""
    with pytest.raises(ModelLoadError, match="no-such-preset"):
        Runtime(model="synthetic:no-such-preset", transport="stdio")


@pytest.mark.parametrize("mode", ["garbage", "wrong_type", "truncated", "huge_length"])
def test_malformed_frame_closes_the_channel_with_a_clear_error(tiny_model, mode, monkeypatch):
    """A malformed or truncated frame: the request fails with ChannelError; the orchestrator survives."""
    monkeypatch.setenv("FAKE_MODE", mode)
    with Runtime(model=tiny_model, transport="stdio", _worker_argv=FAKE,
                 supervision=Supervision(restart=False)) as rt:
        with pytest.raises(ChannelError, match="bad frame|malformed|mid-frame|exceeds"):
            run_with_deadline(lambda: rt.generate("hi", max_tokens=4), 10)
        assert rt.workers[0].state == "failed"
        with pytest.raises(ModelFailedError, match="restart is disabled"):
            rt.generate("hi", max_tokens=4)


def test_worker_that_never_becomes_ready_times_out_naming_the_setting():
    """A worker that never answers the handshake: MlxrtTimeout naming MLXRT_READY_TIMEOUT_S."""
    sleeper = [sys.executable, "-c", "import time; time.sleep(60)"]
    with pytest.raises(MlxrtTimeout, match="MLXRT_READY_TIMEOUT_S"):
        run_with_deadline(
            lambda: Runtime(model="synthetic:tiny", transport="stdio",
                            timeouts=Timeouts(ready_s=1.0), _worker_argv=sleeper),
            20,
        )


def test_worker_exiting_before_ready_reports_its_exit_code():
    """A worker that exits during start-up: ModelLoadError with its exit code and output."""
    dies = [sys.executable, "-c", "import sys; print('boom', file=sys.stderr); sys.exit(3)"]
    with pytest.raises(ModelLoadError, match=r"exit code 3.*boom"):
        Runtime(model="synthetic:tiny", transport="stdio", _worker_argv=dies)


def test_silent_worker_times_out_naming_the_setting(tiny_model, monkeypatch):
    """A worker that stops answering a request: MlxrtTimeout naming MLXRT_TOKEN_TIMEOUT_S."""
    monkeypatch.setenv("FAKE_MODE", "silent")
    with Runtime(model=tiny_model, transport="stdio", timeouts=Timeouts(token_s=0.5),
                 _worker_argv=FAKE) as rt:
        with pytest.raises(MlxrtTimeout, match="MLXRT_TOKEN_TIMEOUT_S"):
            run_with_deadline(lambda: rt.generate("hi", max_tokens=4), 10)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_sigkill_mid_stream_raises_worker_died_promptly(tiny_model, transport):
    """SIGKILL of the worker mid-stream with resumes off: the caller gets WorkerDied, not a hang."""
    with Runtime(model=tiny_model, transport=transport, supervision=Supervision(max_resumes=0)) as rt:
        stream = rt.stream("The quick brown fox", max_tokens=400, ignore_eos=True)
        next(stream)
        os.kill(rt.workers[0].pid, signal.SIGKILL)
        with pytest.raises(WorkerDied, match="died"):
            run_with_deadline(lambda: list(stream), 5)


def test_closing_the_runtime_stops_its_workers(tiny_model):
    """close() stops every worker process; a request in flight ends as cancelled, not hung."""
    rt = Runtime(model=tiny_model, workers=2, transport="stdio")
    stream = rt.stream("hello", max_tokens=400, ignore_eos=True)
    next(stream)
    pids = [w.pid for w in rt.workers]
    rt.close()
    rt.close()  # idempotent
    run_with_deadline(lambda: list(stream), 5)
    assert stream.finish_reason == "cancelled"
    with pytest.raises(WorkerDied, match="closing"):
        rt.generate("hi", max_tokens=2)
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


ORCHESTRATOR = """
import sys, time
from mlxrt import Runtime
rt = Runtime(model=sys.argv[1], workers=2, transport=sys.argv[2])
stream = rt.stream("hello", max_tokens=400, ignore_eos=True)
next(stream)
print(" ".join(str(w.pid) for w in rt.workers), flush=True)
time.sleep(600)
"""


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_sigkill_of_the_orchestrator_stops_its_workers(tiny_model, transport):
    """SIGKILL of the orchestrator: its workers notice (stdin EOF), exit, and leave no shared memory."""
    import glob
    import subprocess

    import psutil

    before = set(glob.glob("/dev/shm/mlxrt-*"))
    proc = subprocess.Popen([sys.executable, "-c", ORCHESTRATOR, tiny_model, transport],
                            stdout=subprocess.PIPE, text=True)
    try:
        pids = [int(p) for p in run_with_deadline(proc.stdout.readline, 60).split()]
        workers = [psutil.Process(p) for p in pids]
        proc.kill()
        proc.wait()
        _, alive = psutil.wait_procs(workers, timeout=10)
        for p in alive:
            p.kill()
        assert not alive, "workers outlived their orchestrator"
    finally:
        proc.kill()
        proc.wait()
        proc.stdout.close()
    new = set(glob.glob("/dev/shm/mlxrt-*")) - before
    assert {p for p in new if created_here(p, proc.pid)} == set()  # other programs' rings are theirs


def test_silent_worker_times_out_in_asyncio_too(tiny_model, monkeypatch):
    """AsyncRuntime: a worker that goes quiet raises MlxrtTimeout naming MLXRT_TOKEN_TIMEOUT_S."""
    import asyncio

    from mlxrt import AsyncRuntime

    monkeypatch.setenv("FAKE_MODE", "silent")

    async def main() -> None:
        async with AsyncRuntime(model=tiny_model, transport="stdio", timeouts=Timeouts(token_s=0.5),
                                _worker_argv=FAKE) as rt:
            with pytest.raises(MlxrtTimeout, match="MLXRT_TOKEN_TIMEOUT_S"):
                await asyncio.wait_for(rt.generate("hi", max_tokens=4), 10)

    asyncio.run(main())


def test_worker_that_stops_reading_is_killed_naming_the_setting(tiny_model, monkeypatch):
    """A worker that stops reading its input: the write gives up after MLXRT_SEND_TIMEOUT_S, the worker is
    killed and the request ends with an error naming the setting; the slot's lock stays free meanwhile,
    so no other request or supervision step waits behind the stuck write."""
    import time

    from mlxrt import MlxrtError

    monkeypatch.setenv("FAKE_MODE", "deaf")
    with Runtime(model=tiny_model, transport="stdio", timeouts=Timeouts(send_s=3.0), _worker_argv=FAKE,
                 supervision=Supervision(restart=False)) as rt:
        (slot,) = rt._pool.all()
        pid = slot.handle.pid
        big = "x" * (1 << 20)  # more than a pipe holds: the write waits for a reader that never reads
        box: dict = {}

        def ask() -> None:
            try:
                rt.generate(big, max_tokens=2)
            except MlxrtError as exc:
                box["error"] = exc

        asker = threading.Thread(target=ask, daemon=True)
        asker.start()
        deadline = time.monotonic() + 10
        while slot.handle.in_flight == 0 and time.monotonic() < deadline:  # the frame is on its way
            time.sleep(0.01)
        assert slot.handle.in_flight == 1
        assert slot._lock.acquire(timeout=1.0), "the slot's lock is held during the write"
        slot._lock.release()
        asker.join(30)
        assert not asker.is_alive(), "the request hung"
        assert "MLXRT_SEND_TIMEOUT_S" in str(box["error"])
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_worker_that_stops_reading_never_blocks_an_event_loop(tiny_model, monkeypatch):
    """AsyncRuntime: a request to a worker that stops reading returns to the loop at once (the frame
    waits in the handle's writer thread); the loop keeps ticking until the write gives up, the worker
    is killed and the request ends naming MLXRT_SEND_TIMEOUT_S."""
    import asyncio
    import time

    from mlxrt import AsyncRuntime, MlxrtError

    monkeypatch.setenv("FAKE_MODE", "deaf")

    async def main() -> float:
        async with AsyncRuntime(model=tiny_model, transport="stdio", timeouts=Timeouts(send_s=2.0),
                                _worker_argv=FAKE, supervision=Supervision(restart=False)) as rt:
            gaps: list[float] = []

            async def tick() -> None:
                last = time.monotonic()
                while True:
                    await asyncio.sleep(0.01)
                    now = time.monotonic()
                    gaps.append(now - last)
                    last = now

            ticker = asyncio.create_task(tick())
            await asyncio.sleep(0.1)
            big = "x" * (1 << 20)  # more than a pipe holds
            with pytest.raises(MlxrtError, match="MLXRT_SEND_TIMEOUT_S"):
                await asyncio.wait_for(rt.generate(big, max_tokens=2), 20)
            ticker.cancel()
            return max(gaps)

    worst = asyncio.run(main())
    assert worst < 1.0, f"the event loop was blocked for {worst:.2f} s"


def _fake_torch(root: Path, mark: Path) -> None:
    """An installed-looking `torch` (version 2.9.0) whose import leaves `mark` and fails."""
    pkg = root / "torch"
    pkg.mkdir()
    body = f"open({str(mark)!r}, 'a').write('imported')\nraise ImportError('fake torch')\n"
    (pkg / "__init__.py").write_text(body)
    meta = root / "torch-2.9.0.dist-info"
    meta.mkdir()
    (meta / "METADATA").write_text("Metadata-Version: 2.1\nName: torch\nVersion: 2.9.0\n")


def test_worker_never_imports_pytorch(tiny_model, tmp_path, monkeypatch):
    """transformers imports PyTorch when installed (10 s a worker start on a GPU host); the worker hides it.

    MLXRT_WORKER_TORCH=1 lets it through: the fake torch is imported and the load fails, which shows
    the fake is one transformers would import.
    """
    mark = tmp_path / "imported"
    _fake_torch(tmp_path, mark)
    path = filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")])
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(path))
    with Runtime(model=tiny_model, workers=1, warmup_tokens=0) as rt:
        assert len(rt.generate("Hello", max_tokens=2, temperature=0.0).tokens) == 2
    assert not mark.exists()
    monkeypatch.setenv("MLXRT_WORKER_TORCH", "1")
    with pytest.raises(ModelLoadError, match="fake torch"):
        Runtime(model=tiny_model, workers=1, warmup_tokens=0)
    assert mark.exists()
