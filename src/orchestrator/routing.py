"""Cache-aware routing: send a request to the worker most likely to hold its prompt's prefix.

Each worker keeps a prefix cache of its own, so with several workers of one
model, where a request goes decides whether its prefix is found. The
orchestrator never tokenizes, so prefixes are judged on the request as sent:
its prompt in a canonical byte form (chat messages as role and content,
prompt ids as bytes, text as UTF-8), cut into blocks of `BLOCK_BYTES`, each
block's key hashing everything up to its end. A table remembers which worker
last served each key. A new request goes to the worker that holds its
deepest key, unless that worker's batch is full (then the least loaded
takes it): a chat's later turns begin with its earlier turns, so they find
the worker that served them, and prompts that share a long system prompt
gather where it is cached.
"""

from __future__ import annotations

import hashlib
import struct
import threading
from collections import OrderedDict
from collections.abc import Sequence

from ..ipc.protocol import Generate
from .supervisor import Slot

BLOCK_BYTES = 256
#: Keys remembered at most (16 bytes each): about 16 MB of prompt text.
MAX_KEYS = 1 << 16


def prompt_bytes(req: Generate) -> bytes:
    """The request's prompt in a form where a longer conversation extends a shorter one."""
    if req.messages is not None:
        parts = (m.role.encode() + b"\0" + m.content.encode("utf-8", "replace") + b"\1" for m in req.messages)
        return b"".join(parts)
    if req.prompt_ids is not None:
        return struct.pack(f"<{len(req.prompt_ids)}I", *req.prompt_ids)
    return (req.prompt or "").encode("utf-8", "replace")


def block_keys(model: str, req: Generate) -> list[bytes]:
    """One key per whole block of the prompt, each covering every block before it."""
    data = prompt_bytes(req)
    h = hashlib.blake2b(model.encode(), digest_size=16).digest()
    keys = []
    for end in range(BLOCK_BYTES, len(data) + 1, BLOCK_BYTES):
        h = hashlib.blake2b(h + data[end - BLOCK_BYTES : end], digest_size=16).digest()
        keys.append(h)
    return keys


class PrefixRouter:
    """Remembers which worker served which prompt prefixes; picks one for a new request."""

    def __init__(self, max_keys: int = MAX_KEYS) -> None:
        self._owner: OrderedDict[bytes, str] = OrderedDict()
        self._max_keys = max_keys
        self._lock = threading.Lock()
        self.affinity_hits = 0

    def choose(self, slots: Sequence[Slot], keys: list[bytes]) -> Slot:
        """The live slot holding the deepest of `keys`, if its batch has room; else the least loaded."""
        by_name = {s.name: s for s in slots}
        with self._lock:
            owner = next((self._owner[k] for k in reversed(keys) if k in self._owner), None)
        slot = by_name.get(owner) if owner is not None else None
        if slot is not None and not slot.saturated:
            self.affinity_hits += 1
            return slot
        return min(slots, key=lambda s: s.routing_key)

    def record(self, slot: Slot, keys: list[bytes]) -> None:
        """`slot` now holds these prefixes (it is about to prefill them)."""
        with self._lock:
            owner = self._owner
            for k in keys:
                owner[k] = slot.name
                owner.move_to_end(k)
            while len(owner) > self._max_keys:
                owner.popitem(last=False)
