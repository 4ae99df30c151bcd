"""The worker's prompt-prefix cache: KV caches of recent prompts, bounded in bytes.

mlx-lm's `LRUPromptCache` does the work (a token trie, least-recently-used
eviction by kind, a byte cap, trimming a longer cached sequence back to the
shared prefix where every layer's cache can be trimmed). This wrapper adds
what the engine needs around it:

- a served prefix is always shorter than the prompt, so at least one token
  is left to prefill (the model must produce the first token's logits);
- a longer entry is trimmed back to what it shares with the prompt only where
  that is at least `MIN_PREFIX_TOKENS` (or all of the prompt but its last
  token): prompts that merely begin alike (the same first word) would each take
  a copy of another's cache to skip a token or two, and a burst of them would
  be prefilled in uneven rows. An entry the prompt begins with (a system
  prompt's checkpoint, a prompt-cache file, an earlier turn) is served at any
  length: it was kept to be shared;
- caches that cannot be trimmed (`RotatingKVCache` once it has rotated,
  `ArraysCache`'s recurrent state) are only reused from an exact checkpoint,
  which `LRUPromptCache` already guarantees; the engine takes checkpoints at
  the boundaries a later request can share;
- hit, miss and cached-token counters, for the worker's report;
- in a worker group, eviction by the group's bytes (`total`): each rank holds
  its own shard of every entry, of a size that differs between ranks under
  pipeline parallelism, yet every rank must keep and evict the same entries,
  or their prefills (and their collectives) would part ways.

Entries are copies (`kvcache.owned`, as they come in): a cache taken out of a batch is a lazy graph over
the batch's arrays, or for a recurrent state a view of them, and either would keep them all alive while
counting its own bytes; so an entry is evaluated, and a recurrent state's arrays are copied. A served
entry is a deep copy, which the batch extends without touching the entry.

Under it, optionally, a disk tier (`disk_cache.DiskTier`): every entry inserted
is also written to disk in the background while the writer keeps up, an entry
that leaves memory before it was written is written then, and a prompt whose
longest prefix on disk is longer than in memory loads it from there (where
reading beats prefilling), so a prefix outlives eviction, an unload, a restart
or a crash (what is lost: disk_cache.py). `LRUPromptCache` has no eviction
hook: its trie's `pop` and `pop_prefixes`, through which every entry leaves
(`_EvictingTrie`), are the one place to hear of them.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import mlx.core as mx
from mlx_lm.models.cache import (
    LRUPromptCache,
    PromptTrie,
    PromptTrieResult,
    can_trim_prompt_cache,
    trim_prompt_cache,
)

from ..ipc.protocol import DiskCacheReport, EngineReport
from .kvcache import owned
from .limits import out_of_memory, relieve

if TYPE_CHECKING:
    from .disk_cache import DiskTier

#: LRUPromptCache keys entries by model too; a worker serves one model.
_MODEL_KEY = "model"
#: Entries kept at most, besides the byte cap: the trie walk grows with them.
MAX_ENTRIES = 256
#: The shortest shared part a longer entry is trimmed back to, tokens (docs/engine.md#prefix-reuse).
MIN_PREFIX_TOKENS = 32


class _Trie(PromptTrie):
    """`LRUPromptCache`'s trie, but a longer trimmable entry does not supersede (`pop_prefixes`) one under
    `MIN_PREFIX_TOKENS`: a short system prompt's checkpoint or prompt-cache file would otherwise go once a
    chat that begins with it ends, and a trim back to it is refused (`PrefixCache._fetch`)."""

    def search(self, model: object, tokens: list[int]) -> PromptTrieResult:
        """`PromptTrie.search`'s result, in time linear in the nodes visited: mlx-lm's copies the path at
        every node of its look for a longer entry (docs/engine.md#prefix-reuse); here it is kept as links."""
        if model not in self._trie:
            return PromptTrieResult(model, None, None, None, 0)
        if not tokens and "__value__" in self._trie[model]:
            return PromptTrieResult(model, [], None, None, 0)
        current, index, last_index = self._walk(model, tokens)
        if last_index == len(tokens) - 1 >= 0:
            return PromptTrieResult(model, tokens, None, None, 0)
        shorter = tokens[: last_index + 1] if last_index > 0 else None
        longer = None
        if index > 0:  # the shortest entry below, in mlx-lm's order: the last child first, a shorter one wins
            best, best_path = None, None
            stack: list[tuple[dict, int, tuple | None]] = [(current, 0, None)]
            while stack:
                node, depth, path = stack.pop()
                if "__value__" in node:
                    if best is None or depth < best:
                        best, best_path = depth, path
                elif best is None or depth < best:
                    stack.extend((child, depth + 1, (tok, path)) for tok, child in node.items())
            extra: list[int] = []
            while best_path is not None:
                tok, best_path = best_path
                extra.append(tok)
            longer = tokens[:index] + extra[::-1]
        return PromptTrieResult(model, None, shorter, longer, index)

    def _walk(self, model: object, tokens: list[int]) -> tuple[dict, int, int]:
        """How far `tokens` go down the trie: the node reached, the tokens walked, and the index of the last
        walked token an entry ends at (-1: none)."""
        current, index, last = self._trie[model], 0, -1
        while index < len(tokens) and tokens[index] in current:
            current = current[tokens[index]]
            if "__value__" in current:
                last = index
            index += 1
        return current, index, last

    def pop_prefixes(self, model: object, tokens: list[int]) -> list[tuple[int, object]]:
        popped, node = [], self._trie[model]
        for i, token in enumerate(tokens):
            if i >= MIN_PREFIX_TOKENS and "__value__" in node:
                popped.append((i, node.pop("__value__")))
            node = node[token]
        return popped

    def below_floor(self, model: object, tokens: list[int]) -> int | None:
        """Where `fetch_nearest_cache` would trim a longer entry back to fewer than all of `tokens` (a
        prompt's first tokens, `PrefixCache._fetch`): the length of the longest entry of 2 tokens or more
        that `tokens` begin with (0: none), else None. What `search` tells of it, by one walk of `tokens`:
        `search` also visits the trie below them to find which longer entry, which does not matter here."""
        if model not in self._trie:
            return None
        node, walked, last = self._walk(model, tokens)
        shorter = last + 1 if last > 0 else 0  # `search` never counts a 1-token entry as a shorter one
        if walked == len(tokens):
            return None  # all of `tokens` shared: trimmed back to at least them, or an exact entry
        # The walk stopped inside `tokens`: a longer entry is trimmed back to it, unless one ends right there.
        return shorter if shorter < walked and "__value__" not in node else None


class _EvictingTrie(_Trie):
    """`LRUPromptCache`'s trie (`_Trie`), telling `evicted(tokens, entry)` of each entry that leaves memory:
    evictions (the byte cap, the entry cap, `trim_to`, through `pop`) and prefixes a longer trimmable
    entry supersedes (`pop_prefixes`: in memory the longer one serves them trimmed, but a disk entry
    serves only prompts it begins, so a system prompt's checkpoint must reach the disk itself).
    While `muted` (a `clear` under memory pressure) it tells nothing: a copy to write is no relief."""

    def __init__(self, evicted: Callable[[list[int], object], None]) -> None:
        super().__init__()
        self._evicted = evicted
        self.muted = False

    def pop(self, model: object, tokens: list[int]) -> object:
        entry = super().pop(model, tokens)
        if not self.muted:
            self._evicted(list(tokens), entry)
        return entry

    def pop_prefixes(self, model: object, tokens: list[int]) -> list[tuple[int, object]]:
        popped = super().pop_prefixes(model, tokens)
        if not self.muted:
            for n, entry in popped:
                self._evicted(list(tokens[:n]), entry)
        return popped


class PrefixCache:
    """KV caches of earlier prompts, reused for the longest shared prefix.

    `total`, in a worker group: maps this rank's bytes to the group's (a collective every
    rank calls at the same point); the byte cap then bounds the group's cache, all ranks
    together, and every rank evicts the same entries.
    """

    def __init__(self, max_bytes: int, total: Callable[[int], int] | None = None,
                 disk: DiskTier | None = None) -> None:
        self.max_bytes = max_bytes
        self._total = total
        self.disk = disk if max_bytes > 0 else None
        #: The engine's prefill rate, tokens/s (EWMA of finished requests'), against which a disk load
        #: must be faster; None until one is measured.
        self.prefill_tps: float | None = None
        cap = max(max_bytes, 0) if total is None else 1 << 62  # a group evicts in `_evict`
        self._lru = LRUPromptCache(max_size=MAX_ENTRIES, max_bytes=cap)
        # Empty yet: see the module docstring.
        self._lru._trie = _EvictingTrie(self._evicted) if self.disk is not None else _Trie()
        self._spill_until = 0.0  # while `spill` runs: how long a write may wait for room (monotonic s)
        self.hits = 0
        self.misses = 0
        self.cached_tokens = 0

    @property
    def enabled(self) -> bool:
        return self.max_bytes > 0

    @property
    def nbytes(self) -> int:
        return self._lru.nbytes

    def __len__(self) -> int:
        return len(self._lru)

    def fetch(self, ids: list[int]) -> tuple[list | None, int]:
        """A copy of the cache for the longest cached prefix of `ids`, and its length in tokens.

        The prefix is at most ``len(ids) - 1`` tokens long; one trimmed from a longer entry is at least
        `MIN_PREFIX_TOKENS` long unless it is all of `ids` but the last token; (None, 0) on a miss.
        """
        cache, n = self._fetch(ids) if self.enabled and len(ids) > 1 else (None, 0)
        if self.disk is not None and len(ids) > 1:
            cache, n = self._from_disk(ids, cache, n)
        if n:
            self.hits += 1
            self.cached_tokens += n
        else:
            self.misses += 1
        return cache, n

    def _fetch(self, ids: list[int]) -> tuple[list | None, int]:
        # What `fetch_nearest_cache` would serve, as far as the floor can matter: a prompt that shares its
        # first `MIN_PREFIX_TOKENS` tokens with an entry is served as mlx-lm serves it.
        shorter = self._lru._trie.below_floor(_MODEL_KEY, ids[: min(MIN_PREFIX_TOKENS, len(ids) - 1)])
        if shorter is not None:
            # The nearest entry shares only the prompt's first few tokens: not trimmed back to them.
            if not shorter:
                return None, 0
            cache, _ = self._lru.fetch_nearest_cache(_MODEL_KEY, ids[:shorter])
            return cache, shorter
        cache, rest = self._lru.fetch_nearest_cache(_MODEL_KEY, ids)
        if cache is None:
            return None, 0
        if rest:
            return cache, len(ids) - len(rest)
        # The whole prompt is cached: step back one token, by trimming or to a shorter entry.
        if can_trim_prompt_cache(cache):
            trim_prompt_cache(cache, 1)
            return cache, len(ids) - 1
        cache, rest = self._lru.fetch_nearest_cache(_MODEL_KEY, ids[:-1])
        return (cache, len(ids) - 1 - len(rest)) if cache is not None else (None, 0)

    def _from_disk(self, ids: list[int], cache: list | None, n: int) -> tuple[list | None, int]:
        """The disk tier's prefix of `ids` where it is longer than memory's `n` tokens and reading it
        beats prefilling the difference; it joins the memory tier too."""
        while True:  # an entry that does not load is removed: the next longest may
            found = self.disk.find(ids, n)
            if found is None or not self.disk.worth_loading(found.entry, found.tokens - n, self.prefill_tps):
                return cache, n
            loaded = self.disk.load(found, ids)
            if loaded is not None:
                break
        self.disk.hits += 1
        kept = copy.deepcopy(loaded)  # the batch extends the returned copy in place
        self._lru.insert_cache(_MODEL_KEY, list(ids[: found.tokens]), kept, cache_type="user")
        return loaded, found.tokens

    def warm(self, max_bytes: int) -> Iterator[None]:
        """A generator that reads the disk tier's most recently used entries into the memory tier,
        newest first, at most `max_bytes` of them (and never past the memory tier's cap), yielding
        between any two layers' reads: the MLX thread runs it while idle and serves a request between
        two steps. An entry that a request loaded meanwhile is not added twice."""
        if self.disk is None or max_bytes <= 0:
            return
        for entry in self.disk.newest(min(max_bytes, self.max_bytes)):
            if not self._room_to_warm(entry.nbytes) or entry.digest in self.disk.loaded:
                continue  # requests have filled the memory tier meanwhile (theirs come first), or loaded it
            got = yield from self.disk.read_in_steps(entry)
            if got is None or entry.digest in self.disk.loaded:  # not loadable, or a request loaded it
                continue
            cache, tokens = got
            if not self._room_to_warm(sum(c.nbytes for c in cache)):
                continue
            self._lru.insert_cache(_MODEL_KEY, list(tokens), cache, cache_type="user")
            self.disk.warmed += 1

    def _room_to_warm(self, nbytes: int) -> bool:
        """Whether a warmed entry of `nbytes` fits beside what is kept, evicting nothing (bytes, count)."""
        return self.nbytes + nbytes <= self.max_bytes and len(self._lru) < MAX_ENTRIES

    def _evicted(self, tokens: list[int], entry: LRUPromptCache.CacheEntry) -> None:
        """The memory tier dropped `entry`: to disk, if it is not there yet (`DiskTier.put` knows)."""
        self.disk.put(tokens, entry.prompt_cache, evicted=True, wait_until=self._spill_until)

    def note_prefill(self, tokens: int, tokens_per_s: float) -> None:
        """A request prefilled `tokens` at `tokens_per_s`: the rate a disk load is weighed against."""
        if tokens >= 64 and tokens_per_s > 0:
            rate = self.prefill_tps
            self.prefill_tps = tokens_per_s if rate is None else 0.8 * rate + 0.2 * tokens_per_s

    def insert(self, tokens: list[int], cache: list, kind: str = "assistant") -> None:
        """Keep a copy of `cache` (`owned`: evaluated, a recurrent state's arrays its own), which holds
        exactly `tokens`; evict to stay under the byte cap.

        kind: "system", "user" or "assistant": under pressure `LRUPromptCache`
        evicts assistant entries first and system prompts last.
        """
        if self.enabled and tokens and cache:
            try:
                cache = owned(cache)
            except Exception as exc:  # a prefix kept is a gain, not a need: this one is skipped
                if self._total is not None or not out_of_memory(exc):
                    raise  # (a group's ranks must keep the same entries)
                relieve(exc, mx.clear_cache, kept_bytes=0,
                        what="a prefix was not kept; MLX's cached buffers were dropped")
                return
            self._lru.insert_cache(_MODEL_KEY, list(tokens), cache, cache_type=kind)
            if self._total is not None:
                self._evict(self._total)
            if self.disk is not None:
                self.disk.put(tokens, cache)

    def _evict(self, total: Callable[[int], int]) -> None:
        """Evict least-recently-used entries, the same on every rank, until the group's bytes fit."""
        while len(self._lru) and total(self._lru.nbytes) > self.max_bytes:
            self._lru.trim_to(n_sequences=len(self._lru) - 1)

    def clear(self) -> None:
        """Drop every entry (memory pressure, `Engine.clear_cache`): those not on disk are not written,
        as a write would first copy them."""
        trie = self._lru._trie
        muted = isinstance(trie, _EvictingTrie)
        if muted:
            trie.muted = True
        try:
            self._lru.trim_to(n_sequences=0)
        finally:
            if muted:
                trie.muted = False

    def spill(self, timeout: float) -> None:
        """The worker is stopping (an unload, a shutdown): every entry not on disk yet is queued to be
        written, as if evicted, waiting for room in the write queue at most `timeout` s in all; the
        disk tier's close then flushes."""
        if self.disk is not None:
            self._spill_until = time.monotonic() + timeout
            try:
                self._lru.trim_to(n_sequences=0)
            finally:
                self._spill_until = 0.0

    def report(self, report: EngineReport) -> EngineReport:
        report.prompt_cache_bytes = self.nbytes
        report.prompt_cache_cap_bytes = self.max_bytes
        report.prompt_cache_entries = len(self)
        report.prompt_cache_hits = self.hits
        report.prompt_cache_misses = self.misses
        report.cached_tokens_total = self.cached_tokens
        if self.disk is not None:
            d = self.disk
            report.disk_cache = DiskCacheReport(nbytes=d.nbytes, cap_bytes=d.max_bytes, entries=len(d),
                                                hits=d.hits, writes=d.writes, removed=d.removed,
                                                skipped=d.skipped, evicted_writes=d.evicted_writes,
                                                lost=d.lost, warmed=d.warmed)
        return report
