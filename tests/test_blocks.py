"""A reply as typed blocks (`http/blocks.py`): the streamed events and the collected blocks agree, in the
order the model wrote the parts, however the worker cut them into chunks."""

from __future__ import annotations

import asyncio

from mlxrt.ipc.protocol import ToolCall
from mlxrt.orchestrator.http.blocks import BlockEvents, collect, reasoning_tokens
from mlxrt.orchestrator.runtime import Chunk

CALL_A = ToolCall(name="a", arguments='{"x": 1}', id="call_a")
CALL_B = ToolCall(name="b", arguments="{}", id="call_b")
# Thinks, answers, calls twice, answers again; one chunk carries the end of the thought and the
# start of the answer, one carries nothing yet (text held back), one ends with a call.
CHUNKS = [
    Chunk("", [1], reasoning="Let me "),
    Chunk("", [2], reasoning="think."),
    Chunk("Hello", [3], reasoning=" Done."),
    Chunk("", [4]),
    Chunk(" world", [5, 6], tool_calls=[CALL_A]),
    Chunk("", [7], tool_calls=[CALL_B]),
    Chunk("Bye", [8]),
]
EXPECTED = [("reasoning", "Let me think. Done.", None), ("text", "Hello world", None), ("call", "", CALL_A),
            ("call", "", CALL_B), ("text", "Bye", None)]


def streamed(chunks: list[Chunk]) -> tuple[list[tuple], BlockEvents]:
    async def source():
        for c in chunks:
            yield c

    async def run():
        events = BlockEvents(source())
        return [(e.type, e.index, e.block.kind, e.text, e.block.text if e.type == "stop" else None)
                async for e in events], events

    return asyncio.run(run())


def test_collected_blocks_keep_the_models_order():
    """Consecutive reasoning or text parts make one block; each call is a block; order is kept."""
    assert [(b.kind, b.text, b.call) for b in collect(CHUNKS)] == EXPECTED


def test_streamed_events_open_add_and_close_each_block():
    """Each block opens, gets its deltas, and closes with its whole text before the next opens; the
    deltas add up to the collected blocks."""
    events, tally = streamed(CHUNKS)
    assert [(t, i) for t, i, *_ in events if t != "delta"] == [
        ("start", 0), ("stop", 0), ("start", 1), ("stop", 1), ("start", 2), ("stop", 2), ("start", 3),
        ("stop", 3), ("start", 4), ("stop", 4)]
    for index, (kind, text, _) in enumerate(EXPECTED):
        deltas = [d for t, i, _, d, _ in events if t == "delta" and i == index]
        assert "".join(deltas) == text
        (stop,) = [e for e in events if e[0] == "stop" and e[1] == index]
        assert stop[2] == kind and (kind == "call" or stop[4] == text)
    assert tally.reasoning_tokens == reasoning_tokens(CHUNKS) == 2


def test_a_reply_of_only_text_is_one_block():
    """The common case, answer text only: one block, one delta per chunk that carries text."""
    chunks = [Chunk(t, [i]) for i, t in enumerate(["a", "", "b", "c"])]
    events, _ = streamed(chunks)
    assert [e[0] for e in events] == ["start", "delta", "delta", "delta", "stop"]
    assert events[-1][4] == "abc" and [(b.kind, b.text) for b in collect(chunks)] == [("text", "abc")]


def test_an_empty_reply_has_no_blocks():
    """Nothing generated (or only held-back text): no events and no blocks."""
    assert streamed([Chunk("", [1])])[0] == [] and collect([Chunk("", [1])]) == []
