"""What the machine allows: how many prompt tokens one prefill call may carry, how big the prefix
cache may grow when no cap is given, and how many sequences the batch may decode together.

MLX's CUDA backend launches its quantized gather matmul (a mixture-of-experts layer's experts) with
one grid row per (token, expert) pair, and CUDA's y and z grid dimensions stop at 65535: one call
with more pairs fails ("cuGraphAddKernelNode ... invalid argument", seen on an H200 with mlx 0.32.4 at
8 prompts x 2048 tokens for Qwen3-30B-A3B and gpt-oss-20b), and the CUDA context is unusable after.
mlx_lm.server fails the same way; Metal and the CPU have no such limit.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
import structlog

from ..ipc.protocol import (
    AUTO_PROMPT_CACHE_SHARE,
    MAX_AUTO_DECODE_CONCURRENCY,
    MAX_AUTO_PROMPT_CACHE_BYTES,
    MIN_AUTO_PROMPT_CACHE_BYTES,
)

log = structlog.get_logger("mlxrt.worker")

CUDA_GRID_LIMIT = 65535
#: A model's experts per token, under the names configs give it.
EXPERTS_PER_TOKEN_KEYS = ("num_experts_per_tok", "experts_per_token", "moe_top_k", "top_k_experts")
#: Taken where a model has mlx-lm's expert layers under a name not known here: the largest common top-k.
UNKNOWN_EXPERTS_PER_TOKEN = 8
#: MLX's `device_info()` keys for the memory it may use: Metal's working set first, then a GPU's memory.
MEMORY_KEYS = ("max_recommended_working_set_size", "memory_size", "total_memory")


def on_cuda() -> bool:
    """Whether MLX runs on its CUDA backend here."""
    cuda = getattr(mx, "cuda", None)
    return cuda is not None and cuda.is_available()


#: How MLX says an allocation failed: CUDA's ``cudaMallocAsync(...) failed: out of memory``, its
#: allocator's ``[malloc] Unable to allocate N bytes.``, Metal's ``Attempting to allocate N bytes which is
#: greater than the maximum allowed buffer size`` (one array too big for a buffer: freeing memory cannot
#: help it, nor harms) and ``Insufficient Memory (...kIOGPUCommandBufferCallbackErrorOutOfMemory)``
#: (reported by users; not seen here), C++'s ``std::bad_alloc`` on the CPU.
OUT_OF_MEMORY = re.compile(r"out of memory|outofmemory|insufficient memory|unable to allocate|"
                           r"attempting to allocate|bad_alloc", re.IGNORECASE)
#: What lowers a text or vision worker's needs, for `relieve`'s warning.
GENERATION_KNOBS = "--decode-concurrency, --prefill-step-size or --prompt-cache-bytes"


def out_of_memory(exc: BaseException) -> bool:
    """Whether `exc` is an allocation that failed (MLX raises these as RuntimeError, by message)."""
    return isinstance(exc, MemoryError) or bool(OUT_OF_MEMORY.search(str(exc)))


def relieve(cause: BaseException, clear: Callable[[], None], *, kept_bytes: int, what: str,
            knobs: str = GENERATION_KNOBS) -> None:
    """An allocation failed (`cause`): `clear` hands back what an engine keeps beyond its requests (its
    prefix or image cache, `kept_bytes`, and MLX's cached buffers), so that the next requests find room.
    `what` says what failed and what was dropped; a prefix the disk tier holds comes back from there. The
    warning's `dropped_bytes` is what the caches held: arrays a running request shares stay in use."""
    kept_bytes += mx.get_cache_memory()
    clear()
    log.warning("engine.out_of_memory", error=repr(cause)[:300], dropped_bytes=int(kept_bytes),
                hint=f"{what}. Lower {knobs}, or free the memory other processes hold beside the worker")


def prefill_token_cap(model: nn.Module, config: dict) -> int | None:
    """The most prompt tokens one forward pass may carry on this backend, or None for no limit:
    on MLX's CUDA backend, `CUDA_GRID_LIMIT` over the experts each token goes to."""
    if not on_cuda():
        return None
    k = next((int(config[n]) for n in EXPERTS_PER_TOKEN_KEYS if isinstance(config.get(n), int)), None)
    if k is None:
        if not any(type(m).__name__ in ("SwitchGLU", "SwitchMLP") for _, m in model.named_modules()):
            return None  # no experts
        k = UNKNOWN_EXPERTS_PER_TOKEN
    return CUDA_GRID_LIMIT // max(1, k)


@dataclass(frozen=True)
class PrefillSteps:
    """Prompt tokens per prefill step of a lone prompt and of a batch, the batch's most prompts, and the
    most tokens one call may carry, padding counted (None: no limit)."""

    solo: int
    batch: int
    batch_prompts: int
    call_tokens: int | None = None


def prefill_steps(step: int, *, prompts: int, cap: int | None, model: str) -> PrefillSteps:
    """`step` tokens a step and `prompts` together, each call within `cap` tokens: mlx-lm prefills
    `prompts` prompts as one batch of that many rows, so the batch's step is cut to fit them (in 64s),
    and where not even 64 tokens a row fit, fewer prompts go together."""
    if cap is None or prompts * step <= cap:
        return PrefillSteps(step, step, prompts, cap)
    asked = prompts
    per_row = cap // prompts
    if per_row < 64:
        prompts, per_row = max(1, cap // 64), 64
    steps = PrefillSteps(min(step, cap), min(step, per_row - per_row % 64), prompts, cap)
    log.warning("worker.prefill_step_capped", model=model, prefill_step_size=step, lone=steps.solo,
                batched=steps.batch, prompts_asked=asked, batch_prompts=prompts,
                tokens_per_call=cap,
                why=f"MLX's CUDA expert matmul takes at most {CUDA_GRID_LIMIT} (token, expert) pairs")
    return steps


def usable_memory() -> int:
    """The memory MLX may use here, bytes: Metal's recommended working set, a GPU's memory, else the
    machine's RAM."""
    import psutil

    info = mx.device_info() if hasattr(mx, "device_info") else {}
    memory = next((int(info[k]) for k in MEMORY_KEYS if isinstance(info.get(k), int) and info[k] > 0), 0)
    return memory or psutil.virtual_memory().total


def auto_prompt_cache_bytes(share: int = 1) -> int:
    """The prefix cache's byte cap when none is given: an eighth of `usable_memory`, 1-64 GiB, split
    evenly between the `share` workers that leave their cap on auto (one orchestrator's)."""
    total = min(usable_memory() // AUTO_PROMPT_CACHE_SHARE, MAX_AUTO_PROMPT_CACHE_BYTES)
    return max(MIN_AUTO_PROMPT_CACHE_BYTES, total) // max(1, share)


def sequence_kv_bytes(model: nn.Module, cache: list, context: int) -> int:
    """The KV-cache bytes one sequence holds at `context` tokens: `cache` (a fresh one of the batch's
    kind) is measured after one token through `model`; a layer that grows with the sequence counts
    its bytes per token times the tokens it keeps (a rotating one keeps its window), others (a
    linear-attention state) their size."""
    model(mx.array([[0]]), cache=cache)
    mx.eval([c.state for c in cache])
    return sum(_layer_kv_bytes(c, context) for c in cache)


def _layer_kv_bytes(c, context: int) -> int:
    inner = getattr(c, "caches", None)  # mlx-lm's CacheList
    if inner is not None:
        return sum(_layer_kv_bytes(x, context) for x in inner)
    keys, values = getattr(c, "keys", None), getattr(c, "values", None)
    if isinstance(keys, mx.array) and isinstance(values, mx.array) and keys.ndim == 4:
        kept = min(context, getattr(c, "max_size", None) or context)
        return (keys.nbytes + values.nbytes) * kept // keys.shape[2]
    return int(c.nbytes)


def auto_decode_concurrency(model: nn.Module, cache: list, context: int, *, share: int, reserved_bytes: int,
                            floor: int) -> int:
    """The decode batch when none is given: as many sequences as the memory MLX may use (this worker's
    `share` of it), less what is loaded and `reserved_bytes` (the prefix cache's cap), holds at its whole
    `context` each (`sequence_kv_bytes`, on `cache`), within [`floor`, `MAX_AUTO_DECODE_CONCURRENCY`]."""
    free = usable_memory() // max(1, share) - mx.get_active_memory() - reserved_bytes
    return batch_that_fits(sequence_kv_bytes(model, cache, context), free, floor)


def batch_that_fits(sequence_bytes: int, free_bytes: int, floor: int) -> int:
    """The sequences whose KV (`sequence_bytes` each) fits in `free_bytes`, within [`floor`,
    `MAX_AUTO_DECODE_CONCURRENCY`] (mlx-lm decodes at least as many as it prefills together, so
    `floor` is the prompt concurrency)."""
    fits = free_bytes // max(1, sequence_bytes)
    return max(min(floor, MAX_AUTO_DECODE_CONCURRENCY), min(MAX_AUTO_DECODE_CONCURRENCY, fits))
