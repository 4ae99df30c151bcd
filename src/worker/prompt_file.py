"""Prompt-cache files: a prompt's KV cache saved to disk, loaded into a worker's prefix cache at start.

``mlxrt cache-prompt`` (like ``mlx_lm.cache_prompt``) prefills a prompt with
the model and writes its cache with mlx-lm's `save_prompt_cache`, recording
the prompt's token ids in the file's metadata (``mlxrt_tokens``): the prefix
cache finds entries by token ids. A worker given the file
(``--prompt-cache-file``) loads it with `load_prompt_cache`, checks that it
fits the model, and keeps it as a "system" entry of its prefix cache (evicted
last), put back whenever the prefix cache is emptied. So an app can ship a
long system prompt already prefilled: every chat that starts with it starts
from the file.

Two kinds of prompt:

- a chat's system prompt (``--system``): the tokens the chat template puts
  before the first user message, which every chat with that system prompt
  begins with (the same boundary the engine keeps a checkpoint at);
- raw text (``--prompt``): its tokens as a raw prompt is tokenized; a later
  raw prompt hits when its tokens begin with them (end the text at a word
  boundary, or the tokenizer may merge across it).
"""

from __future__ import annotations

import copy
import json
from typing import TYPE_CHECKING

import mlx.core as mx
from mlx_lm.models.cache import load_prompt_cache, save_prompt_cache

from ..ipc.protocol import ChatMessage, Generate, SamplingParams
from .kvcache import make_cache

if TYPE_CHECKING:
    from .engine import Engine

#: The metadata key holding the prompt's token ids, as JSON.
TOKENS_KEY = "mlxrt_tokens"  # no dot: mlx-lm flattens metadata keys on dots


def prompt_tokens(engine: Engine, *, prompt: str | None = None, system: str | None = None) -> list[int]:
    """The token ids to cache: raw `prompt` as the engine tokenizes it, or the head of any chat whose
    system prompt is `system`."""
    if (prompt is None) == (system is None):
        raise ValueError("give a prompt or a system prompt, not both")
    if prompt is not None:
        return engine.prompt_ids(Generate(id=0, prompt=prompt, params=SamplingParams()))
    req = Generate(id=0, params=SamplingParams(),
                   messages=[ChatMessage("system", system or ""), ChatMessage("user", "Hello.")])
    ids = engine.prompt_ids(req)
    end = engine.system_end(req, ids)
    if not end:
        raise ValueError("this model's chat template puts nothing of the system prompt before the user's "
                         "turn")
    return ids[:end]


def save_prompt_file(engine: Engine, out: str, ids: list[int]) -> int:
    """Prefill `ids` (in chunks of the engine's prefill step) and save their cache at `out`; bytes."""
    cache = make_cache(engine.model, engine.options.max_kv_size)
    step = engine.prefill.solo  # the options' step, within what the backend takes in one call
    for start in range(0, len(ids), step):
        engine.model(mx.array(ids[start : start + step])[None], cache=cache)
        mx.eval([c.state for c in cache])
    save_prompt_cache(out, cache, {TOKENS_KEY: json.dumps(ids), "model": engine.path})
    return sum(c.nbytes for c in cache)


def load_prompt_file(engine: Engine, path: str) -> tuple[list[int], list]:
    """The tokens and cache saved at `path`, checked to fit `engine`'s model; `ValueError` otherwise."""
    try:
        cache, meta = load_prompt_cache(path, return_metadata=True)
    except Exception as exc:
        raise ValueError(f"invalid prompt_cache_file={path!r}: not a prompt-cache file: {exc}") from None
    if TOKENS_KEY not in meta:
        raise ValueError(f"invalid prompt_cache_file={path!r}: it records no token ids "
                         "(make it with 'mlxrt cache-prompt')")
    tokens = json.loads(meta[TOKENS_KEY])
    want = [type(c).__name__ for c in make_cache(engine.model, engine.options.max_kv_size)]
    kinds = [type(c).__name__ for c in cache]
    if kinds != want or not tokens:
        raise ValueError(f"invalid prompt_cache_file={path!r}: it holds {len(kinds)} caches "
                         f"({sorted(set(kinds))}), this model has {len(want)} ({sorted(set(want))})")
    try:  # one token through a copy: a cache of another model's shapes fails here
        mx.eval(engine.model(mx.array([[tokens[-1]]]), cache=copy.deepcopy(cache)))
    except Exception as exc:
        raise ValueError(f"invalid prompt_cache_file={path!r}: it does not fit this model: {exc}") from None
    return tokens, cache
