"""A reply as a run of typed blocks (reasoning, text, tool calls), for the APIs that answer in blocks.

Anthropic Messages (``thinking``, ``text``, ``tool_use``) and OpenAI
Responses (``reasoning``, ``message``, ``function_call`` items) return a
reply as a list of typed blocks, where chat completions has one message with
side fields. The worker already splits each chunk into its answer text, its
reasoning and whole tool calls (worker/reply.py); here a chunk becomes parts
in that order, consecutive parts of one kind make one block, and each call is
a block of its own. Both APIs stream the same `BlockEvent`s in their own
words, and collect the same `Block`s when not streaming.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable, Iterator
from dataclasses import dataclass
from typing import Literal

from ...ipc.protocol import ToolCall
from ..runtime import Chunk

Kind = Literal["reasoning", "text", "call"]


@dataclass(slots=True)
class Block:
    """One block: reasoning or answer text (`text`), or one tool call (`call`)."""

    kind: Kind
    text: str = ""
    call: ToolCall | None = None


def parts(chunk: Chunk) -> Iterator[Block]:
    """A chunk's parts: its reasoning, then its text, then each call (a chunk spans a few tokens
    at most, so within one the worker's order is this one)."""
    if chunk.reasoning:
        yield Block("reasoning", chunk.reasoning)
    if chunk.text:
        yield Block("text", chunk.text)
    for call in chunk.tool_calls:
        yield Block("call", call=call)


def reasoning_tokens(chunks: Iterable[Chunk]) -> int:
    """Tokens of the chunks that carried only reasoning (a chunk is a token or a few): OpenAI's
    `reasoning_tokens`, as near as the chunks tell."""
    return sum(len(c.tokens) for c in chunks if _reasoning_only(c))


def _reasoning_only(chunk: Chunk) -> bool:
    return bool(chunk.reasoning) and not chunk.text and not chunk.tool_calls


def collect(chunks: Iterable[Chunk]) -> list[Block]:
    """The reply's blocks: consecutive reasoning or text parts merged, each call a block."""
    out: list[Block] = []
    pieces: list[list[str]] = []  # each block's texts, joined at the end
    for chunk in chunks:
        for part in parts(chunk):
            if out and part.kind != "call" and out[-1].kind == part.kind:
                pieces[-1].append(part.text)
            else:
                out.append(part)
                pieces.append([part.text])
    for block, texts in zip(out, pieces, strict=True):
        block.text = "".join(texts)
    return out


@dataclass(slots=True)
class BlockEvent:
    """`start` opens block `index` (`block` holds its kind, or its whole call); `delta` adds
    `text` to it; `stop` closes it (`block.text` is then the whole text)."""

    type: Literal["start", "delta", "stop"]
    index: int
    block: Block
    text: str = ""


class BlockEvents:
    """The reply as block events, in order: a block opens at its first part and closes when a part
    of another kind comes, or at the end; a call is a start and a stop, nothing between.

    One `delta` event is reused for every delta (read it before asking for the next event), and a
    chunk of answer text that continues the open block skips the parts machinery: this is the
    per-token path. `reasoning_tokens` counts as the function of that name does.
    """

    def __init__(self, chunks: AsyncIterator[Chunk]) -> None:
        self.chunks = chunks
        self.reasoning_tokens = 0

    async def __aiter__(self) -> AsyncIterator[BlockEvent]:
        index = -1
        current: Block | None = None
        pieces: list[str] = []  # the open block's text, joined when it closes
        delta = BlockEvent("delta", 0, Block("text"))
        async for chunk in self.chunks:
            if chunk.reasoning or chunk.tool_calls or current is None or current.kind != "text":
                if _reasoning_only(chunk):
                    self.reasoning_tokens += len(chunk.tokens)
            elif chunk.text:  # more answer text: the common case
                pieces.append(chunk.text)
                delta.text = chunk.text
                yield delta
                continue
            for part in parts(chunk):
                if current is not None and (part.kind == "call" or part.kind != current.kind):
                    current.text = "".join(pieces)
                    yield BlockEvent("stop", index, current)
                    current = None
                index += 1 if current is None else 0
                if part.kind == "call":
                    yield BlockEvent("start", index, part)
                    yield BlockEvent("stop", index, part)
                    continue
                if current is None:
                    current, pieces = Block(part.kind), []
                    delta.index, delta.block = index, current
                    yield BlockEvent("start", index, current)
                pieces.append(part.text)
                delta.text = part.text
                yield delta
        if current is not None:
            current.text = "".join(pieces)
            yield BlockEvent("stop", index, current)
