"""Structured output in the worker: llguidance grammars, applied as per-sequence logits processors.

::

    reader thread                        MLX thread, each batch step
    Generate with params.grammar         Engine.step -> StepMasks.plan(the decoding rows whose grammar
      -> GrammarCache.prepare()            consumes last step's token, and those tokens, unread)
         compile against the tokenizer   the first planned Constraint(tokens, logits) -> StepMasks:
         (llguidance drops the GIL),       read the tokens (one sync), start the forward pass
         keep the pristine matcher         (async_eval), then on the CPU: advance every matcher and
    Engine.submit -> GrammarCache          fill every bitmask (LLExecutor: its threads, no GIL),
      .matcher(): a copy of the cached     expand them all at once (-inf where not allowed)
      matcher (a compile error fails     every planned Constraint: its row's slice of that mask
      the request alone, at admission)   any other Constraint (a first step, the single-stream
                                           path): the same work for its own row

The engine reads each constrained sequence's state after every token
(`Constraint.finish_reason`): a grammar that is complete (nothing more can
follow) ends the request with ``stop``, one that allows no next token ends it
with ``grammar_dead_end``; max_tokens ends it with ``length`` as always, so a
constrained request always ends. EOS is in the mask only where the grammar
accepts, so EOS (a stop id) ends a constrained reply only when it is complete.

The mask is applied with portable MLX ops (a gather and a bitwise and), not
llguidance's Metal kernel, so it runs on the CPU, CUDA and Metal backends.
Unconstrained sequences have no `Constraint` and pay nothing.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict

import llguidance
import llguidance.numpy
import mlx.core as mx
import numpy as np

from ..ipc.protocol import GRAMMAR_DEAD_END, Grammar

#: Compiled grammars kept per worker (each a pristine matcher, copied per request).
DEFAULT_GRAMMAR_CACHE_ENTRIES = 64
#: Whitespace between JSON tokens: none, one space, or a newline and up to 20 spaces or tabs of indent
#: (llama.cpp's rule). Compact and pretty-printed JSON both match, and no reply can spend its
#: max_tokens on endless whitespace, which unbounded whitespace lets a weak model do.
JSON_WHITESPACE = r"(?:\n[ \t]{0,20}| )?"


class GrammarError(ValueError):
    """A grammar that cannot be compiled against this model's tokenizer: the request fails alone."""


#: Keywords whose value is a map of schemas, a list of schemas, or one schema (JSON Schema 2020-12 and
#: the older ``definitions`` and array ``items``); `closed_schema` walks these and nothing else.
_SCHEMA_MAPS = ("properties", "$defs", "definitions", "patternProperties", "dependentSchemas")
_SCHEMA_LISTS = ("anyOf", "oneOf", "prefixItems", "items")
_SCHEMA_ONE = ("items", "additionalProperties", "unevaluatedProperties", "not", "if", "then", "else",
               "contains", "propertyNames", "unevaluatedItems", "additionalItems")
#: An object schema with one of these says what other properties it takes (or gets them from elsewhere).
_OPEN_KEYS = frozenset({"additionalProperties", "unevaluatedProperties", "patternProperties", "allOf",
                        "anyOf", "oneOf", "$ref", "$dynamicRef", "if", "dependentSchemas"})


def closed_schema(schema: object) -> object:
    """`schema` compiled as the strict engines compile it (OpenAI's ``strict``, xgrammar's strict mode):
    an object schema that declares ``properties`` and says nothing of others takes no others
    (``additionalProperties: false``); one that declares none, or allows others, is left as it is.
    Members of ``allOf`` are not closed: each would refuse the others' properties."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _SCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: closed_schema(sub) for name, sub in out[key].items()}
    for key in _SCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [closed_schema(sub) for sub in out[key]]
    for key in _SCHEMA_ONE:
        if isinstance(out.get(key), dict):
            out[key] = closed_schema(out[key])
    if isinstance(out.get("allOf"), list):
        out["allOf"] = [_close_inside(sub) for sub in out["allOf"]]
    if isinstance(out.get("properties"), dict) and not _OPEN_KEYS & out.keys():
        out["additionalProperties"] = False
    return out


def _close_inside(schema: object) -> object:
    """`closed_schema` below `schema`'s own level (an ``allOf`` member)."""
    if not isinstance(schema, dict):
        return schema
    closed = closed_schema({**schema, "allOf": []})
    assert isinstance(closed, dict)
    if "allOf" in schema:
        closed["allOf"] = [_close_inside(sub) for sub in schema["allOf"]]
    else:
        del closed["allOf"]
    if "additionalProperties" not in schema:
        closed.pop("additionalProperties", None)
    return closed


def grammar_text(grammar: Grammar) -> str:
    """llguidance's grammar definition for `grammar` (not yet checked); a JSON schema is closed first
    (`closed_schema`) and its whitespace bounded (`JSON_WHITESPACE`)."""
    if grammar.kind == "json_schema":
        options: llguidance.JsonCompileOptions = {"whitespace_pattern": JSON_WHITESPACE}
        source = json.dumps(closed_schema(json.loads(grammar.source)))
        return llguidance.LLMatcher.grammar_from_json_schema(source, defaults=options)
    if grammar.kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(grammar.source)
    return llguidance.LLMatcher.grammar_from_lark(grammar.source)


class GrammarCache:
    """Compiled grammars for one tokenizer, keyed by `Grammar`, least recently used dropped first.

    Safe to call from any thread: the reader thread compiles (`prepare`), the
    MLX thread takes copies (`matcher`). A failed compile is cached too, so
    the request fails at admission without compiling again.
    """

    def __init__(self, tokenizer, vocab_size: int, eos_ids, *, entries: int = DEFAULT_GRAMMAR_CACHE_ENTRIES):
        self._hf = getattr(tokenizer, "_tokenizer", tokenizer)  # mlx-lm's wrapper holds the HF tokenizer
        self._vocab_size = vocab_size
        self._eos = sorted(eos_ids)
        self._entries = entries
        self._lock = threading.Lock()
        self._llt: llguidance.LLTokenizer | None = None
        self._compiled: OrderedDict[Grammar, llguidance.LLMatcher | str] = OrderedDict()
        self.compiles = 0
        self.hits = 0

    def tokenizer(self) -> llguidance.LLTokenizer:
        """llguidance's view of the model's tokenizer, built on first use (~1 s for a 150k vocabulary)."""
        with self._lock:
            if self._llt is None:
                self._llt = _ll_tokenizer(self._hf, self._vocab_size, self._eos)
            return self._llt

    def warm(self) -> None:
        """Build llguidance's view of the tokenizer now, if it can be built (errors surface at use)."""
        try:
            self.tokenizer()
        except Exception:  # noqa: S110 -- the request that needs it fails with the reason, at admission
            pass

    def prepare(self, grammar: Grammar) -> None:
        """Compile `grammar` into the cache unless it is there; never raises (errors are cached)."""
        with self._lock:
            if grammar in self._compiled:
                return
        try:
            compiled: llguidance.LLMatcher | str = _compile(self.tokenizer(), grammar)
        except Exception as exc:  # a tokenizer llguidance cannot read: the request fails, the worker lives
            compiled = f"{type(exc).__name__}: {exc}"
        with self._lock:
            self.compiles += 1
            self._compiled[grammar] = compiled
            while len(self._compiled) > self._entries:
                self._compiled.popitem(last=False)

    def constraint(self, grammar: Grammar) -> Constraint:
        """A new sequence's `Constraint` for `grammar`; `GrammarError` if it does not compile."""
        matcher = self.matcher(grammar)
        return Constraint(matcher, self.tokenizer().vocab_size)

    def matcher(self, grammar: Grammar) -> llguidance.LLMatcher:
        """A fresh matcher for `grammar`, compiled now if `prepare` did not; `GrammarError` if it fails."""
        with self._lock:
            compiled = self._compiled.get(grammar)
            if compiled is not None:
                self.hits += 1
                self._compiled.move_to_end(grammar)
        if compiled is None:
            self.prepare(grammar)
            with self._lock:
                compiled = self._compiled.get(grammar)
        if compiled is None:  # evicted at once (entries=0): compile for this request alone
            compiled = _compile(self.tokenizer(), grammar)
        if isinstance(compiled, str):
            raise GrammarError(f"invalid grammar ({grammar.kind}): {compiled}")
        return compiled.deep_copy()


def _ll_tokenizer(hf, vocab_size: int, eos: list[int]) -> llguidance.LLTokenizer:
    import llguidance.hf
    import transformers

    if not isinstance(hf, transformers.PreTrainedTokenizerFast):
        kind = type(hf).__name__
        raise GrammarError(f"structured output needs a fast (Rust) Hugging Face tokenizer, not {kind}")
    n_vocab = max(vocab_size, len(hf)) or None  # the logits' width: the model may pad past the tokenizer
    return llguidance.hf.from_tokenizer(hf, n_vocab=n_vocab, eos_token=eos or None)


def _compile(llt: llguidance.LLTokenizer, grammar: Grammar) -> llguidance.LLMatcher | str:
    """A pristine matcher, or the compile error's message."""
    try:
        text = grammar_text(grammar)
    except ValueError as exc:
        return str(exc)
    matcher = llguidance.LLMatcher(llt, text, log_level=0)
    return matcher.get_error() if matcher.is_error() else matcher


class MaskIndex:
    """Per vocabulary position, the bitmask word that holds it and its bit: built once per logits width."""

    _by_width: dict[int, MaskIndex] = {}

    def __init__(self, width: int) -> None:
        pos = mx.arange(width, dtype=mx.uint32)
        self.word = pos // 32
        self.bit = mx.left_shift(mx.array(1, dtype=mx.uint32), pos % 32)

    @classmethod
    def of(cls, width: int) -> MaskIndex:
        index = cls._by_width.get(width)
        if index is None:
            index = cls._by_width[width] = cls(width)
        return index

    def allowed(self, words: np.ndarray) -> mx.array:
        """Bitmask words (rows, words) as booleans (rows, width): one gather and one `and` for all rows."""
        return (mx.take(mx.array(words.view(np.uint32)), self.word, axis=1) & self.bit) != 0


class StepMasks:
    """One batch step's grammar work for all its constrained rows, done at once (`Engine.step`).

    Before a batch step the engine names the rows whose constraint will consume the token sampled
    last step (`plan`). The first of their processors to run reads those tokens in one sync, lets
    the forward pass start, then advances every matcher and fills every bitmask through llguidance's
    executor (its threads, without the GIL), and expands all the bitmasks at once; each row's
    processor then masks its logits with its slice. A constraint not in the plan (a row's first
    step, the single-stream path, a matcher llguidance's executor cannot take) does its own row.
    """

    def __init__(self) -> None:
        self._executor: llguidance.LLExecutor | None = None
        self._rows: list[Constraint] = []
        self._tokens: mx.array | None = None
        self._allowed: dict[int, mx.array] = {}  # id(constraint) -> its (1, width) row, this step
        #: Rows masked through the batch path, all steps (tests check it is taken).
        self.batched_rows = 0

    def plan(self, rows: list[Constraint], tokens: mx.array | None) -> None:
        """This step's constraints and the tokens they consume (`tokens[i]` for `rows[i]`, lazy)."""
        self._rows, self._tokens, self._allowed = rows, tokens, {}
        for con in rows:
            con.planned = self

    def clear(self) -> None:
        """The step is over (or failed): nothing planned is left for the next one."""
        for con in self._rows:
            con.planned = None
        self._rows, self._tokens, self._allowed = [], None, {}

    def mask(self, con: Constraint, logits: mx.array) -> mx.array:
        """`con`'s row of logits masked with this step's mask, the whole step's work done on first use."""
        if self._tokens is not None:
            self._run(logits)
        con.planned = None
        allowed = self._allowed.get(id(con))
        return logits if allowed is None else mx.where(allowed, logits, -mx.inf)

    def _run(self, logits: mx.array) -> None:
        rows, tokens = self._rows, self._tokens
        assert tokens is not None
        self._tokens = None
        # The tokens first, then the forward pass: on MLX's CPU backend (one stream) reading the
        # tokens after queueing the forward pass would wait for it. The masks are computed meanwhile.
        last = tokens.tolist()
        mx.async_eval(logits)
        if self._executor is None:
            self._executor = llguidance.LLExecutor()
        ok = llguidance.numpy.consume_token_par(
            self._executor, [(c.matcher, t) for c, t in zip(rows, last, strict=True)])
        live = [i for i, good in enumerate(ok) if good]
        for i in set(range(len(rows))) - set(live):
            rows[i].reject(last[i])
        words = np.zeros((len(live), rows[0].n_words), dtype=np.int32) if live else None
        if words is not None:
            llguidance.numpy.fill_next_token_bitmask_par(
                self._executor, [(rows[i].matcher, j) for j, i in enumerate(live)], words)
            masked = [j for j, i in enumerate(live) if rows[i].check(words[j])]
            if masked:
                allowed = MaskIndex.of(logits.shape[-1]).allowed(words[masked])
                for k, j in enumerate(masked):
                    self._allowed[id(rows[live[j]])] = allowed[k : k + 1]
        self.batched_rows += len(self._allowed)


class Constraint:
    """One sequence's grammar: a logits processor that masks what the grammar forbids.

    mlx-lm calls it once per step with the sequence's tokens and the step's
    logits; the last token is the one sampled at the previous step (the
    first call's is the prompt's last, which the grammar does not see). In a
    batch step the engine has planned, the mask comes from `StepMasks`.
    """

    def __init__(self, matcher: llguidance.LLMatcher, n_vocab: int) -> None:
        self.matcher = matcher
        self.n_words = (n_vocab + 31) // 32
        self._words = np.zeros(self.n_words, dtype=np.uint32)
        self.started = False
        #: The step's `StepMasks` while this row is in its plan.
        self.planned: StepMasks | None = None
        #: Set when the grammar rejected the last token: it must not reach the reply.
        self.rejected = False
        #: Why the grammar cannot go on (llguidance's message), once it cannot.
        self.error = ""

    @property
    def finish_reason(self) -> str | None:
        """``stop`` once the grammar is complete, the dead-end reason once it allows nothing, else None."""
        if self.error:
            return GRAMMAR_DEAD_END
        return "stop" if self.matcher.is_stopped() else None

    @property
    def batchable(self) -> bool:
        """Whether `StepMasks` can advance this row: started, still going, a matcher llguidance runs."""
        return self.started and not self.error and isinstance(self.matcher, llguidance.LLMatcher)

    def reject(self, token: int) -> None:
        """The grammar refused `token`: note why (the row gets no mask; the engine ends it unsent)."""
        self.rejected = True
        self.error = self.matcher.get_error() or f"the grammar rejected token {token}"

    def check(self, words: np.ndarray) -> bool:
        """Whether `words`, this row's new bitmask, allows a token; if not, note the dead end."""
        if self.matcher.is_error() or not words.any():
            self.error = self.matcher.get_error() or "the grammar allows no next token"
            return False
        return True

    def __call__(self, tokens: mx.array, logits: mx.array) -> mx.array:
        if self.planned is not None:
            return self.planned.mask(self, logits)
        m = self.matcher
        # The last token first, then the forward pass (see `StepMasks._run`).
        last = int(tokens[-1].item()) if self.started else None
        mx.async_eval(logits)
        if last is not None and not m.consume_token(last):
            self.reject(last)
            return logits
        self.started = True
        m.unsafe_compute_mask_ptr(self._words.ctypes.data, self._words.nbytes)
        if not self.check(self._words):
            return logits  # the engine ends the sequence before this step's token is sent
        return mx.where(MaskIndex.of(logits.shape[-1]).allowed(self._words[None]), logits, -mx.inf)
