"""End-to-end behaviour of the runtime: real worker processes on the tiny model, over each transport."""

from __future__ import annotations

import asyncio
import json
import threading
from pathlib import Path

import pytest
from mlxrt import AsyncRuntime, InvalidField, Request, RequestError, Runtime
from support import TRANSPORTS, assert_stopped, native_tokens

PROMPTS = [
    "The quick brown fox",
    "Once upon a time, in a small village by the sea,",
    [5, 17, 42, 99, 3, 250],
    [{"role": "user", "content": "Tell me about the weather."}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
]


@pytest.fixture(scope="module", params=TRANSPORTS)
def rt(request, tiny_model):
    """One runtime per transport, shared by this module's tests."""
    runtime = Runtime(model=tiny_model, transport=request.param)
    assert runtime.transport == request.param
    pids = [w.pid for w in runtime.workers]
    yield runtime
    runtime.close()
    assert_stopped(pids)


@pytest.mark.parametrize("prompt", PROMPTS, ids=["text", "text2", "ids", "chat", "chat-system"])
def test_greedy_tokens_match_inprocess(rt, reference, prompt):
    """Greedy ids from the worker equal in-process mlx-lm's for text, ids and chat prompts."""
    c = rt.generate(prompt, max_tokens=24, ignore_eos=True)
    assert c.tokens == native_tokens(reference, prompt, 24, ignore_eos=True)
    assert c.stats.generation_tokens == 24
    assert c.finish_reason == "length"


def test_eos_stops_like_inprocess(rt, reference):
    """With EOS enabled the worker stops where mlx-lm stops."""
    prompt = PROMPTS[1]
    c = rt.generate(prompt, max_tokens=64)
    assert c.tokens == native_tokens(reference, prompt, 64, ignore_eos=False)


def test_stream_text_equals_full_text(rt):
    """Concatenated stream chunks equal the non-streamed completion, text and ids."""
    full = rt.generate(PROMPTS[0], max_tokens=40, ignore_eos=True)
    stream = rt.stream(PROMPTS[0], max_tokens=40, ignore_eos=True)
    chunks = list(stream)
    assert "".join(c.text for c in chunks) == full.text
    assert [t for c in chunks for t in c.tokens] == full.tokens
    assert stream.stats is not None and stream.stats.generation_tokens == 40
    assert full.text  # the tiny model's tokenizer decodes to real text


def test_stats_are_complete(rt):
    """Each request ends with prompt, TTFT, decode, memory and finish figures."""
    c = rt.generate(PROMPTS[0], max_tokens=16, ignore_eos=True)
    s = c.stats
    assert s.prompt_tokens > 0 and s.prompt_tps > 0 and s.ttft_ms > 0
    assert s.generation_tokens == 16 and s.decode_tps > 0
    assert s.peak_memory_bytes > 0


def test_stop_string_cuts_text(rt):
    """A stop string ends generation and is not part of the text."""
    full = rt.generate(PROMPTS[0], max_tokens=40, ignore_eos=True).text
    stop = full[len(full) // 2 : len(full) // 2 + 3]
    assert stop
    c = rt.generate(PROMPTS[0], max_tokens=40, ignore_eos=True, stop=[stop])
    assert c.text == full[: full.index(stop)]
    assert c.finish_reason == "stop"


def test_stop_token_id_ends_generation(rt):
    """A stop token id ends generation before that token."""
    full = rt.generate(PROMPTS[0], max_tokens=20, ignore_eos=True).tokens
    c = rt.generate(PROMPTS[0], max_tokens=20, ignore_eos=True, stop_token_ids=[full[5]])
    assert c.tokens == full[: full.index(full[5])]
    assert c.finish_reason == "stop"


def test_seeded_sampling_is_reproducible(rt):
    """The same seed gives the same sampled tokens; sampling parameters reach mlx-lm."""
    kw = dict(max_tokens=24, temperature=1.0, top_p=0.9, top_k=50, min_p=0.01,
              repetition_penalty=1.1, repetition_context_size=32, ignore_eos=True)
    a = rt.generate(PROMPTS[0], seed=7, **kw).tokens
    b = rt.generate(PROMPTS[0], seed=7, **kw).tokens
    c = rt.generate(PROMPTS[0], seed=8, **kw).tokens
    assert a == b
    assert a != c


def test_cancel_stops_generation_in_worker(rt):
    """cancel() stops the worker between tokens; the stats say cancelled."""
    stream = rt.stream(PROMPTS[0], max_tokens=400, ignore_eos=True)
    next(stream)
    stream.cancel()
    rest = list(stream)
    assert stream.finish_reason == "cancelled"
    assert stream.stats.generation_tokens < 400
    assert 1 + sum(len(c.tokens) for c in rest) <= stream.stats.generation_tokens


def test_breaking_out_of_a_stream_cancels_it(rt):
    """Leaving a for-loop early cancels the request: the worker stops short of max_tokens."""
    before = rt.workers[0].tokens
    for _ in rt.stream(PROMPTS[0], max_tokens=400, ignore_eos=True):
        break
    after = rt.generate(PROMPTS[0], max_tokens=1)  # queued behind the cancelled one
    assert after.tokens
    produced = rt.workers[0].tokens - before - 1
    assert produced < 400


def test_prompt_longer_than_context_is_a_request_error(rt, tiny_model):
    """A prompt past the model's context fails that request only; the worker keeps serving."""
    context = json.loads((Path(tiny_model) / "config.json").read_text())["max_position_embeddings"]
    with pytest.raises(RequestError) as err:
        rt.generate([10 + i % 50 for i in range(context + 1)], max_tokens=4)
    assert err.value.error_type == "PromptTooLongError"
    assert (err.value.kind, err.value.field) == ("too_long", "prompt")  # classed by the worker, by type
    assert "context" in err.value.message
    assert "Traceback" in err.value.remote_traceback
    assert rt.generate(PROMPTS[0], max_tokens=2).tokens


@pytest.mark.parametrize(
    "kw, field",
    [
        (dict(temperature=-1.0), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_k=-3), "top_k"),
        (dict(max_tokens=0), "max_tokens"),
        (dict(min_p=1.5), "min_p"),
        (dict(repetition_context_size=100000), "repetition_context_size"),
        (dict(temperature="hot"), "temperature"),
        (dict(stop=[""]), "stop"),
    ],
)
def test_invalid_sampling_params_raise_before_the_worker(rt, kw, field):
    """Bad sampling parameters raise InvalidField (a ValueError) naming the field, as data too; nothing
    reaches the worker."""
    before = rt.workers[0].requests
    with pytest.raises(ValueError, match=field) as err:
        rt.generate(PROMPTS[0], **kw)
    assert isinstance(err.value, InvalidField) and err.value.field == field
    assert rt.workers[0].requests == before


def test_submit_takes_a_typed_request(rt):
    """`submit(Request)` is what `generate` does: the same ids; a request for another model names it."""
    req = Request.build(PROMPTS[0], {"max_tokens": 8, "ignore_eos": True})
    assert [t for c in rt.submit(req) for t in c.tokens] == rt.generate(PROMPTS[0], max_tokens=8,
                                                                        ignore_eos=True).tokens
    with pytest.raises(InvalidField) as err:
        rt.submit(Request.build(PROMPTS[0], {}, model="nope"))
    assert err.value.field == "model"


def test_unknown_keyword_is_a_type_error(rt):
    """A misspelled sampling keyword is not silently ignored."""
    with pytest.raises(TypeError, match="temprature"):
        rt.generate(PROMPTS[0], temprature=0.5)


def test_workers_report_pid_model_state_transport(rt):
    """rt.workers has one record per worker with its pid, model, state and transport."""
    (w,) = rt.workers
    assert w.pid > 0 and w.state == "ready" and w.transport == rt.transport


def test_two_workers_serve_concurrent_requests(tiny_model):
    """Two workers take two concurrent requests, one each (least-loaded routing)."""
    with Runtime(model=tiny_model, workers=2, transport="stdio") as rt:
        streams = [rt.stream(PROMPTS[0], max_tokens=64, ignore_eos=True) for _ in range(2)]
        assert {s.worker.pid for s in streams} == {w.pid for w in rt.workers}
        results: list[list[int]] = [[], []]

        def drain(i: int) -> None:
            results[i] = [t for c in streams[i] for t in c.tokens]

        threads = [threading.Thread(target=drain, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert results[0] == results[1] and len(results[0]) == 64


def test_several_models_by_name(tiny_model):
    """Several models by name: each request goes to the model it names."""
    with Runtime(models={"a": tiny_model, "b": tiny_model}, transport="stdio") as rt:
        assert rt.models == ["a", "b"]
        a = rt.stream(PROMPTS[0], model="b", max_tokens=4)
        assert a.worker.model == "b"
        list(a)
        with pytest.raises(ValueError, match="model"):
            rt.generate(PROMPTS[0], model="c")


def test_async_runtime_generate_and_stream(tiny_model, reference):
    """AsyncRuntime gives the same tokens; leaving an async for early cancels."""

    async def main() -> None:
        async with AsyncRuntime(model=tiny_model, transport="stdio") as rt:
            c = await rt.generate(PROMPTS[0], max_tokens=16, ignore_eos=True)
            assert c.tokens == native_tokens(reference, PROMPTS[0], 16, ignore_eos=True)
            text = ""
            async for chunk in rt.stream(PROMPTS[0], max_tokens=16, ignore_eos=True):
                text += chunk.text
            assert text == c.text
            stream = rt.stream(PROMPTS[0], max_tokens=400, ignore_eos=True)
            async for _ in stream:
                stream.cancel()
            assert stream.finish_reason == "cancelled"

    asyncio.run(main())


def test_breaking_out_of_an_async_stream_cancels_it(tiny_model):
    """Leaving an `async for` early cancels the request in the worker (the stream is collected)."""

    async def main() -> None:
        async with AsyncRuntime(model=tiny_model, transport="stdio") as rt:
            before = rt.workers[0].tokens
            async for _ in rt.stream(PROMPTS[0], max_tokens=400, ignore_eos=True):
                break
            await rt.generate(PROMPTS[0], max_tokens=1)  # queued behind the cancelled one
            assert rt.workers[0].tokens - before - 1 < 400

    asyncio.run(main())


def test_worker_classes_failures_by_type():
    """The worker sends each failure's kind by its exception's type: the request's fault (with its
    field where the check names one), a prompt beyond the context, or a bug."""
    import jinja2
    from mlxrt.worker.prompt import PromptTooLongError
    from mlxrt.worker.serve import failure_kind

    assert failure_kind(PromptTooLongError("long")) == ("too_long", "prompt")
    assert failure_kind(InvalidField("top_k", "=9: too big")) == ("invalid", "top_k")
    assert failure_kind(jinja2.TemplateError("roles must alternate")) == ("invalid", "messages")
    assert failure_kind(ValueError("bad ids")) == ("invalid", None)
    assert failure_kind(RuntimeError("a bug")) == ("internal", None)
