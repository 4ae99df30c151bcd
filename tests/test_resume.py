"""Streams that outlive their worker: a request goes on from the tokens its caller has (`Generate.resume`).

In-process, a reply is cut after k tokens and resumed from them on the engine: the caller's events
before the cut and the resumed run's events after it must add up to the uninterrupted run's (tokens,
text, reasoning, tool calls, finish, usage), for every cache kind, stop strings, a grammar, n > 1 and
seeded sampling. With processes, a worker is SIGKILLed mid-stream and the stream goes on.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
from pathlib import Path

import httpx
import msgspec
import openai
import pytest
from forcing import forced, reply_ids
from mlxrt import Runtime, Supervision, WorkerDied
from mlxrt.ipc.protocol import ChatMessage, ChatOptions, EngineOptions, Generate, Grammar, Resume
from mlxrt.worker.engine import Engine
from support import (
    CALL,
    FAMILIES,
    FAST,
    TRANSPORTS,
    gen,
    metric,
    run_batch,
    run_with_deadline,
    running,
    wait_for,
)


class Events:
    """A listener keeping, per request and choice, each token's event and the end."""

    def __init__(self) -> None:
        self.tokens: dict[int, list[tuple[int, str, str, list]]] = {}
        self.ends: dict[int, tuple[str, str, list, object]] = {}
        self.errors: list[BaseException] = []

    def started(self, req_id: int) -> None:
        pass

    def token(self, req_id, token, text, reasoning="", calls=None, *, logprob=None, index=0) -> None:
        self.tokens.setdefault(index, []).append((token, text, reasoning, list(calls or []), logprob))

    def done(self, req_id, stats, text, reasoning="", calls=None, *, index=0, final=True) -> None:
        self.ends[index] = (text, reasoning, list(calls or []), stats)

    def failed(self, req_id, exc) -> None:
        self.errors.append(exc)


def run(eng: Engine, req: Generate) -> Events:
    events = run_batch(eng, [req], Events())
    assert not events.errors, events.errors
    return events


def reply(tokens: list, done: tuple) -> tuple[list[int], str, str, list]:
    """The reply as the caller assembles it: ids, text, reasoning, tool calls."""
    ids = [t[0] for t in tokens]
    text = "".join(t[1] for t in tokens) + done[0]
    reasoning = "".join(t[2] for t in tokens) + done[1]
    calls = [c for t in tokens for c in t[3]] + done[2]
    return ids, text, reasoning, [(c.name, c.arguments) for c in calls]


def check_resumed(eng: Engine, req: Generate, cut: int, *, script=None) -> Events:
    """Run `req` whole, then cut after `cut` tokens and resume: the two halves add up to the whole.
    `script(seq_resumed)` optionally adds a forced processor per run (its ids start at the resume point)."""
    full = run_with(eng, req, script, 0)
    ids = [t[0] for t in full.tokens[0]]
    assert len(ids) > cut, f"the reply has {len(ids)} tokens: cut {cut} would not be mid-reply"
    later = run_with(eng, msgspec.structs.replace(req, resume=Resume(tokens=[ids[:cut]])), script, cut)
    joined = reply(full.tokens[0][:cut] + later.tokens[0], later.ends[0])
    assert joined == reply(full.tokens[0], full.ends[0])
    a, b = full.ends[0][3], later.ends[0][3]
    assert (b.prompt_tokens, b.generation_tokens, b.finish_reason) == (a.prompt_tokens, a.generation_tokens,
                                                                        a.finish_reason)
    assert (a.resumes, b.resumes) == (0, 1)
    return later


def run_with(eng: Engine, req: Generate, script, skip: int) -> Events:
    if script is None:
        return run(eng, req)
    original = eng._sequences

    def sequences(r, listener, queued_at):
        seqs = original(r, listener, queued_at)
        seqs[0].processors = [script(skip)]
        return seqs

    eng._sequences = sequences
    try:
        return run(eng, req)
    finally:
        del eng._sequences


@pytest.fixture(scope="module")
def engine():
    """name -> an in-process engine on that tiny preset (kwargs: its options), loaded once per module."""
    from mlxrt.synthetic.build import ensure_model

    cache: dict[tuple, Engine] = {}

    def get(name: str, **options) -> Engine:
        key = (name, *sorted(options.items()))
        if key not in cache:
            options = EngineOptions(decode_concurrency=4, **options)
            cache[key] = Engine(str(ensure_model(name)), options=options)
        return cache[key]

    return get


@pytest.mark.parametrize("name", FAMILIES)
def test_greedy_reply_resumes_exactly_on_every_cache_kind(engine, name):
    """Every family's cache kind (KV, rotating, arrays): a greedy reply cut after 7 tokens and resumed
    is the uninterrupted reply, with its usage counted once."""
    check_resumed(engine(name), gen(1, "The tide came in over the rocks", max_tokens=18), 7)


def test_quantized_kv_reply_resumes_exactly(engine):
    """Quantized KV (kv_bits=8 from the first token): the resumed greedy reply is the uninterrupted one."""
    eng = engine("small", kv_bits=8, quantized_kv_start=0)
    check_resumed(eng, gen(1, "Quantized and resumed", max_tokens=16), 5)


@pytest.mark.parametrize("params", [{}, {"temperature": 0.8, "seed": 4}], ids=["greedy", "seeded"])
def test_drafted_reply_resumes_exactly(engine, params):
    """Speculative decoding (a noisy draft of the model, on the lone-request fast path): a greedy or seeded
    reply resumed after 9 tokens is the uninterrupted one (the draft's cache is prefilled from the
    resumed prompt too)."""
    eng = engine("tiny", draft_model="synthetic:tiny?noise=0.05", prompt_cache_bytes=0)
    check_resumed(eng, gen(1, "Drafted and resumed", max_tokens=30, **params), 9)


def test_seeded_choices_resume_exactly_and_ended_ones_are_not_redone(engine):
    """n = 2, seeded, with log-probabilities: each choice resumed from its own cut is its uninterrupted
    reply; a choice that had ended is not generated again, and the request's last end is final."""
    eng = engine("tiny")
    req = gen(1, "Seeded and resumed", max_tokens=14, temperature=1.0, seed=11, n=2, logprobs=2)
    full = run(eng, req)
    ids = {i: [t[0] for t in full.tokens[i]] for i in (0, 1)}
    later = run(eng, msgspec.structs.replace(req, resume=Resume(tokens=[ids[0][:5], ids[1][:9]])))
    for i, cut in ((0, 5), (1, 9)):
        assert ids[i][:cut] + [t[0] for t in later.tokens[i]] == ids[i]
        expected = [t[4].logprob for t in full.tokens[i][cut:]]
        assert [t[4].logprob for t in later.tokens[i]] == pytest.approx(expected, abs=1e-4)
    one = run(eng, msgspec.structs.replace(req, resume=Resume(tokens=[ids[0], ids[1][:3]], ended=[0])))
    assert set(one.tokens) == {1} and set(one.ends) == {1}
    assert ids[1][:3] + [t[0] for t in one.tokens[1]] == ids[1]


def test_stop_string_after_the_cut_still_ends_the_reply(engine):
    """A stop string that the reply reaches after the resume point ends it there, as it did uninterrupted;
    a cut inside the held-back text sends none of it twice."""
    eng = engine("tiny")
    plain = run(eng, gen(1, "Stop strings go on", max_tokens=40))
    text = "".join(t[1] for t in plain.tokens[0]) + plain.ends[0][0]
    stop = text[len(text) // 2: len(text) // 2 + 3]
    assert text.find(stop) == len(text) // 2, "the chosen stop string must first occur at the midpoint"
    req = gen(1, "Stop strings go on", max_tokens=40, stop=[stop])
    whole = run(eng, req)
    n = len(whole.tokens[0])
    for cut in (n // 2, n - 1):
        later = check_resumed(eng, req, cut)
        assert later.ends[0][3].finish_reason == "stop" and later.ends[0][3].stop_sequence == stop


def test_grammar_resumes_from_the_replayed_matcher(engine):
    """Under a regex grammar the resumed reply keeps to the grammar from where it was: the whole reply
    equals the uninterrupted one and matches."""
    grammar = Grammar(kind="regex", source="(ab|cd){3,12}")
    req = gen(1, "Letters", max_tokens=40, grammar=grammar, ignore_eos=False)
    later = check_resumed(engine("tiny"), req, 3)
    assert later.ends[0][3].finish_reason == "stop"


@pytest.mark.parametrize("name, forced_reply", [
    ("tiny-qwen3", f"<think>\nI should call the tool.\n</think>\n\n<tool_call>\n{CALL}\n</tool_call>"),
    ("tiny-gpt-oss", "<|channel|>analysis<|message|>I should call the tool.<|end|><|start|>assistant"
                     "<|channel|>commentary to=functions.get_weather <|constrain|>json"
                     '<|message|>{"city": "Paris"}<|call|>'),
])
def test_reasoning_and_tool_call_split_the_same_across_a_resume(engine, name, forced_reply):
    """A chat reply cut inside its reasoning and inside its tool call: the resumed halves split into the
    same reasoning, answer and call as the uninterrupted reply."""
    eng = engine(name)
    ids = reply_ids(eng.tokenizer, forced_reply)

    def script(skip):
        return forced(ids[skip:], eng.vocab_size)

    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}}]
    req = gen(1, messages=[ChatMessage("user", "Weather in Paris?")], max_tokens=len(ids) + 4,
              ignore_eos=False)
    req = msgspec.structs.replace(req, chat=ChatOptions(tools=tools))
    for cut in (3, len(ids) - 4):
        later = check_resumed(eng, req, cut, script=script)
        assert later.ends[0][3].finish_reason in ("stop", "tool_calls")


def test_reply_that_had_ended_ends_at_once(engine):
    """Every token was sent but the end was lost with the worker: the resumed request ends at once with
    the same finish and no new token."""
    eng = engine("tiny")
    req = gen(1, "All sent already", max_tokens=9)
    full = run(eng, req)
    ids = [t[0] for t in full.tokens[0]]
    later = run(eng, msgspec.structs.replace(req, resume=Resume(tokens=[ids])))
    assert later.tokens == {} and later.ends[0][3].finish_reason == "length"
    assert later.ends[0][3].generation_tokens == 9


# ---- processes: SIGKILL mid-stream ------------------------------------------------------------


def killed_mid_stream(rt: Runtime, after: int = 1, **params) -> tuple[list[int], object]:
    """Stream a long reply, SIGKILL its worker after `after` chunks; what the caller gets in the end."""
    stream = rt.stream("The quick brown fox", max_tokens=120, ignore_eos=True, **params)
    ids: list[int] = []
    for i, chunk in enumerate(run_with_deadline(lambda: iter(stream), 60)):
        ids += chunk.tokens
        if i + 1 == after:
            os.kill(rt.workers[0].pid, signal.SIGKILL)
    return ids, stream.stats


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("params", [{}, {"temperature": 0.9, "seed": 5}], ids=["greedy", "seeded"])
def test_stream_goes_on_after_its_worker_is_killed(tiny_model, transport, params):
    """SIGKILL mid-stream, greedy and seeded: the stream pauses and goes on on the restarted worker with
    exactly the tokens an uninterrupted run gives, usage counted once, the resume counted."""
    with Runtime(model=tiny_model, transport=transport, supervision=Supervision(**FAST)) as rt:
        whole = rt.generate("The quick brown fox", max_tokens=120, ignore_eos=True, **params)
        old = rt.workers[0].pid
        ids, stats = killed_mid_stream(rt, **params)
        (w,) = rt.workers
        assert w.pid != old and (w.restarts, w.resumes) == (1, 1)
    assert ids == whole.tokens
    assert (stats.generation_tokens, stats.resumes) == (120, 1)
    assert stats.prompt_tokens == whole.stats.prompt_tokens


LINGERING = [sys.executable, str(Path(__file__).with_name("lingering_worker.py"))]


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_stream_goes_on_while_the_dead_workers_channel_stays_open(tiny_model, transport, tmp_path,
                                                                   monkeypatch):
    """A worker killed mid-stream whose pipes and ring stay open (a child of its holds them, as a CUDA
    worker's stay while the driver tears its context down): its exited process is noticed, not its
    channel's close, and the stream goes on with the tokens of an uninterrupted run."""
    pids = tmp_path / "lingering"
    monkeypatch.setenv("LINGER_PID_FILE", str(pids))
    with Runtime(model=tiny_model, transport=transport, supervision=Supervision(**FAST),
                 _worker_argv=LINGERING) as rt:
        try:
            whole = rt.generate("The quick brown fox", max_tokens=120, ignore_eos=True)
            # a hang guard: the children hold the channels for LINGER_S (120 s)
            ids, stats = run_with_deadline(lambda: killed_mid_stream(rt), 45)
            assert (rt.workers[0].restarts, rt.workers[0].resumes) == (1, 1)
            assert len(pids.read_text().split()) == 2  # both children still hold their worker's files
        finally:  # before the runtime closes: a worker's channel closes only then
            for pid in pids.read_text().split() if pids.exists() else []:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(int(pid), signal.SIGKILL)
    assert ids == whole.tokens and stats.resumes == 1


def test_request_whose_worker_dies_past_max_resumes_fails(tiny_model):
    """MLXRT_MAX_RESUMES=1: the first death is survived, the second fails the request with WorkerDied
    naming the knob, so a request that kills workers cannot walk through the pool."""
    with Runtime(model=tiny_model, transport="ring", supervision=Supervision(**FAST, max_resumes=1)) as rt:
        stream = rt.stream("Killed twice", max_tokens=400, ignore_eos=True)
        next(stream)
        first = rt.workers[0].pid
        os.kill(first, signal.SIGKILL)
        next(stream)  # went on
        wait_for(lambda: rt.workers[0].pid != first and rt.workers[0].state == "busy", 30, "resumed worker")
        os.kill(rt.workers[0].pid, signal.SIGKILL)
        with pytest.raises(WorkerDied, match="MLXRT_MAX_RESUMES"):
            run_with_deadline(lambda: list(stream), 30)


def test_http_stream_goes_on_with_its_id_and_usage_once(tiny_model):
    """Through `mlxrt serve` and the OpenAI client: a chat stream whose worker is killed keeps its id,
    its content equals the uninterrupted reply's, usage is counted once, and /metrics counts the resume."""
    with running({"tiny": tiny_model}, supervision=Supervision(**FAST)) as srv:
        client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="x", max_retries=0)
        ask = {"model": "tiny", "messages": [{"role": "user", "content": "Tell a long story"}],
               "max_tokens": 100, "temperature": 0, "extra_body": {"ignore_eos": True}}
        whole = client.chat.completions.create(**ask)
        old = srv.rt.workers[0].pid
        text, ids, usage = "", set(), None
        for i, chunk in enumerate(client.chat.completions.create(**ask, stream=True,
                                                                 stream_options={"include_usage": True})):
            ids.add(chunk.id)
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
            usage = chunk.usage or usage
            if i == 2:
                os.kill(old, signal.SIGKILL)
        with httpx.Client(base_url=srv.url) as http:
            name = srv.rt.workers[0].name
            assert metric(http, "mlxrt_worker_resumes_total", model="tiny", worker=name) == 1
        assert srv.rt.workers[0].pid != old
    assert len(ids) == 1
    assert text == whole.choices[0].message.content
    assert (usage.completion_tokens, usage.prompt_tokens) == (100, whole.usage.prompt_tokens)
