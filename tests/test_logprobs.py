"""Log-probabilities: the engine's values against in-process mlx-lm, and both HTTP APIs and Python.

The reference is teacher forcing: the tiny model run once by mlx-lm over the prompt and the
generated ids, its logits turned into log-softmax at each generated position. The values are those
of the distribution each token was sampled from, after the logits processors (a repetition
penalty is applied in the reference too), before temperature and top-p/top-k.
"""

from __future__ import annotations

import json

import httpx
import mlx.core as mx
import pytest
from mlx_lm.sample_utils import make_logits_processors
from mlxrt import Runtime
from mlxrt.ipc.protocol import MAX_TOP_LOGPROBS, EngineOptions, Generate, SamplingParams
from mlxrt.worker import engine as engine_module
from mlxrt.worker.engine import Engine

PROMPTS = ["Hello", "The tide came in over the rocks", "Give me a list of colours"]
ATOL = 2e-3  # float32 tiny model: the batch's padded attention and a full forward pass differ slightly


@pytest.fixture(scope="module")
def engine(tiny_model, reference):
    engine = Engine(tiny_model, options=EngineOptions(decode_concurrency=8))
    engine.reference_model = reference[0]  # the same weights, loaded apart by mlx-lm (conftest)
    return engine


class Recorder:
    """Each request's ids and log-probability entries; rejects keywords a plain request must not get."""

    def __init__(self) -> None:
        self.ids: dict[int, list[int]] = {}
        self.logprobs: dict[int, list] = {}
        self.reason: dict[int, str] = {}

    def started(self, req_id: int) -> None:
        pass

    def token(self, req_id, token, text, reasoning="", calls=None, *, logprob=None, index=0) -> None:
        self.ids.setdefault(req_id, []).append(token)
        if logprob is not None:
            self.logprobs.setdefault(req_id, []).append(logprob)

    def done(self, req_id, stats, text, reasoning="", calls=None, **_) -> None:
        self.reason[req_id] = stats.finish_reason

    def failed(self, req_id, exc) -> None:
        raise AssertionError(f"request {req_id} failed: {exc!r}")


class PlainRecorder(Recorder):
    """A listener with the plain signature: a request that did not ask gets no extra keywords."""

    def token(self, req_id, token, text, reasoning="", calls=None) -> None:  # type: ignore[override]
        self.ids.setdefault(req_id, []).append(token)

    def done(self, req_id, stats, text, reasoning="", calls=None) -> None:  # type: ignore[override]
        self.reason[req_id] = stats.finish_reason


def run(engine: Engine, reqs: list[Generate], rec: Recorder | None = None, *, second_after: int = 0,
        late: Generate | None = None) -> Recorder:
    """Run `reqs`; with `late`, submit it after `second_after` steps (a hand-over mid-stream)."""
    rec = rec or Recorder()
    for r in reqs:
        engine.submit(r, rec)
    steps = 0
    while engine.busy or late is not None:
        if late is not None and steps == second_after:
            engine.submit(late, rec)
            late = None
        engine.step()
        steps += 1
    return rec


def reference(engine: Engine, req: Generate, ids: list[int]) -> mx.array:
    """mlx-lm's log-softmax at each generated position (teacher forcing on the prompt and `ids`), after
    the request's repetition penalty as mlx-lm's processors apply it."""
    prompt = engine.prompt_ids(req)
    seq = prompt + ids
    logits = engine.reference_model(mx.array(seq[:-1])[None])[0, len(prompt) - 1:].astype(mx.float32)
    p = req.params
    if p.repetition_penalty:
        (penalty,) = make_logits_processors(repetition_penalty=p.repetition_penalty,
                                            repetition_context_size=p.repetition_context_size)
        logits = mx.concatenate([penalty(mx.array(seq[: len(prompt) + j]), logits[j:j + 1])
                                 for j in range(len(ids))])
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


def assert_matches_reference(engine: Engine, req: Generate, rec: Recorder, k: int) -> None:
    ids, entries = rec.ids[req.id], rec.logprobs[req.id]
    assert [e.id for e in entries] == ids
    ref = reference(engine, req, ids)
    for j, e in enumerate(entries):
        row = ref[j]
        assert abs(e.logprob - row[e.id].item()) < ATOL, (j, e.logprob, row[e.id].item())
        assert len(e.top) == k
        values = [t.logprob for t in e.top]
        assert values == sorted(values, reverse=True)
        want = sorted(row.tolist(), reverse=True)[:k]
        assert all(abs(a - b) < ATOL for a, b in zip(values, want, strict=True)), (values, want)
        for t in e.top:
            assert abs(t.logprob - row[t.id].item()) < ATOL
            assert t.token_bytes == engine.token_bytes(t.id)
        if req.params.temperature == 0 and k:
            assert e.top[0].id == e.id  # greedy: the sampled token is the most likely one


def gen(i: int, prompt: str, **params) -> Generate:
    return Generate(id=i, prompt=prompt, params=SamplingParams(**{"max_tokens": 12, "ignore_eos": True,
                                                                    **params}))


@pytest.mark.parametrize("k", [0, 5])
def test_logprobs_in_a_batch_equal_mlx_lm(engine, k):
    """In a batch, greedy, seeded and with a repetition penalty: each token's log-probability is
    mlx-lm's log-softmax of the logits it was sampled from; the top k are the k largest, sorted."""
    reqs = [gen(1, PROMPTS[0], logprobs=k), gen(2, PROMPTS[1], logprobs=k, temperature=0.9, seed=3),
            gen(3, PROMPTS[2], logprobs=k, repetition_penalty=1.3), gen(4, PROMPTS[1])]
    rec = run(engine, reqs)
    for r in reqs[:3]:
        assert_matches_reference(engine, r, rec, k)
    assert 4 not in rec.logprobs


def test_logprobs_alone_and_handed_over_equal_mlx_lm(engine):
    """A lone request (the single-stream path) and one handed over to the batch mid-stream: the same
    values as mlx-lm, every token with its entry."""
    alone = gen(1, PROMPTS[1], logprobs=3)
    rec = run(engine, [alone])
    assert_matches_reference(engine, alone, rec, 3)
    solo_before = engine.solo_requests
    first, late = gen(2, PROMPTS[0], logprobs=3, max_tokens=16), gen(3, PROMPTS[2], logprobs=2)
    rec = run(engine, [first], second_after=6, late=late)
    assert engine.solo_requests == solo_before + 1  # `first` began alone, `late` joined it in the batch
    assert_matches_reference(engine, first, rec, 3)
    assert_matches_reference(engine, late, rec, 2)


def test_no_logprobs_no_work(engine, monkeypatch):
    """Requests that do not ask get no log-probability work and plain listener calls (no keywords)."""
    calls = []
    monkeypatch.setattr(engine_module, "token_logprobs", lambda *a: calls.append(a))
    rec = run(engine, [gen(i, p) for i, p in enumerate(PROMPTS)], PlainRecorder())
    assert calls == [] and all(len(rec.ids[i]) == 12 for i in range(3))


def test_logprobs_do_not_change_the_tokens(engine):
    """Asking for log-probabilities does not change what is generated, alone or in a batch."""
    plain = run(engine, [gen(i, p, temperature=0.8, seed=i) for i, p in enumerate(PROMPTS)])
    asked = run(engine, [gen(i, p, temperature=0.8, seed=i, logprobs=2) for i, p in enumerate(PROMPTS)])
    assert asked.ids == plain.ids


def test_logprobs_are_after_the_processors(engine):
    """A grammar's mask is a logits processor: the values are the masked distribution's (renormalised
    over the few tokens "yes" or "no" can start with, far above the raw model's), and the masked
    alternatives say -9999 (-inf; JSON has no infinity)."""
    from mlxrt.ipc.protocol import Grammar

    req = gen(1, "Hi", logprobs=MAX_TOP_LOGPROBS, ignore_eos=False, max_tokens=16,
              grammar=Grammar(kind="regex", source="(yes|no)"))
    rec = run(engine, [req])
    first = rec.logprobs[1][0]
    raw = reference(engine, req, rec.ids[1][:1])[0]
    assert first.logprob > raw[first.id].item() + 1.0
    assert any(t.logprob == -9999.0 for t in first.top) and all(t.logprob > -9999.0 for t in first.top[:1])


# ---- over HTTP, and the Python API -----------------------------------------------------------


CHAT = [{"role": "user", "content": "Tell me about the tide"}]


def test_openai_chat_logprobs_streamed_and_not(oai):
    """chat: logprobs true, top_logprobs 3: an entry per completion token, its bytes the text's, the
    top ones sorted with the greedy token first; streamed, the same entries chunk by chunk."""
    kw = dict(model="tiny", messages=CHAT, max_tokens=12, temperature=0, logprobs=True, top_logprobs=3)
    r = oai.chat.completions.create(**kw)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    # The tokens' own bytes make the text (random weights write broken UTF-8, which both replace); the
    # detokenizer drops the reply's leading space, the bytes keep it.
    joined = b"".join(bytes(e.bytes) for e in content).decode("utf-8", "replace")
    assert joined.lstrip() == r.choices[0].message.content
    for e in content:
        assert len(e.top_logprobs) == 3 and e.top_logprobs[0].token == e.token
        values = [t.logprob for t in e.top_logprobs]
        assert values == sorted(values, reverse=True)
        assert e.logprob == e.top_logprobs[0].logprob <= 0
    chunks = list(oai.chat.completions.create(**kw, stream=True))
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs
                for e in c.choices[0].logprobs.content]
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in content]
    plain = oai.chat.completions.create(model="tiny", messages=CHAT, max_tokens=4)
    assert plain.choices[0].logprobs is None


def test_openai_completions_logprobs(oai):
    """/v1/completions logprobs k: tokens, token_logprobs, top_logprobs (the k most likely and the
    sampled token) and text_offset, streamed too."""
    kw = dict(model="tiny", prompt="The tide", max_tokens=10, temperature=0, logprobs=2)
    r = oai.completions.create(**kw)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == r.usage.completion_tokens
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert top[token] == value and 1 <= len(top) <= 3
    chunks = list(oai.completions.create(**kw, stream=True))
    parts = [c.choices[0].logprobs for c in chunks if c.choices and c.choices[0].logprobs]
    assert [t for p in parts for t in p.tokens] == lp.tokens
    assert [o for p in parts for o in p.text_offset] == lp.text_offset


def test_ollama_logprobs_generate_and_chat(oll):
    """Ollama's logprobs and top_logprobs, on /api/generate and /api/chat, streamed and not."""
    opts = {"temperature": 0, "num_predict": 8}
    r = oll.generate(model="tiny", prompt="The tide", options=opts, logprobs=True, top_logprobs=2)
    assert len(r.logprobs) == r.eval_count
    assert all(len(e.top_logprobs) == 2 and e.top_logprobs[0].token == e.token for e in r.logprobs)
    parts = list(oll.generate(model="tiny", prompt="The tide", options=opts, logprobs=True, top_logprobs=2,
                              stream=True))
    assert [e.token for p in parts for e in p.logprobs or []] == [e.token for e in r.logprobs]
    c = oll.chat(model="tiny", messages=CHAT, options=opts, logprobs=True)
    assert len(c.logprobs) == c.eval_count and all(not e.top_logprobs for e in c.logprobs)
    assert oll.chat(model="tiny", messages=CHAT, options=opts).logprobs is None


def test_python_api_logprobs(tiny_model):
    """`rt.generate(..., logprobs=k)`: a TokenLogprob per token (its text as `token`), streamed too."""
    with Runtime(model=tiny_model, transport="stdio") as rt:
        c = rt.generate("The tide", max_tokens=6, logprobs=2, ignore_eos=True)
        assert [e.id for e in c.logprobs] == c.tokens and all(len(e.top) == 2 for e in c.logprobs)
        assert "".join(e.token for e in c.logprobs).encode() == b"".join(e.token_bytes for e in c.logprobs)
        chunks = list(rt.stream("The tide", max_tokens=6, logprobs=0, ignore_eos=True))
        assert [e.id for ch in chunks for e in ch.logprobs] == c.tokens
        assert rt.generate("The tide", max_tokens=3).logprobs is None
        with pytest.raises(ValueError, match="invalid logprobs=21"):
            rt.generate("Hi", logprobs=21)


BAD = [
    ("/v1/chat/completions", {"messages": CHAT, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("/v1/chat/completions", {"messages": CHAT, "top_logprobs": 2}, "top_logprobs"),
    ("/v1/completions", {"prompt": "Hi", "logprobs": 21}, "logprobs"),
    ("/v1/completions", {"prompt": "Hi", "logprobs": -1}, "logprobs"),
    ("/api/generate", {"prompt": "Hi", "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("/api/chat", {"messages": CHAT, "logprobs": True, "top_logprobs": -1}, "top_logprobs"),
]


@pytest.mark.parametrize("path, extra, param", BAD, ids=[f"{p}-{i}" for i, (p, _, _) in enumerate(BAD)])
def test_bad_logprobs_are_400_naming_the_field(srv, path, extra, param):
    """top_logprobs above 20 (OpenAI's and Ollama's limit), below 0, or without logprobs: a 400 in the
    API's shape naming the field, and nothing reaches the worker."""
    sent = sum(w.requests for w in srv.rt.workers)
    r = httpx.post(srv.url + path, json={"model": "tiny", **extra}, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    if path.startswith("/api/"):
        assert param in err
    else:
        assert err["param"] == param, err
    assert sum(w.requests for w in srv.rt.workers) == sent
    json.dumps(err)
