"""Forced tool calls (tool choice "required" or a named function) in the engine, on random weights.

A random-weight model never calls a tool by itself: every call it makes here is the grammar's doing
(`src/worker/forced.py`), so a reply that ends by itself must be calls, parsed by the family's parser,
whose arguments validate against the function's `parameters`. Where a model thinks first, the
thinking is scripted (random text never reaches the end marker) and the grammar writes the call.
The HTTP and client side is in `test_tools_http.py`.
"""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
from forcing import prefixed
from mlxrt.ipc.protocol import Capabilities, ChatMessage, ChatOptions, Generate, SamplingParams
from mlxrt.orchestrator.chat import chat_options, missing_capability
from mlxrt.synthetic.build import ensure_model
from mlxrt.worker.engine import Engine

# Small schemas: the tiny models' context is 512 tokens, and the template renders every tool.
LOOKUP = {"type": "function", "function": {"name": "find", "parameters": {
    "type": "object", "properties": {"q": {"type": "string", "maxLength": 8}}, "required": ["q"],
    "additionalProperties": False}}}
CONVERT = {"type": "function", "function": {"name": "conv", "parameters": {
    "type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99},
                                     "u": {"enum": ["cm", "in"]}},
    "required": ["n", "u"], "additionalProperties": False}}}
NESTED = {"type": "function", "function": {"name": "plan", "parameters": {
    "type": "object", "properties": {"s": {"type": "array", "maxItems": 2, "items": {"$ref": "#/$defs/t"}}},
    "required": ["s"], "additionalProperties": False,
    "$defs": {"t": {"type": "object", "properties": {"n": {"enum": [1, 2]}}, "required": ["n"],
                    "additionalProperties": False}}}}}
TOOLS = [LOOKUP, CONVERT, NESTED]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
PROMPTS = ["Hello", "Find my notes on tides", "Convert 3 inches", "Plan a trip in two steps"]
CHOICES = [("required", ""), ("function", "find"), ("function", "conv"), ("function", "plan")]


class Recorder:
    """A listener that keeps each request's answer text, reasoning, calls, ids and finish reason."""

    def __init__(self) -> None:
        self.text: dict[int, str] = {}
        self.reasoning: dict[int, str] = {}
        self.calls: dict[int, list] = {}
        self.ids: dict[int, list[int]] = {}
        self.reason: dict[int, str] = {}
        self.errors: dict[int, BaseException] = {}

    def started(self, req_id: int) -> None:
        pass

    def token(self, req_id, token, text, reasoning="", calls=None, **_) -> None:
        self.ids.setdefault(req_id, []).append(token)
        self._add(req_id, text, reasoning, calls)

    def done(self, req_id, stats, text, reasoning="", calls=None, **_) -> None:
        self._add(req_id, text, reasoning, calls)
        self.reason[req_id] = stats.finish_reason

    def failed(self, req_id, exc) -> None:
        self.errors[req_id] = exc

    def _add(self, req_id, text, reasoning, calls) -> None:
        self.text[req_id] = self.text.get(req_id, "") + text
        self.reasoning[req_id] = self.reasoning.get(req_id, "") + reasoning
        self.calls.setdefault(req_id, []).extend(calls or [])


@pytest.fixture(scope="module")
def engines():
    made: dict[str, Engine] = {}

    def get(preset: str) -> Engine:
        if preset not in made:
            engine = made[preset] = Engine(str(ensure_model(preset)))
            # Room for three rendered tools: the tiny models' 512-token context is a number in their
            # config (rotary positions have no hard end), and these prompts need ~650 tokens.
            engine.context_length = 2048
        return made[preset]

    return get


def chat_request(i: int, prompt: str, choice: str, name: str, *, think: bool | None = None,
                 **params) -> Generate:
    params = {"max_tokens": 160, **params}
    chat = ChatOptions(tools=TOOLS, tool_choice=choice, tool_name=name, enable_thinking=think).validate()
    return Generate(id=i, params=SamplingParams(**params), messages=[ChatMessage("user", prompt)], chat=chat)


def run(engine: Engine, reqs: list[Generate], prefix: str = "") -> Recorder:
    """Run `reqs` together; with `prefix`, each reply is forced to begin with it (its thinking)."""
    rec = Recorder()
    for r in reqs:
        if prefix:
            _submit_prefixed(engine, r, rec, prefix)
        else:
            engine.submit(r, rec)
    while engine.busy:
        engine.step()
    return rec


def _submit_prefixed(engine: Engine, req: Generate, rec: Recorder, prefix: str) -> None:
    engine.submit(req, rec)
    seq = engine._waiting[-1]
    ids = engine.tokenizer.encode(prefix, add_special_tokens=False)
    seq.processors.insert(len(seq.processors) - 1, prefixed(ids, engine.vocab_size))  # before the grammar


def assert_forced(rec: Recorder, req: Generate, *, one_call: bool = False) -> bool:
    """A reply that ended by itself is calls (to the named function), arguments valid, no answer text;
    a reply cut by max_tokens is allowed. Returns whether it ended by itself."""
    reason = rec.reason[req.id]
    if reason == "length":
        return False
    assert reason == "stop", reason
    calls = rec.calls[req.id]
    assert calls and rec.text[req.id] == "", (rec.text[req.id], calls)
    assert req.chat is not None
    if req.chat.tool_choice == "function":
        assert [c.name for c in calls] == [req.chat.tool_name]
    if req.chat.tool_choice == "required" and one_call:
        assert len(calls) == 1
    for c in calls:
        jsonschema.validate(json.loads(c.arguments), SCHEMAS[c.name])
    return True


@pytest.mark.parametrize("preset, think", [("tiny", None), ("tiny-qwen3", False), ("tiny-llama", None)],
                         ids=["qwen2.5", "qwen3-think-false", "llama"])
@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
def test_forced_calls_always_parse_and_validate(engines, preset, think, sampled):
    """Required and named choices, greedy and sampled, in one batch: every reply that ends by itself
    is only calls, to the named function where one is named, with arguments valid for its schema
    (a nested $ref one included), and most replies end by themselves."""
    engine = engines(preset)
    params = {"temperature": 1.0, "seed": 11} if sampled else {}
    reqs = [chat_request(i, PROMPTS[i % len(PROMPTS)], *CHOICES[i // len(PROMPTS)], think=think, **params)
            for i in range(len(PROMPTS) * len(CHOICES))]
    rec = run(engine, reqs)
    assert not rec.errors
    one_call = preset == "tiny-llama"  # Meta's template renders one call per assistant turn
    complete = sum(assert_forced(rec, r, one_call=one_call) for r in reqs)
    assert complete >= 0.75 * len(reqs), f"only {complete} of {len(reqs)} replies ended by themselves"


def test_unforced_requests_unchanged_beside_forced_ones(engines):
    """Plain requests batched with forced ones get the ids they get alone."""
    engine = engines("tiny")
    plain = [Generate(id=100 + i, prompt=p, params=SamplingParams(max_tokens=16, ignore_eos=True))
             for i, p in enumerate(PROMPTS)]
    forced = [chat_request(200 + i, p, "required", "") for i, p in enumerate(PROMPTS)]
    alone = {r.id: run(engine, [r]).ids[r.id] for r in plain}
    mixed = run(engine, [x for pair in zip(plain, forced, strict=True) for x in pair])
    for r in plain:
        assert mixed.ids[r.id] == alone[r.id], r.id
    for r in forced:
        assert_forced(mixed, r)


THINKING = [
    ("tiny-qwen3", "<think>\nThe notes will say.\n</think>\n\n"),  # the model opens <think> itself
    ("tiny-qwen3.5", "The notes will say.\n</think>\n\n"),  # the template opened it in the prompt
    # gpt-oss: analysis, then into the commentary channel (random weights would pick another analysis
    # half the time); the grammar writes the recipient and the call.
    ("tiny-gpt-oss", "<|channel|>analysis<|message|>The notes will say.<|end|><|start|>assistant"
                     "<|channel|>commentary"),
]


@pytest.mark.parametrize("preset, prefix", THINKING, ids=[p for p, _ in THINKING])
def test_a_thinking_model_thinks_then_must_call(engines, preset, prefix):
    """With thinking on, the grammar lets the model think first (scripted here: random text never
    ends its reasoning), then forces the call: reasoning apart, the call valid."""
    engine = engines(preset)
    reqs = [chat_request(i, PROMPTS[i], choice, name) for i, (choice, name) in enumerate(CHOICES)]
    rec = run(engine, reqs, prefix)
    assert not rec.errors
    for r in reqs:
        assert rec.reasoning[r.id] == "The notes will say.", rec.reasoning[r.id]
        assert_forced(rec, r)
    assert any(rec.reason[r.id] == "stop" for r in reqs)


def test_gpt_oss_calls_without_thinking(engines):
    """gpt-oss's analysis message is optional: a reply may go straight to the call."""
    engine = engines("tiny-gpt-oss")
    reqs = [chat_request(i, PROMPTS[i], choice, name) for i, (choice, name) in enumerate(CHOICES)]
    rec = run(engine, reqs, "<|channel|>commentary")
    for r in reqs:
        assert rec.reasoning[r.id] == "" and assert_forced(rec, r)


def test_think_false_leaves_no_room_to_think(engines):
    """think=False renders a closed think block: pushed towards <think>, the model still has to write
    the call at once (with thinking on it would have opened a think block)."""
    engine = engines("tiny-qwen3")
    req = chat_request(1, "Hello", "function", "find", think=False)
    rec = run(engine, [req], "<think>")
    assert rec.reasoning[1] == "" and assert_forced(rec, req)


def test_bad_parameters_schema_refused_at_the_edge():
    """A forced choice enforces the parameters schema, so one llguidance cannot enforce is a
    ValueError naming the tool's field; an auto choice only renders it and takes it as is."""
    bad = {"type": "function", "function": {"name": "f", "parameters": {"type": "integer", "minimum": 3,
                                                                          "maximum": 1}}}
    with pytest.raises(ValueError, match=r"tools\[1\]\.function\.parameters"):
        chat_options(tools=[LOOKUP, bad], tool_choice="required")
    with pytest.raises(ValueError, match=r"tools\[1\]\.function\.parameters"):
        chat_options(tools=[LOOKUP, bad], tool_choice={"type": "function", "function": {"name": "f"}})
    assert chat_options(tools=[LOOKUP, bad], tool_choice={"type": "function", "function": {"name": "find"}})
    assert chat_options(tools=[LOOKUP, bad], tool_choice="auto")


def test_forcing_needs_a_tool_format_with_a_grammar(engines):
    """A tool format no grammar is written for cannot be forced: refused at the edge (from the
    worker's capabilities) and by the worker itself."""
    caps = Capabilities(chat_template=True, tools="qwen3_coder")
    assert missing_capability(caps, thinking=False, tools=True, forced=True) == "forced tool calls"
    assert missing_capability(caps, thinking=False, tools=True, forced=False) is None
    engine = engines("tiny")
    saved = engine.capabilities
    engine.capabilities = caps
    try:
        rec = run(engine, [chat_request(1, "Hi", "required", "")])
    finally:
        engine.capabilities = saved
    assert "cannot be forced to call a tool" in str(rec.errors[1])


# An open schema (no additionalProperties, no maxLength), as clients write them: the run-away case.
WEATHER = {"type": "function", "function": {"name": "weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


def _accepted(engine: Engine, grammar, text: str) -> bool:
    """Whether the forced grammar lets the model write `text` (whole) from the reply's start."""
    matcher = engine.grammars.matcher(grammar)
    ids = engine.tokenizer.encode(text, add_special_tokens=False)
    return matcher.validate_tokens(ids) == len(ids)


def test_forced_call_takes_no_undeclared_key_nor_endless_whitespace(engines):
    """A forced call on a schema that says nothing of other properties is compiled as the strict
    engines compile it: a key the schema does not declare, or whitespace past one space, cannot be
    written (1 of 5 seeded required calls on synthetic:tiny ran to max_tokens inside such a key)."""
    from mlxrt.worker.forced import tool_call_grammar

    engine = engines("tiny")
    chat = ChatOptions(tools=[WEATHER], tool_choice="required").validate()
    grammar = tool_call_grammar(engine.tokenizer, engine.capabilities, chat, reasoning_open=False)
    head = '<tool_call>\n{"name": "weather", "arguments": {"city": "Oslo"'
    assert _accepted(engine, grammar, head + '}}\n</tool_call>')
    assert not _accepted(engine, grammar, head + ', "when": "now"')
    assert not _accepted(engine, grammar, head + ',  ')
    assert not _accepted(engine, grammar, '<tool_call>\n{"name": "weather", "arguments":\n')


def test_seeded_required_calls_on_an_open_schema_write_only_its_keys(engines):
    """Five seeded "required" calls on the open schema: every key written, in calls that ended and in
    replies cut by max_tokens (an unbounded string may still run), is one the grammar declares."""
    engine = engines("tiny")
    reqs = [Generate(id=i, params=SamplingParams(max_tokens=160, temperature=1.0, seed=i),
                     messages=[ChatMessage("user", "Weather in Oslo?")],
                     chat=ChatOptions(tools=[WEATHER], tool_choice="required").validate()) for i in range(5)]
    rec = run(engine, reqs)
    assert not rec.errors
    key = re.compile(r'(?<!\\)"((?:[^"\\]|\\.)*)" ?:')  # a JSON key: its closing quote unescaped
    for r in reqs:
        text = engine.tokenizer.decode(rec.ids[r.id])
        assert set(key.findall(text)) <= {"name", "arguments", "city"}, text
        for c in rec.calls[r.id]:
            assert set(json.loads(c.arguments)) == {"city"}
