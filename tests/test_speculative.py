"""Speculative decoding on the fast path: greedy ids unchanged, alone and handed over to the batch."""

from __future__ import annotations

import dataclasses
import time

import httpx
import pytest
from mlxrt import ModelSpec, Runtime
from mlxrt.ipc.protocol import EngineOptions
from mlxrt.worker.draft_policy import WINDOW_TOKENS, DraftPolicy, Window
from mlxrt.worker.engine import Engine
from support import chat, gen, run_alone, run_batch, run_handed_over

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


def test_seeded_request_handed_over_with_accepted_tokens_pending(tiny_model, plain):
    """Nearly greedy, so drafts are accepted: handed over at every step of the first rounds, some
    with accepted tokens not yet delivered, whose draws the batch makes again."""
    engine = Engine(tiny_model, options=EngineOptions(draft_model=DRAFTS["self"], prompt_cache_bytes=0,
                                                      draft_policy="always"))
    reqs = [gen(1, "Once upon a time", max_tokens=24, temperature=0.05, seed=3),
            gen(2, "Hi", max_tokens=4, temperature=0.05, seed=4)]
    expected = run_batch(plain, reqs).ids
    for after in range(3, 16):
        rec = run_handed_over(engine, *reqs, after)
        assert rec.ids == expected and rec.stats[1].draft_accepted > 0, after


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
    from support import running

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


def windows(policy: DraftPolicy, drafting: bool, seconds_per_token: float, n: int = 1) -> list[bool]:
    """The ways `policy` chooses after `n` windows of 8 tokens one way at this speed."""
    return [policy.window(Window(drafting, 8 * seconds_per_token, 8)) for _ in range(n)]


def test_policy_keeps_the_faster_way_and_backs_off_retrying_the_slower():
    """Drafting measured slower: plain decoding from then on, drafting tried again after `retry`
    tokens, the interval doubling each time it loses; measured faster: drafting kept."""
    slow = DraftPolicy(retry=64)
    assert slow.first() is True  # not measured yet: draft, as asked
    assert windows(slow, True, 0.1) == [False]  # then try plain once
    assert windows(slow, False, 0.01) == [False] and slow.retry == 64  # plain won its trial: kept
    assert windows(slow, False, 0.01, 7) == [False] * 6 + [True]  # 72 tokens: drafting is stale
    assert windows(slow, True, 0.1) == [False] and slow.retry == 128  # lost its trial: later next time
    assert windows(slow, False, 0.01, 16) == [False] * 15 + [True]
    assert windows(slow, True, 0.005) == [True] and slow.retry == 64  # won (its old rate replaced)
    fast = DraftPolicy(retry=64)
    assert windows(fast, True, 0.01) == [False]  # plain is tried once
    assert windows(fast, False, 0.05) == [True] and fast.retry == 128  # and loses
    assert windows(fast, True, 0.01, 3) == [True] * 3 and fast.first() is True
    assert all(DraftPolicy(adaptive=False).window(Window(True, 9.0, 1)) for _ in range(5))


def test_policy_trial_cut_short_is_finished_by_the_next_sequence():
    """A sequence that ends (or joins the batch) in the middle of a trial: the next one starts the
    trial's way, and the faster way's window in between is not taken for the trial's."""
    policy = DraftPolicy(retry=64)
    windows(policy, True, 0.1)
    windows(policy, False, 0.01, 8)  # 72 tokens: drafting's trial is due
    assert policy.first() is True  # ... and a new sequence starts it
    assert windows(policy, False, 0.01) == [True] and policy.retry == 64  # plain's window is no trial
    assert windows(policy, True, 0.1) == [False] and policy.retry == 128
    policy.reset()
    assert policy.first() is True and policy.rates[False].seconds_per_token is None


def test_warmup_does_not_teach_the_policy(tiny_model):
    """The worker's warm-up drafts (its rounds compile) but leaves the policy as new."""
    engine = Engine(tiny_model, options=EngineOptions(draft_model=DRAFTS["cut"]))
    engine.warmup(4)
    policy = engine.draft.policy
    assert policy.windows == {True: 0, False: 0} and policy.rates[True].seconds_per_token is None


class Alternating(DraftPolicy):
    """Switches way at every window: the switches themselves under test."""

    def __init__(self, start: bool) -> None:
        super().__init__()
        self.start = start

    def first(self) -> bool:
        return self.start

    def window(self, w: Window) -> bool:
        self.windows[w.drafting] += 1
        return not w.drafting


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
    """A model whose every call takes `seconds`, and `per_token` a token of its input, longer (the rest
    is the model's)."""

    def __init__(self, model, seconds: float, per_token: float = 0.0) -> None:
        self._model, self._seconds, self._per_token = model, seconds, per_token

    def __call__(self, inputs, *args, **kwargs):
        time.sleep(self._seconds + self._per_token * inputs.shape[-1])
        return self._model(inputs, *args, **kwargs)

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


@pytest.mark.parametrize("prompt_words", [10, 200])
def test_a_draft_that_pays_is_kept(tiny_model, plain, prompt_words):
    """A target made slow (its self-draft accepted every time, so a round makes four tokens for one
    target call): the sequence keeps drafting after trying plain decoding once, a long prompt too
    (the draft's catch-up on it is not counted against drafting)."""
    engine = Engine(tiny_model, options=EngineOptions(draft_model=DRAFTS["self"], prompt_cache_bytes=0))
    engine.model = Slow(engine.model, 0.02)
    # The draft's prefill of the prompt alone takes longer than a drafting window's 8 tokens decoded plainly.
    engine.draft = dataclasses.replace(engine.draft, model=Slow(engine.draft.model, 0.0, 0.001))
    prompt = " ".join(["Once upon a time, in a small village by the sea,"] * (prompt_words // 10))
    req = gen(1, prompt, max_tokens=80)
    ids, st = run_alone(engine, req)
    assert ids == run_alone(plain, req)[0] and len(ids) == 80 and st.prompt_tokens > prompt_words
    policy = engine.draft.policy
    assert policy.rates[True].seconds_per_token < policy.rates[False].seconds_per_token
    # Plain tried once (again only if a window was slowed by the machine); the rest drafted, all accepted.
    assert policy.windows[False] >= 1 and st.draft_accepted == st.draft_tokens >= len(ids) // 2


#: Families whose caches rewind (mlx-lm's KVCache) draft; the others refuse a draft at load.
REWINDING = ["tiny-llama", "tiny-qwen3", "tiny-qwen3-moe"]
NOT_REWINDING = {"tiny-gemma3": "RotatingKVCache", "tiny-gpt-oss": "RotatingKVCache",
                 "tiny-qwen3.5": "ArraysCache"}


@pytest.mark.parametrize("family", REWINDING)
def test_each_rewinding_family_drafts_with_its_own_ids(family):
    """A KVCache family drafts with a perturbed copy of itself, rejecting some tokens, and keeps its ids."""
    from mlxrt.synthetic.build import ensure_model

    path = str(ensure_model(family))
    plain = Engine(path, options=EngineOptions(prompt_cache_bytes=0))
    drafted = Engine(path, options=EngineOptions(draft_model=f"synthetic:{family}?noise=0.05",
                                                 draft_policy="always", prompt_cache_bytes=0))
    reqs = [gen(1, "Once upon a time, in a small village by the sea,", max_tokens=24),
            gen(2, messages=chat("What is the weather like?"), max_tokens=24)]
    proposed = accepted = 0
    for req in reqs:
        ids, st = run_alone(drafted, req)
        assert ids == run_alone(plain, req)[0], (family, req.id)
        proposed, accepted = proposed + st.draft_tokens, accepted + st.draft_accepted
    assert 0 < accepted < proposed  # some rejected: the cache was rewound past them


@pytest.mark.parametrize("family", sorted(NOT_REWINDING))
def test_families_whose_caches_cannot_rewind_refuse_a_draft_at_load(family):
    """A family with sliding-window or recurrent caches refuses a draft at load, naming the cache kind."""
    from mlxrt.synthetic.build import ensure_model

    with pytest.raises(ValueError, match=f"rewinds the cache, which the target's .*{NOT_REWINDING[family]}"):
        Engine(str(ensure_model(family)), options=EngineOptions(draft_model=f"synthetic:{family}"))
