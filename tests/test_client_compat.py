"""What real coding agents send is served: request bodies shaped as Claude Code's and Codex's, unknown fields
ignored and named in the log, hosted tools left out with a warning, namespaced and custom tools round-tripped.

The bodies carry the fields the issue lists (Claude Code 2.1: ``role: "system"`` turns, ``metadata``,
``thinking`` above ``max_tokens``, ``context_management``, ``cache_control``, ``defer_loading``,
``?beta=true``, replayed server-tool blocks; Codex 0.169: ``namespace``, ``custom`` and ``web_search``
tools, ``client_metadata``, ``include``, ``store: false``, ``prompt_cache_key``, ``reasoning.summary``,
no output limit). Replies are scripted (`scripted_worker.py`): random weights never call a tool by
themselves. The log lines come from a real ``mlxrt serve --log-level info``.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import subprocess
import sys
import time

import anthropic
import httpx
import openai
import pytest
from support import SCRIPTED, ServerThread, assert_stopped, free_port

QWEN3 = "synthetic:tiny-qwen3?context=8192"  # room for the agents' tool lists
LIST_CALL = {"name": "mcp__fs__list", "arguments": {"path": "."}}
PATCH = "*** Begin Patch\n*** Add File: a.txt\n+hi\n*** End Patch\n"
SCRIPT = [
    ["<tool_response>\nREADME.md", "<think>\nThe tool answered.\n</think>\n\nOne file: README.md."],
    ["<tool_response>\nDone!", "<think>\nPatched.\n</think>\n\nThe patch is in."],
    ["List the files", f"<think>\nI will list them.\n</think>\n\n<tool_call>\n{json.dumps(LIST_CALL)}\n"
                       "</tool_call>"],
    ["Patch the readme", "<think>\nA patch.\n</think>\n\n<tool_call>\n"
     + json.dumps({"name": "apply_patch", "arguments": {"input": PATCH}}) + "\n</tool_call>"],
    ["Say hi", "<think>\nA greeting.\n</think>\n\nHi there!"],
]
LARK = ('start: begin_patch hunk+ end_patch\nbegin_patch: "*** Begin Patch" LF\n'
        'end_patch: "*** End Patch" LF?\nhunk: "*** Add File: " /(.+)/ LF ("+" /(.*)/ LF)*\n'
        '%import common.LF\n')
# A ChatML template that, like several families' templates, takes a system turn only first.
SYSTEM_FIRST = ("{%- for m in messages -%}{%- if m.role == 'system' and not loop.first -%}"
                "{{ raise_exception('System messages must come first') }}{%- endif -%}"
                "<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor -%}"
                "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif -%}")
OBJ = {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"],
       "additionalProperties": False}


@pytest.fixture(scope="module")
def srv():
    """One server: the tiny model (unscripted) and a scripted tiny Qwen3 with an 8k context."""
    from mlxrt import ModelSpec
    from mlxrt.synthetic.build import ensure_model

    old = os.environ.get("SCRIPTED_REPLIES")
    os.environ["SCRIPTED_REPLIES"] = json.dumps(SCRIPT)
    tiny = str(ensure_model("tiny"))
    models = {"tiny": tiny, "qwen3": QWEN3, "system-first": ModelSpec(tiny, chat_template=SYSTEM_FIRST)}
    s = ServerThread(models, _worker_argv=SCRIPTED)
    refs = {name: m if isinstance(m, str) else m.path for name, m in models.items()}
    s.serve = functools.partial(ServerThread.serve, s, model_refs=refs)  # /api/show reads the paths
    try:
        s.url = s.start()
        pids = s.pids
        yield s
        s.stop()
        assert_stopped(pids)
    finally:
        if old is None:
            del os.environ["SCRIPTED_REPLIES"]
        else:
            os.environ["SCRIPTED_REPLIES"] = old


@pytest.fixture
def http(srv):
    with httpx.Client(base_url=srv.url, timeout=120) as c:
        yield c


# ---- Claude Code --------------------------------------------------------------------------

CACHE = {"type": "ephemeral"}


def claude_code_body(*turns: dict, stream: bool = False) -> dict:
    """A /v1/messages body as Claude Code 2.1 sends it for a model name it does not know."""
    return {
        "model": "qwen3", "max_tokens": 21333, "stream": stream,
        "thinking": {"type": "enabled", "budget_tokens": 31999},
        "metadata": {"user_id": "user_abc_account_def_session_123"},
        "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
        "system": [{"type": "text", "text": "You are Claude Code.", "cache_control": CACHE}],
        "messages": [
            {"role": "user", "content": [
                {"type": "text", "text": "<system-reminder>Be brief.</system-reminder>"}]},
            {"role": "system", "content": "<env>Working directory: /tmp/p</env>"},
            *turns,
        ],
        "tools": [
            {"name": "Bash", "description": "Run a command", "cache_control": CACHE,
             "input_schema": {"$schema": "http://json-schema.org/draft-07/schema#", **OBJ}},
            {"name": "mcp__fs__list", "description": "List files", "defer_loading": True,
             "input_schema": OBJ},
            {"type": "web_search_20250305", "name": "web_search", "max_uses": 5},
        ],
        "temperature": 1,
        "future_field": {"x": 1},  # a field this server has never heard of
    }


def test_claude_code_session_round_trip(http):
    """Claude Code's shape (a system turn inside messages, thinking above max_tokens, metadata,
    context_management, cache_control, defer_loading, a server tool, ?beta=true, an unknown field):
    the tool call, its result with replayed server-tool and tool_reference blocks, and the answer
    are all 200s, and the second request reads its prefix from the cache."""
    headers = {"anthropic-beta": "claude-code-20250219,interleaved-thinking-2025-05-14",
               "anthropic-version": "2023-06-01", "x-api-key": "unused"}
    first = http.post("/v1/messages?beta=true", headers=headers, json=claude_code_body(
        {"role": "user", "content": [{"type": "text", "text": "List the files", "cache_control": CACHE}]}))
    assert first.status_code == 200, first.text
    call = next(b for b in first.json()["content"] if b["type"] == "tool_use")
    assert (call["name"], call["input"]) == ("mcp__fs__list", {"path": "."})
    assert first.json()["stop_reason"] == "tool_use"
    turns = [
        {"role": "user", "content": [{"type": "text", "text": "List the files"}]},
        {"role": "assistant", "content": [
            {"type": "server_tool_use", "id": "srvtoolu_1", "name": "web_search", "input": {"query": "x"}},
            {"type": "web_search_tool_result", "tool_use_id": "srvtoolu_1", "content": []},
            *first.json()["content"]]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": call["id"], "cache_control": CACHE,
             "content": [{"type": "text", "text": "README.md"},
                         {"type": "tool_reference", "tool_name": "Bash"}]}]},
    ]
    with anthropic.Anthropic(base_url=str(http.base_url), api_key="unused", max_retries=0) as claude:
        body = claude_code_body(*turns)
        with claude.messages.stream(model="qwen3", max_tokens=body["max_tokens"], messages=body["messages"],
                                    system=body["system"], tools=body["tools"], thinking=body["thinking"],
                                    metadata=body["metadata"], extra_query={"beta": "true"},
                                    extra_body={"context_management": body["context_management"],
                                                "future_field": 1}) as stream:
            final = stream.get_final_message()
    assert [b.type for b in final.content] == ["thinking", "text"]
    assert final.content[1].text == "One file: README.md." and final.stop_reason == "end_turn"
    assert final.usage.cache_read_input_tokens > 0


def test_leading_system_turns_join_the_system_prompt(http):
    """System turns before the conversation join the system text: the same prompt as one system field."""
    def prompt_tokens(body: dict) -> int:
        r = http.post("/v1/messages/count_tokens", json=body)
        assert r.status_code == 200, r.text
        return r.json()["input_tokens"]

    joined = prompt_tokens({"model": "qwen3", "system": "You are terse.\n\nBe kind.",
                            "messages": [{"role": "user", "content": "Say hi"}]})
    turns = prompt_tokens({"model": "qwen3", "system": "You are terse.", "messages": [
        {"role": "system", "content": [{"type": "text", "text": "Be kind."}]},
        {"role": "user", "content": "Say hi"}]})
    assert joined == turns


def test_a_late_system_turn_the_template_refuses_is_a_400_naming_it(http):
    """A system turn after the conversation began stays in place; a template that takes system turns
    only first refuses it: a 400 in Anthropic's shape naming that turn's role. Leading ones are joined."""
    turns = [{"role": "user", "content": "Hi"}, {"role": "system", "content": "Be kind."},
             {"role": "user", "content": "Say hi"}]
    r = http.post("/v1/messages", json={"model": "system-first", "max_tokens": 2, "messages": turns})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["message"].startswith("messages[1].role: ")
    assert "System messages must come first" in err["message"]
    r = http.post("/v1/messages", json={"model": "system-first", "max_tokens": 2, "messages": turns[1:]})
    assert r.status_code == 200, r.text


# ---- Codex ---------------------------------------------------------------------------------


def codex_body(*items: dict) -> dict:
    """A /v1/responses body as Codex 0.169 sends it: no output limit, hosted and grouped tools."""
    return {
        "model": "qwen3", "instructions": "You are Codex, a coding agent.",
        "input": [
            {"type": "message", "role": "developer",
             "content": [{"type": "input_text", "text": "Sandbox: on"}]},
            {"type": "message", "role": "user", "content": [
                {"type": "input_text", "text": "<environment_context>cwd /tmp/p</environment_context>"}]},
            *items,
        ],
        "tools": [
            {"type": "function", "name": "exec_command", "description": "Run a command", "strict": False,
             "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}, "required": ["cmd"],
                            "additionalProperties": False}},
            {"type": "custom", "name": "apply_patch", "description": "Edit files with a patch",
             "format": {"type": "grammar", "syntax": "lark", "definition": LARK}},
            {"type": "web_search", "external_web_access": False},
            {"type": "namespace", "name": "collaboration", "description": "Agents", "tools": [
                {"type": "function", "name": "spawn_agent", "description": "Start an agent", "strict": False,
                 "parameters": {"type": "object", "properties": {"task": {"type": "string"}}}}]},
            {"type": "namespace", "name": "mcp__fs__", "description": "Files", "tools": [
                {"type": "function", "name": "list", "description": "List files", "strict": False,
                 "defer_loading": True, "parameters": OBJ}]},
            {"type": "image_generation", "output_format": "png"},
        ],
        "tool_choice": "auto", "parallel_tool_calls": False,
        "reasoning": {"effort": "medium", "summary": "auto"},
        "store": False, "stream": True, "include": ["reasoning.encrypted_content"],
        "prompt_cache_key": "019a-session", "text": {"verbosity": "medium"},
        "client_metadata": {"x-codex-turn-metadata": '{"turn_id": "1"}'},
    }


def user(text: str) -> dict:
    return {"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}


def completed(oai: openai.OpenAI, body: dict):
    """Stream `body` with the openai client, as Codex does; the final response."""
    extra = {k: v for k, v in body.items() if k not in ("model", "input", "stream")}
    with oai.responses.stream(model=body["model"], input=body["input"], extra_body=extra) as stream:
        events = list(stream)
        return stream.get_final_response(), events


def test_codex_session_round_trip(srv):
    """Codex's shape: a namespaced MCP call comes back as name + namespace, is replayed with its
    namespace and output, and the answer completes; hosted tools are left out with a warning, and
    the follow-up reads its prefix from the cache."""
    with openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0) as oai:
        first, events = completed(oai, codex_body(user("List the files")))
        assert first.status == "completed"
        call = next(i for i in first.output if i.type == "function_call")
        assert (call.name, call.namespace, json.loads(call.arguments)) == ("list", "mcp__fs__", {"path": "."})
        warnings = first.model_extra["warnings"]
        assert any("web_search" in w for w in warnings) and any("image_generation" in w for w in warnings)
        assert events[-1].type == "response.completed"
        reasoning = next(i for i in first.output if i.type == "reasoning")
        replay = [user("List the files"),
                  {"type": "reasoning", "id": reasoning.id, "summary": [], "encrypted_content": None,
                   "content": [{"type": "reasoning_text", "text": reasoning.content[0].text}]},
                  {"type": "function_call", "name": "list", "namespace": "mcp__fs__", "call_id": call.call_id,
                   "arguments": call.arguments},
                  {"type": "function_call_output", "call_id": call.call_id, "output": "README.md"}]
        second, _ = completed(oai, codex_body(*replay))
    assert second.status == "completed" and second.output_text == "One file: README.md."
    assert second.usage.input_tokens_details.cached_tokens > 0


def test_codex_custom_tool_round_trip(srv):
    """A call of a custom (free-form) tool comes back as custom_tool_call with its text input, streamed
    with its input events, and its replayed call and output are served."""
    body = codex_body(user("Patch the readme"))
    with httpx.Client(base_url=srv.url, timeout=120) as http, \
            http.stream("POST", "/v1/responses", json=body) as r:
        assert r.status_code == 200
        names = [line[len("event: "):] for line in r.iter_lines() if line.startswith("event: ")]
    assert "response.custom_tool_call_input.delta" in names and names[-1] == "response.completed"
    with openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0) as oai:
        first, _ = completed(oai, body)
        call = next(i for i in first.output if i.type == "custom_tool_call")
        assert (call.name, call.input) == ("apply_patch", PATCH)
        second, _ = completed(oai, codex_body(
            user("Patch the readme"),
            {"type": "custom_tool_call", "call_id": call.call_id, "name": "apply_patch", "input": call.input},
            {"type": "custom_tool_call_output", "call_id": call.call_id, "output": "Done!"}))
    assert second.output_text == "The patch is in."


def test_forced_custom_tool_input_matches_its_regex(http):
    """A forced custom tool with a regex grammar: the model (random weights, unscripted) can only write
    an input the regex matches, returned as the custom call's text."""
    body = {"model": "tiny", "input": "Pick a colour", "max_output_tokens": 64, "temperature": 1.0,
            "tools": [{"type": "custom", "name": "pick", "format": {"type": "grammar", "syntax": "regex",
                                                                     "definition": "(red|green|blue)"}}],
            "tool_choice": {"type": "custom", "name": "pick"}}
    done = 0
    for _ in range(3):
        r = http.post("/v1/responses", json=body)
        assert r.status_code == 200, r.text
        if r.json()["status"] == "completed":
            done += 1
            (item,) = r.json()["output"]
            assert item["type"] == "custom_tool_call" and item["input"] in ("red", "green", "blue")
    assert done, "no forced call ended by itself"


def test_forced_namespaced_call_comes_back_with_its_namespace(http):
    """A tool choice naming a namespaced function (by name and namespace): the model, unscripted, must
    call it, and the call comes back as that name with its namespace, its arguments valid."""
    tool = {"type": "function", "name": "list", "parameters": {
        "type": "object", "properties": {"n": {"enum": [1, 2]}}, "required": ["n"]}}
    body = {"model": "tiny", "input": "Count", "max_output_tokens": 64,
            "tools": [{"type": "namespace", "name": "mcp__fs", "tools": [tool]}],
            "tool_choice": {"type": "function", "name": "list", "namespace": "mcp__fs"}}
    r = http.post("/v1/responses", json=body)
    assert r.status_code == 200, r.text
    assert r.json()["tool_choice"] == body["tool_choice"]
    (call,) = [i for i in r.json()["output"] if i["type"] == "function_call"]
    assert (call["name"], call["namespace"]) == ("list", "mcp__fs")
    assert json.loads(call["arguments"]) in ({"n": 1}, {"n": 2})


def test_no_output_limit_gets_the_default_not_the_context(http):
    """A request that sets no limit, on a model with an 8k context, stops at the 512-token default
    (mlx_lm.server's --max-tokens) and says it was cut: incomplete, max_output_tokens."""
    r = http.post("/v1/responses", json={"model": "qwen3", "input": "Tell me everything",
                                         "reasoning": {"effort": "none"}})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["usage"]["output_tokens"] <= 512
    assert (body["status"] == "incomplete") is (body["usage"]["output_tokens"] == 512)
    if body["status"] == "incomplete":
        assert body["incomplete_details"] == {"reason": "max_output_tokens"}
    chat = http.post("/v1/chat/completions", json={"model": "qwen3", "ignore_eos": True,
                                                   "messages": [{"role": "user", "content": "Go on"}]})
    assert chat.status_code == 200 and chat.json()["usage"]["completion_tokens"] == 512


# ---- the log of a real `mlxrt serve` -------------------------------------------------------


@contextlib.contextmanager
def serve_logged(model: str, log_path, env: dict[str, str] | None = None):
    """`mlxrt serve --log-level info` on `model` (named tiny); its URL and a function returning the
    JSON log lines written so far."""
    port = free_port()
    with open(log_path, "wb") as err:
        proc = subprocess.Popen([sys.executable, "-m", "mlxrt", "--log-level", "info", "serve", "--model",
                                 f"tiny={model}", "--port", str(port), "--transport", "stdio"],
                                stdout=subprocess.DEVNULL, stderr=err, env={**os.environ, **(env or {})})
    url = f"http://127.0.0.1:{port}"

    def lines() -> list[dict]:
        return [json.loads(s) for s in log_path.read_text().splitlines() if s.startswith("{")]

    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                httpx.get(url + "/health")
                break
            except httpx.TransportError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    pytest.fail(f"server did not come up: {log_path.read_text()}")
                time.sleep(0.1)
        yield url, lines
    finally:
        proc.terminate()
        proc.wait(30)


@pytest.fixture(scope="module")
def served(tiny_model, tmp_path_factory):
    with serve_logged(tiny_model, tmp_path_factory.mktemp("serve") / "stderr.log") as s:
        yield s


def new_lines(lines, before: int, event: str) -> list[dict]:
    return [e for e in lines()[before:] if e.get("event") == event]


@pytest.mark.parametrize("path, body, fields", [
    ("/v1/chat/completions", {"model": "tiny", "max_tokens": 2, "verbosity": "low", "messages": [
        {"role": "user", "content": [{"type": "text", "text": "Hi", "cache_control": {}}], "x": 1}]},
     ["verbosity", "messages[0].x", "messages[0].content[0].cache_control"]),
    ("/api/chat", {"model": "tiny", "stream": False, "messages": [{"role": "user", "content": "Hi", "y": 2}],
                   "options": {"num_predict": 2, "mirostat": 2}, "shift": True},
     ["shift", "messages[0].y", "options.mirostat"]),
    ("/v1/completions", {"model": "tiny", "prompt": "Hi", "max_tokens": 2, "stream_options": None, "z": 0},
     ["z"]),
])
def test_unknown_fields_are_served_and_named_once_in_the_log(served, path, body, fields):
    """Fields the server does not know, at any depth, on chat completions, Ollama and completions: the
    request is served, and one info line names their paths."""
    url, lines = served
    before = len(lines())
    r = httpx.post(url + path, json=body, timeout=60)
    assert r.status_code == 200, r.text
    time.sleep(0.2)  # the line is written before the reply; the file is read from another process
    (line,) = new_lines(lines, before, "http.ignored_fields")
    assert line["path"] == path and line["fields"] == fields and line["level"] == "info"


def test_hosted_tools_left_out_with_a_warning(served):
    """A hosted tool a Responses request lists is left out: one warning names it, and the response
    says so in its warnings."""
    url, lines = served
    before = len(lines())
    hosted = [{"type": "file_search", "vector_store_ids": ["v"]}]
    r = httpx.post(url + "/v1/responses", json={"model": "tiny", "input": "Hi", "max_output_tokens": 2,
                                                 "tools": hosted, "client_metadata": {"a": "b"}}, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["warnings"] == ["ignored: tools[0] (file_search: a hosted tool this server cannot run)"]
    time.sleep(0.2)
    (line,) = new_lines(lines, before, "http.ignored")
    assert line["level"] == "warning" and "file_search" in line["dropped"][0]


@pytest.mark.parametrize("path, body, status, param", [
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "n": "two"},
     400, "n"),
    ("/v1/messages", {"model": "tiny", "messages": [{"role": "user", "content": "x"}]}, 400, "max_tokens"),
    ("/api/generate", {"model": "nope", "prompt": "x"}, 404, "model"),
])
def test_every_4xx_leaves_one_info_line(served, path, body, status, param):
    """A body-validation 400 or a 404 logs one info line: path, status, and the message the client got."""
    url, lines = served
    before = len(lines())
    r = httpx.post(url + path, json=body, timeout=60)
    assert r.status_code == status
    time.sleep(0.2)
    (line,) = new_lines(lines, before, "http.client_error")
    assert (line["path"], line["status"], line["level"], line["param"]) == (path, status, "info", param)
    sent = r.json()["error"]
    assert line["error"] in (sent if isinstance(sent, str) else sent["message"])


def test_a_prompt_over_the_context_logs_why(served):
    """A prompt longer than the context: the client's 400 and the log's lines both say why."""
    url, lines = served
    before = len(lines())
    r = httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": "word " * 2000, "max_tokens": 2},
                   timeout=60)
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    time.sleep(0.2)
    (gen,) = new_lines(lines, before, "http.generation")
    (err,) = new_lines(lines, before, "http.client_error")
    assert gen["reason"] == "error" and gen["error"] and err["error"] == r.json()["error"]["message"]


def test_the_request_line_carries_what_a_user_needs(served):
    """http.generation: prompt tokens, cached tokens, TTFT and the finish reason."""
    url, lines = served
    before = len(lines())
    r = httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": "Hello there", "max_tokens": 3,
                                                   "ignore_eos": True}, timeout=60)
    assert r.status_code == 200
    time.sleep(0.2)
    (gen,) = new_lines(lines, before, "http.generation")
    assert gen["reason"] == "length" and gen["prompt_tokens"] == r.json()["usage"]["prompt_tokens"]
    assert {"cached_tokens", "ttft_ms", "tokens"} <= set(gen)


def test_a_5xx_logs_an_error_with_its_traceback(tiny_model, tmp_path):
    """A request that times out waiting for its tokens (a 504): one error line with the message the
    client got and the traceback of the runtime's timeout."""
    env = {"MLXRT_TOKEN_TIMEOUT_S": "0.000001"}
    with serve_logged(tiny_model, tmp_path / "stderr.log", env) as (url, lines):
        r = httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": "Hi", "max_tokens": 8},
                       timeout=60)
        assert r.status_code == 504, r.text
        time.sleep(0.2)
        (line,) = new_lines(lines, 0, "http.error")
    assert (line["level"], line["status"], line["error"]) == ("error", 504, r.json()["error"]["message"])
    assert "Traceback" in line["exception"] and "MLXRT_TOKEN_TIMEOUT_S" in line["exception"]
