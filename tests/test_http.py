"""The HTTP server end to end: real uvicorn on loopback over real workers on the tiny model,
driven by the official openai and ollama clients and by raw HTTP."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import msgspec
import ollama
import openai
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from mlxrt import Timeouts
from mlxrt.orchestrator.http import ServerConfig
from mlxrt.orchestrator.http.ollama import parse_keep_alive
from mlxrt.orchestrator.http.server import parse_model_specs
from support import (
    NO_RESTART,
    ServerThread,
    assert_stopped,
    free_port,
    metric,
    native_tokens,
    sse_events,
    wait_for,
)

PROMPT_IDS = [5, 17, 42, 99, 3, 250]
CHAT = [{"role": "user", "content": "Tell me about the weather."}]
OK_STATUSES = {200, 400, 404, 413}
FAKE_WORKER = [sys.executable, str(Path(__file__).with_name("fake_worker.py"))]


# ---- OpenAI ----------------------------------------------------------------


def test_openai_completion_token_ids_match_native(http, reference):
    """Streamed /v1/completions with an id prompt returns mlx-lm's greedy ids in the token_ids extension."""
    body = {"model": "tiny", "prompt": PROMPT_IDS, "max_tokens": 24, "temperature": 0,
            "ignore_eos": True, "stream": True, "return_token_ids": True}
    with http.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    ids = [t for c in chunks for t in c["choices"][0]["token_ids"]]
    assert ids == native_tokens(reference, PROMPT_IDS, 24)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    full = http.post("/v1/completions", json={**body, "stream": False}).json()
    assert full["choices"][0]["text"] == "".join(c["choices"][0]["text"] for c in chunks)
    assert full["choices"][0]["token_ids"] == ids
    # The same prompt again: all but its last token come from the worker's prefix cache.
    assert full["usage"] == {"prompt_tokens": len(PROMPT_IDS), "completion_tokens": 24, "total_tokens": 30,
                             "prompt_tokens_details": {"cached_tokens": len(PROMPT_IDS) - 1}}


def test_openai_client_chat_stream_equals_non_stream(oai):
    """The openai client's streamed chat deltas add up to the non-streamed message; usage comes last."""
    kw = dict(model="tiny", messages=CHAT, max_tokens=20, temperature=0, extra_body={"ignore_eos": True})
    full = oai.chat.completions.create(**kw)
    assert full.choices[0].finish_reason == "length"
    assert full.usage.completion_tokens == 20 and full.usage.prompt_tokens > 0
    chunks = list(oai.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == full.usage.total_tokens


def test_openai_client_completions_stop_and_seed(oai):
    """A stop string cuts the text (finish_reason stop); the same seed samples the same text."""
    kw = dict(model="tiny", prompt="The quick brown fox", max_tokens=30, extra_body={"ignore_eos": True})
    full = oai.completions.create(**kw, temperature=0).choices[0].text
    stop = full[len(full) // 2 : len(full) // 2 + 3]
    cut = oai.completions.create(**kw, temperature=0, stop=[stop]).choices[0]
    assert cut.text == full[: full.index(stop)] and cut.finish_reason == "stop"
    a = oai.completions.create(**kw, temperature=1.0, top_p=0.9, seed=7).choices[0].text
    b = oai.completions.create(**kw, temperature=1.0, top_p=0.9, seed=7).choices[0].text
    assert a == b


def test_openai_client_lists_models(oai):
    """/v1/models lists the served model names; /v1/models/{name} retrieves one."""
    assert [m.id for m in oai.models.list()] == ["tiny"]
    assert oai.models.retrieve("tiny").id == "tiny"
    with pytest.raises(openai.NotFoundError):
        oai.models.retrieve("nope")


# ---- Ollama ----------------------------------------------------------------


def test_ollama_client_generate_stream_and_timings(oll):
    """Ollama streaming ends with done, done_reason and nanosecond timings; it equals stream=False."""
    opts = {"temperature": 0, "num_predict": 12, "repeat_penalty": 1.0}
    parts = list(oll.generate(model="tiny", prompt="Why is the sky blue?", options=opts, stream=True))
    final = parts[-1]
    assert final.done and not any(p.done for p in parts[:-1])
    assert final.done_reason in ("length", "stop")
    assert final.prompt_eval_count > 0 and final.eval_count <= 12
    assert final.total_duration >= final.prompt_eval_duration > 0 and final.eval_duration >= 0
    assert (final.eval_duration > 0) == (final.eval_count > 1)  # decode time runs from the first token
    assert final.load_duration == 0
    whole = oll.generate(model="tiny:latest", prompt="Why is the sky blue?", options=opts, stream=False)
    assert whole.response == "".join(p.response for p in parts)
    assert whole.done and whole.eval_count == final.eval_count


def test_ollama_client_chat(oll):
    """/api/chat streams message deltas (NDJSON) and answers stream=False with the same message."""
    opts = {"temperature": 0, "num_predict": 10, "repeat_last_n": 0}
    parts = list(oll.chat(model="tiny", messages=CHAT, options=opts, stream=True))
    assert parts[-1].done and parts[-1].message.role == "assistant"
    whole = oll.chat(model="tiny", messages=CHAT, options=opts)
    assert whole.message.content == "".join(p.message.content for p in parts)
    assert whole.eval_count == parts[-1].eval_count


def test_ollama_raw_ndjson_lines(http):
    """Raw /api/generate streams one JSON object per line by default (Ollama streams unless told not to)."""
    body = {"model": "tiny", "prompt": "Hi", "raw": True, "options": {"num_predict": 5, "temperature": 0}}
    with http.stream("POST", "/api/generate", json=body) as r:
        assert r.headers["content-type"] == "application/x-ndjson"
        lines = [json.loads(x) for x in r.iter_lines() if x]
    assert lines[-1]["done"] is True and all(x["done"] is False for x in lines[:-1])
    timings = ("total_duration", "prompt_eval_duration", "eval_duration")
    assert all(isinstance(lines[-1][k], int) for k in timings)


def test_ollama_tags_ps_show_version(oll, http):
    """The model-listing endpoints describe the served model; the client parses every one."""
    assert [m.model for m in oll.list().models] == ["tiny"]
    ps = oll.ps().models[0]
    assert ps.name == "tiny" and ps.context_length == 512
    show = oll.show("tiny")
    assert show.modelinfo["general.architecture"] == show.details.family and "completion" in show.capabilities
    assert http.get("/api/version").json()["version"]


def test_ollama_keep_alive_loads_keeps_and_unloads(tiny_model):
    """keep_alive durations are accepted, garbage is 400; an empty request with keep_alive 0 unloads
    the model, one without loads it, and the next generation reloads an unloaded model."""
    srv = ServerThread({"tiny": tiny_model})  # its own: unloading would disturb the shared one
    srv.url = srv.start()
    try:
        with httpx.Client(base_url=srv.url, timeout=60) as http:
            _exercise_keep_alive(srv, http)
    finally:
        srv.stop()


def _exercise_keep_alive(srv, http) -> None:
    gen = {"model": "tiny", "prompt": "Hi", "stream": False, "options": {"num_predict": 2}}
    for value in ("5m", "1h30m", 300, -1):
        assert http.post("/api/generate", json={**gen, "keep_alive": value}).status_code == 200, value
    bad = http.post("/api/generate", json={**gen, "keep_alive": "soon"})
    assert bad.status_code == 400 and "keep_alive" in bad.json()["error"]
    unload = http.post("/api/chat", json={"model": "tiny", "messages": [], "keep_alive": 0}).json()
    assert unload["done"] is True and unload["done_reason"] == "unload"
    assert srv.rt.workers[0].state == "unloaded"
    load = http.post("/api/generate", json={"model": "tiny", "keep_alive": -1}).json()
    assert load["done"] is True and load["done_reason"] == "load"
    deadline = time.monotonic() + 60
    while srv.rt.workers[0].state != "ready" and time.monotonic() < deadline:
        time.sleep(0.05)
    assert srv.rt.workers[0].state == "ready"
    http.post("/api/chat", json={"model": "tiny", "messages": [], "keep_alive": "0"})
    again = http.post("/api/generate", json={**gen, "keep_alive": -1})
    assert again.status_code == 200 and again.json()["eval_count"] == 2
    assert parse_keep_alive("1m30s") == 90.0 and parse_keep_alive("-1m") == -60.0


# ---- health, metrics, auth --------------------------------------------------


def test_health_and_metrics(http):
    """/health is 200 with each worker's state; /metrics has request, token, latency, decode-gap and worker
    series."""
    before = metric(http, "mlxrt_http_requests_total", endpoint="/v1/completions", status="200")
    done = http.post("/v1/completions", json={"model": "tiny", "prompt": "Hi", "max_tokens": 3})
    assert done.status_code == 200
    h = http.get("/health")
    assert h.status_code == 200 and h.json()["status"] == "ok"
    (w,) = h.json()["models"]["tiny"]["workers"]
    assert w["state"] == "ready" and w["pid"] > 0
    text = http.get("/metrics").text
    for series in ("mlxrt_http_requests_total", "mlxrt_generated_tokens_total",
                   "mlxrt_time_to_first_token_seconds_bucket", "mlxrt_decode_tokens_per_second_bucket",
                   "mlxrt_decode_longest_gap_seconds_bucket",
                   'mlxrt_workers{model="tiny",state="ready"} 1.0', "mlxrt_worker_restarts_total"):
        assert series in text
    assert metric(http, "mlxrt_http_requests_total", endpoint="/v1/completions", status="200") == before + 1


def test_cached_tokens_in_usage_and_metrics(oai, http):
    """A chat's second turn reports its cached prefix as usage.prompt_tokens_details.cached_tokens,
    and /metrics counts it; batch and queue gauges exist per worker."""
    msgs = [{"role": "system", "content": "You are a careful assistant who explains the sea. " * 6},
            {"role": "user", "content": "First question"}]
    first = oai.chat.completions.create(model="tiny", messages=msgs, max_tokens=6)
    msgs += [{"role": "assistant", "content": first.choices[0].message.content},
             {"role": "user", "content": "Second question"}]
    before = metric(http, "mlxrt_cached_prompt_tokens_total", model="tiny")
    second = oai.chat.completions.create(model="tiny", messages=msgs, max_tokens=6)
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert 0 < cached < second.usage.prompt_tokens
    assert metric(http, "mlxrt_cached_prompt_tokens_total", model="tiny") - before == cached
    text = http.get("/metrics").text
    assert "mlxrt_worker_batch_size{" in text and "mlxrt_worker_queued{" in text


def test_api_key_is_required_when_configured(srv):
    """With an API key every endpoint but /health needs 'Authorization: Bearer KEY': 401 otherwise."""
    url = srv.serve(ServerConfig(api_key="s3cret"))
    body = {"model": "tiny", "prompt": "Hi", "max_tokens": 2}
    assert httpx.post(url + "/v1/completions", json=body).status_code == 401
    wrong = httpx.post(url + "/v1/completions", json=body, headers={"Authorization": "Bearer nope"})
    assert wrong.status_code == 401 and wrong.json()["error"]["type"] == "authentication_error"
    assert httpx.get(url + "/api/tags").json() == {"error": "missing or wrong API key: send "
                                                            "'Authorization: Bearer <key>' (or "
                                                            "'x-api-key: <key>')"}
    assert httpx.get(url + "/health").status_code == 200
    with openai.OpenAI(base_url=url + "/v1", api_key="s3cret", max_retries=0) as client:
        ok = client.completions.create(model="tiny", prompt="Hi", max_tokens=2)
        assert ok.choices[0].finish_reason in ("length", "stop") and 1 <= ok.usage.completion_tokens <= 2
    with openai.OpenAI(base_url=url + "/v1", api_key="bad", max_retries=0) as client:
        with pytest.raises(openai.AuthenticationError):
            client.models.list()


# ---- bad input ----------------------------------------------------------------


BAD = [
    ("/v1/chat/completions", b'{"model": "tiny", "messages": [', 400, "malformed JSON"),
    ("/v1/chat/completions", b'{"model": "tiny", "messages": [], "max_tokens": 2}', 400, "messages"),
    ("/v1/chat/completions", b'{"model": "tiny", "messages": [{"role": "user"}]}', 400, "content"),
    ("/v1/chat/completions", b'{"model": "tiny", "messages": [{"role": "wizard", "content": "x"}]}', 400,
     "role"),
    ("/v1/chat/completions", b'{"model": "tiny", "messages": [{"role": "user", "content": "x"}], "n": 17}',
     400, "n"),
    ("/v1/completions", b'{"model": "tiny", "prompt": "x", "temperature": "hot"}', 400, "temperature"),
    ("/v1/completions", b'{"model": "tiny", "prompt": "x", "max_tokens": 0}', 400, "max_tokens"),
    ("/v1/completions", b'{"model": "tiny", "prompt": "x", "temprature": 0.5, "stream": "yes"}', 400,
     "stream"),
    ("/v1/completions", b'{"model": "tiny", "prompt": ["a", "b"]}', 400, "prompt"),
    ("/v1/completions", b'{"model": "tiny", "prompt": [1, 99999999]}', 400, "prompt_ids"),
    ("/v1/completions", b'{"model": "tiny", "prompt": "x", "max_tokens": 1e400}', 400, "max_tokens"),
    ("/v1/completions", b'{"model": "tiny", "prompt": "x", "seed": 99999999999999999999999}', 400, "seed"),
    ("/v1/completions", b'{"model": "tiny", "prompt": ""}', 400, "prompt"),
    ("/v1/completions", b'[1, 2]', 400, "object"),
    ("/v1/completions", b'', 400, "empty"),
    ("/v1/completions", b'{"model": "gpt-4", "prompt": "x"}', 404, "gpt-4"),
    ("/api/generate", b'{"model": "llama3", "prompt": "x"}', 404, "llama3"),
    ("/api/generate", b'{"model": "tiny", "prompt": "x", "options": {"temperature": "hot"}}', 400,
     "options.temperature"),
    ("/api/generate", b'{"model": "tiny", "prompt": "x", "options": {"mirostat": 2, "top_k": "many"}}', 400,
     "options.top_k"),
    ("/api/generate", b'{"model": "tiny", "prompt": "x", "options": {"repeat_last_n": 5000}}', 400,
     "options.repeat_last_n"),
    ("/api/generate", b'{"model": "tiny", "prompt": "x", "options": {"num_predict": -7}}', 400,
     "options.num_predict"),
    ("/api/generate", b'{"model": "tiny", "prompt": "x", "images": ["aGk="]}', 400, "images"),
    ("/api/chat", b'{"model": "tiny", "messages": "hi"}', 400, "messages"),
    ("/api/chat", b'{"model": "tiny", "messages": [{"role": "user", "content": 3}]}', 400, "content"),
    ("/api/chat", b'not json', 400, "malformed JSON"),
    ("/api/show", b'{"model": "nope"}', 404, "nope"),
]


@pytest.mark.parametrize("path, body, status, names", BAD, ids=[f"{p}-{n}" for p, _, _, n in BAD])
def test_bad_input_is_a_4xx_naming_the_field(http, path, body, status, names):
    """Client mistakes get a 4xx in the endpoint's error shape, and the message names the field."""
    r = http.post(path, content=body, headers={"content-type": "application/json"})
    assert r.status_code == status, r.text
    err = r.json()["error"]
    message = err if path.startswith("/api/") else err["message"]
    assert names in message
    if not path.startswith("/api/"):
        assert set(err) == {"message", "type", "param", "code"}


def test_unknown_endpoint_and_method(http):
    """An unknown path is 404 and a wrong method 405, both as JSON errors."""
    assert http.get("/v2/everything").status_code == 404
    r = http.get("/v1/completions")
    assert r.status_code == 405 and "not allowed" in r.json()["error"]["message"]


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"model": "tiny", "max_tokens": 2}),
    ("/api/generate", {"model": "tiny", "raw": True, "stream": False}),
])
def test_prompt_beyond_context_is_400(http, path, body):
    """A prompt longer than the model's context is a 400 (not a broken stream), streamed or not."""
    prompt = [10 + i % 50 for i in range(600)] if path.startswith("/v1") else "word " * 600
    for stream in (False, True):
        r = http.post(path, json={**body, "prompt": prompt, "stream": stream})
        assert r.status_code == 400, r.text
        assert "context" in r.text


def test_oversized_body_is_413(http):
    """A body over the limit (8 MiB by default) is refused with 413, declared or chunked."""
    big = b'{"model": "tiny", "prompt": "' + b"a" * (9 * 1024 * 1024) + b'"}'
    r = http.post("/v1/completions", content=big)
    assert r.status_code == 413 and "--max-body-bytes" in r.json()["error"]["message"]

    def chunks():
        for i in range(0, len(big), 1 << 20):
            yield big[i : i + (1 << 20)]

    assert http.post("/api/generate", content=chunks()).status_code == 413
    assert http.get("/health").status_code == 200


# ---- cancellation, worker death, timeouts -------------------------------------


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"model": "tiny", "prompt": "Hi", "max_tokens": 500, "ignore_eos": True,
                         "stream": True}),
    # Not "Hi": the tiny model's greedy reply to it ends after 3 tokens, before a loaded machine's
    # client hangs up, and the generation then ends as "stop", not "disconnected".
    ("/api/generate", {"model": "tiny", "prompt": "Hello", "raw": True,
                       "options": {"num_predict": 500, "temperature": 0}}),
])
def test_client_disconnect_cancels_generation(srv, http, path, body):
    """Hanging up mid-stream stops the worker: it produces far fewer than max_tokens tokens."""
    whole = http.post(path, json={**body, "stream": False}).json()  # left alone, it runs to its limit
    ended = whole["choices"][0]["finish_reason"] if "choices" in whole else whole["done_reason"]
    assert ended == "length"
    gone = metric(http, "mlxrt_generations_total", model="tiny", reason="disconnected")
    before = srv.rt.workers[0].tokens
    with httpx.Client(base_url=srv.url, timeout=30) as c, c.stream("POST", path, json=body) as r:
        assert r.status_code == 200
        next(r.iter_lines())
    deadline = time.monotonic() + 20
    while srv.rt.workers[0].in_flight and time.monotonic() < deadline:
        time.sleep(0.01)
    assert srv.rt.workers[0].in_flight == 0
    assert srv.rt.workers[0].tokens - before < 250
    # The handler counts the disconnect as it unwinds, which may be just after the worker is free.
    wait_for(lambda: metric(http, "mlxrt_generations_total", model="tiny", reason="disconnected") == gone + 1,
             20, "the disconnect counted once in mlxrt_generations_total")


def test_worker_death_mid_stream_then_503(tiny_model):
    """A worker killed mid-stream ends the stream with an error event; with no worker left it is 503."""
    # A context long enough that the streams are still running when a loaded machine gets to the kill.
    long = "synthetic:tiny?context=8192"
    s = ServerThread({"a": long, "b": long}, **NO_RESTART)
    url = s.start()
    pids = s.pids
    try:
        by_model = {w.model: w.pid for w in s.rt.workers}
        with httpx.Client(base_url=url, timeout=30) as c:
            body = {"model": "a", "prompt": "Hi", "max_tokens": 6000, "ignore_eos": True, "stream": True}
            with c.stream("POST", "/v1/completions", json=body) as r:
                lines = r.iter_lines()
                next(lines)
                os.kill(by_model["a"], signal.SIGKILL)
                events = [json.loads(x[6:]) for x in lines if x.startswith("data: ")]
            assert "error" in events[-1] and "worker" in events[-1]["error"]["message"]
            assert events[-1]["error"]["code"] == "worker_unavailable"
            # Greedy "Hello" runs 4,184 tokens on this model; sampled, a reply may end within a few.
            body = {"model": "b", "prompt": "Hello", "raw": True,
                    "options": {"num_predict": 6000, "temperature": 0}}
            with c.stream("POST", "/api/generate", json=body) as r:
                lines = r.iter_lines()
                next(lines)
                os.kill(by_model["b"], signal.SIGKILL)
                last = json.loads([x for x in lines if x][-1])
            assert "worker" in last["error"]
            after = c.post("/v1/completions", json={"model": "a", "prompt": "Hi", "max_tokens": 2})
            assert after.status_code == 503 and "no worker can serve" in after.json()["error"]["message"]
            assert c.post("/api/generate", json={"model": "b", "prompt": "Hi"}).status_code == 503
            health = c.get("/health")
            assert health.status_code == 503 and health.json()["status"] == "unavailable"
    finally:
        s.stop()
    assert_stopped(pids)


def test_worker_timeout_is_504(tiny_model, monkeypatch):
    """A worker that never answers within MLXRT_TOKEN_TIMEOUT_S gives 504 naming the setting."""
    monkeypatch.setenv("FAKE_MODE", "silent")
    s = ServerThread({"tiny": tiny_model}, timeouts=Timeouts(token_s=0.5), _worker_argv=FAKE_WORKER)
    url = s.start()
    pids = s.pids
    try:
        r = httpx.post(url + "/api/generate", json={"model": "tiny", "prompt": "Hi"}, timeout=30)
        assert r.status_code == 504 and "MLXRT_TOKEN_TIMEOUT_S" in r.json()["error"]
    finally:
        s.stop()
    assert_stopped(pids)


# ---- the CLI ------------------------------------------------------------------


def test_cli_serve_runs_and_stops_cleanly(tiny_model):
    """`mlxrt serve --spares 1` serves the Ollama client with a spare standing by (shown in /health,
    not counted ready), answers to the model's path on both APIs, then stops itself and both workers
    on SIGTERM."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "mlxrt", "serve", "--model", f"tiny={tiny_model}",
                             "--port", str(port), "--transport", "stdio", "--spares", "1"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                health = httpx.get(url + "/health").json()
                break
            except httpx.TransportError:
                time.sleep(0.1)
        else:
            why = proc.stderr.read().decode() if proc.poll() is not None else "timeout"
            pytest.fail(f"server did not come up: {why}")
        pids = [w["pid"] for w in health["models"]["tiny"]["workers"]]
        assert [w["spare"] for w in health["models"]["tiny"]["workers"]] == [False, True]
        assert health["models"]["tiny"]["ready"] == 1 and len(set(pids)) == 2
        with ollama.Client(host=url) as client:
            assert client.generate(model="tiny", prompt="Hi", options={"num_predict": 3}).done
            assert client.generate(model=tiny_model, prompt="Hi", options={"num_predict": 3}).done
        r = httpx.post(url + "/v1/completions", json={"model": tiny_model, "prompt": "Hi", "max_tokens": 2})
        assert r.status_code == 200, r.text
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
        assert b"listening on" in proc.stderr.read()
        assert_stopped(pids)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stderr.close()


def test_cli_serve_reports_a_missing_model():
    """A model that cannot be found ends `mlxrt serve` with status 1 and a message, before binding."""
    r = subprocess.run([sys.executable, "-m", "mlxrt", "serve", "--model", "/no/such/model"],
                       capture_output=True, timeout=60)
    assert r.returncode == 1 and b"does not exist" in r.stderr


def test_model_specs_are_named():
    """`--model name=path` names it; a bare path is named by its directory; refs by themselves."""
    assert parse_model_specs(["a=/m/x", "/models/Qwen-0.5B/", "synthetic:tiny", "org/model"]) == {
        "a": "/m/x", "Qwen-0.5B": "/models/Qwen-0.5B/", "synthetic:tiny": "synthetic:tiny",
        "org/model": "org/model"}
    with pytest.raises(ValueError, match="twice"):
        parse_model_specs(["x=/a", "x=/b"])


# ---- fuzz ------------------------------------------------------------------------


_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=8,
)
_role = st.sampled_from(["user", "user", "user", "system", "assistant", "bot"])
_msgs = st.lists(st.fixed_dictionaries({"role": _role, "content": st.text(max_size=16)}),
                 min_size=1, max_size=3) | st.just([])
# Mostly valid values with the edges just outside; `request_bodies` adds wild JSON on top.
_sampling = {
    "temperature": st.floats(0, 2) | st.just(-1.0), "top_p": st.floats(0.01, 1) | st.just(0.0),
    "seed": st.integers(0, 2**63 - 1) | st.integers(-5, -1) | st.just(2**64),
    "stop": st.one_of(st.text(max_size=3), st.lists(st.text(max_size=3), max_size=2)),
    "stream": st.booleans(), "min_p": st.floats(0, 0.5) | st.just(1.5),
    "top_k": st.integers(-1, 100) | st.sampled_from([2047, 2048, 10**6]),  # tiny's vocabulary: 2048
}
# Structured output: plausible schemas, and wild ones from `request_bodies` (a dict of junk is a schema too).
_schema = st.sampled_from([{"type": "object"}, {"type": "integer", "minimum": 3, "maximum": 1},
                           {"type": "array", "items": {"type": "boolean"}}, {"type": "wizard"}])
FIELDS = {
    "/v1/chat/completions": {"model": st.just("tiny"), "messages": _msgs, "max_tokens": st.integers(-1, 4),
                             "n": st.just(1) | st.integers(0, 2),
                             "stream_options": st.just({"include_usage": True}), **_sampling},
    "/v1/completions": {"model": st.just("tiny"), "max_tokens": st.integers(-1, 4),
                        "prompt": st.text(max_size=16) | st.lists(st.integers(-2, 3000), max_size=6),
                        "ignore_eos": st.booleans(), "return_token_ids": st.booleans(),
                        "stop_token_ids": st.lists(st.integers(0, 2100), max_size=2),
                        "response_format": st.fixed_dictionaries(
                            {"type": st.sampled_from(["text", "json_object", "json_schema", "xml"])},
                            optional={"json_schema": st.fixed_dictionaries({"name": st.just("r")},
                                                                           optional={"schema": _schema})}),
                        **_sampling},
    "/api/generate": {"model": st.sampled_from(["tiny", "tiny:latest"]), "prompt": st.text(max_size=16),
                      "raw": st.booleans(), "stream": st.booleans(), "system": st.text(max_size=8),
                      "keep_alive": st.one_of(st.text(max_size=4), st.integers(-2, 2)),
                      "format": st.sampled_from(["json", "", "xml"]) | _schema,
                      "options": st.fixed_dictionaries({"num_predict": st.integers(-3, 4)},
                                                       optional={k: v for k, v in _sampling.items()
                                                                 if k != "stream"})},
    "/api/chat": {"model": st.just("tiny"), "messages": _msgs, "stream": st.booleans(),
                  "options": st.fixed_dictionaries({"num_predict": st.integers(-3, 4)},
                                                   optional={"temperature": st.floats(-1, 3)})},
    "/api/show": {"model": st.sampled_from(["tiny", "x"]), "verbose": st.booleans()},
}


REQUIRED = {"model", "messages", "prompt"}
# Put in place of one string of a body, each makes it a 400 wherever it lands: invalid UTF-8 (a
# surrogate encoded as UTF-8 too), unpaired UTF-16 surrogate escapes, NUL, and deep nesting.
POISONS = [b"\xff\xfe", b"ok\xc3", b"\xed\xa0\x80", b"\\ud800", b"x\\udc00", b"\\udfff\\ud800",
           b"\\ud800\\u0041", b"\\u0000", b"stop\\\\\\u0000"]
SENTINEL = "\ue000poison\ue000"


def _string_slots(node) -> list[tuple]:
    """(container, key) of every string value in a JSON-like `node`, nested ones included."""
    slots = []
    for key, value in node.items() if isinstance(node, dict) else enumerate(node):
        if isinstance(value, str):
            slots.append((node, key))
        elif isinstance(value, (dict, list)):
            slots.extend(_string_slots(value))
    return slots


def _poison(draw, body: dict) -> bytes | None:
    """`body` encoded with one of its strings replaced by bad bytes or deep nesting; None: left alone."""
    slots = _string_slots(body)
    if not slots or draw(st.integers(0, 3)):
        return None
    container, key = draw(st.sampled_from(slots))
    container[key] = SENTINEL
    raw = msgspec.json.encode(body)
    if draw(st.booleans()):
        depth = draw(st.integers(65, 3000))
        opener, closer = draw(st.sampled_from([(b"[", b"]"), (b'{"a":', b"}")]))
        return raw.replace(b'"' + SENTINEL.encode() + b'"', opener * depth + b"1" + closer * depth)
    return raw.replace(SENTINEL.encode(), draw(st.sampled_from(POISONS)))


@st.composite
def request_bodies(draw):
    """A body for a random endpoint: mostly plausible fields, some wild values, unknown keys, garbage,
    and bad bytes or deep nesting in place of a string (then it must be a 400: the last item)."""
    path = draw(st.sampled_from(sorted(FIELDS)))
    if draw(st.integers(0, 9)) == 0:
        return path, draw(st.binary(max_size=40)), False
    body = {}
    for name, valid in FIELDS[path].items():
        if name in REQUIRED or draw(st.integers(0, 2)) == 0:
            body[name] = draw(valid if draw(st.integers(0, 9)) else _json)
    if draw(st.integers(0, 7)) == 0:
        body[draw(st.text(min_size=1, max_size=8))] = draw(_json)
    # Keep generations short: an unbounded one would run to the end of the context.
    if path.startswith("/v1"):
        body.setdefault("max_tokens", 4)
    elif path != "/api/show" and not isinstance(body.get("options"), dict):
        body["options"] = {"num_predict": 4}
    poisoned = _poison(draw, body)
    return path, poisoned or msgspec.json.encode(body), poisoned is not None


@settings(max_examples=80, deadline=None, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(case=request_bodies())
def test_fuzzed_bodies_never_500_or_hang(http, case):
    """Random and mutated request bodies get 200 or a 4xx/501 with a JSON body: no 500, crash or hang;
    bad bytes and deep nesting get 400 in the API's error shape."""
    path, body, poisoned = case
    with http.stream("POST", path, content=body, headers={"content-type": "application/json"}) as r:
        raw = r.read()
    event(f"{path} {r.status_code}{' poisoned' if poisoned else ''}")  # --hypothesis-show-statistics
    assert r.status_code in OK_STATUSES, (r.status_code, raw[:500])
    if poisoned:
        assert r.status_code == 400, raw[:500]
        err = json.loads(raw)["error"]
        if path.startswith("/api/"):
            assert isinstance(err, str)
        else:
            assert set(err) == {"message", "type", "param", "code"}
    if r.headers["content-type"].startswith("text/event-stream"):
        assert raw.endswith(b"data: [DONE]\n\n") and b'"error"' not in raw
    else:
        for line in raw.splitlines():
            if line:
                json.loads(line)
    assert http.get("/health").status_code == 200
