"""Log-probabilities of generated tokens, for the requests that ask (`SamplingParams.logprobs`).

mlx-lm already computes, for every sequence at every step, the log-softmax
of the logits its token was sampled from (after the logits processors:
repetition penalty, a grammar's mask; before the sampler's temperature and
top-p/top-k), and evaluates it with the step (`GenerationBatch.Response.logprobs`;
the single-stream path keeps its own). So the value of the sampled token
costs a gather, and the top k an `argpartition` on the device, only for the
rows that asked, all in one evaluation per step. Requests that do not ask
add no device work and no bytes on the wire (their frames stay plain
`Tokens`).

Token bytes are what the tokenizer writes for the token (byte-level BPE
undone, SentencePiece's ``▁`` a space), from llguidance's view of the
tokenizer, memoised per id.
"""

from __future__ import annotations

import mlx.core as mx

from ..ipc.protocol import TokenLogprob, TopLogprob

#: A masked token's log-probability (-inf) as sent: JSON has no infinity (vLLM sends the same).
FLOOR = -9999.0


class TokenBytes:
    """id -> the token's bytes, memoised; from llguidance's tokenizer view, else the tokenizer's decode."""

    def __init__(self, tokenizer, grammars) -> None:
        self._tokenizer = tokenizer
        self._grammars = grammars
        self._bytes: dict[int, bytes] = {}
        self._ll = None

    def warm(self) -> None:
        """Build llguidance's tokenizer view now (any thread), so the first use does not wait."""
        if self._ll is None:
            try:
                self._ll = self._grammars.tokenizer()
            except Exception:  # a tokenizer llguidance cannot read: decode instead
                self._ll = False

    def __call__(self, token: int) -> bytes:
        out = self._bytes.get(token)
        if out is None:
            self.warm()
            out = self._ll.decode_bytes([token]) if self._ll else self._tokenizer.decode([token]).encode()
            self._bytes[token] = out
        return out


def token_logprobs(rows: list[mx.array], tokens: list[int], tops: list[int],
                   token_bytes: TokenBytes) -> list[TokenLogprob]:
    """Each row's `TokenLogprob`: `rows[i]` the vocabulary's log-probabilities (shape (V,)) at the
    step that sampled `tokens[i]`, `tops[i]` how many of the most likely tokens to add."""
    lp = mx.stack(rows) if len(rows) > 1 else rows[0][None]
    chosen = mx.take_along_axis(lp, mx.array(tokens)[:, None], axis=-1)[:, 0]
    k = max(tops)
    if k:
        ids = mx.argpartition(-lp, kth=k - 1, axis=-1)[:, :k]
        values = mx.take_along_axis(lp, ids, axis=-1)
        mx.eval(chosen, ids, values)
        top_ids, top_values = ids.tolist(), values.tolist()
    else:
        mx.eval(chosen)
        top_ids = top_values = [[] for _ in rows]
    out = []
    for token, value, n, row_ids, row_values in zip(tokens, chosen.tolist(), tops, top_ids, top_values,
                                                    strict=True):
        best = sorted(zip(row_values, row_ids, strict=True), key=lambda p: -p[0])[:n]
        top = [TopLogprob(i, _finite(v), token_bytes(i)) for v, i in best]
        out.append(TokenLogprob(token, _finite(value), token_bytes(token), top))
    return out


def _finite(value: float) -> float:
    return value if value > FLOOR else FLOOR
