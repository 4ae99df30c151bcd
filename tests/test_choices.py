"""n > 1: several choices for one prompt, decoded together from one prefill.

In the engine the request's first choice prefills the prompt; the others start from a copy of
its cache at the prompt's end (all but the last token) and each prefill one token. Greedy choices
are the n=1 reply; seeded ones are each deterministic (choice 0 is what n=1 gives with that seed).
"""

from __future__ import annotations

import asyncio

import httpx
import pytest
from mlxrt import Runtime
from mlxrt.ipc.protocol import ChatMessage, EngineOptions, Generate, SamplingParams
from mlxrt.synthetic.build import ensure_model
from mlxrt.worker.engine import Engine

PROMPT = "The tide came in over the rocks and the gulls rose"
SYSTEM = [ChatMessage("system", "You are a careful assistant who answers briefly."),
          ChatMessage("user", "Tell me about tides.")]


class Recorder:
    """Per request and choice: ids, text, finish reason, cached tokens; and the request-level events."""

    def __init__(self) -> None:
        self.ids: dict[tuple[int, int], list[int]] = {}
        self.reason: dict[tuple[int, int], str] = {}
        self.cached: dict[tuple[int, int], int] = {}
        self.starts: list[int] = []
        self.finals: list[int] = []
        self.failures: dict[int, list[BaseException]] = {}
        self.after_end: list = []

    def started(self, req_id: int) -> None:
        self.starts.append(req_id)

    def token(self, req_id, token, text, reasoning="", calls=None, *, logprob=None, index=0) -> None:
        if req_id in self.finals or req_id in self.failures:
            self.after_end.append((req_id, index, token))
        self.ids.setdefault((req_id, index), []).append(token)

    def done(self, req_id, stats, text, reasoning="", calls=None, *, index=0, final=True) -> None:
        if req_id in self.finals or req_id in self.failures:
            self.after_end.append((req_id, index, "done"))
        self.reason[(req_id, index)] = stats.finish_reason
        self.cached[(req_id, index)] = stats.cached_tokens
        if final:
            self.finals.append(req_id)

    def failed(self, req_id, exc) -> None:
        self.failures.setdefault(req_id, []).append(exc)


def run(engine: Engine, reqs: list[Generate], *, cancel_after: int | None = None) -> Recorder:
    rec = Recorder()
    for r in reqs:
        engine.submit(r, rec)
    steps = 0
    while engine.busy:
        if cancel_after is not None and steps == cancel_after:
            for r in reqs:
                engine.cancel(r.id)
        engine.step()
        steps += 1
    return rec


def gen(i: int, n: int = 1, prompt: str = PROMPT, **params) -> Generate:
    return Generate(id=i, prompt=prompt, params=SamplingParams(n=n, **{"max_tokens": 10, "ignore_eos": True,
                                                                       **params}))


@pytest.fixture(scope="module")
def engine(tiny_model):
    """No prefix cache: what the choices share comes from the fork, not from a cached entry."""
    return Engine(tiny_model, options=EngineOptions(decode_concurrency=8, prompt_cache_bytes=0))


def prefilled(engine: Engine) -> int:
    """Prompt tokens prefilled so far: by the engine's prefill scheduler, and by the batch (mlx-lm's
    counter)."""
    return engine.prefill_tokens + engine._batch._counters.prompt_tokens


def test_greedy_choices_are_the_single_reply_from_one_prefill(engine):
    """n=3 greedy: three choices, each the n=1 reply; the prompt is prefilled once (the others prefill
    its last token only, from the first's cache), and one final done ends the request."""
    length = len(engine.prompt_ids(gen(1)))
    before = prefilled(engine)
    one = run(engine, [gen(1, n=1), gen(3, n=1), gen(4, n=1)])  # three requests: three prefills
    separate = prefilled(engine) - before
    before = prefilled(engine)
    rec = run(engine, [gen(2, n=3)])
    assert [rec.ids[(2, i)] for i in range(3)] == [one.ids[(1, 0)]] * 3
    # mlx-lm counts prompt chunks; a sequence's last prompt token is its first decode step's input.
    assert separate == 3 * (length - 1) and prefilled(engine) - before == length - 1
    assert [rec.cached[(2, i)] for i in range(3)] == [0, length - 1, length - 1]
    assert rec.starts == [2] and rec.finals == [2] and not rec.after_end


def test_seeded_choices_are_each_deterministic(engine):
    """Seeded, each choice has its own stream of draws: choice 0 is the n=1 reply with that seed, the
    choices differ, and the same request gives the same choices alone or beside others."""
    params = dict(temperature=1.0, seed=42)
    single = run(engine, [gen(1, **params)]).ids[(1, 0)]
    alone = run(engine, [gen(2, n=3, **params)])
    choices = [alone.ids[(2, i)] for i in range(3)]
    assert choices[0] == single
    assert len({tuple(c) for c in choices}) == 3
    others = [gen(10 + i, prompt=f"Something else {i}", temperature=0.7, seed=i) for i in range(3)]
    mixed = run(engine, [others[0], gen(3, n=3, **params), *others[1:]])
    assert [mixed.ids[(3, i)] for i in range(3)] == choices


def test_more_choices_than_the_batch_holds(tiny_model):
    """n above decode_concurrency: the choices queue for room and every one ends."""
    small = Engine(tiny_model, options=EngineOptions(decode_concurrency=2))
    rec = run(small, [gen(1, n=5, max_tokens=6)])
    assert sorted(i for _, i in rec.reason) == [0, 1, 2, 3, 4]
    assert all(len(rec.ids[(1, i)]) == 6 for i in range(5)) and rec.finals == [1]


def test_a_fork_left_alone_starts_from_its_fork_not_the_fast_path(tiny_model):
    """With room for one sequence, choice 0 ends before its fork is admitted: the fork runs alone
    but still starts from the fork's cache (no prefill of the prompt again, no fast path)."""
    one = Engine(tiny_model, options=EngineOptions(decode_concurrency=1, prompt_cache_bytes=0))
    length = len(one.prompt_ids(gen(1)))
    before, solo = prefilled(one), one.solo_requests
    rec = run(one, [gen(1, n=2, max_tokens=4)])
    assert rec.ids[(1, 0)] == rec.ids[(1, 1)] and rec.cached[(1, 1)] == length - 1
    assert prefilled(one) - before == length - 1 and one.solo_requests == solo


@pytest.mark.parametrize("preset", ["tiny-qwen3.5", "tiny-gemma3"])
def test_fork_from_caches_that_cannot_be_trimmed(preset):
    """Recurrent (ArraysCache) and sliding-window (RotatingKVCache) models, a chat with a system
    prompt: the choices fork from the prompt-end checkpoint and are the n=1 reply."""
    engine = Engine(str(ensure_model(preset)))
    chat = Generate(id=1, messages=SYSTEM, params=SamplingParams(max_tokens=8, ignore_eos=True))
    one = run(engine, [chat]).ids[(1, 0)]
    engine.prefix_cache.clear()
    many = Generate(id=2, messages=SYSTEM, params=SamplingParams(max_tokens=8, ignore_eos=True, n=3))
    rec = run(engine, [many])
    assert [rec.ids[(2, i)] for i in range(3)] == [one] * 3


def test_cancel_ends_every_choice(engine):
    """A cancel ends all the choices (cancelled), the last done final, nothing after it."""
    rec = run(engine, [gen(1, n=3, max_tokens=200)], cancel_after=4)
    assert {rec.reason[(1, i)] for i in range(3)} == {"cancelled"}
    assert rec.finals == [1] and not rec.after_end


def test_a_failed_step_fails_the_request_once(engine, monkeypatch):
    """A batch step that fails: the request with n choices gets one failed and nothing after, and
    the engine serves the next request."""
    real = engine._batch.next
    calls = [0]

    def failing():
        calls[0] += 1
        if calls[0] == 3:
            raise RuntimeError("boom")
        return real()

    monkeypatch.setattr(engine._batch, "next", failing)
    rec = run(engine, [gen(1, n=3, max_tokens=50)])
    assert len(rec.failures[1]) == 1 and not rec.after_end and rec.finals == []
    monkeypatch.undo()
    again = run(engine, [gen(2, n=2)])
    assert again.finals == [2]


def test_choices_with_logprobs(engine):
    """Each choice carries its own log-probabilities."""
    rec = Recorder()
    got: dict = {}
    rec.token = lambda req_id, token, text, reasoning="", calls=None, *, logprob=None, index=0: \
        got.setdefault(index, []).append((token, logprob.id))
    engine.submit(gen(1, n=2, temperature=1.0, seed=5, logprobs=1), rec)
    while engine.busy:
        engine.step()
    assert set(got) == {0, 1} and all(t == lp for c in got.values() for t, lp in c)


# ---- over HTTP, and the Python API -------------------------------------------------------------


CHAT = [{"role": "user", "content": "Tell me about the tide"}]


def test_openai_chat_n_streamed_and_not(oai):
    """chat n=3 at temperature 0: three choices (index 0..2) equal to the n=1 reply, usage counting
    all of them; streamed, chunks carry their choice's index and each choice ends with its own
    finish chunk."""
    kw = dict(model="tiny", messages=CHAT, max_tokens=8, temperature=0)
    one = oai.chat.completions.create(**kw).choices[0].message.content
    r = oai.chat.completions.create(**kw, n=3)
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert [c.message.content for c in r.choices] == [one] * 3
    assert r.usage.completion_tokens == 3 * oai.chat.completions.create(**kw).usage.completion_tokens
    chunks = list(oai.chat.completions.create(**kw, n=3, stream=True))
    texts = {i: "".join(c.choices[0].delta.content or "" for c in chunks if c.choices[0].index == i)
             for i in range(3)}
    assert texts == {0: one, 1: one, 2: one}
    ends = [(c.choices[0].index, c.choices[0].finish_reason) for c in chunks if c.choices[0].finish_reason]
    assert sorted(ends) == [(i, r.choices[i].finish_reason) for i in range(3)]
    assert [c.choices[0].delta.role for c in chunks[:3]] == ["assistant"] * 3


def test_openai_completions_n_seeded(oai):
    """/v1/completions n=3 with a seed: three different choices, the same again with the same seed,
    choice 0 the n=1 reply; streamed the same."""
    kw = dict(model="tiny", prompt="The tide", max_tokens=8, temperature=1.0, seed=9)
    r = oai.completions.create(**kw, n=3)
    texts = [c.text for c in r.choices]
    assert len(set(texts)) == 3 and texts == [c.text for c in oai.completions.create(**kw, n=3).choices]
    assert texts[0] == oai.completions.create(**kw).choices[0].text
    chunks = list(oai.completions.create(**kw, n=3, stream=True))
    assert ["".join(c.choices[0].text for c in chunks if c.choices and c.choices[0].index == i)
            for i in range(3)] == texts


def test_n_above_the_limit_is_a_400_and_reaches_no_worker(srv):
    """n above 16 (or below 1) is a 400 naming n, before any worker sees it."""
    sent = sum(w.requests for w in srv.rt.workers)
    for n in (17, 0):
        body = {"model": "tiny", "prompt": "Hi", "n": n}
        r = httpx.post(srv.url + "/v1/completions", json=body, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == "n", r.text
    assert sum(w.requests for w in srv.rt.workers) == sent


def test_python_api_n(tiny_model):
    """`rt.generate(..., n=3)`: one Completion (choice 0) with all three in `choices`, each with its
    index and stats; `rt.stream` chunks say their choice."""
    with Runtime(model=tiny_model, transport="stdio") as rt:
        c = rt.generate(PROMPT, n=3, max_tokens=6, ignore_eos=True, temperature=1.0, seed=1)
        assert [x.index for x in c.choices] == [0, 1, 2] and c.choices[0] is c
        assert all(len(x.tokens) == 6 == x.stats.generation_tokens for x in c.choices)
        assert c.tokens == rt.generate(PROMPT, max_tokens=6, ignore_eos=True, temperature=1.0, seed=1).tokens
        chunks = list(rt.stream(PROMPT, n=3, max_tokens=6, ignore_eos=True, temperature=1.0, seed=1))
        assert [[t for ch in chunks if ch.index == i for t in ch.tokens] for i in range(3)] == \
            [x.tokens for x in c.choices]
        with pytest.raises(ValueError, match="invalid n=17"):
            rt.generate(PROMPT, n=17)


def test_async_runtime_n(srv):
    """The async runtime collects n choices the same way."""
    async def go():
        return await srv.rt.generate(PROMPT, n=2, max_tokens=4, ignore_eos=True)

    c = asyncio.run_coroutine_threadsafe(go(), srv._loop).result(60)
    assert len(c.choices) == 2 and c.choices[1].tokens == c.tokens
