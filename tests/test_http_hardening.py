"""The HTTP server against bad bytes, deep nesting, oversized bodies, out-of-vocabulary sampling
values and model paths: real uvicorn over a real worker on the tiny model, raw HTTP and sockets."""

from __future__ import annotations

import json
import socket
import urllib.error
import urllib.request
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import ollama
import pytest
from mlxrt.orchestrator.http import ServerConfig
from mlxrt.orchestrator.http.body import MAX_JSON_DEPTH

SMALL_LIMIT = 64 * 1024  #: the body limit of the small-limit server
VOCAB = 2048  #: the tiny model's vocabulary size
GENERATE = {
    "/v1/chat/completions": b'{"model": "tiny", "max_tokens": 2, '
                            b'"messages": [{"role": "user", "content": %s}]}',
    "/v1/completions": b'{"model": "tiny", "max_tokens": 2, "prompt": %s}',
    "/api/generate": b'{"model": "tiny", "options": {"num_predict": 2}, "stream": false, "prompt": %s}',
    "/api/chat": b'{"model": "tiny", "options": {"num_predict": 2}, "stream": false, '
                 b'"messages": [{"role": "user", "content": %s}]}',
}


@pytest.fixture(scope="module")
def small(srv):
    """The base URL of a second server over the same runtime, refusing bodies over `SMALL_LIMIT`."""
    return srv.serve(ServerConfig(max_body_bytes=SMALL_LIMIT))


def error_message(path: str, r: httpx.Response) -> str:
    """The message of an error response, checking it has the endpoint's API's shape."""
    err = r.json()["error"]
    if path.startswith("/api/"):
        assert isinstance(err, str)
        return err
    assert set(err) == {"message", "type", "param", "code"}
    return err["message"]


# ---- bad bytes and bad shapes --------------------------------------------------


BAD_STRINGS = [
    (b'"\xff\xfe"', "UTF-8"),
    (b'"caf\xc3"', "UTF-8"),
    (b'"\xed\xa0\x80"', "UTF-8"),  # a surrogate, encoded as UTF-8
    (rb'"\ud800"', "surrogate"),
    (rb'"x\udc00"', "surrogate"),
    (rb'"\udfff\ud800"', "surrogate"),
    (rb'"\ud800\u0041"', "surrogate"),
    (rb'"a\u0000b"', "NUL"),
    (rb'"a\\\u0000"', "NUL"),  # an escaped backslash, then NUL
]


@pytest.mark.parametrize("path", sorted(GENERATE))
@pytest.mark.parametrize("text, names", BAD_STRINGS, ids=[f"{t!r}" for t, _ in BAD_STRINGS])
def test_bad_bytes_in_the_prompt_are_400(http, path, text, names):
    """Invalid UTF-8, unpaired surrogate escapes and NUL in the prompt or a message get a 400 naming
    the problem, in the API's error shape."""
    r = http.post(path, content=GENERATE[path] % text, headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    assert names in error_message(path, r)


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", b'{"model": %s, "prompt": "x"}'),
    ("/v1/completions", b'{"model": "tiny", "prompt": "x", "stop": ["a", %s]}'),
    ("/v1/chat/completions", b'{"model": "tiny", "messages": [{"role": "user", "content": [{"type": "text", '
                             b'"text": %s}]}]}'),
    ("/v1/chat/completions", b'{"model": "tiny", "messages": [{"role": "user", "content": "x"}], '
                             b'"user": %s}'),
    ("/api/generate", b'{"model": %s, "prompt": "x"}'),
    ("/api/generate", b'{"model": "tiny", "prompt": "x", "system": %s}'),
    ("/api/chat", b'{"model": "tiny", "messages": [], "options": {"stop": %s}}'),
    ("/api/show", b'{"model": %s}'),
])
def test_nul_and_bad_utf8_in_any_string_field_are_400(http, path, body):
    """NUL and invalid UTF-8 are refused in every string field (model, stop, system, ...), not just
    the prompt."""
    for text, names in ((rb'"t\u0000iny"', "NUL"), (b'"t\xffiny"', "UTF-8")):
        r = http.post(path, content=body % text, headers={"content-type": "application/json"})
        assert r.status_code == 400, r.text
        assert names in error_message(path, r)


def test_escaped_text_that_only_looks_bad_is_served(http):
    """A literal backslash before 'u0000', and a surrogate pair (an emoji), are ordinary text."""
    for text in (rb'"C:\\u0000 path"', rb'"\ud83d\ude00 weather"'):
        r = http.post("/v1/completions", content=GENERATE["/v1/completions"] % text)
        assert r.status_code == 200, r.text


def nested(depth: int) -> bytes:
    """A JSON value of `depth` levels of arrays and objects."""
    opens, closes = b"", b""
    for i in range(depth):
        opens, closes = (opens + b"[", b"]" + closes) if i % 2 else (opens + b'{"k": ', b"}" + closes)
    return opens + b"1" + closes


@pytest.mark.parametrize("path", [*sorted(GENERATE), "/api/show"])
def test_deep_nesting_is_400(http, path):
    """A body nested thousands of levels deep is a 400 naming the limit, not a RecursionError; bracket
    characters inside strings do not count."""
    for field in (b'"format"', b'"zz"', b'"model"'):
        body = b'{"model": "tiny", ' + field + b": " + nested(5000) + b"}"
        r = http.post(path, content=body, headers={"content-type": "application/json"})
        assert r.status_code == 400, r.text
        assert f"deeper than {MAX_JSON_DEPTH} levels" in error_message(path, r)
    flat = GENERATE.get(path, b'{"model": %s}') % (b'"' + b"[{" * 3000 + b'"')
    assert "levels" not in http.post(path, content=flat).text


def test_nesting_limit_is_exact(http):
    """The body itself is level 1: MAX_JSON_DEPTH levels pass the nesting check, one more does not."""
    for depth, deep in ((MAX_JSON_DEPTH, False), (MAX_JSON_DEPTH + 1, True)):
        # think takes a bool or a string: a 400 either way; format would now be a JSON schema to serve
        body = b'{"model": "tiny", "think": ' + nested(depth - 1) + b"}"
        r = http.post("/api/chat", content=body)
        assert r.status_code == 400, r.text
        assert ("levels" in r.json()["error"]) is deep, r.text


# ---- oversized bodies -------------------------------------------------------------


def raw_post(url: str, path: str, head: bytes, parts: list[bytes]) -> bytes:
    """Send a request on a fresh socket (all of it, as a client that reads only afterwards would),
    then read the whole response until the server closes the connection."""
    host, port = urlsplit(url).hostname, urlsplit(url).port
    with socket.create_connection((host, port), timeout=30) as sock:
        sock.sendall(b"POST %s HTTP/1.1\r\nHost: x\r\nConnection: close\r\n%s\r\n" % (path.encode(), head))
        for part in parts:
            sock.sendall(part)
        response = b""
        while chunk := sock.recv(1 << 16):
            response += chunk
    return response


def chunked(body: bytes, size: int = 1 << 16) -> list[bytes]:
    """`body` in HTTP/1.1 chunked transfer coding."""
    pieces = [body[i : i + size] for i in range(0, len(body), size)]
    return [*(b"%x\r\n%s\r\n" % (len(p), p) for p in pieces), b"0\r\n\r\n"]


@pytest.mark.parametrize("path", ["/v1/completions", "/api/generate"])
def test_oversized_body_gets_its_413_before_the_close(small, path):
    """A body over the limit, announced by Content-Length or chunked, from a client that sends all of
    it before reading and asks for 'Connection: close', reads a whole 413 in the API's shape (the
    server reads the rest of the body first: closing on unread bytes would reset the connection)."""
    big = b'{"model": "tiny", "prompt": "' + b"a" * (16 << 20) + b'"}'
    declared = raw_post(small, path, b"Content-Length: %d\r\n" % len(big), [big])
    streamed = raw_post(small, path, b"Transfer-Encoding: chunked\r\n", chunked(big))
    for response in (declared, streamed):
        head, _, body = response.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 413 "), head
        error = json.loads(body)["error"]
        assert "--max-body-bytes" in (error if path.startswith("/api/") else error["message"])


def test_oversized_body_413_with_urllib(small):
    """urllib (which always sends 'Connection: close') gets the 413, not a reset connection."""
    big = b'{"model": "tiny", "prompt": "' + b"a" * (16 << 20) + b'"}'
    request = urllib.request.Request(small + "/v1/completions", data=big,
                                     headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(request, timeout=30)
    info.value.close()
    assert info.value.code == 413


def test_oversized_body_with_expect_continue_is_refused_unsent(small):
    """A client that asks 'Expect: 100-continue' gets its 413 at once, without sending the body."""
    head = b"Content-Length: %d\r\nExpect: 100-continue\r\n" % (SMALL_LIMIT + 1)
    response = raw_post(small, "/api/chat", head, [])
    assert response.startswith(b"HTTP/1.1 413 ") and b"100 Continue" not in response


def test_body_at_the_limit_is_served(small):
    """A body of exactly the limit is read and served, announced by Content-Length or chunked."""
    body = b'{"model": "tiny", "prompt": "x", "max_tokens": 2, "user": "' + b"u" * SMALL_LIMIT
    body = body[: SMALL_LIMIT - 2] + b'"}'
    declared = raw_post(small, "/v1/completions", b"Content-Length: %d\r\n" % len(body), [body])
    streamed = raw_post(small, "/v1/completions", b"Transfer-Encoding: chunked\r\n", chunked(body, 1000))
    for response in (declared, streamed):
        assert response.startswith(b"HTTP/1.1 200 "), response[:300]


# ---- sampling values checked against the model -----------------------------------


@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", {"prompt": "Hi", "max_tokens": 2, "top_k": VOCAB}, "top_k"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "top_k": 10**6}, "top_k"),
    ("/v1/completions", {"prompt": "Hi", "max_tokens": 2, "stop_token_ids": [3, VOCAB]}, "stop_token_ids"),
    ("/api/generate", {"prompt": "Hi", "options": {"top_k": VOCAB}}, "options.top_k"),
    ("/api/chat", {"messages": [{"role": "user", "content": "Hi"}], "options": {"top_k": 10**9}},
     "options.top_k"),
])
def test_sampling_beyond_the_vocabulary_is_400_before_the_worker(srv, http, path, body, param):
    """top_k of the model's vocabulary size or more, or a stop token id outside it, is a 400 naming the field,
    and the request never reaches the worker."""
    before = srv.rt.workers[0].requests
    r = http.post(path, json={"model": "tiny", "stream": False, **body})
    assert r.status_code == 400, r.text
    message = error_message(path, r)
    assert param in message and str(VOCAB) in message
    if not path.startswith("/api/"):
        assert r.json()["error"]["param"] == param
    assert srv.rt.workers[0].requests == before


def test_top_k_just_inside_the_vocabulary_is_served(http):
    """top_k up to the vocabulary size less one is served (mlx-lm's sampler takes (0, vocab_size)),
    as is the last token id as a stop id."""
    body = {"model": "tiny", "prompt": "Hi", "max_tokens": 2, "stop_token_ids": [VOCAB - 1]}
    assert http.post("/v1/completions", json={**body, "top_k": VOCAB - 1}).status_code == 200
    r = http.post("/v1/completions", json={**body, "top_k": VOCAB})
    assert r.status_code == 400 and r.json()["error"]["param"] == "top_k"


# ---- model names: the path a model is served from ---------------------------------


def test_model_answers_to_the_path_it_is_served_from(srv, tiny_model, tmp_path):
    """A model served from a path answers to that path as given and resolved, on every endpoint that
    takes a model name, while /v1/models and /api/tags still list its name only."""
    link = tmp_path / "models" / "small"
    link.parent.mkdir()
    link.symlink_to(tiny_model)
    url = srv.serve(ServerConfig(), model_refs={"tiny": str(link)})
    chat = [{"role": "user", "content": "Hi"}]
    with httpx.Client(base_url=url, timeout=60) as http, ollama.Client(host=url) as oll:
        for name in (str(link), str(Path(tiny_model).resolve())):
            r = http.post("/v1/chat/completions", json={"model": name, "max_tokens": 2, "messages": chat})
            assert r.status_code == 200, (name, r.text)
            r = http.post("/v1/completions", json={"model": name, "prompt": "Hi", "max_tokens": 2})
            assert r.status_code == 200, (name, r.text)
            assert http.get(f"/v1/models/{name}").json()["id"] == "tiny"
            assert oll.generate(model=name, prompt="Hi", options={"num_predict": 2}).done
            assert oll.chat(model=name + ":latest", messages=chat, options={"num_predict": 2}).done
            assert oll.show(name).details.family == "qwen2"
        assert [m["id"] for m in http.get("/v1/models").json()["data"]] == ["tiny"]
        assert [m.model for m in oll.list().models] == ["tiny"]
        other = http.post("/v1/completions", json={"model": str(tmp_path), "prompt": "Hi"})
        assert other.status_code == 404 and "'tiny'" in other.json()["error"]["message"]


def test_worker_failures_map_by_kind_not_by_name():
    """A request the worker refused is a 400 naming the field as the API does, a prompt beyond the
    context a 400 with OpenAI's code, anything else a 500: by the kind the worker sent, whatever the
    exception's class name; a gone worker is a 503 by type."""
    from mlxrt import RequestError, WorkerDied
    from mlxrt.orchestrator.http.errors import from_runtime_error

    bad = RequestError("SomeNewError", "invalid top_k=9000: must be < 2048", kind="invalid", field="top_k")
    err = from_runtime_error(bad, {"top_k": "options.top_k"})
    assert (err.status, err.param) == (400, "options.top_k") and "invalid options.top_k=9000" in err.message
    long = from_runtime_error(RequestError("X", "prompt has 9 tokens", kind="too_long", field="prompt"))
    assert (long.status, long.param, long.code) == (400, "prompt", "context_length_exceeded")
    assert from_runtime_error(RequestError("ValueError", "oops")).status == 500  # kind defaults to internal
    assert from_runtime_error(WorkerDied("gone")).status == 503
