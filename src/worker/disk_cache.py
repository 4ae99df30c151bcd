"""The prefix cache's disk tier: KV caches of prompt prefixes in files that outlive eviction, unloads,
restarts and crashes, shared by every worker of the model and the next process.

::

    DIR/<model identity>/<tokens>-<sha256 of the token ids>.safetensors

- The identity (`model_identity`) hashes what makes a cache valid: the weights (config.json and
  the weight files' names, sizes and times), the adapter, the KV-cache options and the chat
  template. A cache made by another model or other options lives under another identity and is
  never looked at.
- An entry is written by mlx-lm's `save_prompt_cache` (every cache kind: `KVCache`, rotating,
  `ArraysCache`, quantized; the checkpoints the engine keeps for caches that cannot be trimmed are
  entries like any other), its token ids and identity in the file's metadata. It is written in
  the background, never on a decode step, to a temporary name and renamed into place: a crash
  mid-write leaves nothing that loads, and two workers writing the same prefix leave one entry.
- What is written: every prefix the memory tier keeps, as it keeps it (so a crash loses little),
  but for one that a slightly longer entry, written or queued, covers where caches can be trimmed
  (`COVER_RATIO`: a system prompt's checkpoint under its chat's first prompt is one file, not two),
  while the writer keeps up; past the write queue's bounds the newest is left in memory, and is
  written when it leaves memory (`put(evicted=True)`: evicted, superseded by a longer entry, or the
  worker stopping), ahead of waiting write-throughs, which make room for it. Lost are only prefixes
  evicted while the queue is full of other evicted ones (`lost`), and those dropped under memory
  pressure (`PrefixCache.clear`), which a copy to write would not relieve.
- The index is the directory listing (the length and digest are in the name): a lookup hashes the
  prompt's prefixes at the lengths the index holds, in one pass, and a miss reads the listing
  again at most every `RESCAN_S` (other workers' entries).
- Where every layer's cache can be trimmed (`KVCache`, quantized), an entry that the prompt does not
  begin serves the part they share, trimmed back to it, as the memory tier does: a chat's first
  prompt ends in the generation prompt, which its next turn replaces with the reply, so without this
  only the system prompt's checkpoint would serve that turn. Such a lookup compares the token ids in
  the entries' file headers (read once per entry) with the prompt.
- Loading checks the metadata (identity, token ids) and the cache's kinds and length against the
  model; a truncated or corrupt entry, one from another model, one of the wrong kind or length is
  removed with a warning, never used.
- Least-recently-used within the byte budget (a load touches the file's time).
- Warming: a worker that has just started (a restart, a crash's replacement, a reload) and is idle
  reads the most recently used entries back into its memory tier, newest first, up to a byte budget
  (`PrefixCache.warm`), one layer's arrays at a time, so that a request arriving meanwhile waits for
  one layer's read at most; a chat's next turn after a restart then finds its prefix in memory.
- A prefix is loaded only where that is faster than prefilling it (`worth_loading`: the bytes at
  the disk's measured read rate against the tokens at the engine's measured prefill rate). Until a
  load has been timed, a prefix is loaded: the first load measures the disk.
- A directory that cannot be written, or a full disk, turns the tier off with one warning; serving
  goes on from memory.

Written by hand: mlx-lm's `LRUPromptCache` is memory-only, and the peers' disk caches are
their servers' own code.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import threading
import time
from array import array
from collections import deque
from collections.abc import Generator
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import numpy as np
import structlog
from mlx.utils import tree_map
from mlx_lm.models import cache as mlx_cache
from mlx_lm.models.cache import can_trim_prompt_cache, load_prompt_cache, save_prompt_cache, trim_prompt_cache

log = structlog.get_logger("mlxrt.worker")

SUFFIX = ".safetensors"
TOKENS_KEY = "mlxrt_tokens"  # no dot: mlx-lm flattens metadata keys on dots
IDENTITY_KEY = "mlxrt_identity"
#: A miss reads the directory again at most this often (s): entries other workers wrote meanwhile.
RESCAN_S = 2.0
#: Prefixes shorter than this are not written: prefilling them costs less than a file.
MIN_TOKENS = 32
#: Entries queued for writing at most, and their bytes at most (snapshots held outside the memory
#: tier's cap): past either, a new write-through is refused (`put`; it is written at its eviction).
MAX_QUEUED_WRITES = 8
MAX_QUEUED_BYTES = 4 << 30
#: At shutdown, queued writes get this long (s) to land: under the worker's MLXRT_SHUTDOWN_TIMEOUT_S.
DEFAULT_FLUSH_S = 5.0
#: A temporary file this old (s) is a write that a killed process left behind: removed at a scan.
STALE_TMP_S = 600.0


#: A lone sequence's KV cache may be quantized (--kv-bits): it stands where the model's `KVCache` does.
_QUANTIZED_AS = {"QuantizedKVCache": "KVCache"}
#: Cache kinds that can always be trimmed back (a rotating one only until it rotates: not counted).
_TRIMMABLE = {"KVCache"}
#: Where caches can be trimmed, a prefix is not written while an entry at most this many times its
#: length begins with it (written, being written or queued): that entry serves it, trimmed back, for
#: a read that much larger; a queued shorter one it covers is withdrawn (`put`).
COVER_RATIO = 1.25
#: A file header larger than this (bytes) is not read for its token ids: not an entry of ours.
_MAX_HEADER = 64 << 20


@dataclass
class Entry:
    tokens: int
    digest: str
    path: Path
    nbytes: int
    used: float
    #: Written or loaded by this process: known whole. An entry found on disk is rewritten when this
    #: process keeps the same prefix (it may be a torn or foreign file).
    verified: bool = False
    #: Its token ids, once known (written here, or read from its header by `shared`); an empty array
    #: where the header would not read.
    ids: np.ndarray | None = None

    def shared(self, prompt: np.ndarray) -> int:
        """How many leading ids of `prompt` this entry holds (its header read the first time)."""
        if self.ids is None:
            self.ids = _header_ids(self.path)
        return _shared(self.ids, prompt)


@dataclass
class Found:
    """A lookup's answer: `entry` serves the prompt's first `tokens` (fewer than the entry holds
    where it is trimmed back to what the two share)."""

    entry: Entry
    tokens: int


@dataclass
class _Write:
    """A prefix waiting to be written: its ids, digest, snapshot, bytes, and whether the memory tier
    had evicted it (then it goes ahead of write-throughs: `DiskTier._room`)."""

    tokens: list[int]
    digest: str
    cache: list
    nbytes: int
    evicted: bool


def model_identity(path: str, extra: dict[str, object]) -> str:
    """A digest of what makes a cache valid for this model: its config and weight files (names, sizes,
    times) and `extra` (adapter, KV options, chat template...)."""
    root = Path(path)
    h = hashlib.sha256()
    try:
        h.update((root / "config.json").read_bytes())
        for f in sorted(root.glob("*.safetensors")):
            st = f.stat()
            h.update(f"{f.name}:{st.st_size}:{st.st_mtime_ns}".encode())
    except OSError:
        h.update(str(root.resolve()).encode())
    h.update(json.dumps(extra, sort_keys=True, default=str).encode())
    return h.hexdigest()[:32]


def flush_timeout() -> float:
    """How long a stopping worker gives its writes to land, s: MLXRT_DISK_CACHE_FLUSH_S, else 5."""
    return float(os.environ.get("MLXRT_DISK_CACHE_FLUSH_S") or DEFAULT_FLUSH_S)


def _contiguous(x: object) -> object:
    return mx.contiguous(x) if isinstance(x, mx.array) else x


def _unlink(path: Path) -> None:
    """Remove `path` if it is there; a directory gone meanwhile is no error."""
    try:
        path.unlink(missing_ok=True)
    except OSError:
        pass


def _digest(ids: list[int]) -> str:
    return _digests(ids, [len(ids)])[len(ids)]


def _stored_ids(text: object) -> list[int] | None:
    """The token ids an entry's metadata holds (JSON text), or None where it holds no list of ids."""
    try:
        ids = json.loads(text)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return None
    return ids if isinstance(ids, list) and all(type(t) is int for t in ids) else None


def _header_ids(path: Path) -> np.ndarray:
    """The token ids in an entry file's safetensors header, without reading its tensors; empty if the
    header does not read or holds no list of ids (a foreign or damaged file is no entry to share with)."""
    try:
        with open(path, "rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            if size > _MAX_HEADER:
                return np.zeros(0, np.int64)
            meta = json.loads(f.read(size)).get("__metadata__") or {}
        ids = _stored_ids(next((v for k, v in meta.items() if k.rpartition(".")[2] == TOKENS_KEY), None))
        return np.asarray(ids or [], dtype=np.int64)
    except Exception:  # unreadable, not JSON, ids past int64, a header of another shape
        return np.zeros(0, np.int64)


def _covers(longer: list[int], tokens: list[int]) -> bool:
    """Whether `longer` begins with `tokens` and is at most `COVER_RATIO` times as long."""
    return len(tokens) < len(longer) <= COVER_RATIO * len(tokens) and longer[: len(tokens)] == tokens


def _shared(a: np.ndarray, b: np.ndarray) -> int:
    """How many leading ids `a` and `b` share."""
    n = min(len(a), len(b))
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if len(differ) else n


def _digests(ids: list[int], lengths: list[int]) -> dict[int, str]:
    """The digest of ``ids[:n]`` for each n of `lengths`, hashing `ids` once (a running hash copied at
    each length)."""
    data = array("q", ids).tobytes()
    h, at, out = hashlib.sha256(), 0, {}
    for n in sorted(lengths):
        h.update(data[at * 8 : n * 8])
        at = n
        out[n] = h.copy().hexdigest()[:40]
    return out


class DiskTier:
    """The disk tier of one model's prefix cache (see the module docstring).

    `kinds`: the class names of a fresh cache of the model, which a loaded one must match.
    """

    def __init__(self, root: str, identity: str, max_bytes: int, *, kinds: list[str]) -> None:
        self.dir = Path(root) / identity
        self.identity = identity
        self.max_bytes = max_bytes
        self.kinds = kinds
        self.enabled = max_bytes > 0 and all(hasattr(mlx_cache, k) for k in kinds)
        #: Whether an entry may serve a prompt it does not begin, trimmed back (`find`).
        self.trimmable = bool(kinds) and set(kinds) <= _TRIMMABLE
        self.hits = self.loads = self.writes = self.removed = 0
        #: The disk's read rate as loads measured it (bytes/s); None until one has.
        self.read_bps: float | None = None
        self._entries: dict[str, Entry] = {}
        self._lock = threading.Lock()
        self._scanned = 0.0
        #: Writes waiting, oldest first, and how many are being written (0 or 1); `_lock` guards both.
        self._waiting: deque[_Write] = deque()
        self._writing = 0
        self._writing_digest = ""
        self._writing_tokens: list[int] = []
        self._changed = threading.Condition(self._lock)
        self._stop = False
        #: Write-throughs refused or withdrawn while the writer was behind (the queue's bounds): those
        #: prefixes stay in memory, and are written when it evicts them.
        self.skipped = 0
        #: Evicted prefixes refused, the queue being full of other evicted ones: gone from both tiers.
        self.lost = 0
        #: Prefixes written as the memory tier evicted them.
        self.evicted_writes = 0
        #: Entries read back into the memory tier by warming (`PrefixCache.warm`).
        self.warmed = 0
        #: Digests of the entries requests' lookups have loaded (warming skips them).
        self.loaded: set[str] = set()
        self._thread: threading.Thread | None = None
        if not self.enabled:
            if max_bytes > 0:
                log.warning("disk_cache.off", reason=f"cache kinds {kinds} cannot be saved by mlx-lm")
            return
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            probe = self.dir / f".probe-{os.getpid()}"
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as exc:
            self._off(f"cannot write {self.dir}: {exc}")
            return
        self._scan()
        self._thread = threading.Thread(target=self._write_loop, name="mlxrt-disk-cache", daemon=True)
        self._thread.start()

    # -- lookups (MLX thread) --------------------------------------------------
    @property
    def nbytes(self) -> int:
        with self._lock:
            return sum(e.nbytes for e in self._entries.values())

    def __len__(self) -> int:
        return len(self._entries)

    def find(self, ids: list[int], longer_than: int) -> Found | None:
        """The entry that serves the most of `ids`, leaving at least one token to prefill, and more
        than `longer_than` tokens: the longest entry that begins `ids`, or, where the caches can be
        trimmed, one that shares more of them; None if there is none."""
        if not self.enabled or len(ids) - 1 <= max(longer_than, MIN_TOKENS - 1):
            return None
        found = self._best(ids, longer_than)
        if found is None and time.monotonic() - self._scanned > RESCAN_S:
            self._scan()
            found = self._best(ids, longer_than)
        return found

    def _best(self, ids: list[int], longer_than: int) -> Found | None:
        exact = self._longest(ids, longer_than)
        best = Found(exact, exact.tokens) if exact is not None else None
        if self.trimmable:
            trimmed = self._trimmed(ids, best.tokens if best else longer_than)
            if trimmed is not None:
                best = trimmed
        return best

    def _trimmed(self, ids: list[int], longer_than: int) -> Found | None:
        """The entry sharing the most of `ids` (more than `longer_than` tokens, one left to prefill) that
        `ids` does not begin, to be trimmed back to what they share; None if none shares more."""
        with self._lock:
            candidates = [e for e in self._entries.values() if e.tokens > longer_than + 1]
        prompt = np.asarray(ids, dtype=np.int64)
        best: Found | None = None
        for e in candidates:
            n = min(e.shared(prompt), len(ids) - 1)
            if n < e.tokens and n > max(longer_than, MIN_TOKENS - 1) and (best is None or n > best.tokens):
                best = Found(e, n)
        return best

    def _longest(self, ids: list[int], longer_than: int) -> Entry | None:
        with self._lock:
            by_length: dict[int, list[Entry]] = {}
            for e in self._entries.values():
                if longer_than < e.tokens < len(ids):
                    by_length.setdefault(e.tokens, []).append(e)
        digests = _digests(ids, list(by_length))
        for n in sorted(by_length, reverse=True):
            match = next((e for e in by_length[n] if e.digest == digests[n]), None)
            if match is not None:
                return match
        return None

    def worth_loading(self, entry: Entry, gain_tokens: int, prefill_tps: float | None) -> bool:
        """Whether reading `entry` is faster than prefilling the `gain_tokens` it saves, at the disk's and
        the engine's measured rates; either unmeasured: load (an assumed read rate that says no would
        never be measured: an H200 prefilling 6k tokens/s never loaded an 8k-token prefix so)."""
        if not prefill_tps or not self.read_bps:
            return True
        return entry.nbytes / self.read_bps < gain_tokens / prefill_tps

    def load(self, found: Found, ids: list[int]) -> list | None:
        """The cache of `found`'s entry, checked against `ids` and the model, holding `found.tokens`
        (trimmed back where the entry holds more); None (the entry removed, with a warning) if it does
        not load or does not fit."""
        entry = found.entry
        t0 = time.perf_counter()
        try:
            cache, meta = load_prompt_cache(str(entry.path), return_metadata=True)
            mx.eval([c.state for c in cache])
        except Exception as exc:
            self._unreadable(entry, exc)
            return None
        problem = self._problem(cache, meta, entry, ids[: found.tokens])
        if problem:
            self._remove(entry, problem)
            return None
        if found.tokens < entry.tokens:
            if not can_trim_prompt_cache(cache):  # not as `kinds` said: trimmed lookups end here
                log.warning("disk_cache.untrimmable", path=str(entry.path), kinds=self.kinds)
                self.trimmable = False
                return None
            trim_prompt_cache(cache, entry.tokens - found.tokens)
        seconds = time.perf_counter() - t0
        if seconds > 0:
            rate = entry.nbytes / seconds
            self.read_bps = rate if self.read_bps is None else 0.5 * self.read_bps + 0.5 * rate
        entry.used, entry.verified = time.time(), True
        self.loaded.add(entry.digest)
        try:
            os.utime(entry.path)
        except OSError:
            pass
        self.loads += 1
        return cache

    def newest(self, max_bytes: int) -> list[Entry]:
        """The most recently used entries, newest first, as many as fit in `max_bytes` together."""
        if not self.enabled:
            return []
        self._scan()
        with self._lock:
            entries = sorted(self._entries.values(), key=lambda e: -e.used)
        chosen, total = [], 0
        for e in entries:
            if total + e.nbytes <= max_bytes:
                chosen.append(e)
                total += e.nbytes
        return chosen

    def read_in_steps(self, entry: Entry) -> Generator[None, None, tuple[list, list[int]] | None]:
        """A generator that reads `entry`'s cache one layer at a time, yielding between layers (MLX's
        load is lazy: each layer's arrays are read as they are evaluated), and returns the cache and
        its token ids, checked as `load` checks them, or None (removed with a warning where it does not
        load or fit; a miss where another worker evicted it meanwhile)."""
        try:
            cache, meta = load_prompt_cache(str(entry.path), return_metadata=True)
            for c in cache:
                mx.eval(c.state)
                yield
        except Exception as exc:
            self._unreadable(entry, exc)
            return None
        problem = self._problem(cache, meta, entry, [])
        if problem:
            self._remove(entry, problem)
            return None
        entry.verified = True
        return cache, _stored_ids(meta.get(TOKENS_KEY))

    def _unreadable(self, entry: Entry, exc: Exception) -> None:
        """`entry` did not load: gone meanwhile (another worker evicted it) is a miss; anything else
        (truncated, corrupt, not a cache file at all) removes it with a warning."""
        if isinstance(exc, FileNotFoundError):
            with self._lock:
                self._entries.pop(entry.digest, None)
        else:
            self._remove(entry, f"does not load: {type(exc).__name__}: {exc}")

    def _problem(self, cache: list, meta: dict, entry: Entry, shared: list[int]) -> str | None:
        """Why a loaded `entry`, whose ids should begin with `shared`, must not be used."""
        if meta.get(IDENTITY_KEY) != self.identity:
            return "made by another model or other options"
        saved = _stored_ids(meta.get(TOKENS_KEY))
        length = entry.tokens
        if saved is None or len(saved) != length or _digest(saved) != entry.digest \
                or saved[: len(shared)] != shared:
            return "its token ids are not the prefix its name says"
        kinds = [type(c).__name__ for c in cache]
        if [_QUANTIZED_AS.get(k, k) for k in kinds] != self.kinds:
            return f"its cache kinds {kinds} are not the model's {self.kinds}"
        offsets = {getattr(c, "offset", length) for c in cache}
        if offsets != {length}:
            return f"its caches hold {sorted(offsets)} tokens, not {length}"
        return None

    # -- writes (background) ---------------------------------------------------
    def put(self, tokens: list[int], cache: list, *, evicted: bool = False, wait_until: float = 0.0) -> None:
        """Queue `cache` (holding exactly `tokens`) to be written; `evicted`: the memory tier has just
        dropped it, so the disk is its only home. Called on the MLX thread, which takes an evaluated,
        contiguous snapshot of its arrays, so the writer thread runs no MLX operation: it only
        serializes memory. With no room, waits for some until `wait_until` (monotonic s; a worker
        stopping), else refuses. A failure here turns the tier off, never fails a request."""
        if not self.enabled or len(tokens) < MIN_TOKENS:
            return
        tokens = list(tokens)
        try:
            digest = _digest(tokens)
            size = sum(c.nbytes for c in cache)
            with self._lock:
                known = self._entries.get(digest)
                if (known is not None and known.verified) or digest == self._writing_digest:
                    return
                waiting = next((w for w in self._waiting if w.digest == digest), None)
                if waiting is not None:  # already queued: if evicted meanwhile, it may not be withdrawn
                    waiting.evicted = waiting.evicted or evicted
                    return
            if self.trimmable and self._covered(tokens):
                return
            with self._lock:
                while not self._room(size, evicted) and time.monotonic() < wait_until:
                    self._changed.wait(wait_until - time.monotonic())
                if not self._room(size, evicted):
                    if evicted:
                        self.lost += 1
                    else:
                        self.skipped += 1
                    return
            snapshot = [type(c).from_state(tree_map(_contiguous, c.state)) for c in cache]
            mx.eval([c.state for c in snapshot])
            nbytes = sum(c.nbytes for c in snapshot)
        except Exception as exc:  # a cache kind whose state does not round-trip, say
            self._off(f"cannot snapshot a cache to write: {type(exc).__name__}: {exc}")
            return
        with self._lock:
            if self.trimmable:  # queued shorter prefixes this one covers: written as part of it
                for w in [w for w in self._waiting if _covers(tokens, w.tokens)]:
                    self._waiting.remove(w)
                    evicted = evicted or w.evicted  # its only home now: it may not be withdrawn
            self._waiting.append(_Write(list(tokens), digest, snapshot, nbytes, evicted))
            self._changed.notify_all()

    def _covered(self, tokens: list[int]) -> bool:
        """Whether an entry written, being written or queued covers `tokens` (`COVER_RATIO`)."""
        with self._lock:
            queued = [self._writing_tokens, *(w.tokens for w in self._waiting)]
            entries = [e for e in self._entries.values()
                       if len(tokens) < e.tokens <= COVER_RATIO * len(tokens)]
        if any(_covers(q, tokens) for q in queued):
            return True
        prompt = np.asarray(tokens, dtype=np.int64)
        return any(e.shared(prompt) == len(tokens) for e in entries)

    def _room(self, size: int, evicted: bool) -> bool:
        """Whether a write of `size` bytes may wait now. Past the queue's bounds (the writer is behind) a
        write-through is refused: the newest is the prefix the memory tier keeps longest. An evicted
        prefix withdraws waiting write-throughs, newest first, as few as make room (they are still in
        memory, to be written at their own eviction), and none where all of them would not. Lock held;
        `put` runs on the MLX thread alone, so the room found is there when its write is queued."""
        def fits(waiting: list[_Write]) -> bool:
            return not waiting or (len(waiting) < MAX_QUEUED_WRITES
                                   and sum(w.nbytes for w in waiting) + size <= MAX_QUEUED_BYTES)

        if fits(list(self._waiting)):
            return True
        if not evicted or not fits([w for w in self._waiting if w.evicted]):
            return False
        for w in reversed(list(self._waiting)):
            if not w.evicted:
                self._waiting.remove(w)
                self.skipped += 1
                if fits(list(self._waiting)):
                    break
        return True

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until the queued writes are on disk (tests, shutdown), at most `timeout` s (default
        MLXRT_DISK_CACHE_FLUSH_S, else 5); False, with a warning naming the knob, if they did not land."""
        if timeout is None:
            timeout = flush_timeout()
        deadline = time.monotonic() + timeout
        with self._lock:
            while self._thread is not None and self._pending() and time.monotonic() < deadline:
                self._changed.wait(max(0.0, deadline - time.monotonic()))
            left = self._pending() if self._thread is not None else 0
        if left:
            log.warning("disk_cache.flush_timeout", queued=left, timeout_s=timeout,
                        hint="queued prefixes were not written (set MLXRT_DISK_CACHE_FLUSH_S)")
        return not left

    def _pending(self) -> int:
        """Writes waiting or under way. Lock held."""
        return len(self._waiting) + self._writing

    def _write_loop(self) -> None:
        while True:
            with self._lock:
                while not self._waiting and not self._stop:
                    self._changed.wait()
                if not self._waiting:
                    return
                w = self._waiting.popleft()
                self._writing, self._writing_digest, self._writing_tokens = 1, w.digest, w.tokens
            try:
                if self.enabled and self._write(w.tokens, w.digest, w.cache) and w.evicted:
                    self.evicted_writes += 1
            finally:
                with self._lock:
                    self._writing, self._writing_digest, self._writing_tokens = 0, "", []
                    self._changed.notify_all()

    def _write(self, tokens: list[int], digest: str, cache: list) -> bool:
        final = self.dir / f"{len(tokens)}-{digest}{SUFFIX}"
        tmp = self.dir / f".tmp-{os.getpid()}-{threading.get_ident()}-{digest}{SUFFIX}"
        try:
            save_prompt_cache(str(tmp), cache, {TOKENS_KEY: json.dumps(tokens), IDENTITY_KEY: self.identity})
            with open(tmp, "rb+") as f:
                os.fsync(f.fileno())  # on disk before it has its name: a power cut leaves no torn entry
            os.replace(tmp, final)  # atomic: readers see the whole file or none
            nbytes = final.stat().st_size
        except Exception as exc:  # a full disk, a directory taken away: off, serving goes on
            _unlink(tmp)
            self._off(f"cannot write {final}: {type(exc).__name__}: {exc}")
            return False
        with self._lock:
            self._entries[digest] = Entry(len(tokens), digest, final, nbytes, time.time(), verified=True,
                                          ids=np.asarray(tokens, dtype=np.int64) if self.trimmable else None)
        self.writes += 1
        self._evict()
        return True

    def _evict(self) -> None:
        """Remove least-recently-used entries until the tier fits its byte budget."""
        with self._lock:
            entries = sorted(self._entries.values(), key=lambda e: e.used)
            total = sum(e.nbytes for e in entries)
            victims = []
            while entries and total > self.max_bytes:
                e = entries.pop(0)
                total -= e.nbytes
                victims.append(e)
                del self._entries[e.digest]
        for e in victims:
            _unlink(e.path)

    # -- the index ---------------------------------------------------------------
    def _scan(self) -> None:
        """Read the directory: every entry, by the length and digest in its name."""
        found: dict[str, Entry] = {}
        now = time.time()
        try:
            with os.scandir(self.dir) as it:
                for f in it:
                    name = f.name
                    try:
                        st = f.stat()
                    except FileNotFoundError:  # removed meanwhile (evicted here or by another worker)
                        continue
                    if name.startswith(".tmp-") and now - st.st_mtime > STALE_TMP_S:
                        _unlink(Path(f.path))  # a write its process never finished (killed mid-write)
                        continue
                    if name.startswith(".") or not name.endswith(SUFFIX):
                        continue
                    length, _, digest = name[: -len(SUFFIX)].partition("-")
                    if not length.isdigit() or not digest:
                        continue
                    found[digest] = Entry(int(length), digest, Path(f.path), st.st_size, st.st_mtime)
        except OSError as exc:
            self._off(f"cannot read {self.dir}: {exc}")
            return
        with self._lock:
            for digest, e in found.items():
                known = self._entries.get(digest)
                if known is not None and known.nbytes == e.nbytes:
                    e.verified, e.ids = known.verified, known.ids
            self._entries = found
        self._scanned = time.monotonic()

    def _remove(self, entry: Entry, why: str) -> None:
        log.warning("disk_cache.entry_removed", path=str(entry.path), reason=why)
        self.removed += 1
        with self._lock:
            self._entries.pop(entry.digest, None)
        _unlink(entry.path)

    def _off(self, why: str) -> None:
        if self.enabled:
            log.warning("disk_cache.off", reason=why, hint="serving goes on from memory")
        self.enabled = False

    def close(self, timeout: float | None = None) -> None:
        """Write what is queued (at most `timeout` s, as `flush`), then stop the writer."""
        if self._thread is not None:
            self.flush(timeout)
            with self._lock:
                self._stop = True
                self._waiting.clear()  # what the flush left: dropped, as the process is going
                self._changed.notify_all()
            self._thread.join(timeout=5)
            self._thread = None
