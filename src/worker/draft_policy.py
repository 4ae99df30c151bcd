"""Whether a lone sequence drafts: both ways measured, the faster kept, the slower tried again later.

mlx-lm's `speculative_generate_step` drafts whenever it has a draft model. Whether
that pays depends on the draft's acceptance (the text, the sampling), on the draft's
cost against the target's, and on the backend: on MLX's CUDA backend a multi-token
verify compiles its attention for every new cache length, and drafting ran at
0.09-0.27x of plain decoding on an H100 (docs/benchmarks/gpu-h100-features.md);
on a 2-core CPU it ran at 0.4-0.8x. A worker with a draft therefore measures the
seconds per delivered token both ways, as the caller sees them (from one token's
delivery to the next, the engine's own work included), and drafts only while
drafting is the faster. The slower way is tried again for one window after
`retry` tokens, an interval that doubles (up to `max_retry`) each time it loses
again and starts over when it wins, so a draft that never pays costs a window now
and then, and one that pays again (other text, a warmed-up backend) is found.

The rates are the worker's, across requests: they are properties of the model
pair and the machine more than of one request. `Solo` counts a window's seconds
and tokens and asks at each window's end which way the next one goes.
"""

from __future__ import annotations

from dataclasses import dataclass

#: A window: plain decoding, this many tokens; drafting, this many rounds (or as many tokens, if sooner).
WINDOW_TOKENS = 8
WINDOW_ROUNDS = 3
#: Tokens decoded the faster way before the slower is tried again, at first and at most.
RETRY_TOKENS = 64
MAX_RETRY_TOKENS = 4096
#: Weight of a new window in a way's rate (an exponential moving average).
SMOOTHING = 0.5


@dataclass
class Rate:
    """Seconds per token one way, smoothed over windows; None until measured."""

    seconds_per_token: float | None = None
    #: `DraftPolicy.tokens` when it was last measured.
    at: int = 0

    def add(self, seconds: float, tokens: int, now: int, *, fresh: bool = False) -> None:
        """A window's figure; `fresh` replaces the old one (stale: measured long ago) outright."""
        s = seconds / tokens
        old = self.seconds_per_token
        self.seconds_per_token = s if old is None or fresh else SMOOTHING * s + (1 - SMOOTHING) * old
        self.at = now


@dataclass
class Window:
    """One window of a sequence: its way, and its seconds, tokens and drafting rounds so far."""

    drafting: bool
    seconds: float = 0.0
    tokens: int = 0
    rounds: int = 0

    def full(self) -> bool:
        if self.drafting:
            return self.rounds >= WINDOW_ROUNDS or self.tokens >= WINDOW_TOKENS
        return self.tokens >= WINDOW_TOKENS


class DraftPolicy:
    """The worker's choice between drafting and plain decoding (module docstring); ``adaptive=False``
    always drafts, as mlx-lm does."""

    def __init__(self, *, adaptive: bool = True, retry: int = RETRY_TOKENS,
                 max_retry: int = MAX_RETRY_TOKENS) -> None:
        self.adaptive = adaptive
        self._base_retry = retry
        self._max_retry = max_retry
        self.reset()

    def reset(self) -> None:
        """Forget what was measured (after the worker's warm-up, whose first calls compile)."""
        self.rates = {True: Rate(), False: Rate()}  # drafting -> its rate
        #: Tokens counted in all windows so far.
        self.tokens = 0
        self.retry = self._base_retry
        #: The way on trial (the slower, tried again), until its window is measured; else None.
        self._trial: bool | None = None
        #: Windows measured each way (tests and benchmarks read them).
        self.windows = {True: 0, False: 0}

    def first(self) -> bool:
        """The way a new sequence starts: a trial cut short by the last one's end, else the faster
        known, else drafting."""
        if not self.adaptive:
            return True
        return self._faster() if self._trial is None else self._trial

    def window(self, w: Window) -> bool:
        """Window `w` is over; the way the next one goes."""
        if not self.adaptive:
            return True
        self.tokens += w.tokens
        self.windows[w.drafting] += 1
        trial = self._trial == w.drafting
        if w.tokens > 0 and w.seconds > 0:
            self.rates[w.drafting].add(w.seconds, w.tokens, self.tokens, fresh=trial)
        if trial:  # the slower way had its window: back off if it lost again
            self._trial = None
            won = self._faster() == w.drafting
            self.retry = self._base_retry if won else min(2 * self.retry, self._max_retry)
        best = self._faster()
        other = self.rates[not best]
        if other.seconds_per_token is None or self.tokens - other.at >= self.retry:
            self._trial = best = not best
        return best

    def _faster(self) -> bool:
        """Drafting unless plain decoding is measured faster (drafting first: the user asked for it)."""
        draft, plain = (self.rates[w].seconds_per_token for w in (True, False))
        return draft is None or plain is None or draft <= plain
