"""A chat reply split into answer, reasoning and tool calls (`worker/reply.py`), in-process.

The splitters on chosen text, cut at every size; then the engine the worker runs, on each
family's tiny preset, with the reply forced token by token (`forcing.py`): what the template
renders, where the reply starts, and the parts each request gets inside a batch.
"""

from __future__ import annotations

import json

import pytest
from forcing import forced, reply_ids
from mlx_lm.tool_parsers import json_tools
from mlxrt.ipc.protocol import ChatMessage, ChatOptions, Generate, SamplingParams, ToolCall
from mlxrt.worker.engine import Engine
from mlxrt.worker.prompt import is_llama3_json
from mlxrt.worker.reply import (
    HarmonySplitter,
    Llama3JsonSplitter,
    Parts,
    TagSplitter,
    make_splitter,
)
from support import run_batch

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
CALL = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
QWEN = f"<think>\nI should call the tool.\n</think>\n\nLet me look.\n<tool_call>\n{CALL}\n</tool_call>"
HARMONY = ("<|channel|>analysis<|message|>I should call the tool.<|end|>"
           "<|start|>assistant<|channel|>commentary"
           ' to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}')


def split(splitter, text: str, size: int | None = None) -> Parts:
    """Feed `text` in pieces of `size` characters (all at once: None), then finish."""
    parts = Parts()
    step = size or max(len(text), 1)
    for i in range(0, len(text), step):
        parts.extend(splitter.feed(text[i : i + step]))
    return parts.extend(splitter.finish())


def shape(parts: Parts) -> tuple:
    """Parts without the calls' ids (fresh per call)."""
    return parts.content, parts.reasoning, [(c.name, json.loads(c.arguments)) for c in parts.calls]


def qwen_splitter(tools=TOOLS, initial="normal") -> TagSplitter:
    return TagSplitter(think=("<think>", "</think>"), call=("<tool_call>", "</tool_call>"),
                       parser=json_tools.parse_tool_call, tools=tools, initial=initial)


# ---- the splitters on chosen text ------------------------------------------------------


@pytest.mark.parametrize("size", [None, 1, 2, 3, 5, 8])
def test_think_and_tool_call_markup_split_alike_however_the_text_is_cut(size):
    """<think> and <tool_call> markup cut anywhere (a marker over two deltas) gives the same parts,
    with the newlines the template puts around tags dropped."""
    got = shape(split(qwen_splitter(), QWEN, size))
    assert got == ("Let me look.", "I should call the tool.", [("get_weather", {"city": "Paris"})])


def test_reply_that_starts_inside_think_is_reasoning_until_it_closes():
    """A prompt that opened <think> (Qwen3.5) starts the reply in its reasoning."""
    got = shape(split(qwen_splitter(initial="reasoning"), "Hmm.\n</think>\n\nHello.", 2))
    assert got == ("Hello.", "Hmm.", [])


def test_a_call_may_start_inside_the_reasoning():
    """As in mlx_lm.server, a call opened before </think> is still a call; the answer follows it."""
    got = shape(split(qwen_splitter(), f"<think>\nHmm <tool_call>\n{CALL}\n</tool_call>\nDone.", 4))
    assert got == ("Done.", "Hmm", [("get_weather", {"city": "Paris"})])


@pytest.mark.parametrize("reply, content", [
    ("<tool_call>\n{not json}\n</tool_call>", "<tool_call>\n{not json}\n</tool_call>"),
    ('<tool_call>\n{"name": "get_weather", "argu', '<tool_call>\n{"name": "get_weather", "argu'),
    ('<tool_call>\n{"arguments": {}}\n</tool_call>', '<tool_call>\n{"arguments": {}}\n</tool_call>'),
])
def test_a_call_that_does_not_parse_stays_in_the_answer(reply, content):
    """A call that is not JSON, cut off (max_tokens) or nameless is kept as answer text, not dropped."""
    assert shape(split(qwen_splitter(), reply, 3)) == (content, "", [])


def test_whitespace_inside_a_part_is_kept():
    """Only the edges of a part lose their whitespace: inner newlines and a final one stay."""
    got = shape(split(qwen_splitter(), "<think>\na\n\nb\n</think>\n\nx\n\ny\n", 1))
    assert got == ("x\n\ny\n", "a\n\nb", [])


@pytest.mark.parametrize("size", [None, 1, 4, 7])
def test_harmony_channels_split_alike_however_the_text_is_cut(size):
    """gpt-oss: analysis is the reasoning, a commentary message to=functions.X a call whose body is
    its arguments (ending with the reply, as <|call|> ends the turn)."""
    got = shape(split(HarmonySplitter(parse_tools=True, prompt_tail="<|start|>assistant"), HARMONY, size))
    assert got == ("", "I should call the tool.", [("get_weather", {"city": "Paris"})])
    final = "<|channel|>analysis<|message|>Hm.<|end|><|start|>assistant<|channel|>final<|message|>Hi!"
    got = shape(split(HarmonySplitter(parse_tools=False, prompt_tail="<|start|>assistant"), final, size))
    assert got == ("Hi!", "Hm.", [])


def test_harmony_recipient_may_come_before_the_channel():
    """" to=functions.X<|channel|>commentary json<|message|>...": the recipient in the header is found."""
    reply = ' to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Paris"}'
    got = shape(split(HarmonySplitter(parse_tools=True, prompt_tail="<|start|>assistant"), reply, 3))
    assert got == ("", "", [("get_weather", {"city": "Paris"})])


def test_harmony_call_without_tools_is_answer_text():
    """With no tools in the request a commentary call is not parsed; its body is kept as answer text."""
    got = shape(split(HarmonySplitter(parse_tools=False, prompt_tail="<|start|>assistant"), HARMONY, 5))
    assert got == ('{"city": "Paris"}', "I should call the tool.", [])


@pytest.mark.parametrize("reply", [" ba be bo, no header at all", "Plain words<|end|> and more", ""])
def test_text_that_is_not_harmony_is_the_answer(reply):
    """A reply with no harmony header (a random-weight model) is all answer, nothing lost."""
    got = shape(split(HarmonySplitter(parse_tools=True, prompt_tail="<|start|>assistant"), reply, 2))
    assert got == (reply, "", [])


LLAMA_CALL = '{"name": "get_weather", "parameters": {"city": "Paris"}}'
PARIS = ("get_weather", {"city": "Paris"})


@pytest.mark.parametrize("size", [None, 1, 3, 7])
@pytest.mark.parametrize("reply, calls", [
    (LLAMA_CALL, [PARIS]),
    ("<|python_tag|>" + LLAMA_CALL, [PARIS]),
    ("\n " + LLAMA_CALL + "\n", [PARIS]),
    (LLAMA_CALL + '; {"name": "get_time", "arguments": {}}', [PARIS, ("get_time", {})]),
    (LLAMA_CALL + '\n{"name": "get_time", "parameters": "{\\"tz\\": \\"UTC\\"}"}',
     [PARIS, ("get_time", {"tz": "UTC"})]),
])
def test_llama_bare_json_calls_parse_however_the_text_is_cut(size, reply, calls):
    """Llama 3.x: a reply that starts with "{" (after whitespace and an optional <|python_tag|>) is
    calls, one or several separated by ";" or newlines, with "parameters" (or "arguments")."""
    assert shape(split(Llama3JsonSplitter(), reply, size)) == ("", "", calls)


@pytest.mark.parametrize("reply", [
    '{"name": "get_weather", "parameters": {"city": "Par',  # cut off by max_tokens
    '{"name": "get_weather", parameters: {}}',  # not JSON
    '{"answer": 42}',  # a JSON answer, not a call
    '{"name": "get_weather"}',  # no parameters
    LLAMA_CALL + " and then some words",
    LLAMA_CALL + LLAMA_CALL,  # two calls with no separator
    '<|python_tag|>{"name": "get_weather", "parameters": [1]}',
])
def test_llama_reply_that_is_not_calls_is_kept_whole_as_the_answer(reply):
    """A reply that opens with "{" but does not parse as calls is returned as answer text, unchanged."""
    for size in (None, 2):
        assert shape(split(Llama3JsonSplitter(), reply, size)) == (reply, "", [])


def test_llama_text_reply_streams_at_once():
    """A reply that does not start with "{" is answer text from its first delta on; a "{" later in it
    is text too."""
    s = Llama3JsonSplitter()
    assert s.feed("  ").content == ""  # whitespace alone cannot tell yet
    assert s.feed("It is").content == "  It is"
    assert s.feed(' {"name": "x", "parameters": {}}').content == ' {"name": "x", "parameters": {}}'
    assert shape(s.finish()) == ("", "", [])
    held = Llama3JsonSplitter()
    assert held.feed("<|python").content == "" and held.feed("_tag|>{").content == ""
    assert shape(split(Llama3JsonSplitter(), "<|python_tag|>print(1)")) == ("<|python_tag|>print(1)", "", [])


class _Tok:
    """A tokenizer stand-in: a vocabulary and a chat template."""

    def __init__(self, vocab: list[str], template: str) -> None:
        self.chat_template, self._vocab = template, {t: i for i, t in enumerate(vocab)}

    def get_vocab(self) -> dict[str, int]:
        return self._vocab


# The instruction as Meta's templates write it: in single-quoted Jinja strings (Llama 3.1 8B/70B/405B,
# 3.2 1B/3B, 3.3 70B), and escaped in a double-quoted one.
META = """{{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name '}}"""
ESCAPED = '{{- "Respond in the format {\\"name\\": function name, \\"parameters\\": dictionary" }}'


@pytest.mark.parametrize("vocab, template, expected", [
    (["<|python_tag|>"], META, True),
    (["<|python_tag|>"], ESCAPED, True),
    ([], META, False),  # Llama 3.0: no <|python_tag|>
    (["<|python_tag|>"], "{{ messages }}", False),  # a Llama 3.1 base model's or a custom template
    (["<|python_tag|>"], '{"name": "x"} and "parameters": {}', False),
])
def test_llama3_json_detection(vocab, template, expected):
    """llama3_json needs <|python_tag|> in the vocabulary and the template's {"name", "parameters"} format."""
    assert is_llama3_json(_Tok(vocab, template)) is expected


# ---- the engine, per family ---------------------------------------------------------------

# preset -> (Capabilities.thinking, .thinking_switch, .tools)
CAPABILITIES = {
    "tiny": ("", False, "json_tools"),
    "tiny-qwen3": ("think", True, "json_tools"),
    "tiny-qwen3-moe": ("think", True, "json_tools"),
    "tiny-qwen3.5": ("think", True, "json_tools"),
    "tiny-llama": ("", False, "llama3_json"),
    "tiny-gemma3": ("", False, ""),
    "tiny-gpt-oss": ("harmony", False, "harmony"),
}


@pytest.fixture(scope="module")
def engine():
    """name -> an in-process Engine on that tiny preset, loaded once per module."""
    from mlxrt.ipc.protocol import EngineOptions
    from mlxrt.synthetic.build import ensure_model

    cache: dict[str, Engine] = {}

    def get(name: str) -> Engine:
        if name not in cache:
            cache[name] = Engine(str(ensure_model(name)), options=EngineOptions(decode_concurrency=4))
        return cache[name]

    return get


@pytest.mark.parametrize("name", sorted(CAPABILITIES))
def test_capabilities_per_family(engine, name):
    """What each family reports in Ready (docs/models.md's thinking and tool-call columns)."""
    caps = engine(name).capabilities
    assert (caps.thinking, caps.thinking_switch, caps.tools) == CAPABILITIES[name]
    assert caps.chat_template


@pytest.mark.parametrize("name", ["tiny", "tiny-qwen3", "tiny-qwen3.5", "tiny-gpt-oss", "tiny-llama"])
def test_tools_are_rendered_into_the_prompt(engine, name):
    """A request with tools: the template renders them, so the prompt's tokens hold the function."""
    eng = engine(name)
    ask = [ChatMessage("user", "Weather in Paris?")]
    with_tools = eng.tokenizer.decode(eng.prompt_ids(Generate(
        id=1, params=SamplingParams(), messages=ask, chat=ChatOptions(tools=TOOLS))))
    without = eng.tokenizer.decode(eng.prompt_ids(Generate(id=2, params=SamplingParams(), messages=ask)))
    assert "get_weather" in with_tools and "Weather in a city" in with_tools
    assert "get_weather" not in without


@pytest.mark.parametrize("name", ["tiny-qwen3", "tiny-gpt-oss", "tiny-gemma3", "tiny-llama"])
def test_earlier_calls_render_with_their_arguments_once(engine, name):
    """An assistant turn's call arrives with JSON-text arguments (OpenAI's form); templates get an object,
    as mlx_lm.server gives them, so it is rendered once, not as an escaped string."""
    eng = engine(name)
    history = [ChatMessage("user", "Weather in Paris?"),
               ChatMessage("assistant", "", tool_calls=[
                   ToolCall(name="get_weather", arguments='{"city": "Paris"}', id="call_1")]),
               ChatMessage("tool", "sunny, 21 C", tool_call_id="call_1", name="get_weather")]
    text = eng.tokenizer.decode(eng.prompt_ids(Generate(id=1, params=SamplingParams(), messages=history)))
    assert "Paris" in text and '\\"city\\"' not in text and "sunny, 21 C" in text


def test_thinking_off_renders_the_closed_think_block(engine):
    """enable_thinking=False reaches the template; the reply then starts outside any reasoning."""
    eng = engine("tiny-qwen3.5")
    ask = [ChatMessage("user", "Hi")]
    on = eng.prompt_ids(Generate(id=1, params=SamplingParams(), messages=ask))
    off = eng.prompt_ids(Generate(id=2, params=SamplingParams(), messages=ask,
                                  chat=ChatOptions(enable_thinking=False)))
    assert eng.tokenizer.decode(on).endswith("<think>\n")
    assert eng.tokenizer.decode(off).endswith("<think>\n\n</think>\n\n")
    caps = eng.capabilities
    assert shape(split(make_splitter(eng.tokenizer, caps, None, on), "a</think>b")) == ("b", "a", [])
    assert shape(split(make_splitter(eng.tokenizer, caps, None, off), "a</think>b")) == ("a</think>b", "", [])


class Parted:
    """A listener keeping each request's ids and its parts, and its end."""

    def __init__(self) -> None:
        self.ids: dict[int, list[int]] = {}
        self.parts: dict[int, Parts] = {}
        self.stats: dict = {}
        self.errors: dict = {}

    def started(self, req_id: int) -> None:
        self.parts[req_id] = Parts()

    def token(self, req_id, token, text, reasoning="", calls=None) -> None:
        self.ids.setdefault(req_id, []).append(token)
        self.parts[req_id].extend(Parts(text, reasoning, list(calls or [])))

    def done(self, req_id, stats, text, reasoning="", calls=None) -> None:
        self.parts.setdefault(req_id, Parts()).extend(Parts(text, reasoning, list(calls or [])))
        self.stats[req_id] = stats

    def failed(self, req_id, exc) -> None:
        self.errors[req_id] = exc


FORCED = {  # preset -> (forced reply, the parts it splits into)
    "tiny": (f"<tool_call>\n{CALL}\n</tool_call>", ("", "", [("get_weather", {"city": "Paris"})])),
    "tiny-qwen3": (QWEN, ("Let me look.", "I should call the tool.", [("get_weather", {"city": "Paris"})])),
    # The template opened <think> in the prompt: the reply starts inside it.
    "tiny-qwen3.5": (f"Hmm.\n</think>\n\n<tool_call>\n{CALL}\n</tool_call>",
                     ("", "Hmm.", [("get_weather", {"city": "Paris"})])),
    "tiny-gpt-oss": (HARMONY + "<|call|>",
                     ("", "I should call the tool.", [("get_weather", {"city": "Paris"})])),
    # Llama 3.x: the bare JSON call after the <|python_tag|> token.
    "tiny-llama": ("<|python_tag|>" + LLAMA_CALL, ("", "", [PARIS])),
}


@pytest.mark.parametrize("name", sorted(FORCED))
def test_forced_reply_splits_inside_a_batch(engine, name):
    """A forced reply splits into its parts in the engine's batch, next to an unforced chat whose ids are
    those it gets alone; its finish is a normal stop."""
    eng = engine(name)
    reply, expected = FORCED[name]
    ask = [ChatMessage("user", "Weather in Paris?")]
    plain = Generate(id=2, params=SamplingParams(max_tokens=12, ignore_eos=True), messages=ask)
    alone = run(eng, [plain])
    forced_req = Generate(id=1, params=SamplingParams(max_tokens=200), messages=ask,
                          chat=ChatOptions(tools=TOOLS))
    original = eng._sequences

    def sequences(req, listener, queued_at):
        seqs = original(req, listener, queued_at)
        if req.id == 1:
            seqs[0].processors = [forced(reply_ids(eng.tokenizer, reply), eng.vocab_size)]
        return seqs

    eng._sequences = sequences
    try:
        both = run(eng, [forced_req, plain])
    finally:
        del eng._sequences
    assert shape(both.parts[1]) == expected
    assert both.stats[1].finish_reason == "stop"
    assert both.ids[2] == alone.ids[2]


def run(eng: Engine, reqs: list[Generate]) -> Parted:
    rec = run_batch(eng, reqs, Parted())
    assert not rec.errors, rec.errors
    return rec


def test_engine_refuses_what_the_model_cannot_do(engine):
    """Sent to a worker before its capabilities were known, thinking or tools for a model without them
    fail alone, with a clear message."""
    eng = engine("tiny-gemma3")
    ask = [ChatMessage("user", "Hi")]
    rec = Parted()
    think = ChatOptions(enable_thinking=True)
    eng.submit(Generate(id=1, params=SamplingParams(), messages=ask, chat=think), rec)
    eng.submit(Generate(id=2, params=SamplingParams(), messages=ask, chat=ChatOptions(tools=TOOLS)), rec)
    assert "does not support thinking" in str(rec.errors[1])
    assert "does not support tools" in str(rec.errors[2])
    assert not eng.busy
