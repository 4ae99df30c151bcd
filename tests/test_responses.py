"""OpenAI Responses end to end: the official openai client and the OpenAI Agents SDK against a real
server over real workers; and one greedy request through all three chat-shaped APIs.

As in test_anthropic, `tiny` runs unscripted and Qwen3 and gpt-oss run test_tools_http's scripted
worker, whose markers prove what the template rendered from Responses' items.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal

import anthropic
import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field
from support import NO_RESTART, THINKERS, ServerThread, assert_stopped, metric

TOOLS = [{"type": "function", "name": "get_weather", "description": "Weather in a city",
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}]
ASK = [{"role": "user", "content": "Weather in Paris?"}]


@pytest.fixture(scope="module")
def srv(scripted_server):
    """The session's scripted server: `tiny` (unscripted prompts), scripted Qwen3 and gpt-oss, and more."""
    return scripted_server


def items(response) -> list[tuple]:
    """A response's output as comparable tuples."""
    out = []
    for item in response.output:
        if item.type == "reasoning":
            out.append(("reasoning", "".join(c.text for c in item.content)))
        elif item.type == "message":
            out.append(("message", "".join(c.text for c in item.content)))
        else:
            out.append(("function_call", item.name, json.loads(item.arguments)))
    return out


def raw_events(http, body) -> list[dict]:
    """The data of each event of a streamed /v1/responses, checking each is named by its type."""
    out, name = [], None
    with http.stream("POST", "/v1/responses", json={**body, "stream": True}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("event: "):
                name = line[len("event: "):]
            elif line.startswith("data: "):
                out.append(json.loads(line[len("data: "):]))
                assert out[-1]["type"] == name
    return out


# ---- plain, streamed, stored ------------------------------------------------------------


def test_create_get_delete(oai, srv):
    """A plain response: one message item, incomplete at max_output_tokens, usage counting the prompt as
    chat completions does; stored, it is returned by GET until DELETE removes it."""
    r = oai.responses.create(model="tiny", input="Hello", max_output_tokens=6, temperature=0)
    assert r.id.startswith("resp_") and r.object == "response" and r.model == "tiny"
    assert [i.type for i in r.output] == ["message"] and r.output_text
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    chat = oai.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hello"}],
                                       max_tokens=6, temperature=0)
    assert r.usage.input_tokens == chat.usage.prompt_tokens and r.usage.output_tokens == 6
    assert r.usage.total_tokens == r.usage.input_tokens + 6
    assert oai.responses.retrieve(r.id).output_text == r.output_text
    oai.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError):
        oai.responses.retrieve(r.id)
    with pytest.raises(openai.NotFoundError):
        oai.responses.delete(r.id)
    unstored = oai.responses.create(model="tiny", input="Hello", max_output_tokens=2, store=False)
    with pytest.raises(openai.NotFoundError):
        oai.responses.retrieve(unstored.id)


def test_streamed_events(oai, http):
    """Streamed: the Responses event sequence, numbered from 0, deltas adding up to the non-streamed
    text, and a last response.incomplete (max_output_tokens) holding the whole response."""
    body = {"model": "tiny", "input": "Tell me a story", "max_output_tokens": 8, "temperature": 0}
    full = oai.responses.create(**body)
    events = raw_events(http, body)
    kinds = [e["type"] for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", "response.incomplete"]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    deltas = [e["delta"] for e in events if e["type"] == "response.output_text.delta"]
    assert "".join(deltas) == full.output_text
    last = events[-1]["response"]
    assert last["status"] == "incomplete" and last["usage"]["output_tokens"] == 8
    assert last["output"][0]["content"][0]["text"] == full.output_text
    assert events[0]["response"]["status"] == "in_progress" and events[0]["response"]["output"] == []
    assert oai.responses.retrieve(last["id"]).output_text == full.output_text  # stored at its end too


@pytest.mark.parametrize("model", THINKERS)
def test_streamed_reasoning_with_the_clients_helper(oai, http, model):
    """A thinking model's reasoning is a reasoning item before the message, streamed as
    reasoning_text deltas; the client's own stream helper builds the completed response."""
    with oai.responses.stream(model=model, input="Say hi", max_output_tokens=100) as stream:
        final = stream.get_final_response()
    assert items(final) == [("reasoning", "A greeting."), ("message", "Hi there!")]
    assert final.status == "completed" and final.output_text == "Hi there!"
    assert final.usage.output_tokens_details.reasoning_tokens > 0
    events = raw_events(http, {"model": model, "input": "Say hi", "max_output_tokens": 100})
    thought = "".join(e["delta"] for e in events if e["type"] == "response.reasoning_text.delta")
    assert thought == "A greeting." and events[-1]["type"] == "response.completed"


def test_reasoning_effort_none_turns_thinking_off(oai):
    """reasoning.effort "none" renders Qwen3's template with enable_thinking=False."""
    r = oai.responses.create(model="qwen3", input="Say hi", max_output_tokens=100,
                             reasoning={"effort": "none"})
    assert items(r) == [("message", "Hello without thinking.")]


# ---- tools ------------------------------------------------------------------------------


@pytest.mark.parametrize("model", THINKERS)
def test_function_tool_round_trip(oai, model):
    """function_call, function_call_output, answer: the output items sent back as they came are
    templated as the call and its result, and so is the same turn by previous_response_id."""
    first = oai.responses.create(model=model, input=ASK, tools=TOOLS, max_output_tokens=200)
    assert items(first) == [("reasoning", "I should call the tool."), ("function_call", "get_weather",
                                                                          {"city": "Paris"})]
    call = first.output[1]
    assert call.call_id and call.id.startswith("fc_") and first.status == "completed"
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 21 C"}
    second = oai.responses.create(model=model, input=[*ASK, *first.output, result], tools=TOOLS,
                                  max_output_tokens=200)
    assert items(second) == [("reasoning", "The tool answered."), ("message", "It is sunny in Paris.")]
    chained = oai.responses.create(model=model, input=[result], previous_response_id=first.id, tools=TOOLS,
                                   max_output_tokens=200)
    assert items(chained) == items(second) and chained.previous_response_id == first.id
    assert chained.usage.input_tokens == second.usage.input_tokens


def test_streamed_function_call(oai, http):
    """Streamed, a call is an output item whose arguments come in function_call_arguments events."""
    body = {"model": "qwen3", "input": ASK, "tools": TOOLS, "max_output_tokens": 200}
    events = raw_events(http, body)
    args = [e for e in events if e["type"].startswith("response.function_call_arguments.")]
    assert [e["type"] for e in args] == ["response.function_call_arguments.delta",
                                         "response.function_call_arguments.done"]
    assert json.loads(args[0]["delta"]) == json.loads(args[1]["arguments"]) == {"city": "Paris"}
    added = [e["item"] for e in events if e["type"] == "response.output_item.added"]
    assert [i["type"] for i in added] == ["reasoning", "function_call"] and added[1]["arguments"] == ""
    with oai.responses.stream(**body) as stream:
        final = stream.get_final_response()
    assert items(final)[-1] == ("function_call", "get_weather", {"city": "Paris"})


def test_previous_response_id_chain(oai):
    """A chain of three by previous_response_id is templated as the whole conversation: the prompt
    counts what chat completions counts for the same messages, the earlier turns read from the prefix
    cache; earlier instructions are not carried over."""
    kw = dict(model="tiny", max_output_tokens=4, temperature=0)
    one = oai.responses.create(input="First question", instructions="Be brief.", **kw)
    two = oai.responses.create(input="Second question", previous_response_id=one.id, **kw)
    third = [{"role": "user", "content": [{"type": "input_text", "text": "Third"}]}]
    three = oai.responses.create(input=third, previous_response_id=two.id, **kw)
    messages = [{"role": "user", "content": "First question"},
                {"role": "assistant", "content": one.output_text},
                {"role": "user", "content": "Second question"},
                {"role": "assistant", "content": two.output_text},
                {"role": "user", "content": "Third"}]
    chat = oai.chat.completions.create(model="tiny", messages=messages, max_tokens=4, temperature=0)
    assert three.usage.input_tokens == chat.usage.prompt_tokens
    assert three.output_text == chat.choices[0].message.content
    assert three.usage.input_tokens_details.cached_tokens > 0


SCHEMA = {"type": "object", "additionalProperties": False, "required": ["city", "rain"],
          "properties": {"city": {"type": "string", "maxLength": 12}, "rain": {"type": "boolean"}}}


class Forecast(BaseModel):
    city: str = Field(max_length=12)
    rain: bool


def test_json_schema_text_format(oai):
    """text.format json_schema is enforced: the reply validates against the schema, and the client's
    parse() reads it into its model."""
    fmt = {"type": "json_schema", "name": "forecast", "schema": SCHEMA, "strict": True}
    r = oai.responses.create(model="tiny", input="Forecast for Oslo", text={"format": fmt},
                             max_output_tokens=60, temperature=0)
    assert r.status == "completed", r.output_text
    jsonschema.validate(json.loads(r.output_text), SCHEMA)
    assert r.text.format.type == "json_schema"
    parsed = oai.responses.parse(model="tiny", input="Forecast for Oslo", text_format=Forecast,
                                 max_output_tokens=60, temperature=0)
    assert isinstance(parsed.output_parsed, Forecast)


# ---- the OpenAI Agents SDK --------------------------------------------------------------


def test_agents_sdk_runs_a_tool_loop(srv, http):
    """The OpenAI Agents SDK with its default model (Responses) runs an agent against the server: the
    model calls the tool, the SDK runs it and sends the result back, and the answer is the final output."""
    from agents import Agent, RunConfig, Runner, function_tool
    from agents.models.openai_provider import OpenAIProvider

    calls = []

    @function_tool
    def get_weather(city: str) -> str:
        """Weather in a city."""
        calls.append(city)
        return "sunny, 21 C"

    agent = Agent(name="weather", instructions="Answer questions about the weather.", tools=[get_weather],
                  model="qwen3")

    async def run():
        async with openai.AsyncOpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0) as client:
            config = RunConfig(model_provider=OpenAIProvider(openai_client=client), tracing_disabled=True)
            return await Runner.run(agent, "Weather in Paris?", run_config=config)

    served = metric(http, "mlxrt_http_requests_total", endpoint="/v1/responses", status="200")
    result = asyncio.run(run())
    assert calls == ["Paris"]
    assert metric(http, "mlxrt_http_requests_total", endpoint="/v1/responses", status="200") == served + 2
    assert result.final_output == "It is sunny in Paris."


# ---- one core under all the APIs --------------------------------------------------------


def test_same_tokens_through_chat_completions_messages_and_responses(oai, srv):
    """The same greedy request through chat completions, Anthropic Messages and Responses templates the
    same prompt and generates the same tokens."""
    ask = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Tell me a story"}]
    chat = oai.chat.completions.create(model="tiny", messages=ask, max_tokens=24, temperature=0,
                                       extra_body={"return_token_ids": True})
    with anthropic.Anthropic(base_url=srv.url, api_key="unused", max_retries=0) as claude:
        msg = claude.messages.create(model="tiny", system="You are terse.", messages=ask[1:], max_tokens=24,
                                     extra_body={"temperature": 0})
    resp = oai.responses.create(model="tiny", instructions="You are terse.", input="Tell me a story",
                                max_output_tokens=24, temperature=0)
    text = chat.choices[0].message.content
    assert len(chat.choices[0].token_ids) == msg.usage.output_tokens == resp.usage.output_tokens == 24
    assert msg.content[0].text == resp.output_text == text
    assert chat.usage.prompt_tokens == msg.usage.input_tokens + msg.usage.cache_read_input_tokens
    assert chat.usage.prompt_tokens == resp.usage.input_tokens


# ---- bad input --------------------------------------------------------------------------

BAD = [
    ({"input": [{"type": "mystery", "content": "x"}]}, "input[0].type"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0].type"),
    ({"input": "Hi", "previous_response_id": "resp_unknown"}, "previous_response_id"),
    ({"input": [{"type": "function_call_output", "call_id": "call_9", "output": "42"}]}, "input[0].call_id"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}]},
     "input[0].content[0].image_url"),  # remote images are not fetched (docs/vision.md)
    ({"input": [{"role": "wizard", "content": "x"}]}, "input[0].role"),
    ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "input[0].call_id"),
    ({"input": "Hi", "tools": [{**TOOLS[0], "parameters": {"type": "object", "required": "city"}}]},
     "tools[0].parameters"),
    ({"input": "Hi", "tools": [{"type": "namespace", "name": "ns", "tools": [{"type": "web_search"}]}]},
     "tools[0].tools[0].type"),
    ({"input": "Hi", "tools": [{**TOOLS[0], "name": "ns__f"},
                               {"type": "namespace", "name": "ns", "tools": [{**TOOLS[0], "name": "f"}]}]},
     "tools[1].tools[0].name"),
    ({"input": "Hi", "tools": [{"type": "custom", "name": "patch", "format": {"type": "grammar"}}]},
     "tools[0].format"),
    ({"input": "Hi", "tools": [{"type": "function", "name": 7}]}, "tools[0].name"),
    ({"input": "Hi", "tools": TOOLS, "tool_choice": {"type": "function", "name": "nope"}},
     "tool_choice.name"),
    ({"input": "Hi", "text": {"format": {"type": "json_schema", "name": "x", "schema": {
        "type": "integer", "minimum": 5, "maximum": 1}}}}, "text.format.schema"),
    ({"input": "Hi", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "Hi", "reasoning": {"effort": "high"}}, "reasoning.effort"),
]


@pytest.mark.parametrize("body, param", BAD, ids=[p for _, p in BAD])
def test_bad_input_is_a_400_in_openai_shape_and_reaches_no_worker(srv, http, body, param):
    """An unknown item type, an unknown previous_response_id, a call output answering no call, an
    invalid tool schema and the like: 400 in OpenAI's error shape naming the field; no worker sees it."""
    sent = sum(w.requests for w in srv.rt.workers)
    r = http.post("/v1/responses", json={"model": "tiny", **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["type"] == "invalid_request_error"
    assert err["param"] == param and param.rpartition(".")[2] in err["message"]
    assert sum(w.requests for w in srv.rt.workers) == sent


def test_worker_death_mid_stream_in_messages_and_responses(tiny_model):
    """A worker killed mid-stream ends a Messages stream with an error event and a Responses stream
    with response.failed, each in its API's shape; with no worker left, each is a 503."""
    s = ServerThread({"a": tiny_model, "b": tiny_model}, **NO_RESTART)
    url = s.start()
    pids = s.pids
    try:
        by_model = {w.model: w.pid for w in s.rt.workers}
        with httpx.Client(base_url=url, timeout=30) as c:
            hi = [{"role": "user", "content": "Hi"}]
            # Greedy: a sampled reply may end within a few tokens, before the kill.
            body = {"model": "a", "max_tokens": 500, "temperature": 0, "stream": True, "messages": hi}
            with c.stream("POST", "/v1/messages", json=body) as r:
                lines = r.iter_lines()
                next(lines)
                os.kill(by_model["a"], signal.SIGKILL)
                rest = [x for x in lines if x]
            assert rest[-2] == "event: error"
            error = json.loads(rest[-1][len("data: "):])
            assert error["type"] == "error" and error["error"]["type"] == "overloaded_error"
            body = {"model": "b", "max_output_tokens": 500, "temperature": 0, "stream": True, "input": "Hi"}
            with c.stream("POST", "/v1/responses", json=body) as r:
                lines = r.iter_lines()
                next(lines)
                os.kill(by_model["b"], signal.SIGKILL)
                last = json.loads([x for x in lines if x.startswith("data: ")][-1][len("data: "):])
            assert last["type"] == "response.failed" and last["response"]["status"] == "failed"
            assert last["response"]["error"]["code"] == "worker_unavailable"
            after = c.post("/v1/messages", json={"model": "a", "max_tokens": 2, "messages": hi})
            assert after.status_code == 503 and after.json()["error"]["type"] == "overloaded_error"
            after = c.post("/v1/responses", json={"model": "b", "input": "Hi"})
            assert after.status_code == 503 and after.json()["error"]["code"] == "worker_unavailable"
    finally:
        s.stop()
    assert_stopped(pids)
