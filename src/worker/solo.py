"""One sequence decoded alone, the way mlx-lm's `generate_step` does: the batch-size-1 fast path.

mlx-lm's `BatchGenerator` does more host work per step than `generate_step`
(merged batch caches, per-sequence bookkeeping), which costs a single stream
a third of its speed on a GPU. `Solo` runs one `Sequence` with a cache of
its own: the prompt in chunks of `prefill_step_size`, one chunk per call, split
into the same segments as in the batch (so the engine can keep a checkpoint
at each boundary), then one token per call, the next one already queued with
`mx.async_eval` before the current one is read, as `generate_step` does.

Every step is the batch's step for one row: the same model call, the same
logits processors on the same token context, the same log-softmax and the
same sampler object, so the ids are those the batch would give. `handoff`
says how to put the sequence into a `BatchGenerator` so that it goes on
exactly where it is (`Engine._hand_over`).

Two things only a lone sequence does, because mlx-lm's `BatchGenerator`
cannot batch them (docs/engine.md has the rules):

- **KV-cache quantization** (`kvcache.py`): after each model call its
  `KVCache` layers past ``quantized_kv_start`` become `QuantizedKVCache`s,
  as in `generate_step`; handed over, the cache goes back to full precision.
- **Speculative decoding** with a draft model, as `speculative_generate_step`
  does it: the draft proposes `num_draft_tokens` tokens greedily, the target
  scores them all in one call, and the tokens up to the first one the
  target's own sampler does not pick are kept, with the target's token at
  that place. A greedy target gets exactly its own ids; a sampled one its own
  distribution (a drafted token is kept only where the target drew it). One
  round runs when the tokens it made are all delivered, so `decode` still
  returns one token per call; the token after the accepted ones is delivered
  before the next round is drafted. Handed over, the tokens it made beyond the
  delivered one are dropped (the cache is rewound) and the draft's cache with
  them: the batch recomputes them. Whether a round drafts at all is the
  worker's `DraftPolicy` (draft_policy.py): it times both ways in windows of
  a few tokens and drafts only while drafting is the faster; between windows
  the sequence switches ways without losing or repeating a token.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

import mlx.core as mx
from mlx_lm.models.cache import TokenBuffer, make_prompt_cache, trim_prompt_cache
from mlx_lm.sample_utils import greedy_sampler

from .draft_policy import DraftPolicy, Window
from .kvcache import KVQuant, full_precision, make_cache, quantize
from .prefill import outgrown
from .sequence import Sequence, unsample

#: Give MLX's cached buffers back every this many tokens, as `generate_step` does.
CLEAR_CACHE_EVERY = 256
#: A resumed reply's tokens replayed one a model call: this many to one engine step.
SINGLES_PER_CALL = 32
#: Cache lengths at which one sequence's decode step on MLX's CUDA backend first builds a cuDNN
#: attention graph of a new kind (the graph follows the cache's buffer, which grows by 256 tokens):
#: 0.45-0.7 s each on an H200, where the longer buffers' graphs took about 50 ms.
CUDNN_DECODE_LENGTHS = (256, 512, 768, 1024)


@dataclass(frozen=True)
class Draft:
    """A loaded draft model, how many tokens it proposes per round, and when it drafts at all."""

    model: object
    num_draft_tokens: int
    policy: DraftPolicy = field(default_factory=DraftPolicy)


class Solo:
    """A sequence, its cache and its pending token; every method runs on the engine's thread."""

    def __init__(self, model, seq: Sequence, cache: list | None, segments: list[list[int]], *,
                 prefill_step_size: int, stream, kv: KVQuant | None = None, max_kv_size: int | None = None,
                 draft: Draft | None = None) -> None:
        self.model = model
        self.seq = seq
        self.cache = cache if cache is not None else make_cache(model, max_kv_size)
        self._kv = kv
        # A grammar's matcher follows every token it is shown: drafted tokens the target rejects would
        # corrupt it, so a constrained sequence decodes one token at a time. So does one that asked for
        # log-probabilities: they come from the plain step's distribution.
        self._draft = draft if seq.constraint is None and seq.logprobs is None else None
        if self._draft is not None:
            self._draft_cache = make_prompt_cache(self._draft.model)
            #: Whether this window drafts; while it does not, how many of `tokens` the draft has seen.
            self._drafting = self._draft.policy.first()
            self._draft_seen = 0
            #: Tokens the draft has not seen yet, before the head: at first, the whole prompt.
            self._draft_in: list[int] = list(seq.ids) if self._drafting else []
            self._window = Window(self._drafting)
            self._mark: float | None = None  # when the last `decode` began
        #: Speculative: tokens in the cache, accepted, not yet delivered; and whether `_next` (the
        #: head, sampled, not in the cache) was delivered.
        self._pending: deque[int] = deque()
        self._head_sent = False
        self._head = 0
        #: The tokens whose keys and values are in `cache`, in order.
        self.tokens = list(seq.ids[: seq.cached_tokens])
        #: Whether a chunk ended inside a segment (`prefill.Prefill.pieces`); whether MLX's freed buffers
        #: are kept from the last chunk (`prefill(keep=)`).
        self.pieces = self._kept = False
        segments = [list(s) for s in segments if s]
        if len(segments[-1]) != 1:  # the last token is the first decode step's input, as in mlx-lm
            segments.append(segments[-1][-1:])
            segments[-2] = segments[-2][:-1]
        #: The prompt still to prefill, by segment; the last is the prompt's last token.
        self.segments = segments
        #: A resumed reply (`Sequence.replay`): the prefill's last tokens, fed one a call as they were
        #: decoded, so their keys and values are the ones the uninterrupted run had, bit for bit (a chunk
        #: sums in another order; in bfloat16 on a GPU a greedy reply then parts from it at a near-tie).
        self._singles = seq.resumed
        #: Responses so far, as `GenerationBatch` counts them for max_tokens.
        self.n = 0
        self._step_size = prefill_step_size
        self._stream = stream
        self._matcher = seq.stop.matcher()
        self._context: TokenBuffer | None = None
        self._next: mx.array | None = None  # sampled, queued, not yet delivered
        self._next_logprobs: mx.array | None = None  # what `_next` was sampled from, when asked for
        #: The log-probabilities (shape (V,)) the token `decode` returned last was sampled from; kept
        #: only for a sequence that asks for them.
        self.logprobs: mx.array | None = None
        self._resume: int | None = None  # delivered without lookahead: the batch's next input

    def end(self) -> None:
        """It ends before its prompt is in (cancelled, failed): the buffers its chunks kept go back where
        its cache outgrew them (`prefill.outgrown`)."""
        if self._kept and outgrown(self, self._step_size):
            mx.clear_cache()

    @property
    def prefilling(self) -> bool:
        """Whether prompt tokens are left to prefill (the first token is not queued yet)."""
        return bool(self.segments)

    def prefill(self, size: int | None = None, *, keep: bool = False) -> bool:
        """Prefill one chunk of `size` tokens (None: `prefill_step_size`); queue the first decode step
        after the last. True at an inner segment's end. MLX's freed buffers are handed back after the
        chunk, as mlx-lm does after each prompt step; with `keep` (the scheduler's chunks on CUDA) only
        after the prompt's last chunk: the next chunk reuses them, and a long prompt does not leave its
        cache's outgrown buffers cached once it decodes."""
        if len(self.segments) > 1:
            seg, size = self.segments[0], size or self._step_size
            singles = self._singles if len(self.segments) == 2 else 0
            one_a_call = singles >= len(seg)  # the resumed reply's tokens, as decode steps
            if one_a_call:
                size = min(size, SINGLES_PER_CALL)
            elif singles:
                size = min(size, len(seg) - singles)
            chunk, self.segments[0] = seg[:size], seg[size:]
            with mx.stream(self._stream):
                for piece in ([[t] for t in chunk] if one_a_call else [chunk]):
                    self.model(mx.array(piece)[None], cache=self.cache)
                    quantize(self.cache, self._kv)
                    if one_a_call:  # queued as a decode step is; one graph of many calls ran slower on an
                        mx.async_eval([c.state for c in self.cache])  # H200 (gpu-h200-resume-evict-vision.md)
                mx.eval([c.state for c in self.cache])
            self._kept = keep and not (not self.segments[0] and len(self.segments) == 2)  # but after the last
            if not self._kept:
                mx.clear_cache()
            self.tokens += chunk
            self.pieces = self.pieces or bool(self.segments[0])
            if self.segments[0]:
                return False
            self.segments.pop(0)
            boundary = True
        else:
            boundary = False
        if len(self.segments) == 1:  # only the prompt's last token is left: the first decode step
            (last,) = self.segments.pop()
            self.tokens.append(last)
            self._queue(mx.array([last]))
        return boundary

    def decode(self, *, lookahead: bool = True) -> tuple[int, str | None]:
        """The token queued last step, and mlx-lm's finish reason for it ("length", "stop" or None).

        With `lookahead` the step after it is queued first (its keys and values join the cache);
        without, the cache ends before the returned token, ready for `handoff`.
        """
        if self._draft is not None:
            self._time_window()
            if self._drafting:
                return self._count(self._speculative(lookahead))
        y, self._next = self._next, None
        assert y is not None, "decode before the prompt was prefilled"
        lp, self._next_logprobs = self._next_logprobs, None
        self.logprobs = None if lp is None else lp[0]
        if lookahead:
            self._queue(y)
        token = int(y.item())
        if lookahead:
            self.tokens.append(token)
        else:
            self._resume = token
        return self._count(token)

    def _count(self, token: int) -> tuple[int, str | None]:
        """Count a delivered token; mlx-lm's finish reason for it."""
        self.n += 1
        if self.n % CLEAR_CACHE_EVERY == 0:
            mx.clear_cache()
        reason = "length" if self.n >= self.seq.max_tokens else None
        if self._matcher.advance(token):
            reason = "stop"
        return token, reason

    # -- speculative decoding -------------------------------------------------------
    def _time_window(self) -> None:
        """Count the token delivered last call and the time since; at a window's end, let the policy
        choose the next window's way and switch to it.

        A drafting window ends between rounds (the head delivered, nothing pending), a plain one after
        any token; either has then delivered every token it computed, so no token is lost or repeated.
        """
        now, w = time.perf_counter(), self._window
        if self._mark is not None:
            w.seconds += now - self._mark
            w.tokens += 1
        self._mark = now
        if not w.full() or (self._drafting and (self._pending or not self._head_sent)):
            return
        assert self._draft is not None
        drafting = self._draft.policy.window(w)
        self._window = Window(drafting)
        if drafting and not self._drafting:  # `_next`, queued, is the head: the draft catches up first
            self._draft_in = self.tokens[self._draft_seen :]
            self._head_sent = False
        elif self._drafting and not drafting:  # the head, delivered, goes into the cache: `_next` after it
            self._draft_seen = len(self.tokens) - len(self._draft_in)
            self.tokens.append(self._head)
            self._context = None  # rebuilt from `tokens` by `_queue`
            assert self._next is not None
            self._queue(self._next)
        self._drafting = drafting

    def _speculative(self, lookahead: bool) -> int:
        """The next token: an accepted draft token, else the head (a round first if it was sent)."""
        if not self._pending and self._head_sent:
            self._round()
        if self._pending:
            token = self._pending.popleft()
            if not lookahead:  # the batch goes on from `token`: the cache ends before it
                self._rewind(1 + len(self._pending))
                unsample(self.seq.sampler, 1 + len(self._pending))  # the batch draws them again
                self._pending.clear()
                self._resume = token
            return token
        assert self._next is not None, "decode before the prompt was prefilled"
        self._head = token = int(self._next.item())
        self._head_sent = True
        if not lookahead:
            self._resume = token
        return token

    def _round(self) -> None:
        """Draft up to `num_draft_tokens` after the head, score head and drafts in one target call,
        keep the accepted ones as pending and the target's next token as the new head."""
        draft, seq = self._draft, self.seq
        assert draft is not None and self._next is not None
        k = max(0, min(draft.num_draft_tokens, seq.max_tokens - self.n - 1))
        with mx.stream(self._stream):
            drafted = self._draft_tokens(k)
            inputs = mx.concatenate([self._next.astype(mx.uint32), drafted])
            logits = self.model(inputs[None], cache=self.cache)[0]
            quantize(self.cache, self._kv)
            sampled = self._sample(inputs, logits)
            mx.eval(sampled, drafted)
        ids, proposed = sampled.tolist(), drafted.tolist()
        n = next((i for i, (t, d) in enumerate(zip(ids, proposed, strict=False)) if t != d), k)
        trim_prompt_cache(self.cache, k - n)
        unsample(seq.sampler, k - n)
        self.tokens += [self._head, *proposed[:n]]
        if k:
            if n == k:
                self._draft_in = [proposed[-1]]  # the draft never saw its own last token
            else:
                trim_prompt_cache(self._draft_cache, k - 1 - n)
        seq.draft_tokens += k
        seq.draft_accepted += n
        self._window.rounds += 1
        self._pending.extend(proposed[:n])
        self._next, self._head_sent = sampled[n : n + 1], False

    def _draft_tokens(self, k: int) -> mx.array:
        """k tokens drafted greedily after the head (the draft first fed what it has not seen), through
        the sequence's logits processors (a repetition penalty), as the target will score them."""
        draft = self._draft
        assert draft is not None
        if k == 0:
            self._draft_in.append(self._head)
            return mx.array([], dtype=mx.uint32)
        feed, self._draft_in = [*self._draft_in, self._head], []
        if len(feed) > 2:  # more than a round leaves: the prompt, or what plain decoding made
            self._catch_up(feed[:-1])
            feed = feed[-1:]
        y = mx.array(feed)
        out: list[mx.array] = []
        context = mx.array([*self.tokens, self._head], dtype=mx.uint32)
        for _ in range(k):
            logits = draft.model(y[None], cache=self._draft_cache)[0, -1:]
            for processor in self.seq.processors:
                logits = processor(mx.concatenate([context, *out]), logits)
            y = mx.argmax(logits, axis=-1).astype(mx.uint32)
            out.append(y)
        return mx.concatenate(out)

    def _catch_up(self, tokens: list[int]) -> None:
        """Prefill the draft with `tokens`, in chunks; the time is not the window's (a one-off cost that
        would make drafting look slower the longer it was left, and so leave it longer still)."""
        assert self._draft is not None
        t0 = time.perf_counter()
        for i in range(0, len(tokens), self._step_size):
            self._draft.model(mx.array(tokens[i : i + self._step_size])[None], cache=self._draft_cache)
            mx.eval([c.state for c in self._draft_cache])
        if self._mark is not None:
            self._mark += time.perf_counter() - t0

    def _sample(self, inputs: mx.array, logits: mx.array) -> mx.array:
        """The target's token after each of `inputs`, as its batch step would sample it there."""
        seq = self.seq
        sampler = seq.sampler or greedy_sampler
        if not seq.processors:
            return sampler(logits - mx.logsumexp(logits, axis=-1, keepdims=True))
        base = mx.array(self.tokens, dtype=mx.uint32)
        rows = []
        for i in range(inputs.shape[0]):
            context = mx.concatenate([base, inputs[: i + 1]])
            row = logits[i : i + 1]
            for processor in seq.processors:
                row = processor(context, row)
            rows.append(sampler(row - mx.logsumexp(row, axis=-1, keepdims=True)))
        return mx.concatenate(rows)

    def _rewind(self, n: int) -> None:
        """Take the last `n` tokens out of the cache."""
        trim_prompt_cache(self.cache, n)
        del self.tokens[len(self.tokens) - n :]

    def handoff(self) -> dict:
        """`BatchGenerator.insert_segments` arguments that resume this sequence where it is.

        Call between steps: while prefilling, or right after `decode(lookahead=False)`.
        """
        if self._resume is not None:
            segments = [[self._resume]]
        else:
            assert self.prefilling, "hand over after decode(lookahead=False)"
            segments = [list(s) for s in self.segments]
        return {
            "segments": [segments],
            "max_tokens": [self.seq.max_tokens - self.n],
            "caches": [full_precision(self.cache)],
            "all_tokens": [list(self.tokens)],
            "samplers": [self.seq.sampler],
            "logits_processors": [self.seq.processors],
            "stop_sequences": [self.seq.stop],
        }

    def _queue(self, y: mx.array) -> None:
        """Run the model on `y` (shape (1,)) and queue the sampling of the next token.

        `GenerationBatch._step` for one row: processors on the tokens so far, log-softmax, sampler.
        """
        seq = self.seq
        with mx.stream(self._stream):
            logits = self.model(y[None], cache=self.cache)[:, -1, :]
            quantize(self.cache, self._kv)
            context = []
            if seq.processors:
                if self._context is None:  # the cache's tokens before `y`, as the batch starts it
                    self._context = TokenBuffer(self.tokens[:-1])
                context = self._context.update_and_fetch(y)
                for processor in seq.processors:
                    logits = processor(context, logits)
            logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
            self._next = (seq.sampler or greedy_sampler)(logprobs)
            if seq.logprobs is None:
                mx.async_eval(self._next, context)
            else:
                self._next_logprobs = logprobs
                mx.async_eval(self._next, context, logprobs)


def warm_decode_graphs(model, context: int, lengths: tuple[int, ...] = CUDNN_DECODE_LENGTHS) -> int:
    """Run one sequence's decode step at each of `lengths` (those within `context`) on a cache of the
    model's own, so that a worker builds those attention graphs before a request needs them (on
    MLX's CUDA backend; a resumed stream's replay meets them at once). How many ran."""
    cache, done, at = make_prompt_cache(model), 0, 0
    for n in lengths:
        if n >= context:
            break
        model(mx.zeros((1, n - 1 - at), dtype=mx.int32), cache=cache)  # the buffer grows to n
        mx.eval(model(mx.zeros((1, 1), dtype=mx.int32), cache=cache))
        at, done = n, done + 1
    mx.clear_cache()
    return done
