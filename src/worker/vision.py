"""Vision-language models on mlx-vlm: a chat's images decoded, preprocessed and encoded in the worker.

`VisionEngine` has `Engine`'s surface (submit, cancel, step, report, memory, warmup), so the
worker's serve loop (`serve.py`) and process (`main.py`) run it unchanged::

    submit(req) -> waiting -> step(): the oldest request starts: its images decoded (Pillow),
                                      the chat templated, mlx-vlm's processor and `generate_step`
                                      (vision tower, merged embeddings, prefill); then one token
                                      per step() until it ends -> listener.started/token/done

One request at a time: mlx-vlm's batch generator has a batch of its own per call, with no
way for a request to join a running batch, so a worker serves image requests, and text
requests to a vision model, one after the other (docs/vision.md). Sampling, stop strings and
the detokenizer are the text engine's (`sequence.py`).

Prefix reuse: a prompt's KV is kept with its ids and its images' digests (`ImageCache`). The same
images and prompt again skip the image decoding, the processor, the vision tower and all but the
prompt's last token; a chat's next turn with the same images starts from the longest kept prefix
that holds all their tokens, and only its text is prefilled. A Qwen-style model's mRoPE positions
are primed from the whole prompt, as mlx-vlm's own prefix cache does
(`_prime_cached_prefix_rope_state`).
"""

from __future__ import annotations

import copy
import hashlib
import io
import json
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import msgspec
from mlx.utils import tree_flatten, tree_map
from mlx_lm.sample_utils import greedy_sampler

from ..ipc.protocol import (
    EngineOptions,
    EngineReport,
    Generate,
    InvalidField,
    MemoryReport,
    SamplingParams,
    Stats,
)
from .limits import auto_prompt_cache_bytes, on_cuda, out_of_memory, relieve
from .prompt import (
    DEFAULT_CONTEXT_LENGTH,
    PromptTooLongError,
    capabilities,
    check_request,
    template_kwargs,
    template_message,
)
from .reply import make_splitter, split_emit
from .sequence import (
    Listener,
    Quiet,
    TextStream,
    make_request_processors,
    make_request_sampler,
    replay_reply,
    reseed,
)

#: Options the vision engine does not take: each is refused by name at load.
#: (The disk tier, `prompt_cache_dir`, which `mlxrt serve` turns on by default, is left unused, not refused.)
UNSUPPORTED_OPTIONS = ("draft_model", "kv_bits", "max_kv_size", "adapter_path", "prompt_cache_file")
#: The warm-up image's side, pixels: a few image tokens, enough to compile the vision tower's kernels.
WARMUP_IMAGE_PX = 56


def is_vision_model(path: str) -> bool:
    """Whether `path` holds a vision-language checkpoint mlx-vlm can serve: a "vision_config" in its
    config.json and an image processor's preprocessor_config.json."""
    root = Path(path)
    try:
        config = json.loads((root / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(config.get("vision_config"), dict) and (root / "preprocessor_config.json").is_file()


@dataclass
class _Entry:
    """A prompt's KV up to (not including) its last token, its ids, its images' digests, and the model
    state that continues it (mRoPE positions)."""

    ids: list[int]
    digests: tuple[bytes, ...]
    cache: list
    kwargs: dict[str, Any]
    nbytes: int


@dataclass
class _Plan:
    """How a request is prefilled: its prompt ids, the cache it starts from (`cached` tokens in it), the
    inputs still to run, and the model state to keep with its KV (None: it is not kept)."""

    ids: list[int]
    cache: list
    inputs: mx.array
    pixels: Any
    mask: Any
    kwargs: dict[str, Any]
    cached: int = 0
    keep: dict[str, Any] | None = None


class ImageCache:
    """Prompts' KV by the hash of their text and images' bytes, least recently used out first."""

    def __init__(self, cap_bytes: int) -> None:
        self.cap_bytes = cap_bytes
        self._entries: OrderedDict[str, _Entry] = OrderedDict()
        self.nbytes = 0
        self.hits = 0
        self.misses = 0
        self.cached_tokens_total = 0

    def get(self, key: str) -> _Entry | None:
        """The entry of exactly this prompt and these images, or None."""
        entry = self._entries.get(key)
        if entry is not None:
            self._entries.move_to_end(key)
        return entry

    def longest(self, digests: tuple[bytes, ...], ids: list[int],
                media_end: int) -> tuple[_Entry, int] | None:
        """The kept prompt with the same images that shares the longest prefix with `ids` (an earlier turn
        of the same chat), and that prefix's length: at least `media_end` (every image token of `ids`),
        at most one short of either prompt. None when no entry shares that much."""
        best: tuple[_Entry, int] | None = None
        for entry in self._entries.values():
            if entry.digests != digests:
                continue
            n = _common(entry.ids, ids, min(len(entry.ids), len(ids)) - 1)
            if n > max(media_end - 1, 0) and (best is None or n > best[1]):
                best = (entry, n)
        return best

    def note(self, cached: int) -> None:
        """A request started from `cached` tokens of this cache (0: a miss)."""
        if cached:
            self.hits += 1
            self.cached_tokens_total += cached
        else:
            self.misses += 1

    def put(self, key: str, entry: _Entry) -> None:
        if entry.nbytes > self.cap_bytes:
            return
        old = self._entries.pop(key, None)
        if old is not None:
            self.nbytes -= old.nbytes
        while self._entries and self.nbytes + entry.nbytes > self.cap_bytes:
            self.nbytes -= self._entries.popitem(last=False)[1].nbytes
        self._entries[key] = entry
        self.nbytes += entry.nbytes

    def clear(self) -> None:
        self._entries.clear()
        self.nbytes = 0

    def report(self, report: EngineReport) -> EngineReport:
        report.prompt_cache_bytes, report.prompt_cache_cap_bytes = self.nbytes, self.cap_bytes
        report.prompt_cache_entries, report.prompt_cache_hits = len(self._entries), self.hits
        report.prompt_cache_misses, report.cached_tokens_total = self.misses, self.cached_tokens_total
        return report


@dataclass
class _Run:
    """One request from its start to its end."""

    req: Generate
    listener: Listener
    queued_at: float
    started_at: float = 0.0
    first_at: float = 0.0
    last_at: float = 0.0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    generated: int = 0
    #: Tokens of the reply a worker that died had sent (`Generate.resume`): generated, not sent again.
    resumed: int = 0
    resumes: int = 0
    max_tokens: int = 0
    steps: Any = None  # mlx-vlm's generate_step generator
    text: TextStream | None = None
    reply: Any = None  # splits a chat reply into answer, reasoning and tool calls (`reply.py`)
    stops: set[int] = field(default_factory=set)

    def stats(self, finish: str, stop_sequence: str = "") -> Stats:
        t0, t1, tn, n = self.started_at, self.first_at or self.started_at, self.last_at, self.generated
        new = n - self.resumed
        return Stats(
            prompt_tokens=self.prompt_tokens,
            prompt_tps=((self.prompt_tokens - self.cached_tokens) / max(t1 - t0, 1e-9)) if self.first_at
            else 0.0,
            ttft_ms=(t1 - t0) * 1e3 if self.first_at else 0.0,
            generation_tokens=n,
            decode_tps=(new - 1) / (tn - t1) if new > 1 and tn > t1 else 0.0,
            decode_ms=(tn - t1) * 1e3 if self.first_at else 0.0,
            queue_ms=((t0 or time.perf_counter()) - self.queued_at) * 1e3,
            peak_memory_bytes=int(mx.get_peak_memory()),
            finish_reason=finish,
            cached_tokens=self.cached_tokens,
            mean_batch_size=1.0 if n else 0.0,
            stop_sequence=stop_sequence,
            resumes=self.resumes,
        )


def float32_tower(model: nn.Module) -> None:
    """Run the model's vision tower in float32, its output cast back to the dtype the tower had, so the
    language model and its KV cache keep theirs. MLX's CUDA build (0.32.4, an H200) kills the process
    with SIGFPE evaluating Qwen2.5-VL-3B's vision tower in bfloat16, in mlx-vlm's own generate too; in
    float32 the same image runs (docs/vision.md). The tower's weights take twice the bytes (0.67 B
    parameters of Qwen2.5-VL-3B's 3.75 B)."""
    tower = getattr(model, "vision_tower", None)
    if tower is None:
        return
    floats = (p.dtype for _, p in tree_flatten(tower.parameters()) if mx.issubdtype(p.dtype, mx.floating))
    dtype = next(floats, None)
    if dtype is None or dtype == mx.float32:
        return
    tower.set_dtype(mx.float32)
    base = type(tower)

    def call(self, *args, **kwargs):
        out = base.__call__(self, *args, **kwargs)
        return tree_map(lambda x: x.astype(dtype) if isinstance(x, mx.array) and x.dtype == mx.float32 else x,
                        out)

    # The instance's class, not the model's attribute, is swapped: mlx-vlm reads the tower's own
    # attributes (patch_embed's dtype, its merge size), which a wrapper module would hide.
    tower.__class__ = type(f"Float32{base.__name__}", (base,), {"__call__": call})


def load_model(path: str) -> tuple[nn.Module, Any]:
    """mlx-vlm's model and processor for `path`, as a worker runs them: on MLX's CUDA build, the vision
    tower in float32 (`float32_tower`)."""
    from mlx_vlm.utils import load

    model, processor = load(path)
    if on_cuda():
        float32_tower(model)
    return model, processor


class VisionEngine:
    """One mlx-vlm model serving requests one at a time; every method runs on one thread."""

    def __init__(self, model: str, *, cache_limit_bytes: int | None = None,
                 options: EngineOptions | None = None, prompt_cache_share: int = 1) -> None:
        from mlx_lm.utils import load_tokenizer

        t0 = time.perf_counter()
        if cache_limit_bytes is not None:
            mx.set_cache_limit(cache_limit_bytes)
        self.options = o = (options or EngineOptions()).validate()
        unsupported = [n for n in UNSUPPORTED_OPTIONS if getattr(o, n)]
        if unsupported:
            raise ValueError(f"{', '.join(unsupported)}: not supported for a vision model (mlx-vlm)")
        self.path = model
        self.model, self.processor = load_model(model)
        config = json.loads((Path(model) / "config.json").read_text(encoding="utf-8"))
        # mlx-lm's view of the same tokenizer files: the chat template, the streaming detokenizer, and
        # the thinking and tool-call markup its reply parsers read (the processor tokenizes the prompt).
        extra = {"chat_template": o.chat_template} if o.chat_template is not None else None
        self.tokenizer = load_tokenizer(Path(model), extra, eos_token_ids=config.get("eos_token_id"))
        text = {**config, **config.get("text_config", {})}
        self.model_context = int(text.get("max_position_embeddings") or DEFAULT_CONTEXT_LENGTH)
        if o.context_length is not None and o.context_length > self.model_context:
            raise ValueError(f"invalid context_length={o.context_length}: the model's context is "
                             f"{self.model_context} tokens (max_position_embeddings)")
        self.context_length = o.context_length or self.model_context
        self.vocab_size = int(text.get("vocab_size") or 0)
        # Thinking and tool calls are split out of the reply as the text engine does (`reply.py`).
        self.capabilities = msgspec.structs.replace(capabilities(self.tokenizer), vision=True)
        self.grammars = None  # structured output is refused (`_check`): no grammar to prepare
        self.prompt_cache_bytes = (auto_prompt_cache_bytes(prompt_cache_share) if o.prompt_cache_bytes is None
                                   else o.prompt_cache_bytes)
        self.cache = ImageCache(self.prompt_cache_bytes)
        self._eos = set(self.tokenizer.eos_token_ids)
        self._waiting: deque[_Run] = deque()
        self._run: _Run | None = None
        self.load_s = time.perf_counter() - t0
        self.warmup_s = 0.0

    # -- the public surface (as Engine's) ---------------------------------------
    @property
    def busy(self) -> bool:
        return bool(self._waiting or self._run)

    def submit(self, req: Generate, listener: Listener, *, queued_at: float | None = None) -> None:
        """Check `req` and queue it; a bad request fails at once, alone."""
        try:
            self._check(req)
        except Exception as exc:
            listener.failed(req.id, exc)
            return
        self._waiting.append(_Run(req, listener, queued_at or time.perf_counter()))

    def cancel(self, req_id: int) -> bool:
        """End `req_id` as cancelled, waiting or running; False if it is not here."""
        for run in self._waiting:
            if run.req.id == req_id:
                self._waiting.remove(run)
                run.listener.done(req_id, run.stats("cancelled"), "")
                return True
        if self._run is not None and self._run.req.id == req_id:
            self._end(self._run, "cancelled")
            return True
        return False

    def cancel_all(self) -> None:
        for run in [*self._waiting, *([self._run] if self._run else [])]:
            self.cancel(run.req.id)

    def close(self) -> None:
        """Nothing to flush: the image cache lives in memory only."""

    def step(self) -> None:
        """Start the oldest waiting request (its prefill) when none runs, then decode one token; a
        request whose images, prefill or decode fail ends alone, failed, and the next one starts."""
        if self._run is None and not self._waiting:
            return
        run = self._run = self._run or self._waiting.popleft()
        try:
            if run.steps is None:
                self._start(run)
            if self._run is run:  # (a resumed reply may have ended in its replay)
                self._decode(run)
        except Exception as exc:
            self._run, run.steps = None, None
            reseed()  # a failed draw can leave MLX's random state broken (sequence.check_sampler)
            run.listener.failed(run.req.id, exc)
            if out_of_memory(exc):
                relieve(exc, self.clear_cache, kept_bytes=self.cache.nbytes,
                        what="the request failed; the image cache and MLX's cached buffers were dropped",
                        knobs="--prompt-cache-bytes or the images' size")

    def report(self) -> EngineReport:
        running = int(self._run is not None)
        return self.cache.report(EngineReport(queued=len(self._waiting), batch_size=running))

    def memory(self) -> MemoryReport:
        import psutil

        return MemoryReport(active_bytes=int(mx.get_active_memory()), peak_bytes=int(mx.get_peak_memory()),
                            cache_bytes=int(mx.get_cache_memory()),
                            rss_bytes=int(psutil.Process().memory_info().rss))

    def clear_cache(self) -> None:
        self.cache.clear()
        mx.clear_cache()

    def warmup(self, tokens: int) -> None:
        """Compile the kernels before the first request: a text prompt, then one with an image."""
        if tokens <= 0:
            return
        t0 = time.perf_counter()
        cap, self.cache.cap_bytes = self.cache.cap_bytes, 0  # warm-up prompts are no prefix to keep
        params = SamplingParams(max_tokens=tokens, ignore_eos=True)
        image = _png(WARMUP_IMAGE_PX)
        for req in (Generate(id=-1, params=params, prompt="Warm up the kernels."),
                    Generate(id=-2, params=params, messages=[_user("Warm up.", [image])])):
            box = Quiet()
            self.submit(req, box)
            while self.busy:
                self.step()
            if box.error is not None:
                raise box.error
        self.cache.cap_bytes = cap
        self.cache.hits = self.cache.misses = 0
        self.warmup_s = time.perf_counter() - t0

    # -- one request ----------------------------------------------------------------
    def _check(self, req: Generate) -> None:
        p = req.params
        if p.grammar is not None:
            raise InvalidField("grammar", f": structured output is not supported for a vision model "
                                          f"({self.path})", code="unsupported",
                               capability="structured output")
        if p.n != 1:
            raise InvalidField("n", f"={p.n}: a vision model returns one choice", code="unsupported")
        if p.logprobs is not None:
            raise InvalidField("logprobs", ": not supported for a vision model", code="unsupported")
        check_request(req.chat, self.capabilities, self.path)
        if req.chat is not None and req.chat.forces_call:  # forcing a call takes a grammar
            raise InvalidField("tool_choice", ": a vision model cannot be forced to call a tool (tool_choice "
                                              "auto only)", code="unsupported",
                               capability="forced tool calls")
        if req.messages is None and req.prompt is None and req.prompt_ids is None:
            raise ValueError("request has no prompt, prompt_ids or messages")
        bad = [t for t in req.prompt_ids or () if not 0 <= t < self.vocab_size] if self.vocab_size else []
        if bad:
            raise InvalidField("prompt", f": token ids outside [0, {self.vocab_size}): {bad[:5]}")

    def _start(self, run: _Run) -> None:
        """Template the prompt, decode and encode its images (or find its KV in the cache), prefill."""
        from mlx_vlm.generate.ar import generate_step

        run.started_at = time.perf_counter()
        req = run.req
        prompt, images = self._prompt(req)
        digests = tuple(hashlib.sha256(data).digest() for data in images)
        key = _key(prompt, digests)
        resume = req.resume
        resumed = list(resume.tokens[0]) if resume is not None and resume.tokens else []
        plan = self._plan(prompt, images, key, digests, fresh=resume is not None)
        ids, run.cached_tokens = plan.ids, plan.cached
        if resumed:  # the reply so far joins the prompt (docs/supervision.md, streams outlive workers)
            plan.inputs = mx.concatenate([plan.inputs, mx.array([resumed], dtype=plan.inputs.dtype)], axis=1)
            if plan.mask is not None:
                ones = mx.ones((1, len(resumed)), dtype=plan.mask.dtype)
                plan.mask = mx.concatenate([plan.mask, ones], axis=1)
        ctx = self._context(req)
        if len(ids) >= ctx:
            raise PromptTooLongError(f"prompt has {len(ids)} tokens (its images' included); the context is "
                                     f"{ctx} tokens")
        p = req.params
        # The reply's limit, all told: a resumed reply's tokens count toward it.
        run.prompt_tokens, run.max_tokens = len(ids), min(p.max_tokens, ctx - len(ids))
        run.resumed = run.generated = len(resumed)
        run.resumes = resume.count if resume is not None else 0
        run.stops = set() if p.ignore_eos else set(self._eos)
        run.stops.update(p.stop_token_ids)
        sampler = make_request_sampler(p) or greedy_sampler
        # Only a chat reply has reasoning and tool calls to split out.
        if req.messages is not None:
            run.reply = make_splitter(self.tokenizer, self.capabilities, req.chat, ids)
        emit = split_emit(run.reply, run.listener, req.id)
        run.text = TextStream(self.tokenizer.detokenizer, list(p.stop), emit)
        if resumed and self._replay(run, resumed, sampler):
            return
        run.steps = generate_step(plan.inputs, self.model, plan.pixels, plan.mask,
                                  max_tokens=run.max_tokens - run.resumed,
                                  sampler=sampler, logits_processors=make_request_processors(p),
                                  prompt_cache=plan.cache, prefill_step_size=self.options.prefill_step_size,
                                  **plan.kwargs)
        self.cache.note(plan.cached)
        run.listener.started(req.id)
        first = next(run.steps, None)
        if plan.keep is not None and first is not None:
            self._keep(key, digests, ids, plan.cache, plan.keep)
        run.steps = _prepend(first, run.steps)

    def _replay(self, run: _Run, tokens: list[int], sampler) -> bool:
        """Pass a resumed reply's `tokens` through the text stream and reply splitter unsent, the seeded
        sampler's place after them; True when the reply had already ended there (its end is sent)."""
        assert run.text is not None
        stopped = replay_reply(run.text, run.reply, sampler, tokens)
        if not stopped and run.generated < run.max_tokens:
            return False
        run.listener.started(run.req.id)
        self._end(run, "stop" if stopped else "length", run.text.stop_hit)
        return True

    def _plan(self, prompt: str | list[int], images: list[bytes], key: str,
              digests: tuple[bytes, ...], *, fresh: bool = False) -> _Plan:
        """Where the prefill starts: this exact prompt's KV (its last token left to run), else an earlier
        turn's with the same images (the rest of the prompt to run, its images' tokens all in the kept
        part), else nothing (the images decoded and encoded, the whole prompt run). `fresh` (a resumed
        reply, which goes on after the prompt): nothing, and nothing kept."""
        if fresh:
            inputs, pixels, mask, kwargs = self._inputs(prompt, images)
            return _Plan(inputs[0].tolist(), self._new_cache(), inputs, pixels, mask, kwargs)
        entry = self.cache.get(key) if self.cache.cap_bytes else None
        if entry is not None:
            ids = entry.ids
            return _Plan(ids, copy.deepcopy(entry.cache), mx.array([ids[-1:]]), None, None,
                         dict(entry.kwargs), cached=len(ids) - 1)
        inputs, pixels, mask, kwargs = self._inputs(prompt, images)
        ids = inputs[0].tolist()
        keep = self._positions(inputs, mask, kwargs) if self.cache.cap_bytes else None
        found = None if keep is None else self.cache.longest(digests, ids, self._media_end(ids))
        if found is None:
            return _Plan(ids, self._new_cache(), inputs, pixels, mask, kwargs, keep=keep)
        entry, n = found
        cache = copy.deepcopy(entry.cache)
        for c in cache:
            c.trim(c.offset - n)
        return _Plan(ids, cache, inputs[:, n:], None, None, dict(keep), cached=n, keep=keep)

    def _decode(self, run: _Run) -> None:
        item = next(run.steps, None)
        if item is None:
            self._end(run, "length")
            return
        token = int(item[0])
        now = time.perf_counter()
        run.first_at = run.first_at or now
        run.last_at = now
        if token in run.stops:
            self._end(run, "stop")
            return
        run.generated += 1
        assert run.text is not None
        if run.text.add(token):
            self._end(run, "stop", run.text.stop_hit)
        elif run.generated >= run.max_tokens:
            self._end(run, "length")

    def _end(self, run: _Run, reason: str, stop_sequence: str = "") -> None:
        rest = run.text.finish() if run.text is not None and reason != "cancelled" else ""
        if self._run is run:
            self._run = None
        run.steps = None
        stats = run.stats(reason, stop_sequence)
        if run.reply is None:
            run.listener.done(run.req.id, stats, rest)
            return
        parts = run.reply.feed(rest).extend(run.reply.finish())
        if parts.reasoning or parts.calls:
            run.listener.done(run.req.id, stats, parts.content, parts.reasoning, parts.calls)
        else:
            run.listener.done(run.req.id, stats, parts.content)

    # -- prompts, images and the cache ---------------------------------------------
    def _prompt(self, req: Generate) -> tuple[str | list[int], list[bytes]]:
        """The templated text (or the ids as given) and the images, in the order they appear."""
        if req.prompt_ids is not None:
            return list(req.prompt_ids), []
        if req.messages is None:
            assert req.prompt is not None
            return req.prompt, []
        images = [img for m in req.messages for img in m.images]
        messages = []
        for m in req.messages:
            out = template_message(m)
            if m.images:  # as mlx-vlm's prompt_utils: the message's images, then its text
                out["content"] = [*({"type": "image"} for _ in m.images), {"type": "text", "text": m.content}]
            messages.append(out)
        text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                                  **template_kwargs(req.chat))
        return text, images

    def _inputs(self, prompt: str | list[int], images: list[bytes]) -> tuple[mx.array, Any, Any, dict]:
        """mlx-vlm's processor on the prompt and the decoded images: input ids (image tokens widened
        to each image's count), pixels, mask, and the model's other inputs (the image grids)."""
        from mlx_vlm.utils import prepare_inputs

        if isinstance(prompt, list):
            return mx.array([prompt]), None, None, {}
        decoded = [_decode_image(i, data) for i, data in enumerate(images)]
        bos = self.tokenizer.bos_token  # mlx_lm.stream_generate's rule: a templated BOS is not added again
        inputs = prepare_inputs(self.processor, images=decoded or None, prompts=prompt,
                                image_token_index=getattr(self.model.config, "image_token_index", None),
                                add_special_tokens=bos is None or not prompt.startswith(bos))
        kwargs = {k: v for k, v in inputs.items() if k not in ("input_ids", "pixel_values", "attention_mask")}
        return inputs["input_ids"], inputs.get("pixel_values"), inputs.get("attention_mask"), kwargs

    def _new_cache(self) -> list:
        from mlx_vlm.models.cache import make_prompt_cache

        return make_prompt_cache(self.model.language_model, max_kv_size=None)

    def _positions(self, inputs: mx.array, mask, kwargs: dict) -> dict[str, Any] | None:
        """The whole prompt's positions a model with mRoPE continues from (as mlx-vlm's own prefix cache
        primes them: {} for a model without), or None when they cannot be found (nothing is kept)."""
        from mlx_vlm.generate.dispatch import _prime_cached_prefix_rope_state

        state = dict(kwargs)
        if not _prime_cached_prefix_rope_state(self.model, inputs, mask, state):
            return None
        return {k: state[k] for k in ("position_ids", "rope_deltas") if k in state}

    def _media_end(self, ids: list[int]) -> int:
        """Where the prompt's last image token ends (0: none): a kept prefix must hold every one."""
        config = self.model.config
        token = getattr(config, "image_token_id", None) or getattr(config, "image_token_index", None)
        if token is None or token not in ids:
            return 0
        return len(ids) - ids[::-1].index(token)

    def _keep(self, key: str, digests: tuple[bytes, ...], ids: list[int], cache: list,
              positions: dict[str, Any]) -> None:
        """Keep the prompt's KV but its last token under `key`, with the positions that continue it.

        Called after the first token is sampled, when the cache holds the prompt and that token:
        both are trimmed off. Caches that cannot be trimmed (a sliding window that rotated) are not kept.
        """
        if not all(getattr(c, "is_trimmable", lambda: False)() for c in cache):
            return
        kept = copy.deepcopy(cache)
        for c in kept:
            c.trim(c.offset - (len(ids) - 1))
        nbytes = sum(int(getattr(c, "nbytes", 0)) for c in kept)
        self.cache.put(key, _Entry(ids=ids, digests=digests, cache=kept, kwargs=positions, nbytes=nbytes))

    def _context(self, req: Generate) -> int:
        ctx = req.params.num_ctx
        if ctx is None:
            return self.context_length
        if ctx > self.model_context:
            raise InvalidField("num_ctx", f"={ctx}: the model's context is {self.model_context} tokens")
        return ctx


def _key(prompt: str | list[int], digests: tuple[bytes, ...]) -> str:
    """The cache key of a prompt and its images: a SHA-256 over the text (or ids) and each image's digest."""
    h = hashlib.sha256(json.dumps(prompt).encode())
    for digest in digests:
        h.update(digest)
    return h.hexdigest()


def _common(a: list[int], b: list[int], limit: int) -> int:
    """The length of the common prefix of `a` and `b`, at most `limit`."""
    n = 0
    while n < limit and a[n] == b[n]:
        n += 1
    return n


def _decode_image(i: int, data: bytes):
    """Image `i` of the request as an RGB Pillow image; `InvalidField` naming it when it does not decode."""
    from PIL import Image

    try:
        img = Image.open(io.BytesIO(data))
        img.load()
        return img.convert("RGB")
    except Exception as exc:  # Pillow raises several types for a bad file
        raise InvalidField(f"images[{i}]", f": not a decodable image ({type(exc).__name__})") from None



def _prepend(first, rest):
    if first is not None:
        yield first
    yield from rest


def _png(side: int) -> bytes:
    """A `side` x `side` gradient PNG (the warm-up image)."""
    import numpy as np
    from PIL import Image

    ramp = np.linspace(0, 255, side, dtype=np.uint8)
    pixels = np.stack(np.broadcast_arrays(ramp[None, :], ramp[:, None], ramp[::-1, None]), axis=-1)
    buf = io.BytesIO()
    Image.fromarray(np.ascontiguousarray(pixels)).save(buf, format="PNG")
    return buf.getvalue()


def _user(text: str, images: list[bytes]):
    from ..ipc.protocol import ChatMessage

    return ChatMessage("user", text, images=images)
