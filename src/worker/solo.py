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
"""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models.cache import TokenBuffer, make_prompt_cache
from mlx_lm.sample_utils import greedy_sampler

from .sequence import Sequence

#: Give MLX's cached buffers back every this many tokens, as `generate_step` does.
CLEAR_CACHE_EVERY = 256


class Solo:
    """A sequence, its cache and its pending token; every method runs on the engine's thread."""

    def __init__(self, model, seq: Sequence, cache: list | None, segments: list[list[int]], *,
                 prefill_step_size: int, stream) -> None:
        self.model = model
        self.seq = seq
        self.cache = cache if cache is not None else make_prompt_cache(model)
        #: The tokens whose keys and values are in `cache`, in order.
        self.tokens = list(seq.ids[: seq.cached_tokens])
        segments = [list(s) for s in segments if s]
        if len(segments[-1]) != 1:  # the last token is the first decode step's input, as in mlx-lm
            segments.append(segments[-1][-1:])
            segments[-2] = segments[-2][:-1]
        #: The prompt still to prefill, by segment; the last is the prompt's last token.
        self.segments = segments
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

    @property
    def prefilling(self) -> bool:
        """Whether prompt tokens are left to prefill (the first token is not queued yet)."""
        return bool(self.segments)

    def prefill(self) -> bool:
        """Prefill one chunk; queue the first decode step after the last. True at an inner segment's end."""
        if len(self.segments) > 1:
            seg = self.segments[0]
            chunk, self.segments[0] = seg[: self._step_size], seg[self._step_size :]
            with mx.stream(self._stream):
                self.model(mx.array(chunk)[None], cache=self.cache)
                mx.eval([c.state for c in self.cache])
            mx.clear_cache()
            self.tokens += chunk
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
        self.n += 1
        if self.n % CLEAR_CACHE_EVERY == 0:
            mx.clear_cache()
        reason = "length" if self.n >= self.seq.max_tokens else None
        if self._matcher.advance(token):
            reason = "stop"
        return token, reason

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
            "caches": [self.cache],
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
