"""The worker's inner loop: load a model with mlx-lm and generate, in-process.

`Engine` knows nothing of processes or transports. The worker process
(`mlxrt.worker.main`) runs one behind a pipe or a ring; tests and benchmarks
run one in-process, which is also the native baseline. Generation is
mlx-lm's own `generate_step` with its samplers, logits processors and
streaming detokenizer, driven token by token so that stop conditions and
cancellation are checked between tokens.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import mlx.core as mx
from mlx_lm.generate import generate_step, generation_stream, wired_limit
from mlx_lm.sample_utils import make_logits_processors, make_sampler
from mlx_lm.utils import load

from ..ipc.protocol import Generate, MemoryReport, SamplingParams, Stats

SYNTHETIC_PREFIX = "synthetic:"
DEFAULT_CONTEXT_LENGTH = 4096
WARMUP_PROMPT = "Warm up the kernels."

#: emit(token_id, text_delta) is called once per generated token, on the engine's thread.
EmitFn = Callable[[int, str], None]


class PromptTooLongError(ValueError):
    """The prompt does not fit in the model's context."""


class NoChatTemplateError(ValueError):
    """Chat messages were sent to a model whose tokenizer has no chat template."""


def resolve_model_path(model: str) -> str:
    """Turn ``synthetic:PRESET[:SEED]`` into a made-on-demand directory; pass others through."""
    if not model.startswith(SYNTHETIC_PREFIX):
        return model
    from .synthetic import ensure_model

    preset, _, seed = model[len(SYNTHETIC_PREFIX) :].partition(":")
    return str(ensure_model(preset, int(seed or 0)))


@dataclass
class Result:
    """What `Engine.generate` returns besides the tokens it emitted."""

    stats: Stats
    tail_text: str


class Engine:
    """One loaded model; `generate` must be called from one thread at a time."""

    def __init__(self, model: str, *, cache_limit_bytes: int | None = None) -> None:
        t0 = time.perf_counter()
        if cache_limit_bytes is not None:
            mx.set_cache_limit(cache_limit_bytes)
        path = resolve_model_path(model)
        self.model, self.tokenizer, config = load(path, return_config=True)
        self.path = path
        self.context_length = int(config.get("max_position_embeddings") or DEFAULT_CONTEXT_LENGTH)
        self.vocab_size = int(config.get("vocab_size") or 0)
        self.load_s = time.perf_counter() - t0
        self.warmup_s = 0.0

    def memory(self) -> MemoryReport:
        """MLX's allocator counters and this process's RSS, bytes."""
        import psutil

        return MemoryReport(
            active_bytes=int(mx.get_active_memory()),
            peak_bytes=int(mx.get_peak_memory()),
            cache_bytes=int(mx.get_cache_memory()),
            rss_bytes=int(psutil.Process().memory_info().rss),
        )

    def clear_cache(self) -> None:
        """Return MLX's cached buffers to the system."""
        mx.clear_cache()

    def warmup(self, tokens: int) -> None:
        """Generate a few tokens so kernels are compiled before the first request."""
        if tokens <= 0:
            return
        t0 = time.perf_counter()
        req = Generate(
            id=0,
            prompt=WARMUP_PROMPT,
            params=SamplingParams(max_tokens=tokens, ignore_eos=True),
        )
        self.generate(req, lambda _t, _s: None)
        self.warmup_s = time.perf_counter() - t0

    def prompt_ids(self, req: Generate) -> list[int]:
        """The request's prompt as token ids: text as is, ids as given, messages templated."""
        if req.prompt_ids is not None:
            ids = list(req.prompt_ids)
            bad = [t for t in ids if not 0 <= t < self.vocab_size] if self.vocab_size else []
            if bad:
                raise ValueError(f"prompt_ids contains ids outside [0, {self.vocab_size}): {bad[:5]}")
        elif req.messages is not None:
            if not self.tokenizer.has_chat_template:
                raise NoChatTemplateError(f"model {self.path} has no chat template")
            messages = [{"role": m.role, "content": m.content} for m in req.messages]
            ids = list(self.tokenizer.apply_chat_template(messages, add_generation_prompt=True))
        elif req.prompt is not None:
            tok = self.tokenizer
            # Same rule as mlx_lm.stream_generate, so raw prompts tokenize identically.
            special = tok.bos_token is None or not req.prompt.startswith(tok.bos_token)
            ids = tok.encode(req.prompt, add_special_tokens=special)
        else:
            raise ValueError("request has no prompt, prompt_ids or messages")
        if not ids:
            raise ValueError("prompt is empty")
        if len(ids) >= self.context_length:
            raise PromptTooLongError(
                f"prompt has {len(ids)} tokens; the model's context is "
                f"{self.context_length} tokens (max_position_embeddings)"
            )
        return ids

    def generate(
        self,
        req: Generate,
        emit: EmitFn,
        should_stop: Callable[[], bool] = lambda: False,
        *,
        queued_at: float | None = None,
    ) -> Result:
        """Generate for one request, calling `emit` per token; return stats and unsent text."""
        t_start = time.perf_counter()
        p = req.params
        ids = self.prompt_ids(req)
        max_tokens = min(p.max_tokens, self.context_length - len(ids))
        stop_ids = set(p.stop_token_ids)
        if not p.ignore_eos:
            stop_ids |= set(self.tokenizer.eos_token_ids)
        if p.seed is not None:
            mx.random.seed(p.seed)
        mx.reset_peak_memory()
        steps = generate_step(
            mx.array(ids),
            self.model,
            max_tokens=max_tokens,
            sampler=_sampler(p),
            logits_processors=_processors(p),
        )
        text = _TextStream(self.tokenizer.detokenizer, p.stop, emit)
        finish, n, t_first, t_last = "length", 0, t_start, t_start
        with wired_limit(self.model, [generation_stream]):
            for token, _ in steps:
                t_last = time.perf_counter()
                if n == 0:
                    t_first = t_last
                if token in stop_ids:
                    finish = "stop"
                    break
                n += 1
                if text.add(token):
                    finish = "stop"
                    break
                if should_stop():
                    finish = "cancelled"
                    break
        stats = Stats(
            prompt_tokens=len(ids),
            prompt_tps=len(ids) / max(t_first - t_start, 1e-9),
            ttft_ms=(t_first - t_start) * 1e3,
            generation_tokens=n,
            decode_tps=(n - 1) / (t_last - t_first) if n > 1 and t_last > t_first else 0.0,
            decode_ms=(t_last - t_first) * 1e3,
            queue_ms=(t_start - queued_at) * 1e3 if queued_at is not None else 0.0,
            peak_memory_bytes=int(mx.get_peak_memory()),
            finish_reason=finish,
        )
        return Result(stats=stats, tail_text=text.finish())


class _TextStream:
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
            self._emit(token, self._text[self._sent : hit])
            self._sent = len(self._text)
            return True
        safe = len(self._text) - _held_back(self._text, self._stop)
        self._emit(token, self._text[self._sent : safe])
        self._sent = max(self._sent, safe)
        return False

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


def _sampler(p: SamplingParams):
    # mlx-lm treats top_p=0 as "off"; our API uses the conventional 1.0.
    top_p = p.top_p if p.top_p < 1.0 else 0.0
    return make_sampler(temp=p.temperature, top_p=top_p, min_p=p.min_p, top_k=p.top_k)


def _processors(p: SamplingParams):
    if p.repetition_penalty is None or p.repetition_penalty == 1.0:
        return None
    return make_logits_processors(
        repetition_penalty=p.repetition_penalty,
        repetition_context_size=p.repetition_context_size,
    )


def device_name() -> str:
    """The MLX default device, e.g. ``gpu`` or ``cpu``."""
    return str(mx.default_device())
