"""Structured output: replies match their JSON schema in the engine, over both HTTP APIs and in Python.

The tiny model has random weights, so without the grammar its replies are
never JSON: every reply that completes (finish ``stop``) validating against
its schema is the grammar's doing. A reply cut by max_tokens (``length``)
may be incomplete JSON, as with OpenAI; the schemas bound their strings and
arrays so that most replies complete.
"""

from __future__ import annotations

import asyncio
import ctypes
import json
import subprocess
import sys

import httpx
import jsonschema
import llguidance.numpy
import pytest
from mlxrt import Grammar, Runtime
from mlxrt.ipc.protocol import GRAMMAR_DEAD_END, EngineOptions, Generate, SamplingParams
from mlxrt.worker.engine import Engine
from mlxrt.worker.grammar import Constraint
from support import run_batch as run

S = {"type": "string", "maxLength": 8}
SMALL_INT = {"type": "integer", "minimum": 0, "maximum": 99}


def obj(required: dict, optional: dict | None = None, *, extra: bool = False) -> dict:
    """An object schema with these required (and optional) properties."""
    props = {**required, **(optional or {})}
    return {"type": "object", "properties": props, "required": list(required), "additionalProperties": extra}


SCHEMAS: list[dict] = [
    {"type": "boolean"},
    {"type": "null"},
    SMALL_INT,
    {"type": "integer", "minimum": -5, "maximum": 5},
    {"type": "number", "minimum": 0, "maximum": 1},
    {"type": "integer", "exclusiveMinimum": 10, "exclusiveMaximum": 13},
    S,
    {"type": "string", "enum": ["red", "green", "blue"]},
    {"type": "string", "pattern": "^[a-c]{2,4}$"},
    {"const": "fixed"},
    {"enum": [1, "two", None, True]},
    {"type": "array", "items": {"type": "boolean"}, "maxItems": 3},
    {"type": "array", "items": SMALL_INT, "minItems": 2, "maxItems": 4},
    {"type": "array", "prefixItems": [S, SMALL_INT], "items": False},
    {"type": "object"},
    obj({"ok": {"type": "boolean"}}),
    obj({"name": S, "age": SMALL_INT}),
    obj({"name": S}, {"age": SMALL_INT, "email": S}),
    obj({}, {"a": {"type": "boolean"}, "b": {"type": "null"}}),
    obj({"colour": {"enum": ["red", "green"]}, "size": {"enum": ["S", "M", "L"]}}),
    obj({"score": {"type": "number", "minimum": -1, "maximum": 1}}),
    obj({"tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3}}),
    obj({"point": obj({"x": SMALL_INT, "y": SMALL_INT})}),
    obj({"user": obj({"name": S}, {"admin": {"type": "boolean"}}), "active": {"type": "boolean"}}),
    obj({"items": {"type": "array", "items": obj({"id": SMALL_INT}), "maxItems": 2}}),
    obj({"matrix": {"type": "array", "maxItems": 2,
                    "items": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9},
                              "maxItems": 2}}}),
    obj({"id": SMALL_INT}, {"meta": obj({}, {"k": S})}, extra=True),
    obj({"value": {"anyOf": [SMALL_INT, {"type": "boolean"}]}}),
    obj({"value": {"type": ["integer", "null"], "minimum": 0, "maximum": 9}}),
    obj({"ref": {"$ref": "#/$defs/small"}}) | {"$defs": {"small": {"enum": [1, 2, 3]}}},
    {"oneOf": [obj({"kind": {"const": "a"}, "n": SMALL_INT}), obj({"kind": {"const": "b"}})]},
    obj({"a": obj({"b": obj({"c": obj({"d": {"type": "boolean"}})})})}),
]
PROMPTS = ["Hello", "Give me JSON about the weather", "The tide came in over the rocks"]
MAX_TOKENS = 96


@pytest.fixture(scope="module")
def engine(tiny_model):
    return Engine(tiny_model, options=EngineOptions(decode_concurrency=16))


def schema_grammar(schema: dict) -> Grammar:
    return Grammar(kind="json_schema", source=json.dumps(schema))


def gen(i: int, prompt: str, schema: dict | None = None, **params) -> Generate:
    params.setdefault("max_tokens", MAX_TOKENS)
    grammar = schema_grammar(schema) if schema is not None else None
    return Generate(id=i, prompt=prompt, params=SamplingParams(grammar=grammar, **params))


def assert_matches(text: str, schema: dict, finish_reason: str) -> None:
    """A complete reply is JSON that validates; a cut one (length) is only required to be text."""
    if finish_reason == "stop":
        jsonschema.validate(json.loads(text), schema)
    else:
        assert finish_reason == "length", finish_reason


# ---- in-process, the engine ---------------------------------------------------------------


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
def test_every_complete_reply_validates_against_its_schema(engine, sampled):
    """Dozens of schemas, in batches of 16: every reply that completes is JSON matching its schema,
    and every schema gets complete replies (the check is not vacuous)."""
    params = {"temperature": 1.0, "seed": 7} if sampled else {}
    reqs = [gen(i, PROMPTS[i % len(PROMPTS)], SCHEMAS[i // len(PROMPTS)], **params)
            for i in range(len(SCHEMAS) * len(PROMPTS))]
    rec = run(engine, reqs)
    assert not rec.errors
    complete = set()
    for r in reqs:
        schema = SCHEMAS[r.id // len(PROMPTS)]
        reason = rec.stats[r.id].finish_reason
        assert_matches(rec.text.get(r.id, ""), schema, reason)
        if reason == "stop":
            complete.add(r.id // len(PROMPTS))
    assert len(complete) >= 0.8 * len(SCHEMAS), f"only {len(complete)} schemas completed"


def test_unconstrained_ids_unchanged_beside_constrained_ones(engine):
    """Unconstrained requests batched with constrained ones give the ids they give alone, and so do
    the constrained ones."""
    plain = [gen(100 + i, p, ignore_eos=True, max_tokens=24) for i, p in enumerate(PROMPTS)]
    constrained = [gen(200 + i, p, SCHEMAS[16 + i]) for i, p in enumerate(PROMPTS)]
    alone = {r.id: run(engine, [r]).ids[r.id] for r in plain + constrained}
    mixed = run(engine, [x for pair in zip(plain, constrained, strict=True) for x in pair])
    for r in plain + constrained:
        assert mixed.ids[r.id] == alone[r.id], r.id


def test_ignore_eos_and_max_tokens_still_end(engine):
    """With ignore_eos a complete grammar still ends the reply (stop, no EOS text); max_tokens ends
    an incomplete one (length)."""
    schema = obj({"ok": {"type": "boolean"}})
    rec = run(engine, [gen(1, "Hello", schema, ignore_eos=True), gen(2, "Hello", schema, max_tokens=3)])
    assert rec.stats[1].finish_reason == "stop"
    assert json.loads(rec.text[1]) in ({"ok": True}, {"ok": False})
    assert not set(rec.ids[1]) & set(engine.tokenizer.eos_token_ids)
    assert rec.stats[2].finish_reason == "length" and len(rec.ids[2]) == 3


def test_regex_and_lark_grammars(engine):
    """The other grammar kinds (for tool calling later): replies match them."""
    regex = Grammar(kind="regex", source=r"(yes|no), [0-9]{1,3}")
    lark = Grammar(kind="lark", source='start: "x=" NUM ";"\nNUM: /[0-9]{1,2}/')
    reqs = [Generate(id=1, prompt="Hi", params=SamplingParams(max_tokens=16, grammar=regex)),
            Generate(id=2, prompt="Hi", params=SamplingParams(max_tokens=16, grammar=lark))]
    rec = run(engine, reqs)
    import re

    assert re.fullmatch(r"(yes|no), [0-9]{1,3}", rec.text[1]) and rec.stats[1].finish_reason == "stop"
    assert re.fullmatch(r"x=[0-9]{1,2};", rec.text[2]) and rec.stats[2].finish_reason == "stop"


def test_bad_grammar_fails_alone_at_admission(engine):
    """A grammar that does not compile fails its own request before the batch; the others run on."""
    bad = Generate(id=1, prompt="Hi", params=SamplingParams(grammar=Grammar(kind="regex", source="(")))
    good = gen(2, "Hi", SCHEMAS[16])
    plain = gen(3, "Hi", max_tokens=8, ignore_eos=True)
    rec = run(engine, [bad, good, plain])
    assert type(rec.errors[1]).__name__ == "GrammarError" and 1 not in rec.stats
    assert rec.stats[2].finish_reason in ("stop", "length") and len(rec.ids[3]) == 8


class DeadEnd:
    """A real matcher whose masks allow nothing from the `after`-th step on: a grammar dead end."""

    def __init__(self, matcher, after: int) -> None:
        self._m = matcher
        self._left = after

    def unsafe_compute_mask_ptr(self, ptr: int, size: int) -> None:
        self._m.unsafe_compute_mask_ptr(ptr, size)
        self._left -= 1
        if self._left < 0:
            ctypes.memset(ptr, 0, size)

    def __getattr__(self, name):
        return getattr(self._m, name)


def test_dead_end_ends_with_its_finish_reason(engine, monkeypatch):
    """A grammar that allows no next token ends the request with grammar_dead_end, the tokens before
    it sent and valid, never a hang; the engine serves the next request as before."""
    grammars = engine.grammars

    def dead_end_constraint(grammar):
        return Constraint(DeadEnd(grammars.matcher(grammar), after=3), grammars.tokenizer().vocab_size)

    monkeypatch.setattr(grammars, "constraint", dead_end_constraint)
    plain = gen(2, "Hi", max_tokens=8, ignore_eos=True)
    rec = run(engine, [gen(1, "Hello", SCHEMAS[16]), plain])
    assert rec.stats[1].finish_reason == GRAMMAR_DEAD_END
    assert len(rec.ids[1]) == 3 and rec.text[1].startswith("{")
    assert len(rec.ids[2]) == 8
    monkeypatch.undo()
    again = run(engine, [gen(3, "Hello", SCHEMAS[16])])
    assert_matches(again.text[3], SCHEMAS[16], again.stats[3].finish_reason)


def test_batch_masks_are_the_per_row_masks(engine, monkeypatch):
    """A batch of constrained and plain rows, some ending mid-batch, gives the same ids and endings
    with the step's masks computed for all rows at once as with each row masking itself."""
    reqs = [gen(300 + i, PROMPTS[i % 3], SCHEMAS[(5 * i) % len(SCHEMAS)] if i % 3 else None,
                max_tokens=12 + 5 * i, ignore_eos=not i % 3) for i in range(9)]
    before = engine.masks.batched_rows
    batched = run(engine, reqs)
    after = engine.masks.batched_rows
    assert after > before  # the batch path ran, not only the per-row one
    monkeypatch.setattr(engine, "_plan_masks", lambda: None)
    per_row = run(engine, reqs)
    assert engine.masks.batched_rows == after  # and this time it did not
    for r in reqs:
        assert batched.ids[r.id] == per_row.ids[r.id], r.id
        assert batched.stats[r.id].finish_reason == per_row.stats[r.id].finish_reason, r.id


def test_dead_end_in_a_batch_step_ends_that_row_alone(engine, monkeypatch):
    """A grammar whose batch-computed mask allows nothing ends its request with grammar_dead_end,
    unsent; the other constrained row of the same steps goes on to a valid reply."""
    real = llguidance.numpy.fill_next_token_bitmask_par
    calls = {"n": 0}

    def fill(executor, matchers, words):
        real(executor, matchers, words)
        calls["n"] += 1
        if calls["n"] >= 3:  # from the third batch step on, the first request's grammar allows nothing
            for matcher, row in matchers:
                if matcher is doomed[0]:
                    words[row] = 0

    doomed: list = []
    constraint = engine.grammars.constraint

    def first_doomed(grammar):
        con = constraint(grammar)
        if not doomed:
            doomed.append(con.matcher)
        return con

    monkeypatch.setattr(llguidance.numpy, "fill_next_token_bitmask_par", fill)
    monkeypatch.setattr(engine.grammars, "constraint", first_doomed)
    rec = run(engine, [gen(1, "Hello", SCHEMAS[16], ignore_eos=True), gen(2, "Hello", SCHEMAS[15]),
                       gen(3, "Hi", max_tokens=8, ignore_eos=True)])
    assert rec.stats[1].finish_reason == GRAMMAR_DEAD_END and rec.text[1].startswith("{")
    assert_matches(rec.text[2], SCHEMAS[15], rec.stats[2].finish_reason)
    assert len(rec.ids[3]) == 8


def test_grammar_cache_compiles_once(engine):
    """A grammar is compiled once per worker and copied per request."""
    g = schema_grammar({"type": "array", "items": {"type": "boolean"}, "maxItems": 2, "minItems": 1})
    before = engine.grammars.compiles
    run(engine, [Generate(id=i, prompt="Hi", params=SamplingParams(max_tokens=16, grammar=g))
                 for i in range(3)])
    assert engine.grammars.compiles == before + 1


def test_orchestrator_side_imports_no_mlx():
    """Checking a schema at the edge needs llguidance only: the orchestrator still never imports mlx."""
    code = ("import sys, mlxrt, mlxrt.orchestrator.http.app, mlxrt.orchestrator.structured as s;"
            "s.json_schema_grammar({'type': 'object'});"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('mlx', 'mlx_lm')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


# ---- the Python API -------------------------------------------------------------------------


USER = obj({"name": S, "age": SMALL_INT})


def test_python_api_json_schema_stream_and_generate(tiny_model):
    """`rt.generate(json_schema=...)` and `rt.stream(...)` match the schema; a bad schema is a
    ValueError naming json_schema, raised before anything is sent."""
    with Runtime(model=tiny_model, transport="stdio") as rt:
        c = rt.generate("Hello", max_tokens=MAX_TOKENS, json_schema=USER)
        assert_matches(c.text, USER, c.finish_reason)
        stream = rt.stream("Hi", max_tokens=MAX_TOKENS, json_schema=json.dumps(USER))
        text = "".join(ch.text for ch in stream)
        assert_matches(text, USER, stream.finish_reason)
        sent = sum(w.requests for w in rt.workers)
        for bad in ({"type": "integer", "minimum": 5, "maximum": 1}, {"dependentRequired": {"a": ["b"]}},
                    "{not json", [1]):
            with pytest.raises(ValueError, match="invalid json_schema"):
                rt.generate("Hi", json_schema=bad)
        with pytest.raises(ValueError, match="invalid grammar"):
            rt.generate("Hi", grammar=Grammar(kind="regex", source="("))
        assert sum(w.requests for w in rt.workers) == sent


# ---- HTTP, and the async Python API beneath it ------------------------------------------------


def json_schema_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "reply", "schema": schema, "strict": True}}


def test_openai_chat_json_schema_stream_and_not(oai):
    """/v1/chat/completions with response_format json_schema, streamed and not, via the openai client."""
    for i, schema in enumerate(SCHEMAS[15:25]):
        kw = {"model": "tiny", "messages": [{"role": "user", "content": PROMPTS[i % 3]}], "temperature": 0,
              "max_tokens": MAX_TOKENS, "response_format": json_schema_format(schema)}
        r = oai.chat.completions.create(**kw)
        assert_matches(r.choices[0].message.content, schema, r.choices[0].finish_reason)
        chunks = list(oai.chat.completions.create(**kw, stream=True))
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text == r.choices[0].message.content
        assert chunks[-1].choices[0].finish_reason == r.choices[0].finish_reason


def test_openai_completions_json_object_and_parse(oai):
    """/v1/completions takes response_format json_object; the client's parse() helper gets its model."""
    r = oai.completions.create(model="tiny", prompt="Hello", max_tokens=MAX_TOKENS, temperature=0,
                               extra_body={"response_format": {"type": "json_object"}})
    assert_matches(r.choices[0].text, {"type": "object"}, r.choices[0].finish_reason)
    from pydantic import BaseModel, Field

    class Reply(BaseModel):
        ok: bool
        n: int = Field(ge=0, le=9)

    parsed = oai.chat.completions.parse(model="tiny", messages=[{"role": "user", "content": "Hi"}],
                                        temperature=0, max_tokens=MAX_TOKENS, response_format=Reply)
    assert isinstance(parsed.choices[0].message.parsed, Reply)


def test_ollama_format_schema_and_json(oll):
    """Ollama's format: a schema on /api/generate (streamed and not), "json" on /api/chat."""
    opts = {"temperature": 0, "num_predict": MAX_TOKENS}
    for schema in SCHEMAS[16:20]:
        r = oll.generate(model="tiny", prompt="Hello", format=schema, options=opts)
        assert_matches(r.response, schema, r.done_reason)
        parts = list(oll.generate(model="tiny", prompt="Hello", format=schema, options=opts, stream=True))
        assert "".join(p.response for p in parts) == r.response
    r = oll.chat(model="tiny", messages=[{"role": "user", "content": "Hi"}], format="json", options=opts)
    assert_matches(r.message.content, {"type": "object"}, r.done_reason)


def test_async_runtime_json_schema_batched_with_plain(srv):
    """The async runtime: constrained and unconstrained requests at once; the plain ones' ids are the
    ids they get alone."""
    rt = srv.rt

    async def both():
        plain = dict(max_tokens=16, ignore_eos=True)
        alone = await rt.generate("The tide", **plain)
        together = await asyncio.gather(
            rt.generate("The tide", **plain),
            *(rt.generate(p, max_tokens=MAX_TOKENS, json_schema=USER) for p in PROMPTS))
        return alone, together

    alone, together = asyncio.run_coroutine_threadsafe(both(), srv._loop).result(120)
    assert together[0].tokens == alone.tokens
    for c in together[1:]:
        assert_matches(c.text, USER, c.finish_reason)


BAD_FORMATS = [
    ("/v1/chat/completions", {"response_format": json_schema_format({"type": "integer", "minimum": 3,
                                                                      "maximum": 1})},
     "response_format.json_schema.schema"),
    ("/v1/chat/completions", {"response_format": json_schema_format({"dependentRequired": {"a": ["b"]}})},
     "response_format.json_schema.schema"),
    ("/v1/chat/completions", {"response_format": json_schema_format({"type": "string", "format": "nope"})},
     "response_format.json_schema.schema"),
    ("/v1/chat/completions", {"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ("/v1/chat/completions", {"response_format": {"type": "yaml"}}, "response_format.type"),
    ("/v1/completions", {"response_format": json_schema_format({"$ref": "#/missing"})},
     "response_format.json_schema.schema"),
    ("/api/generate", {"format": {"type": "object", "properties": {"a": {"type": "wizard"}}}}, "format"),
    ("/api/generate", {"format": "xml"}, "format"),
    ("/api/chat", {"format": {"type": "array", "minItems": 3, "maxItems": 1}}, "format"),
]


@pytest.mark.parametrize("path, extra, param", BAD_FORMATS, ids=[f"{p}-{i}" for i, (p, _, _) in
                                                                 enumerate(BAD_FORMATS)])
def test_bad_schema_is_a_400_naming_the_field_and_reaches_no_worker(srv, path, extra, param):
    """An invalid schema, an unsupported keyword or a bad format: 400 in the API's error shape, naming
    the field, and the worker never sees the request."""
    body = {"model": "tiny", "max_tokens": 4, **extra}
    if path == "/v1/completions" or path == "/api/generate":
        body["prompt"] = "Hi"
    else:
        body["messages"] = [{"role": "user", "content": "Hi"}]
    if path.startswith("/api/"):
        body.pop("max_tokens")
    sent = sum(w.requests for w in srv.rt.workers)
    r = httpx.post(srv.url + path, json=body, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    if path.startswith("/api/"):
        assert isinstance(err, str) and param in err
    else:
        assert err["param"] == param and param in err["message"] and err["type"] == "invalid_request_error"
    assert sum(w.requests for w in srv.rt.workers) == sent
