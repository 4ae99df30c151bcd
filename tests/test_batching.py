"""Batching and prefix reuse through real worker processes, over each transport."""

from __future__ import annotations

import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from mlxrt import RequestError, Runtime, WorkerDied
from mlxrt.ipc.protocol import EngineOptions
from mlxrt.worker.limits import auto_prompt_cache_bytes
from support import TRANSPORTS, assert_stopped

SYSTEM = "You are a patient assistant who explains the tides, the wind and the stars. " * 5
REQUESTS = [
    ("Once upon a time", {"max_tokens": 20}),
    ("The harbour was quiet that night and the boats " * 6, {"max_tokens": 12}),
    ([5, 17, 42, 99, 3, 250], {"max_tokens": 16}),
    ([{"role": "user", "content": "Tell me about the weather."}], {"max_tokens": 18}),
    ("A seeded one", {"max_tokens": 16, "temperature": 0.9, "seed": 5}),
    ("With a penalty",
     {"max_tokens": 16, "repetition_penalty": 1.3, "top_k": 8, "temperature": 0.7, "seed": 1}),
]


@pytest.fixture(scope="module", params=TRANSPORTS)
def rt(request, tiny_model):
    runtime = Runtime(model=tiny_model, transport=request.param, engine=EngineOptions(decode_concurrency=8))
    pids = [w.pid for w in runtime.workers]
    yield runtime
    runtime.close()
    assert_stopped(pids)


def concurrently(fn, items):
    with ThreadPoolExecutor(len(items)) as pool:
        return list(pool.map(fn, items))


def test_concurrent_requests_get_their_sequential_ids(rt):
    """N requests at once (lengths and sampling differ) get the ids each gets alone."""
    alone = [rt.generate(p, ignore_eos=True, **kw).tokens for p, kw in REQUESTS]
    together = concurrently(lambda r: rt.generate(r[0], ignore_eos=True, **r[1]), REQUESTS)
    assert [c.tokens for c in together] == alone
    assert max(c.stats.mean_batch_size for c in together) > 1


def test_chat_turns_reuse_the_prefix_with_unchanged_ids(rt, tiny_model):
    """Later turns of a chat report cached tokens; their ids equal a worker's with the cache off."""
    with Runtime(model=tiny_model, transport="stdio", engine=EngineOptions(prompt_cache_bytes=0)) as cold:
        msgs = [{"role": "system", "content": SYSTEM}]
        for k in range(3):
            msgs.append({"role": "user", "content": f"Turn {k}: what next?"})
            warm_c = rt.generate(msgs, max_tokens=12, ignore_eos=True)
            cold_c = cold.generate(msgs, max_tokens=12, ignore_eos=True)
            assert warm_c.tokens == cold_c.tokens
            assert cold_c.stats.cached_tokens == 0
            if k:
                assert warm_c.stats.cached_tokens > len(SYSTEM) // 8
            msgs.append({"role": "assistant", "content": warm_c.text})
    (m,) = rt.memory()
    assert m.prompt_cache_bytes > 0 and m.prompt_cache_hits >= 2
    cap = rt.model_options().prompt_cache_bytes  # None: auto, this lone worker's whole share
    assert m.prompt_cache_cap_bytes == (auto_prompt_cache_bytes() if cap is None else cap)


def test_cancel_one_stream_inside_a_batch(rt):
    """Breaking out of one stream cancels it alone; a request beside it keeps its ids."""
    want = rt.generate("Beside the cancelled one", max_tokens=30, ignore_eos=True).tokens
    stream = rt.stream("This one will be cancelled", max_tokens=400, ignore_eos=True)
    chunks = iter(stream)
    next(chunks)
    other = ThreadPoolExecutor(1).submit(
        rt.generate, "Beside the cancelled one", max_tokens=30, ignore_eos=True
    )
    next(chunks)
    stream.close()
    assert other.result(timeout=60).tokens == want
    assert rt.generate("after", max_tokens=3).tokens


def test_bad_ids_fail_alone_in_a_batch(rt):
    """Prompt ids out of range for one request: a RequestError for it, results for the others."""
    vocab = 10**6

    def run(prompt):
        try:
            return rt.generate(prompt, max_tokens=10, ignore_eos=True)
        except RequestError as exc:
            return exc

    out = concurrently(run, ["Good one", [1, 2, vocab], "Another good one"])
    assert isinstance(out[1], RequestError) and "outside" in str(out[1])
    assert len(out[0].tokens) == 10 and len(out[2].tokens) == 10


def test_sigkill_with_a_full_batch_ends_every_caller(tiny_model):
    """A worker killed mid-batch: every caller's request goes on on the restarted worker and ends with all
    its tokens; none hangs."""
    with Runtime(model=tiny_model, transport="ring") as rt:
        pid = rt.workers[0].pid
        results: list[object] = []

        def run(i):
            try:
                return rt.generate(f"Request {i} runs long", max_tokens=300, ignore_eos=True)
            except WorkerDied as exc:
                return exc

        with ThreadPoolExecutor(8) as pool:
            futures = [pool.submit(run, i) for i in range(8)]
            deadline = time.monotonic() + 60
            while rt.workers[0].batch_size < 4 and time.monotonic() < deadline:
                time.sleep(0.01)
            os.kill(pid, signal.SIGKILL)
            results = [f.result(timeout=60) for f in futures]
        assert [len(r.tokens) for r in results] == [300] * 8
        assert sum(r.stats.resumes for r in results) >= 4  # those in the batch at the kill, at least
        assert rt.generate("after the crash", max_tokens=3).tokens


def test_routing_keeps_a_conversation_on_its_worker(tiny_model):
    """Two workers: a conversation's later turns go to the worker that served its first."""
    with Runtime(model=tiny_model, workers=2, transport="stdio") as rt:
        convs = [[{"role": "system", "content": SYSTEM + f" Conversation {i}."}] for i in range(4)]
        homes: dict[int, set[str]] = {i: set() for i in range(4)}
        lock = threading.Lock()

        def turn(i):
            convs[i].append({"role": "user", "content": f"Question from {i}"})
            s = rt.stream(convs[i], max_tokens=6, ignore_eos=True)
            text = "".join(c.text for c in s)
            with lock:
                homes[i].add(s.worker.name)
            convs[i].append({"role": "assistant", "content": text})

        for _ in range(3):
            concurrently(turn, list(range(4)))
        assert all(len(h) == 1 for h in homes.values()), homes
        assert rt._pool.router.affinity_hits >= 8
