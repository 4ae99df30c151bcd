"""Thinking and tool calls end to end: the official openai and ollama clients and the Python API,
over real workers on the tiny Qwen3, gpt-oss, Qwen2.5, Llama and Gemma 3 (no tool format) presets.

Random weights never think or call a tool on their own, so the workers are the real worker
with its replies scripted (`scripted_worker.py`): a reply is forced token by token through a
logits processor when the templated prompt holds a marker. Which marker matches proves what
the template rendered (the tools, a tool result, ``enable_thinking=False``, a reasoning effort);
the reply then runs the production path: detokenizer, reply splitter, frames, both APIs.
"""

from __future__ import annotations

import json

import jsonschema
import pytest
from mlxrt import Runtime
from openai.lib.streaming.chat import ChatCompletionStreamState
from support import (
    LLAMA_TEXT,
    QWEN_CALL,
    SCRIPTED,
    THINKERS,
    THOUGHT,
    assert_stopped,
    sse_events,
)

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
ASK = [{"role": "user", "content": "Weather in Paris?"}]


@pytest.fixture(scope="module")
def srv(scripted_server):
    """The session's scripted server: Qwen3, gpt-oss, Qwen2.5, Llama and Gemma 3 (and `tiny`)."""
    return scripted_server


def streamed(oai, **kw):
    """A streamed chat accumulated by the openai client's own helper, and the raw chunks."""
    state = ChatCompletionStreamState()
    chunks = list(oai.chat.completions.create(**kw, stream=True))
    for chunk in chunks:
        state.handle_chunk(chunk)
    return state.get_final_completion(), chunks


# ---- OpenAI ---------------------------------------------------------------------------


@pytest.mark.parametrize("model", THINKERS)
def test_openai_client_tool_round_trip(oai, model):
    """Call, tool result, answer with the openai client: the call parsed into tool_calls (finish_reason
    tool_calls, content null), the reasoning apart, the result turn templated, the answer plain."""
    kw = dict(model=model, tools=TOOLS, max_tokens=200, temperature=0)
    first = oai.chat.completions.create(messages=ASK, **kw)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls"
    message = choice.message
    assert message.content is None
    assert message.reasoning_content == message.reasoning == "I should call the tool."
    (call,) = message.tool_calls
    assert call.type == "function" and call.id.startswith("call_") and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    result = {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"}
    second = oai.chat.completions.create(messages=[*ASK, message, result], **kw)
    assert second.choices[0].finish_reason == "stop"
    assert second.choices[0].message.content == "It is sunny in Paris."
    assert second.choices[0].message.reasoning_content == "The tool answered."
    assert not second.choices[0].message.tool_calls


@pytest.mark.parametrize("model", THINKERS)
def test_openai_client_streams_reasoning_and_tool_calls(oai, model):
    """Streamed, the client's own accumulator builds the same message: reasoning deltas, then the call
    as one delta with index, id, type, name and arguments; finish_reason tool_calls."""
    kw = dict(model=model, messages=ASK, tools=TOOLS, max_tokens=200, temperature=0)
    full = oai.chat.completions.create(**kw).choices[0].message
    final, chunks = streamed(oai, **kw)
    assert final.choices[0].finish_reason == "tool_calls"
    got = final.choices[0].message
    (call,) = got.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather", {"city": "Paris"})
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == full.reasoning_content
    assert "".join(getattr(d, "reasoning", None) or "" for d in deltas) == full.reasoning
    (raw,) = [d.tool_calls[0] for d in deltas if d.tool_calls]
    assert raw.index == 0 and raw.type == "function" and raw.id == call.id
    assert not "".join(d.content or "" for d in deltas)


@pytest.mark.parametrize("model", THINKERS)
def test_openai_reasoning_apart_from_the_answer(http, model):
    """A reply that thinks, then answers: reasoning_content and reasoning hold the thought, content the
    answer, streamed or not, with no markup left in either."""
    body = {"model": model, "messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 100}
    msg = http.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]
    assert msg == {"role": "assistant", "content": "Hi there!", "reasoning_content": "A greeting.",
                   "reasoning": "A greeting."}
    with http.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
        events = sse_events(r)
    deltas = [e["choices"][0]["delta"] for e in events[:-1]]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "A greeting."
    assert "".join(d.get("content") or "" for d in deltas) == "Hi there!"
    assert events[-2]["choices"][0]["finish_reason"] == "stop"


def test_openai_client_llama_tool_round_trip(oai):
    """Llama 3.x's bare-JSON call with the openai client: parsed into tool_calls (finish_reason tool_calls,
    content null), streamed as one delta at the end, which the client's accumulator reads alike; the
    result goes back as an ipython turn and the answer is plain."""
    kw = dict(model="llama", tools=TOOLS, max_tokens=200, temperature=0)
    first = oai.chat.completions.create(messages=ASK, **kw).choices[0]
    assert first.finish_reason == "tool_calls" and first.message.content is None
    (call,) = first.message.tool_calls
    assert call.id.startswith("call_") and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    final, chunks = streamed(oai, messages=ASK, **kw)
    assert final.choices[0].finish_reason == "tool_calls"
    (got,) = final.choices[0].message.tool_calls
    assert (got.function.name, json.loads(got.function.arguments)) == ("get_weather", {"city": "Paris"})
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert not "".join(d.content or "" for d in deltas)
    (at,) = [i for i, d in enumerate(deltas) if d.tool_calls]
    assert all(not d.tool_calls and not d.content for d in deltas[at + 1:])  # only the finish follows
    result = {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"}
    second = oai.chat.completions.create(messages=[*ASK, first.message, result], **kw).choices[0]
    assert (second.finish_reason, second.message.content) == ("stop", "It is sunny in Paris.")
    assert not second.message.tool_calls


def test_openai_llama_text_reply_streams_as_it_comes(oai):
    """With tools, a Llama reply that does not start with "{" is text from its first tokens on (not held
    to the end), JSON inside it included; nothing is parsed."""
    kw = dict(model="llama", tools=TOOLS, max_tokens=200, messages=[{"role": "user", "content": "Greet me"}])
    r = oai.chat.completions.create(**kw).choices[0]
    assert (r.finish_reason, r.message.content, r.message.tool_calls) == ("stop", LLAMA_TEXT, None)
    final, chunks = streamed(oai, **kw)
    assert final.choices[0].message.content == LLAMA_TEXT
    pieces = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    assert len(pieces) > 3 and "".join(pieces) == LLAMA_TEXT


def test_tool_choice_none_drops_the_tools(oai):
    """tool_choice "none": the tools are not rendered and nothing is parsed; call markup stays text."""
    r = oai.chat.completions.create(model="qwen3", messages=ASK, tools=TOOLS, tool_choice="none",
                                    max_tokens=200).choices[0]
    assert r.finish_reason == "stop" and not r.message.tool_calls
    assert r.message.content == f"Plain text: {QWEN_CALL}"


NAMED = {"type": "function", "function": {"name": "get_weather"}}


def test_tool_choice_auto_renders_and_parses(oai):
    """auto renders the tools and parses the call the model chose to make, next to its text."""
    r = oai.chat.completions.create(model="qwen2.5", messages=ASK, tools=TOOLS, tool_choice="auto",
                                    max_tokens=200).choices[0]
    assert r.finish_reason == "tool_calls" and r.message.tool_calls[0].function.name == "get_weather"
    # Qwen2.5 has no <think> tokens: its reasoning markup stays in the answer.
    assert r.message.content == "<think>\nI should call the tool.\n</think>"


# One small tool: the tiny models' context is 512 tokens, and the template renders it.
FIND = {"type": "function", "function": {"name": "find", "parameters": {
    "type": "object", "properties": {"q": {"type": "string", "maxLength": 8}}, "required": ["q"],
    "additionalProperties": False}}}
FIND_NAMED = {"type": "function", "function": {"name": "find"}}


def assert_called_find(choice) -> None:
    """The reply is only calls to `find` ("required" allows several), arguments valid for its schema."""
    assert choice.finish_reason == "tool_calls", choice
    assert not choice.message.content  # null; "" when accumulated from a stream (its role chunk's)
    assert choice.message.tool_calls
    for call in choice.message.tool_calls:
        assert call.function.name == "find" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), FIND["function"]["parameters"])


@pytest.mark.parametrize("choice", ["required", FIND_NAMED], ids=["required", "named"])
@pytest.mark.parametrize("model", ["qwen2.5", "qwen3", "llama"])
def test_openai_forced_tool_call_streamed_and_not(oai, model, choice):
    """tool_choice required or a named function: random weights still answer with a call that parses
    and validates, streamed (accumulated by the client's own helper) or not; Qwen3 with thinking off;
    Llama with one bare-JSON call."""
    kw = dict(model=model, tools=[FIND], tool_choice=choice, max_tokens=150,
              messages=[{"role": "user", "content": "Find my notes on tides"}])
    if model == "qwen3":
        kw["extra_body"] = {"chat_template_kwargs": {"enable_thinking": False}}
    for seed in range(3):
        r = oai.chat.completions.create(**kw, temperature=1.0, seed=seed)
        assert_called_find(r.choices[0])
        final, _ = streamed(oai, **kw, temperature=1.0, seed=seed)
        assert_called_find(final.choices[0])
        assert [c.function.arguments for c in final.choices[0].message.tool_calls] == \
            [c.function.arguments for c in r.choices[0].message.tool_calls]
        if model == "llama":
            assert len(r.choices[0].message.tool_calls) == 1


@pytest.mark.parametrize("choice", ["required", FIND_NAMED], ids=["required", "named"])
@pytest.mark.parametrize("model", THINKERS)
def test_openai_forced_tool_call_after_thinking(oai, model, choice):
    """A thinking model thinks first (scripted: random text never ends its reasoning), then the grammar
    writes the call: the reasoning apart, the call valid."""
    r = oai.chat.completions.create(model=model, tools=[FIND], tool_choice=choice, max_tokens=150,
                                    temperature=0, messages=[{"role": "user", "content": "Think, then find"}])
    assert r.choices[0].message.reasoning_content == THOUGHT
    assert_called_find(r.choices[0])


def test_python_api_forced_tool_call(rt):
    """The Python API takes the same tool_choice: the reply is a call, finish_reason tool_calls."""
    ask = [{"role": "user", "content": "Find my notes on tides"}]
    c = rt.generate(ask, model="qwen3", tools=[FIND], tool_choice="required", think=False, max_tokens=150,
                    temperature=1.0, seed=3)
    assert c.finish_reason == "tool_calls" and c.text == "" and [t.name for t in c.tool_calls] == ["find"]
    jsonschema.validate(json.loads(c.tool_calls[0].arguments), FIND["function"]["parameters"])


def test_reasoning_effort_reaches_the_template(oai):
    """gpt-oss's reasoning_effort is rendered into its system prompt ("Reasoning: high")."""
    r = oai.chat.completions.create(model="gpt-oss", messages=[{"role": "user", "content": "Go"}],
                                    reasoning_effort="high", max_tokens=100).choices[0].message
    assert (r.content, r.reasoning_content) == ("Done.", "Thinking hard.")


def test_chat_template_kwargs_turn_thinking_off(http):
    """chat_template_kwargs.enable_thinking false renders Qwen3's closed, empty think block."""
    body = {"model": "qwen3", "messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 100,
            "chat_template_kwargs": {"enable_thinking": False}}
    msg = http.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]
    assert msg == {"role": "assistant", "content": "Hello without thinking."}


# ---- Ollama ---------------------------------------------------------------------------


@pytest.mark.parametrize("model", THINKERS)
def test_ollama_client_tool_round_trip(oll, model):
    """Call, tool result, answer with the ollama client: tool_calls with object arguments, thinking
    apart, the tool turn (tool_name) templated; streamed deltas add up to the same."""
    opts = {"temperature": 0, "num_predict": 200}
    first = oll.chat(model=model, messages=ASK, tools=TOOLS, options=opts)
    msg = first.message
    assert msg.thinking == "I should call the tool." and msg.content == ""
    (call,) = msg.tool_calls
    assert call.function.name == "get_weather" and call.function.arguments == {"city": "Paris"}
    parts = list(oll.chat(model=model, messages=ASK, tools=TOOLS, options=opts, stream=True))
    assert "".join(p.message.thinking or "" for p in parts) == msg.thinking
    assert [c.function.name for p in parts for c in p.message.tool_calls or []] == ["get_weather"]
    assert parts[-1].done and parts[-1].done_reason == "stop"
    history = [*ASK, msg, {"role": "tool", "content": "sunny, 21 C", "tool_name": "get_weather"}]
    second = oll.chat(model=model, messages=history, tools=TOOLS, options=opts).message
    assert (second.content, second.thinking, second.tool_calls) == (
        "It is sunny in Paris.", "The tool answered.", None)


def test_ollama_client_llama_tool_round_trip(oll):
    """Llama 3.x with the ollama client, as Ollama users run it: the bare-JSON call as tool_calls with
    object arguments (streamed: in one chunk at the end), the tool turn templated, the answer plain."""
    opts = {"temperature": 0, "num_predict": 200}
    msg = oll.chat(model="llama", messages=ASK, tools=TOOLS, options=opts).message
    assert msg.content == "" and not msg.thinking
    (call,) = msg.tool_calls
    assert (call.function.name, call.function.arguments) == ("get_weather", {"city": "Paris"})
    parts = list(oll.chat(model="llama", messages=ASK, tools=TOOLS, options=opts, stream=True))
    assert [c.function.arguments for p in parts for c in p.message.tool_calls or []] == [{"city": "Paris"}]
    assert not "".join(p.message.content for p in parts)
    assert parts[-1].done and parts[-1].done_reason == "stop"
    history = [*ASK, msg, {"role": "tool", "content": "sunny, 21 C", "tool_name": "get_weather"}]
    second = oll.chat(model="llama", messages=history, tools=TOOLS, options=opts).message
    assert (second.content, second.tool_calls) == ("It is sunny in Paris.", None)


@pytest.mark.parametrize("model", THINKERS)
def test_ollama_thinking_in_chat_and_generate(oll, model):
    """Ollama's thinking field, by default and with think true, in /api/chat and /api/generate."""
    opts = {"num_predict": 100}
    chat = oll.chat(model=model, messages=[{"role": "user", "content": "Say hi"}], think=True, options=opts)
    assert (chat.message.content, chat.message.thinking) == ("Hi there!", "A greeting.")
    gen = oll.generate(model=model, prompt="Say hi", options=opts)
    assert (gen.response, gen.thinking) == ("Hi there!", "A greeting.")
    parts = list(oll.generate(model=model, prompt="Say hi", options=opts, stream=True))
    assert "".join(p.thinking or "" for p in parts) == "A greeting."
    assert "".join(p.response for p in parts) == "Hi there!"


def test_ollama_think_false_renders_enable_thinking_false(oll):
    """think false renders Qwen3's template with enable_thinking=False: the model does not think."""
    r = oll.chat(model="qwen3", messages=[{"role": "user", "content": "Say hi"}], think=False,
                 options={"num_predict": 100})
    assert (r.message.content, r.message.thinking) == ("Hello without thinking.", None)


def test_ollama_think_levels_reach_gpt_oss(oll):
    """think "high" is gpt-oss's reasoning effort ("Reasoning: high" in its system prompt)."""
    r = oll.chat(model="gpt-oss", messages=[{"role": "user", "content": "Go"}], think="high",
                 options={"num_predict": 100})
    assert (r.message.content, r.message.thinking) == ("Done.", "Thinking hard.")


def test_ollama_show_lists_tools_and_thinking(oll):
    """/api/show's capabilities come from what the workers reported in Ready."""
    assert set(oll.show("qwen3").capabilities) == {"completion", "tools", "thinking"}
    assert set(oll.show("gpt-oss").capabilities) == {"completion", "tools", "thinking"}
    assert set(oll.show("qwen2.5").capabilities) == {"completion", "tools"}
    assert set(oll.show("llama").capabilities) == {"completion", "tools"}
    assert oll.show("gemma3").capabilities == ["completion"]


# ---- the Python API -------------------------------------------------------------------


@pytest.fixture(scope="module")
def rt(scripted_env):
    """The Python API over scripted workers of Qwen3, gpt-oss, Llama and Gemma 3."""
    from mlxrt.synthetic.build import ensure_model

    models = {name: str(ensure_model(p)) for name, p in
              (("qwen3", "tiny-qwen3"), ("gpt-oss", "tiny-gpt-oss"), ("llama", "tiny-llama"),
               ("gemma3", "tiny-gemma3"))}
    runtime = Runtime(models=models, transport="stdio", _worker_argv=SCRIPTED)
    pids = [w.pid for w in runtime.workers]
    yield runtime
    runtime.close()
    assert_stopped(pids)


REASONING = {"qwen3": ("I should call the tool.", "The tool answered."),
             "gpt-oss": ("I should call the tool.", "The tool answered."), "llama": ("", "")}


@pytest.mark.parametrize("model", sorted(REASONING))
def test_python_api_reasoning_and_tool_calls(rt, model):
    """Completion.reasoning and .tool_calls (finish_reason tool_calls), streamed per chunk, and a round
    trip that sends them back (Llama: no reasoning, its bare-JSON call)."""
    thought, answered = REASONING[model]
    first = rt.generate(ASK, model=model, tools=TOOLS, max_tokens=200)
    assert (first.text, first.reasoning) == ("", thought)
    assert first.finish_reason == "tool_calls"
    (call,) = first.tool_calls
    assert (call.name, json.loads(call.arguments)) == ("get_weather", {"city": "Paris"})
    chunks = list(rt.stream(ASK, model=model, tools=TOOLS, max_tokens=200))
    assert "".join(c.reasoning for c in chunks) == first.reasoning
    assert [c.name for ch in chunks for c in ch.tool_calls] == ["get_weather"]
    history = [*ASK, {"role": "assistant", "content": "", "tool_calls": first.tool_calls},
               {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"}]
    second = rt.generate(history, model=model, tools=TOOLS, max_tokens=200)
    assert (second.text, second.reasoning) == ("It is sunny in Paris.", answered)
    assert second.tool_calls == [] and second.finish_reason == "stop"


def test_python_api_think_and_its_refusals(rt):
    """think=False and think="high" reach the templates; bad tools, chat keywords on raw text, and
    thinking or tools for a model without them raise ValueError naming the field."""
    hi = [{"role": "user", "content": "Say hi"}]
    assert rt.generate(hi, model="qwen3", think=False, max_tokens=50).text == "Hello without thinking."
    high = rt.generate([{"role": "user", "content": "Go"}], model="gpt-oss", think="high", max_tokens=50)
    assert (high.text, high.reasoning) == ("Done.", "Thinking hard.")
    with pytest.raises(ValueError, match=r"tools\[0\]\.function\.name"):
        rt.generate(ASK, model="qwen3", tools=[{"type": "function", "function": {"description": "no name"}}])
    with pytest.raises(ValueError, match="tools, tool_choice and think need chat messages"):
        rt.generate("raw text", model="qwen3", think=True)
    with pytest.raises(ValueError, match="think: model 'llama' does not support thinking"):
        rt.generate(hi, model="llama", think=True)
    with pytest.raises(ValueError, match="tools: model 'gemma3' does not support tools"):
        rt.generate(ASK, model="gemma3", tools=TOOLS)
    assert rt.generate(hi, model="llama", think=False, max_tokens=2).stats.generation_tokens >= 1


# ---- bad input ------------------------------------------------------------------------

NO_NAME = [{"type": "function", "function": {"description": "no name", "parameters": {"type": "object"}}}]
BAD = [
    ("/v1/chat/completions", {"model": "qwen3", "messages": ASK, "tools": NO_NAME}, "tools[0].function.name"),
    ("/v1/chat/completions", {"model": "qwen3", "messages": ASK, "tools": [{"type": "function", "function": {
        "name": ""}}]}, "tools[0].function.name"),
    ("/v1/chat/completions", {"model": "qwen3", "messages": ASK, "tools": TOOLS,
                              "tool_choice": {"type": "function", "function": {"name": "get_time"}}},
     "tool_choice.function.name"),
    ("/v1/chat/completions", {"model": "qwen3", "messages": ASK, "tool_choice": "required"}, "tool_choice"),
    ("/v1/chat/completions", {"model": "qwen3", "messages": ASK, "tools": TOOLS, "tool_choice": "always"},
     "tool_choice"),
    ("/v1/chat/completions", {"model": "gpt-oss", "messages": ASK, "reasoning_effort": "extreme"},
     "reasoning_effort"),
    ("/v1/chat/completions", {"model": "gemma3", "messages": ASK, "tools": TOOLS}, "tools"),
    ("/v1/chat/completions", {"model": "llama", "messages": ASK, "reasoning_effort": "low"},
     "reasoning_effort"),
    ("/v1/chat/completions", {"model": "qwen3", "messages": [{"role": "assistant", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"arguments": "{}"}}]}]},
     "messages[0].tool_calls[0].function.name"),
    ("/api/chat", {"model": "qwen3", "messages": ASK, "tools": NO_NAME}, "tools[0].function.name"),
    ("/api/chat", {"model": "gemma3", "messages": ASK, "tools": TOOLS}, "gemma3 does not support tools"),
    ("/api/chat", {"model": "llama", "messages": ASK, "think": True}, '"llama" does not support thinking'),
    ("/api/chat", {"model": "llama:latest", "messages": ASK, "think": "high"},
     '"llama:latest" does not support thinking'),
    ("/api/generate", {"model": "qwen2.5", "prompt": "Hi", "think": True},
     '"qwen2.5" does not support thinking'),
    ("/api/generate", {"model": "qwen2.5", "prompt": "Hi", "raw": True, "think": True},
     '"qwen2.5" does not support thinking'),
    ("/api/generate", {"model": "llama", "think": True}, '"llama" does not support thinking'),  # a load
    ("/api/chat", {"model": "gemma3", "messages": [], "tools": TOOLS}, "gemma3 does not support tools"),
    ("/api/chat", {"model": "qwen3", "messages": ASK, "think": "extreme"}, "think"),
    ("/v1/chat/completions", {"model": "qwen3", "messages": ASK, "tool_choice": "required", "tools": [
        {"type": "function", "function": {"name": "f", "parameters": {"type": "integer", "minimum": 3,
                                                                      "maximum": 1}}}]},
     "tools[0].function.parameters"),
]


@pytest.mark.parametrize("path, body, names", BAD, ids=[f"{p}-{n}" for p, _, n in BAD])
def test_bad_tools_and_thinking_are_400_naming_the_field(srv, http, path, body, names):
    """A tool without a name, a tool choice naming an unknown function, a forced call's parameters
    schema that cannot be enforced, tools or thinking for a model without them: 400 in the API's
    shape, naming the field, before any worker sees the request."""
    sent = sum(w.requests for w in srv.rt.workers)
    r = http.post(path, json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    if path.startswith("/api/"):
        assert names in err
    else:
        assert names in err["message"] and set(err) == {"message", "type", "param", "code"}
        assert err["param"] == names
    assert sum(w.requests for w in srv.rt.workers) == sent


def test_think_false_is_accepted_by_a_model_without_thinking(oll):
    """As in Ollama, only asking for thinking is refused: think false on a non-thinking model is served."""
    r = oll.chat(model="llama", messages=ASK, think=False, options={"num_predict": 3})
    assert r.done and r.message.thinking is None
