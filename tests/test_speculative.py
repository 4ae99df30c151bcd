"""Speculative decoding on the fast path: greedy ids unchanged, alone and handed over to the batch."""

from __future__ import annotations

import dataclasses
import time

import httpx
import pytest
from mlxrt import ModelSpec, Runtime
from mlxrt.ipc.protocol import EngineOptions
from mlxrt.worker.draft_policy import WINDOW_TOKENS, DraftPolicy
from mlxrt.worker.engine import Engine
from test_engine import chat, gen, run_alone, run_batch, run_handed_over

#: Drafts of the tiny model: itself (every token accepted), a perturbed copy, a one-layer cut.
DRAFTS = {"self": "synthetic:tiny", "noisy": "synthetic:tiny?noise=0.05", "cut": "synthetic:tiny?layers=1"}


def requests() -> list:
    """Greedy requests of every kind the fast path serves, some ending early."""
    return [
        gen(1, "Once upon a time, in a small village by the sea,", max_tokens=40),
        gen(2, ids=[5, 17, 42, 99, 3, 250], max_tokens=33),
        gen(3, messages=chat("What is the weather like?"), max_tokens=30),
        gen(4, "The quick brown fox", max_tokens=30, repetition_penalty=1.3, repetition_context_size=16),
        gen(5, "Hello", max_tokens=1),
        gen(6, "Hello there", max_tokens=2),
        gen(7, "A story", max_tokens=30, ignore_eos=False),
    ]


@pytest.fixture(scope="module")
def plain(tiny_model) -> Engine:
    return Engine(tiny_model, options=EngineOptions(prompt_cache_bytes=0))


@pytest.fixture(scope="module")
def reference(plain) -> dict[int, list[int]]:
    """Each request's ids without a draft."""
    return {r.id: run_alone(plain, r)[0] for r in requests()}


@pytest.fixture(scope="module", params=sorted(DRAFTS))
def drafted(request, tiny_model) -> tuple[str, Engine]:
    """An engine drafting with each draft (prefix cache on: the draft must prefill what it skips)."""
    return request.param, Engine(tiny_model, options=EngineOptions(draft_model=DRAFTS[request.param],
                                                                   draft_policy="always"))


def test_greedy_ids_are_unchanged_by_a_draft(drafted, reference):
    """Alone, a request gets its own greedy ids with any draft; the draft's stats say how many it
    proposed and how many were taken: all of them for the target itself, some for the others."""
    name, engine = drafted
    drafted_total = accepted_total = 0
    for req in requests():
        engine.clear_cache()
        ids, st = run_alone(engine, req)
        assert ids == reference[req.id], (name, req.id)
        again, st2 = run_alone(engine, req)  # from the prefix cache: the draft prefills it all
        assert again == ids and st2.cached_tokens > 0, (name, req.id)
        drafted_total += st.draft_tokens
        accepted_total += st.draft_accepted
        assert st.draft_accepted <= st.draft_tokens
    assert drafted_total > 0
    rate = accepted_total / drafted_total
    assert rate == 1.0 if name == "self" else 0.0 < rate < 1.0, (name, rate)


@pytest.mark.parametrize("after", [1, 2, 3, 5, 9])
def test_greedy_ids_are_unchanged_when_a_second_request_arrives(drafted, reference, after):
    """A second request arrives `after` steps into a drafted one (prefill, between rounds, inside
    a round's accepted tokens): the first is handed over to the batch, both keep their ids."""
    name, engine = drafted
    first, second = requests()[0], requests()[2]
    engine.clear_cache()
    rec = run_handed_over(engine, first, second, after)
    assert not rec.errors
    assert rec.ids == {1: reference[1], 3: reference[3]}, (name, after)
    assert rec.stats[3].draft_tokens == 0  # it ran in the batch


def test_constrained_request_is_not_drafted(tiny_model, plain):
    """A request with a grammar decodes one token at a time (a rejected draft would move its
    matcher): no draft tokens, and the reply the engine gives without a draft."""
    from mlxrt.orchestrator.structured import json_schema_grammar

    engine = Engine(tiny_model, options=EngineOptions(draft_model=DRAFTS["self"], prompt_cache_bytes=0))
    req = gen(1, "A JSON object:", max_tokens=40, ignore_eos=False,
              grammar=json_schema_grammar({"type": "object", "properties": {"a": {"type": "integer"}}}))
    ids, st = run_alone(engine, req)
    assert st.draft_tokens == 0
    assert ids == run_alone(plain, req)[0]


def test_request_asking_for_logprobs_is_not_drafted(tiny_model, plain):
    """Log-probabilities come from the plain step's distribution: such a request is not drafted,
    and gets the ids the engine gives without a draft."""
    engine = Engine(tiny_model, options=EngineOptions(draft_model=DRAFTS["self"], prompt_cache_bytes=0))
    req = gen(1, "Once upon a time", max_tokens=12, logprobs=2)
    ids, st = run_alone(engine, req)
    assert st.draft_tokens == 0
    assert ids == run_alone(plain, req)[0]


@pytest.mark.parametrize("policy", ["always", "alternating"])
def test_seeded_sampled_request_is_the_same_with_or_without_a_draft(tiny_model, plain, policy):
    """Each sampled token of a seeded request draws with the key of its place in the reply, so a
    speculative round (several rows drawn in one call, the rejected ones taken back), a switch to
    plain decoding or a hand-over to the batch gives the tokens the request gets without a draft."""
    engine = Engine(tiny_model, options=EngineOptions(draft_model=DRAFTS["self"], prompt_cache_bytes=0,
                                                      draft_policy="always"))
    if policy == "alternating":
        engine.draft = dataclasses.replace(engine.draft, policy=Alternating(True))
    reqs = [gen(1, "Once upon a time", max_tokens=30, temperature=0.8, top_p=0.9, seed=11),
            gen(2, "The quick brown fox", max_tokens=30, temperature=1.2, seed=5, repetition_penalty=1.2)]
    for req in reqs:
        ids, st = run_alone(engine, req)
        assert ids == run_alone(plain, req)[0] and len(ids) == 30 and st.draft_tokens > 0, req.id
    rec = run_handed_over(engine, reqs[0], reqs[1], 7)
    assert rec.ids == run_batch(plain, reqs).ids


def test_sampled_requests_with_a_draft(tiny_model):
    """Sampled requests with a draft, seeded or not, alone or in a batch, end like any other."""
    engine = Engine(tiny_model, options=EngineOptions(draft_model=DRAFTS["noisy"], prompt_cache_bytes=0))
    req = gen(1, "Once upon a time", max_tokens=30, temperature=0.8, top_p=0.9, seed=11)
    first, st = run_alone(engine, req)
    assert run_alone(engine, req)[0] == first and len(first) == 30 and st.draft_tokens > 0
    rec = run_batch(engine, [gen(2, "Hi", max_tokens=30, temperature=0.8), gen(3, "Yo", max_tokens=5)])
    assert not rec.errors and len(rec.ids[2]) == 30


def test_worker_drafts_and_reports_acceptance(tiny_model, reference):
    """Through a worker: the draft changes no id, the stats carry its counts, and /metrics counts the
    drafted and accepted tokens per model."""
    from test_http import running

    with Runtime(model=ModelSpec(tiny_model, draft_model=DRAFTS["noisy"], draft_policy="always"),
                 transport="stdio") as rt:
        c = rt.generate("Once upon a time, in a small village by the sea,", max_tokens=40, ignore_eos=True)
        assert c.tokens == reference[1]
        assert 0 < c.stats.draft_accepted < c.stats.draft_tokens
        assert c.stats.acceptance_rate == c.stats.draft_accepted / c.stats.draft_tokens
    with running({"tiny": tiny_model}, engine=EngineOptions(draft_model=DRAFTS["self"])) as srv:
        body = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": 20, "temperature": 0,
                "ignore_eos": True}
        assert httpx.post(srv.url + "/v1/completions", json=body, timeout=60).status_code == 200
        metrics = httpx.get(srv.url + "/metrics").text
    drafted = _sample(metrics, 'mlxrt_draft_tokens_total{model="tiny"}')
    assert drafted > 0 and _sample(metrics, 'mlxrt_draft_accepted_tokens_total{model="tiny"}') == drafted


def _sample(metrics: str, name: str) -> float:
    return next(float(line.split()[-1]) for line in metrics.splitlines() if line.startswith(name))


# ---- when to draft: the adaptive policy ---------------------------------------------


def test_policy_keeps_the_faster_way_and_backs_off_retrying_the_slower():
    """Drafting measured slower: plain decoding from then on, drafting tried again after `retry`
    tokens, the interval doubling each time it loses; measured faster: drafting kept."""
    slow = DraftPolicy(retry=64)
    assert slow.first() is True  # not measured yet: draft, as asked
    assert slow.window(True, 0.8, 8) is False  # then try plain once
    assert slow.window(False, 0.08, 8) is False and slow.retry == 64  # plain won: kept
    ways = [slow.window(False, 0.08, 8) for _ in range(7)]  # 72 tokens in all: drafting is stale
    assert ways == [False] * 6 + [True]
    assert slow.window(True, 0.8, 8) is False and slow.retry == 128  # lost again: retried later
    ways = [slow.window(False, 0.08, 8) for _ in range(16)]
    assert ways == [False] * 15 + [True] and slow.first() is False
    fast = DraftPolicy(retry=64)
    assert fast.window(True, 0.1, 8) is False  # plain is tried once
    assert fast.window(False, 0.5, 8) is True and fast.retry == 128  # and loses
    assert [fast.window(True, 0.1, 8) for _ in range(3)] == [True] * 3 and fast.first() is True
    assert all(DraftPolicy(adaptive=False).window(True, 9.0, 1) for _ in range(5))


class Alternating(DraftPolicy):
    """Switches way at every window: the switches themselves under test."""

    def __init__(self, start: bool) -> None:
        super().__init__()
        self.start = start

    def first(self) -> bool:
        return self.start

    def window(self, drafting: bool, seconds: float, tokens: int) -> bool:
        self.windows[drafting] += 1
        return not drafting


@pytest.mark.parametrize("start", [True, False], ids=["drafting-first", "plain-first"])
@pytest.mark.parametrize("draft", ["self", "noisy"])
def test_switching_ways_between_windows_keeps_the_ids(tiny_model, reference, start, draft):
    """A sequence switching between drafting and plain decoding at every window (the draft catching
    up on what it did not see, the head going into the cache) gets its own greedy ids, alone and
    handed over to the batch; the target's own draft is still accepted every time (its cache kept
    in step)."""
    engine = Engine(tiny_model, options=EngineOptions(draft_model=DRAFTS[draft]))
    policy = Alternating(start)
    engine.draft = dataclasses.replace(engine.draft, policy=policy)
    proposed = accepted = 0
    for req in requests():
        engine.clear_cache()
        ids, st = run_alone(engine, req)
        assert ids == reference[req.id], (start, req.id)
        proposed, accepted = proposed + st.draft_tokens, accepted + st.draft_accepted
    assert policy.windows[True] >= 3 and policy.windows[False] >= 3
    assert proposed > 0 and (accepted == proposed if draft == "self" else 0 < accepted < proposed)
    for after in (4, 12, 20):
        engine.clear_cache()
        rec = run_handed_over(engine, requests()[0], requests()[2], after)
        assert rec.ids == {1: reference[1], 3: reference[3]}, (start, after)


class Slow:
    """A model whose every call takes `seconds` longer (the rest is the model's)."""

    def __init__(self, model, seconds: float) -> None:
        self._model, self._seconds = model, seconds

    def __call__(self, *args, **kwargs):
        time.sleep(self._seconds)
        return self._model(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._model, name)


def test_a_draft_that_does_not_pay_is_left(tiny_model, reference):
    """A draft made slow: after its first window and a plain one, the sequence decodes plainly (the
    draft retried once in a while), with its own ids."""
    engine = Engine(tiny_model, options=EngineOptions(draft_model=DRAFTS["self"], prompt_cache_bytes=0))
    engine.draft = dataclasses.replace(engine.draft, model=Slow(engine.draft.model, 0.02))
    req = requests()[0]
    ids, st = run_alone(engine, req)
    assert ids == reference[req.id]
    policy = engine.draft.policy
    assert policy.rates[True].seconds_per_token > policy.rates[False].seconds_per_token
    assert 0 < st.draft_accepted <= 2 * WINDOW_TOKENS < len(ids) - WINDOW_TOKENS
    assert policy.windows[False] >= 2


def test_a_draft_that_pays_is_kept(tiny_model, plain):
    """A target made slow (its self-draft accepted every time, so a round makes four tokens for one
    target call): the sequence keeps drafting after trying plain decoding once."""
    engine = Engine(tiny_model, options=EngineOptions(draft_model=DRAFTS["self"], prompt_cache_bytes=0))
    engine.model = Slow(engine.model, 0.02)
    req = gen(1, "Once upon a time, in a small village by the sea,", max_tokens=80)
    ids, st = run_alone(engine, req)
    assert ids == run_alone(plain, req)[0]
    policy = engine.draft.policy
    assert policy.rates[True].seconds_per_token < policy.rates[False].seconds_per_token
    # One plain window; every other round drafted three tokens, all accepted.
    assert policy.windows[False] == 1 and st.draft_accepted == st.draft_tokens >= len(ids) // 2
