"""The worker's Outbox: direct sends when the channel has room, queued and coalesced when not."""

from __future__ import annotations

import os
import threading

from mlxrt.ipc.channel import ChannelClosed
from mlxrt.ipc.protocol import Done, Stats, Tokens, orchestrator_codec
from mlxrt.ipc.stdio import PipeReceiver, PipeSender
from mlxrt.worker.serve import Outbox


def read_all(rx: PipeReceiver, out: list) -> None:
    codec = orchestrator_codec()
    try:
        while True:
            out.append(codec.decode(rx.recv(timeout=10)))
    except ChannelClosed:
        pass


def test_tokens_arrive_in_order_when_the_reader_lags():
    """With the pipe full, tokens queue, coalesce into fewer frames and arrive whole and in order."""
    r, w = os.pipe()
    outbox = Outbox(PipeSender(w))
    n = 20000
    for i in range(n):  # nobody reads yet: the 64 KiB pipe fills and the writer thread takes over
        outbox.token(7, i, "x")
    outbox.message(Done(id=7, stats=Stats(generation_tokens=n)))
    frames: list = []
    reader = threading.Thread(target=read_all, args=(PipeReceiver(r), frames))
    reader.start()
    outbox.close()
    os.close(w)
    reader.join(30)
    tokens = [t for f in frames if isinstance(f, Tokens) for t in f.token_ids]
    assert tokens == list(range(n))
    assert "".join(f.text for f in frames if isinstance(f, Tokens)) == "x" * n
    assert isinstance(frames[-1], Done)
    assert len(frames) < n  # some frames carried several tokens


def test_tokens_of_different_requests_are_not_merged():
    """Coalescing never mixes two requests' tokens in one frame."""
    r, w = os.pipe()
    outbox = Outbox(PipeSender(w))
    for i in range(6000):
        outbox.token(i % 2, i, "")
    frames: list = []
    reader = threading.Thread(target=read_all, args=(PipeReceiver(r), frames))
    reader.start()
    outbox.close()
    os.close(w)
    reader.join(30)
    for req in (0, 1):
        got = [t for f in frames if isinstance(f, Tokens) and f.id == req for t in f.token_ids]
        assert got == list(range(req, 6000, 2))
    assert all(all(t % 2 == f.id for t in f.token_ids) for f in frames)


def test_pipe_try_send_refuses_instead_of_blocking():
    """try_send on a full pipe returns False at once and writes nothing partial."""
    r, w = os.pipe()
    tx = PipeSender(w)
    sent = 0
    while tx.try_send(b"y" * 1000):
        sent += 1
    assert sent > 0
    rx = PipeReceiver(r)
    assert all(rx.recv(timeout=5) == b"y" * 1000 for _ in range(sent))
    tx.close()
    rx.close()


def test_drain_merges_interleaved_requests_but_never_past_their_end():
    """A batch's interleaved tokens drain as one frame per request, each before its own Done."""
    from mlxrt.ipc.protocol import Done, Stats, Tokens

    class Never:
        def try_send(self, frame):
            return False

        def send(self, frame):
            pass

    box = Outbox(Never())
    box._items.extend([(1, 10, "a"), (2, 20, "x"), (1, 11, "b"), Done(id=1, stats=Stats()),
                       (2, 21, "y"), (1, 12, "c")])
    out = box._drain()
    assert [type(m).__name__ for m in out] == ["Tokens", "Tokens", "Done", "Tokens"]
    assert (out[0].id, out[0].token_ids, out[0].text) == (1, [10, 11], "ab")
    assert (out[1].id, out[1].token_ids, out[1].text) == (2, [20, 21], "xy")
    assert isinstance(out[3], Tokens) and (out[3].id, out[3].token_ids) == (1, [12])
    box.close(timeout=1)


def test_detailed_tokens_coalesce_per_choice():
    """Tokens with log-probabilities or a choice index go as DetailedTokens, coalesced per request and
    choice, each log-probability with its token; a plain request's stay plain Tokens."""
    from mlxrt.ipc.protocol import DetailedTokens, TokenLogprob

    r, w = os.pipe()
    outbox = Outbox(PipeSender(w))
    n = 3000
    for i in range(n):  # request 1: two choices with log-probabilities; request 2: plain
        outbox.token(1, i, "a", logprob=TokenLogprob(i, -float(i), b"a"), index=i % 2)
        outbox.token(2, i, "b")
    outbox.message(Done(id=1, stats=Stats(), index=0, final=False))
    outbox.message(Done(id=1, stats=Stats(), index=1))
    frames: list = []
    reader = threading.Thread(target=read_all, args=(PipeReceiver(r), frames))
    reader.start()
    outbox.close()
    os.close(w)
    reader.join(30)
    plain = [f for f in frames if type(f) is Tokens]
    detailed = [f for f in frames if type(f) is DetailedTokens]
    assert all(f.id == 2 for f in plain) and [t for f in plain for t in f.token_ids] == list(range(n))
    assert all(f.id == 1 for f in detailed)
    for choice in (0, 1):
        mine = [f for f in detailed if f.index == choice]
        assert [t for f in mine for t in f.token_ids] == list(range(choice, n, 2))
        assert [e.id for f in mine for e in f.logprobs] == list(range(choice, n, 2))
    assert len(detailed) < n  # coalesced
    assert [f.final for f in frames if isinstance(f, Done)] == [False, True]
