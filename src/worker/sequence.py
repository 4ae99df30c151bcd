"""One request inside the batching engine: its sampler, its text stream, its figures.

mlx-lm gives the per-sequence machinery (`make_sampler`, `make_logits_processors`,
`StopSequences`, the streaming detokenizer); what it lacks, written here by
hand:

- a seeded sampler per sequence: mlx-lm's samplers draw from MLX's global
  random state, so two seeded requests in one batch would share one stream of
  draws. `KeyedSampler` gives each token a key of its own, made from the seed and
  the token's place, so a seeded request gets the same tokens alone, in any batch
  and with or without a draft model, and unseeded requests never touch it;
- stop strings matched on text with hold-back (`TextStream`): mlx-lm matches
  stop words on token ids, which misses a stop string that tokenizes
  differently inside the reply.
"""

from __future__ import annotations

import hashlib
import random
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import mlx.core as mx
from mlx_lm.generate import StopSequences
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p, make_logits_processors, make_sampler

from ..ipc.protocol import Generate, SamplingParams, Stats, TokenLogprob, ToolCall

if TYPE_CHECKING:
    from .grammar import Constraint

#: emit(token_id, text_delta) is called once per generated token, on the engine's thread.
EmitFn = Callable[[int, str], None]


class BatchStepError(RuntimeError):
    """A batch step failed; every request in that batch fails with this."""


class Listener(Protocol):
    """Where one request's events go; called on the engine's thread, in this order:
    started, token..., then done or failed (failed may also come alone, before started).

    A chat reply's reasoning and tool calls (`reply.py`) come as the extra arguments of token and
    done; they are passed only when there are some. The keywords (a token's log-probability, the
    choice's index, whether every choice is done) come only for a request that asked for
    log-probabilities or n > 1 (`choices.py`), whose choices each send a done.
    """

    def started(self, req_id: int) -> None: ...

    def token(self, req_id: int, token: int, text: str, reasoning: str = "",
              calls: list[ToolCall] | None = None, *, logprob: TokenLogprob | None = None,
              index: int = 0) -> None: ...

    def done(self, req_id: int, stats: Stats, text: str, reasoning: str = "",
             calls: list[ToolCall] | None = None, *, index: int = 0, final: bool = True) -> None: ...

    def failed(self, req_id: int, exc: BaseException) -> None: ...


class Quiet:
    """A listener for warm-up requests: drops their output, keeps the first failure."""

    error: BaseException | None = None

    def started(self, req_id: int) -> None:
        pass

    def token(self, req_id: int, token: int, text: str, reasoning: str = "", calls=None, **_) -> None:
        pass

    def done(self, req_id: int, stats: Stats, text: str, reasoning: str = "", calls=None, **_) -> None:
        pass

    def failed(self, req_id: int, exc: BaseException) -> None:
        self.error = self.error or exc


def make_request_sampler(p: SamplingParams, choice: int = 0):
    """mlx-lm's sampler for these settings, or None for greedy (batched as one argmax).

    `choice`: which of the request's n choices; with a seed, each has a key of its own.
    """
    if p.temperature == 0.0:
        return None
    # mlx-lm treats top_p=0 as "off"; our API uses the conventional 1.0.
    top_p = p.top_p if p.top_p < 1.0 else 0.0
    if p.seed is None:
        return make_sampler(temp=p.temperature, top_p=top_p, min_p=p.min_p, top_k=p.top_k)
    return KeyedSampler(p, top_p, choice)


class KeyedSampler:
    """`make_sampler`'s chain of mlx-lm filters, each token drawn with a key of its own.

    MLX's global random state cannot be set from an array, so the key is passed
    to the draw instead; the filters are mlx-lm's, in `make_sampler`'s order.
    The key of the reply's i-th token is made from the seed, the choice and i
    alone (`draw_key`), so a token's draw does not depend on how the tokens
    before it were computed: alone or in any batch, one token per call or a
    speculative round's several rows at once (`Solo`, which `rewind`s the draws
    of the rows it does not keep), the same seed gives the same reply.
    """

    def __init__(self, p: SamplingParams, top_p: float, choice: int = 0) -> None:
        self._filters = []
        if 0.0 < top_p < 1.0:
            self._filters.append(lambda x: apply_top_p(x, top_p))
        if p.min_p:
            self._filters.append(lambda x: apply_min_p(x, p.min_p, 1))
        if p.top_k > 0:
            self._filters.append(lambda x: apply_top_k(x, p.top_k))
        self._inv_temp = 1.0 / p.temperature
        self._seed = (p.seed, choice)
        #: Tokens drawn (kept) so far: the next row's place in the reply.
        self.drawn = 0

    def __call__(self, logprobs: mx.array) -> mx.array:
        """One token per row of `logprobs` (shape (rows, vocabulary)), the rows the reply's next places."""
        for f in self._filters:
            logprobs = f(logprobs)
        scaled = logprobs * self._inv_temp
        rows = [mx.random.categorical(scaled[i], key=draw_key(*self._seed, self.drawn + i))
                for i in range(scaled.shape[0])]
        self.drawn += len(rows)
        return mx.stack(rows)

    def rewind(self, n: int) -> None:
        """The last `n` draws were not kept: their places are drawn again."""
        self.drawn -= n


def draw_key(seed: int, choice: int, index: int) -> mx.array:
    """The MLX key of choice `choice`'s `index`-th token under `seed`: a hash of the three."""
    digest = hashlib.blake2b(f"{seed}:{choice}:{index}".encode(), digest_size=8).digest()
    return mx.random.key(int.from_bytes(digest, "little"))


def unsample(sampler, n: int) -> None:
    """Take back the last `n` draws of a request's sampler, where it keys its draws (`KeyedSampler`);
    other samplers draw from MLX's global state, which has no place to go back to."""
    if n and isinstance(sampler, KeyedSampler):
        sampler.rewind(n)


def make_request_processors(p: SamplingParams) -> list:
    if p.repetition_penalty is None or p.repetition_penalty == 1.0:
        return []
    return make_logits_processors(
        repetition_penalty=p.repetition_penalty,
        repetition_context_size=p.repetition_context_size,
    )


def check_sampler(sampler, vocab_size: int) -> None:
    """Run `sampler` once on dummy log-probabilities; raise what it raises.

    A sampler that fails inside a batch step would fail every sequence in the
    batch; one that fails here fails its own request. A failed compiled
    sampler leaves MLX's global random state holding an array without a
    primitive, which breaks every later draw; it cannot be set back, so it is
    reseeded.
    """
    if sampler is None or vocab_size <= 0:
        return
    try:
        mx.eval(sampler(mx.zeros((1, vocab_size))))
    except Exception:
        reseed()
        raise
    unsample(sampler, 1)  # a check, not a token of the reply


#: Where `reseed` draws seeds: the system's entropy; the ranks of a worker group share a seeded
#: generator (`share_seeds`), so their random states stay equal.
_seeds: random.Random = secrets.SystemRandom()


def reseed() -> None:
    """Give MLX's global random state a fresh seed (after a failure may have broken it)."""
    mx.random.seed(_seeds.getrandbits(63))


def share_seeds(seed: int) -> None:
    """Seed MLX's random state and `reseed`'s draws with `seed`, which every rank of a group
    agreed on: the same draws on every rank."""
    global _seeds
    _seeds = random.Random(seed)
    mx.random.seed(seed)


class TextStream:
    """Feeds tokens to mlx-lm's streaming detokenizer and emits text deltas.

    With stop strings, text that could still become a stop string is held back
    until it cannot; the text before the first stop string is all that is sent.
    """

    def __init__(self, detokenizer, stop: list[str], emit: EmitFn) -> None:
        detokenizer.reset()
        self._detok = detokenizer
        self._emit = emit
        self._stop = stop
        self._longest = max((len(s) for s in stop), default=0)
        self._text = ""
        self._sent = 0
        self._stopped = False
        #: The stop string that ended the text, once one has.
        self.stop_hit = ""

    def add(self, token: int) -> bool:
        """Emit the token and its text; return True when a stop string was hit."""
        self._detok.add_token(token)
        delta = self._detok.last_segment
        if not self._stop:
            self._emit(token, delta)
            return False
        search_from = max(0, len(self._text) - self._longest + 1)
        self._text += delta
        hit = _first_stop(self._text, self._stop, search_from)
        if hit is not None:
            self._stopped = True
            self.stop_hit = next(s for s in self._stop if self._text.startswith(s, hit))
            self._emit(token, self._text[self._sent : hit])
            self._sent = len(self._text)
            return True
        safe = len(self._text) - _held_back(self._text, self._stop)
        self._emit(token, self._text[self._sent : safe])
        self._sent = max(self._sent, safe)
        return False

    def replay(self, tokens: list[int], feed: Callable[[str], object]) -> bool:
        """Take `tokens` as `add` does, their text going to `feed` instead of being emitted (the caller
        has it); True if a stop string was hit."""
        emit, self._emit = self._emit, lambda _token, text: feed(text)
        try:
            return any(self.add(t) for t in tokens)  # stops at a stop string, as the reply did
        finally:
            self._emit = emit

    def finish(self) -> str:
        """Flush the detokenizer; return text not yet emitted (none after a stop string)."""
        if self._stopped:
            return ""
        self._detok.finalize()
        rest = self._detok.last_segment
        if not self._stop:
            return rest
        self._text += rest
        hit = _first_stop(self._text, self._stop, 0)
        end = hit if hit is not None and hit >= self._sent else len(self._text)
        return self._text[self._sent : end]


def _first_stop(text: str, stops: list[str], start: int) -> int | None:
    found = [i for i in (text.find(s, start) for s in stops) if i >= 0]
    return min(found) if found else None


def _held_back(text: str, stops: list[str]) -> int:
    """Length of the longest tail of `text` that is a proper prefix of a stop string."""
    best = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:k]):
                best = k
                break
    return best


@dataclass
class Sequence:
    """A request admitted to the engine, from its prompt ids to its last token."""

    req: Generate
    ids: list[int]
    #: Where the chat's system prompt ends in `ids` (0: no system prompt or not a chat).
    system_end: int
    max_tokens: int
    stop: StopSequences
    sampler: object
    processors: list
    text: TextStream
    queued_at: float
    listener: Listener
    uid: int = -1
    admitted_at: float = 0.0
    first_at: float = 0.0
    last_at: float = 0.0
    generated: int = 0
    cached_tokens: int = 0
    #: Decode steps this sequence took part in, and the batch sizes of those steps, summed.
    steps: int = 0
    batch_size_sum: int = 0
    #: Where a prompt tail the chat's next turn does not repeat begins (0: none; `Engine._turn_end`).
    turn_end: int = 0
    #: Kinds of the prompt checkpoints still to take, last first (None: a boundary that keeps nothing).
    checkpoint_kinds: list[str | None] = field(default_factory=list)
    #: The system prompt this sequence prefills for others that wait for its checkpoint.
    leads: tuple[int, ...] | None = None
    #: Splits a chat reply into answer, reasoning and tool calls (`reply.py`); None: text as it is.
    reply: object = None
    #: The grammar's logits processor (structured output); None when unconstrained.
    constraint: Constraint | None = None
    #: Log-probabilities asked for: the number of alternatives per token (None: not asked).
    logprobs: int | None = None
    #: The request's other choices (n > 1), held until this one's prompt is prefilled.
    forks: list[Sequence] = field(default_factory=list)
    #: A choice forked from another: the cache of all its prompt but the last token, and its length.
    start: tuple[list, int] | None = None
    #: Speculative decoding on the fast path: tokens drafted for it, and those accepted.
    draft_tokens: int = 0
    draft_accepted: int = 0
    #: Seconds spent prefilling this prompt's own chunks, and waiting behind other prompts' chunks
    #: while admitted (`prefill.py`).
    prefill_s: float = 0.0
    prefill_wait_s: float = 0.0
    #: The longest time between two of its tokens, seconds.
    longest_gap_s: float = 0.0
    #: A resumed reply (`replay`): the tokens it had on the worker that died (at the end of `ids`), which
    #: resume this is, and why it ends without a new token, if it does ("length", "stop").
    resumed: int = 0
    resumes: int = 0
    ended: str | None = None

    def replay(self, tokens: list[int], count: int) -> None:
        """Go on from `tokens`, the reply so far that a worker which died had sent: they join the prompt,
        and pass through the text stream, reply splitter, grammar and sampler as if generated here, with
        nothing sent (docs/supervision.md)."""
        self.ids = self.ids + tokens
        self.resumed = self.generated = len(tokens)
        self.resumes = count
        self.max_tokens -= len(tokens)
        con = self.constraint
        if con is not None and tokens:
            # The last token is the prompt's last now: the grammar's first call takes it (`Constraint`).
            for token in tokens[:-1]:
                if not con.matcher.consume_token(token):
                    raise ValueError(f"the grammar refuses the resumed reply at token {token}")
            con.started = True
        if replay_reply(self.text, self.reply, self.sampler, tokens):
            self.ended = "stop"
        elif self.max_tokens <= 0:
            self.ended = "length"

    def stats(self, finish: str) -> Stats:
        t0, t1, tn, n = self.admitted_at, self.first_at or self.admitted_at, self.last_at, self.generated
        prefilled = len(self.ids) - self.cached_tokens
        new = n - self.resumed
        return Stats(
            prompt_tokens=len(self.ids) - self.resumed,
            prompt_tps=prefilled / max(t1 - t0, 1e-9) if self.first_at else 0.0,
            ttft_ms=(t1 - t0) * 1e3 if self.first_at else 0.0,
            generation_tokens=n,
            decode_tps=(new - 1) / (tn - t1) if new > 1 and tn > t1 else 0.0,
            decode_ms=(tn - t1) * 1e3 if self.first_at else 0.0,
            queue_ms=(t0 - self.queued_at) * 1e3 if t0 else (time.perf_counter() - self.queued_at) * 1e3,
            peak_memory_bytes=int(mx.get_peak_memory()),
            finish_reason=finish,
            cached_tokens=min(self.cached_tokens, len(self.ids) - self.resumed),
            mean_batch_size=self.batch_size_sum / self.steps if self.steps else 0.0,
            stop_sequence=self.text.stop_hit,
            draft_tokens=self.draft_tokens,
            draft_accepted=self.draft_accepted,
            prefill_ms=self.prefill_s * 1e3,
            prefill_wait_ms=self.prefill_wait_s * 1e3,
            longest_gap_ms=self.longest_gap_s * 1e3,
            resumes=self.resumes,
        )


def replay_reply(text: TextStream, reply, sampler, tokens: list[int]) -> bool:
    """A resumed reply's `tokens` through its text stream and reply splitter (`reply.py`; None: plain
    text), sending nothing, and a seeded sampler's place after them; True if a stop string was hit."""
    if isinstance(sampler, KeyedSampler):
        sampler.drawn = len(tokens)
    return text.replay(tokens, reply.feed if reply is not None else _drop)


def _drop(_text: str) -> None:
    pass
