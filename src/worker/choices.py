"""The listener side of requests with n > 1 or log-probabilities: one `Choice` per sequence.

A request with ``n`` choices is ``n`` sequences in the engine, each with its
own sampler, text stream and reply splitter, and one request id. Each
sequence's listener is a `Choice`, which adds the choice's index and the
token's log-probability to the events it passes on, and a `ChoiceGroup` makes
the n of them one request again for the real listener: one ``started``,
each choice's ``done`` with ``final`` on the last, and on a failure one
``failed`` with every later event of the request dropped (the engine
cancels the other choices). A request that asks for neither is not wrapped:
its events and frames are as before.
"""

from __future__ import annotations

from ..ipc.protocol import Stats, TokenLogprob, ToolCall


class ChoiceGroup:
    """The choices of one request, in front of its listener."""

    def __init__(self, listener, n: int) -> None:
        self.listener = listener
        self.left = n
        self.started = False
        self.failed = False
        self.choices = [Choice(self, i) for i in range(n)]


class Choice:
    """One choice's listener: `logprob` is set by the engine before each token it emits."""

    def __init__(self, group: ChoiceGroup, index: int) -> None:
        self.group = group
        self.index = index
        #: The next token's log-probability (None: not asked), taken by `token`.
        self.logprob: TokenLogprob | None = None

    def started(self, req_id: int) -> None:
        if not self.group.started:
            self.group.started = True
            self.group.listener.started(req_id)

    def token(self, req_id: int, token: int, text: str, reasoning: str = "",
              calls: list[ToolCall] | None = None) -> None:
        logprob, self.logprob = self.logprob, None
        group = self.group
        if not group.failed:
            group.listener.token(req_id, token, text, reasoning, calls, logprob=logprob, index=self.index)

    def done(self, req_id: int, stats: Stats, text: str, reasoning: str = "",
             calls: list[ToolCall] | None = None) -> None:
        group = self.group
        group.left -= 1
        if not group.failed:
            final = group.left == 0
            group.listener.done(req_id, stats, text, reasoning, calls, index=self.index, final=final)

    def failed(self, req_id: int, exc: BaseException) -> None:
        if not self.group.failed:
            self.group.failed = True
            self.group.listener.failed(req_id, exc)
