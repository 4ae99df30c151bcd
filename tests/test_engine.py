"""The batching engine in-process (the same `Engine` the worker runs): batching, prefix reuse, failures.

Every family of cache runs the core checks: batching identity, reuse
identity and a chat with cached turns, on the tiny preset of each family.
"""

from __future__ import annotations

import weakref

import msgspec
import pytest
from mlxrt.ipc.protocol import EngineOptions, Generate
from mlxrt.worker.engine import Engine
from support import FAMILIES, Recorder, chat, fail_once, gen, run_alone, run_batch, run_handed_over

#: How MLX's CUDA backend says an allocation failed (seen on an H200).
OOM = "cudaMallocAsync(&data, size, stream) failed: out of memory"


@pytest.fixture(scope="module", params=FAMILIES)
def engines(request):
    """Per family: an engine with prefix reuse and one without (the reference)."""
    from mlxrt.synthetic.build import ensure_model

    path = str(ensure_model(request.param))
    opts = {"decode_concurrency": 8, "prefill_step_size": 64}
    on = Engine(path, options=EngineOptions(**opts))
    off = Engine(path, options=EngineOptions(**opts, prompt_cache_bytes=0))
    return request.param, on, off


def mixed_requests() -> list[Generate]:
    """Different lengths and sampling settings in one batch."""
    long_text = "The tide came in over the rocks while the gulls argued. " * 12
    return [
        gen(1, "Once upon a time"),
        gen(2, long_text, max_tokens=9),
        gen(3, ids=[5, 17, 42, 99, 3, 250, 7]),
        gen(4, messages=chat("What is the weather like?")),
        gen(5, "The quick brown fox", temperature=0.8, seed=7),
        gen(6, "A list of birds:", temperature=1.0, top_k=5, top_p=0.9, seed=11, repetition_penalty=1.3),
        gen(7, "Numbers go up", repetition_penalty=1.2, repetition_context_size=8),
        gen(8, long_text[:200], max_tokens=20),
    ]


def test_batch_gives_each_request_its_single_stream_ids(engines):
    """Greedy and seeded requests of different lengths in one batch get the ids each gets alone."""
    _, on, off = engines
    reqs = mixed_requests()
    alone = {r.id: run_alone(off, r)[0] for r in reqs}
    rec = run_batch(off, reqs)
    assert not rec.errors
    assert rec.ids == alone
    assert max(s.mean_batch_size for s in rec.stats.values()) > 1


def shared_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def test_prefix_reuse_keeps_ids_and_reports_cached_tokens(engines):
    """A multi-turn chat and a shared system prompt: ids with reuse equal ids without; a later turn
    reuses all it shares with the turn before (but the last token, where that is a checkpoint's end),
    also past a ``<think>`` the template opens in the prompt and drops from the next turn (Qwen3.5)."""
    name, on, off = engines
    turns: list[str] = []
    before: list[int] = []
    for k in range(3):
        turns.append(f"Question {k}: and what about the {['sky', 'sea', 'hills'][k]} today?")
        msgs = chat(*turns)
        got, st = run_alone(on, gen(10 + k, messages=msgs))
        want, _ = run_alone(off, gen(10 + k, messages=msgs))
        assert got == want, f"{name} turn {k}"
        ids = on.prompt_ids(gen(10 + k, messages=msgs))
        if k > 0:
            shared = shared_prefix(before, ids)
            assert st.cached_tokens >= shared - 1, f"{name} turn {k}: {st.cached_tokens} of {shared} shared"
        before = ids
        turns.append(on.tokenizer.decode(got))
    other = chat("A different conversation about fish.")
    got, st = run_alone(on, gen(20, messages=other))
    assert got == run_alone(off, gen(20, messages=other))[0]
    assert st.cached_tokens > 0  # the shared system prompt
    assert off.report().prompt_cache_entries == 0


def test_reuse_inside_a_batch_keeps_ids(engines):
    """Requests that share a prefix with a cached prompt, batched with others, keep their ids."""
    _, on, off = engines
    base = "In the harbour the boats rocked gently and the sailors sang. " * 6
    run_alone(on, gen(30, base))
    reqs = [gen(31, base + " Then a storm came."), gen(32, base + " Nothing happened."), gen(33, "Unrelated")]
    rec = run_batch(on, reqs)
    assert rec.ids == {r.id: run_alone(off, r)[0] for r in reqs}
    assert rec.stats[31].cached_tokens > 0 and rec.stats[32].cached_tokens > 0


@pytest.mark.parametrize("batched", [False, True], ids=["alone", "batched"])
def test_a_prefix_under_the_floor_is_not_served_but_a_prompt_sent_again_is(tiny_model, batched):
    """A prompt that shares only its first tokens with a cached one is prefilled whole (no copy of another
    sequence's cache for a token or two), alone or batched; one that shares `MIN_PREFIX_TOKENS` or more is
    served them; a short prompt sent again is served all of it but its last token."""
    from mlxrt.worker.prefix_cache import MIN_PREFIX_TOKENS

    engine = Engine(tiny_model)
    base = [5 + (i * 7) % 90 for i in range(80)]
    run_alone(engine, gen(1, ids=base))
    few = gen(2, ids=base[:3] + [200 + i for i in range(60)])
    many = gen(3, ids=base[: MIN_PREFIX_TOKENS + 8] + [300 + i for i in range(30)])
    if batched:
        rec = run_batch(engine, [few, many])
        cached = (rec.stats[2].cached_tokens, rec.stats[3].cached_tokens)
    else:
        cached = (run_alone(engine, few)[1].cached_tokens, run_alone(engine, many)[1].cached_tokens)
    assert cached == (0, MIN_PREFIX_TOKENS + 8)
    short = [400 + i for i in range(6)]
    assert run_alone(engine, gen(4, ids=short))[1].cached_tokens == 0
    assert run_alone(engine, gen(5, ids=short))[1].cached_tokens == len(short) - 1


def test_the_trie_finds_what_mlx_lms_finds():
    """`_Trie.search` returns what mlx-lm's does, and `below_floor` refuses a trim exactly where the floor's
    test on that search does, on random tries (evictions, `pop_prefixes`, 1-token entries)."""
    import random

    from mlx_lm.models.cache import PromptTrie
    from mlxrt.worker.prefix_cache import _Trie

    def by_search(trie, tokens):
        found = PromptTrie.search(trie, "m", tokens)
        shorter = len(found.shorter or ())
        common = found.common_prefix
        refused = (found.exact is None and found.longer is not None and len(found.longer) > common
                   and shorter < common < len(tokens))
        return shorter if refused else None

    rng = random.Random(7)
    refusals = 0
    for _ in range(3000):
        trie, entries = _Trie(), []
        for _ in range(rng.randint(1, 6)):
            entry = [rng.randint(1, 3) for _ in range(rng.randint(1, 48))]
            trie.add("m", entry, object())
            if rng.random() < 0.7:  # a trimmable cache: mlx-lm drops the prefixes it serves by trimming
                trie.pop_prefixes("m", entry)
            entries.append(entry)
        if len(entries) > 1 and rng.random() < 0.3:  # an eviction
            gone = entries.pop(rng.randrange(len(entries)))
            try:
                trie.pop("m", gone)
            except KeyError:  # its value went with pop_prefixes
                pass
        for _ in range(8):
            head = list(rng.choice(entries)[: rng.randint(0, 40)])
            if head and rng.random() < 0.7:
                head[rng.randrange(len(head))] = rng.randint(1, 4)
            head += [rng.randint(1, 4) for _ in range(rng.randint(0, 8))]
            assert trie.search("m", head) == PromptTrie.search(trie, "m", head), (entries, head)
            head = head[:32]
            want = by_search(trie, head)
            assert trie.below_floor("m", head) == want, (entries, head)
            refusals += want is not None
    assert refusals > 1000  # the cases include many a refusal, not only the walks that serve
    assert _Trie().below_floor("m", [1, 2]) is None


def test_chats_sharing_a_short_system_prompt_start_from_its_checkpoint(tiny_model):
    """A system prompt under `MIN_PREFIX_TOKENS` is a checkpoint the chats beside it begin with: it is
    served to them (the floor is for entries trimmed back, not for those kept to be shared), so one chat
    prefills it and the others wait for it once, not each in turn."""
    from mlxrt.worker.prefix_cache import MIN_PREFIX_TOKENS

    on = Engine(tiny_model, options=EngineOptions(prefill_step_size=512, prefill_budget_ms=2000))
    off = Engine(tiny_model, options=EngineOptions(prefill_step_size=512, prefill_budget_ms=2000,
                                                   prompt_cache_bytes=0))
    reqs = [gen(60 + i, messages=chat(f"Ship {i}: what did you see?", system="Be brief and kind."))
            for i in range(6)]
    system = on.system_end(reqs[0], on.prompt_ids(reqs[0]))
    assert 0 < system < MIN_PREFIX_TOKENS
    rec = run_batch(on, reqs)
    assert rec.ids == run_batch(off, reqs).ids
    assert sorted(rec.stats[r.id].cached_tokens for r in reqs) == [0] + [system] * 5
    assert on.prefill_calls <= 2, on.prefill_calls  # the leader's system prompt, then the rest together


def test_a_short_system_prompt_is_still_served_after_a_chat_that_began_with_it_ends(tiny_model):
    """The cache a chat leaves when it ends does not supersede its system prompt's checkpoint under
    `MIN_PREFIX_TOKENS` (a trim back to that is refused): the next chat with that system prompt starts
    there."""
    from mlxrt.worker.prefix_cache import MIN_PREFIX_TOKENS

    engine = Engine(tiny_model)
    first = gen(70, messages=chat("Ship 1: what did you see?", system="Be brief and kind."))
    later = gen(71, messages=chat("A storm is coming: what now?", system="Be brief and kind."))
    system = engine.system_end(first, engine.prompt_ids(first))
    assert 0 < system < MIN_PREFIX_TOKENS
    run_alone(engine, first)
    assert run_alone(engine, later)[1].cached_tokens == system


def test_chats_arriving_together_prefill_their_system_prompt_once(engines):
    """Chats that share an uncached system prompt: one prefills it, the others start from its checkpoint."""
    name, on, off = engines
    system = "You keep a lighthouse and log every ship that passes, with its flag and cargo. " * 4
    reqs = [gen(40 + i, messages=chat(f"Ship {i}: what did you see?", system=system)) for i in range(4)]
    rec = run_batch(on, reqs)
    assert rec.ids == {r.id: run_alone(off, r)[0] for r in reqs}, name
    cached = sorted(rec.stats[r.id].cached_tokens for r in reqs)
    system_tokens = len(on.tokenizer.encode(system))
    assert cached[0] < system_tokens <= min(cached[1:]), (name, cached)
    # the followers waited for the leader's system prompt, not for its whole prompt
    lead = min(reqs, key=lambda r: rec.stats[r.id].cached_tokens).id
    first_token = rec.events.index(("token", lead))
    assert all(rec.events.index(("started", r.id)) < first_token for r in reqs)


def test_cancel_and_failure_in_a_batch_leave_the_others_unchanged(engines):
    """A cancelled, a failing and a normal request together: only the failing one errors."""
    _, on, off = engines
    normal = gen(41, "Once upon a time there was", max_tokens=24)
    want = run_alone(off, normal)[0]
    rec = Recorder()
    off.submit(gen(40, "A request that will be cancelled", max_tokens=200), rec)
    off.submit(gen(42, ids=[1, 2, off.vocab_size + 5]), rec)
    off.submit(normal, rec)
    steps = 0
    while off.busy:
        off.step()
        steps += 1
        if steps == 6:
            assert off.cancel(40)
    assert rec.ids[41] == want
    assert rec.stats[40].finish_reason == "cancelled"
    assert 42 in rec.errors and "outside" in str(rec.errors[42])
    assert set(rec.stats) == {40, 41}


def test_bad_sampler_fails_alone_and_poisons_nothing():
    """top_k past the vocabulary fails its request at admission; later sampling is as on a fresh engine."""
    from mlxrt.synthetic.build import ensure_model

    path = str(ensure_model("tiny"))
    engine = Engine(path, options=EngineOptions(prompt_cache_bytes=0))
    seeded = gen(2, "The quick brown fox", temperature=0.9, seed=3)
    before = run_alone(engine, seeded)[0]
    with pytest.raises(ValueError, match="top_k"):
        run_alone(engine, gen(1, "Hello", temperature=1.0, top_k=engine.vocab_size + 1))
    assert run_alone(engine, seeded)[0] == before
    assert len(run_alone(engine, gen(3, "Hello", temperature=1.0))[0]) == 16  # unseeded still samples


def test_prefix_cache_stays_under_its_byte_cap():
    """A stream of distinct long prompts against a small byte cap: the cap holds and nothing fails."""
    from mlxrt.synthetic.build import ensure_model

    cap = 400_000
    engine = Engine(str(ensure_model("tiny")), options=EngineOptions(prompt_cache_bytes=cap))
    for i in range(12):
        prompt = f"Prompt number {i} tells a different story. " * (4 + i)
        ids, st = run_alone(engine, gen(i, prompt, max_tokens=4))
        assert len(ids) == 4
        assert engine.prefix_cache.nbytes <= cap
    assert engine.report().prompt_cache_entries >= 1


class Counted:
    """The engine's model, noting the tokens (rows times columns) of each call the scheduler makes."""

    def __init__(self, model) -> None:
        self._model, self.tokens = model, []

    def __call__(self, x, cache=None, **kw):
        self.tokens.append(x.shape[0] * x.shape[1])
        return self._model(x, cache=cache, **kw)

    def __getattr__(self, name):
        return getattr(self._model, name)


def test_moe_batched_prefill_calls_fit_cudas_grid_under_the_scheduler(monkeypatch):
    """On CUDA (pretended, its grid made 2,048 pairs: 1,024 tokens of a top-2 MoE), the scheduler's
    batched calls of short prompts carry at most 1,024 tokens, padding counted, however many rows the
    budget would take; each keeps the uncut engine's ids."""
    from mlxrt.synthetic.build import ensure_model
    from mlxrt.worker import engine as engine_module
    from mlxrt.worker import limits

    moe = str(ensure_model("tiny-qwen3-moe"))
    opts = EngineOptions(prefill_budget_ms=60_000, prompt_cache_bytes=0, decode_concurrency=32)
    burst = [gen(i, ids=[(5 * i + 3 * j) % 200 + 5 for j in range(100)], max_tokens=3) for i in range(16)]
    warm = [gen(100 + i, ids=[(7 * i + j) % 200 + 5 for j in range(20)], max_tokens=1) for i in range(2)]
    monkeypatch.setattr(limits, "on_cuda", lambda: False)
    want = run_batch(Engine(moe, options=opts), burst).ids
    monkeypatch.setattr(limits, "on_cuda", lambda: True)
    monkeypatch.setattr(engine_module, "on_cuda", lambda: True)  # the scheduler's chunks on the grid
    monkeypatch.setattr(limits, "CUDA_GRID_LIMIT", 2048)
    cut = Engine(moe, options=opts)
    assert cut.prefill.call_tokens == 1024 and cut.prefill.batch_prompts == 16 and cut.sizer.grid
    run_batch(cut, warm)
    cut.model, batched = Counted(cut.model), cut.prefill_batched
    got = run_batch(cut, burst)
    assert not got.errors and got.ids == want
    assert max(cut.model.tokens) <= 1024 and cut.prefill_batched > batched  # the burst went in batched calls


def test_owned_settles_every_cache_kind_mlx_lm_has():
    """`kvcache.owned` on each of mlx-lm's cache kinds: a new object of the same kind with equal arrays and
    bytes; a recurrent state's arrays are copies, so a row taken out of a batch of them holds its own
    bytes, not the batch's; a cache whose `state` cannot be set (mlx-lm's DeepSeek V4.1 layer) is kept."""
    import gc

    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.models.cache import (
        ArraysCache,
        CacheList,
        ChunkedKVCache,
        KVCache,
        QuantizedKVCache,
        RotatingKVCache,
    )
    from mlxrt.worker.kvcache import owned

    def filled(c):
        c.update_and_fetch(mx.random.normal((1, 2, 40, 32)), mx.random.normal((1, 2, 40, 32)))
        return c

    def recurrent():
        c = ArraysCache(2)
        c[0], c[1] = mx.random.normal((1, 3, 8)), mx.random.normal((1, 4, 16))
        return c

    kinds = [filled(KVCache()), filled(RotatingKVCache(max_size=32, keep=4)), recurrent(),
             filled(QuantizedKVCache(group_size=32, bits=8)), CacheList(recurrent(), filled(KVCache())),
             filled(ChunkedKVCache(64)), KVCache()]
    for c in kinds:
        (mine,) = owned([c])
        assert type(mine) is type(c) and mine is not c and mine.nbytes == c.nbytes
        src, dst = ([x for _, x in tree_flatten(k.state) if isinstance(x, mx.array)] for k in (c, mine))
        assert len(src) == len(dst)
        assert all(mx.array_equal(a, b).item() for a, b in zip(src, dst, strict=True))

    class ReadOnly:  # a layer whose `state` has no setter
        def __init__(self) -> None:
            self.window = mx.zeros((1, 4, 8))

        @property
        def state(self):
            return (self.window,)

    assert owned([ReadOnly()])[0].window.shape == (1, 4, 8)

    gc.collect()
    base = mx.get_active_memory()
    batch = ArraysCache(1)
    batch[0] = mx.random.normal((8, 4, 64, 256))
    mx.eval(batch.state)
    (row,) = owned([batch.extract(3)])
    del batch
    gc.collect()
    assert 0 < mx.get_active_memory() - base <= row.nbytes  # the batch's 8 rows are gone


@pytest.mark.parametrize("family", FAMILIES)
def test_prefix_cache_entries_hold_only_the_bytes_they_count(family):
    """A lone stream, then eight at once (one of them with two choices, which start from its prompt's
    cache), their rows taken out of batched prefills and the decode batch: dropping the prefix cache then
    frees what its entries count, no more. A row mlx-lm takes out of a batch holds the batch's arrays
    until evaluated (a recurrent state's row for good); kept so, the entries held 2.4-2.7x their bytes
    (before `kvcache.owned`: docs/benchmarks/data/cpu-s15-owned.log), unseen by the byte cap."""
    import gc

    import mlx.core as mx
    from mlxrt.synthetic.build import ensure_model

    def active() -> int:
        gc.collect()
        return mx.get_active_memory()

    # A budget long enough that the batched calls do not hang on this machine's speed: the first call is
    # the sizer's floor, the rest carry up to 8 rows of 160 tokens.
    options = EngineOptions(decode_concurrency=8, prefill_budget_ms=60_000)
    engine = Engine(str(ensure_model(family)), options=options)
    run_alone(engine, gen(99, ids=[7 + (j * 11) % 190 for j in range(160)], max_tokens=6))
    assert engine.solo_requests == 1
    reqs = [gen(i, ids=[5 + (i * 13 + j * 7) % 200 for j in range(160)], max_tokens=6, n=1 + (i == 3))
            for i in range(8)]
    rec = run_batch(engine, reqs)
    assert not rec.errors and all(len(rec.ids[r.id]) == 6 * r.params.n for r in reqs)
    assert engine.prefill_batched > 0  # rows went through batched calls, not one prompt at a time
    counted, before = engine.prefix_cache.nbytes, active()
    assert len(engine.prefix_cache) >= 9 and counted > 0
    engine.prefix_cache.clear()
    freed = before - active()
    # MLX's allocator rounds a small buffer up (a 5,120-byte copy takes 8,192), and a tiny preset's
    # recurrent states are small: its entries take a little more than they count, never the 2x of a batch.
    assert 0.9 * counted <= freed <= 1.25 * counted, (freed, counted)


def test_stop_strings_and_stop_ids_in_a_batch():
    """Stop strings end a sequence inside a batch with the text cut before them, as alone."""
    from mlxrt.synthetic.build import ensure_model

    engine = Engine(str(ensure_model("tiny")), options=EngineOptions(prompt_cache_bytes=0))
    free, _ = run_alone(engine, gen(1, "Once upon a time", max_tokens=30))
    text = engine.tokenizer.decode(free)
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    reqs = [gen(2, "Once upon a time", max_tokens=30, stop=[stop]), gen(3, "Hello there", max_tokens=30),
            gen(4, "Once upon a time", max_tokens=30, stop_token_ids=[free[5]])]
    alone = {r.id: run_alone(engine, r) for r in reqs}
    rec = run_batch(engine, reqs)
    assert rec.ids == {k: v[0] for k, v in alone.items()}
    assert rec.stats[2].finish_reason == "stop" and stop not in rec.text[2]
    assert rec.stats[4].finish_reason == "stop" and rec.ids[4] == free[:5]


def test_long_warmup_prompt_passes_one_prefill_step():
    """On a GPU the warm-up also prefills a prompt past one prefill step (two chunk shapes)."""
    from mlxrt.synthetic.build import ensure_model

    engine = Engine(str(ensure_model("tiny")), options=EngineOptions(prefill_step_size=64))
    ids = engine._long_warmup_ids(4)
    assert 2 * 64 < len(ids) < engine.context_length - 4
    assert all(0 <= t < engine.vocab_size for t in ids)


@pytest.mark.parametrize("preset", ["tiny", "tiny-qwen3.5", "tiny-gemma3"])
def test_decode_graph_warm_up_reaches_each_length_within_the_context(preset):
    """CUDA's warm-up of one sequence's decode steps runs on the model's own caches (KV, linear
    attention, sliding windows), each step's cache and KV buffer as long as asked, none past the
    context."""
    from mlx_lm import load
    from mlxrt.synthetic.build import ensure_model
    from mlxrt.worker import solo

    model, _ = load(str(ensure_model(preset)))
    seen = []

    class Counting:
        def __call__(self, x, cache=None):
            out = model(x, cache=cache)
            if x.shape[-1] == 1:  # the cache's length, and its KV layers' buffers, which key the graph
                seen.append(max(c.offset for c in cache if hasattr(c, "offset")))
                assert {c.keys.shape[2] for c in cache if type(c).__name__ == "KVCache"} == {seen[-1]}
            return out

        def __getattr__(self, name):
            return getattr(model, name)

    counting = Counting()
    assert solo.warm_decode_graphs(counting, 4096) == 4 and seen == list(solo.CUDNN_DECODE_LENGTHS)
    seen.clear()
    assert solo.warm_decode_graphs(counting, 600) == 2 and seen == [256, 512]


# -- the batch-size-1 fast path ------------------------------------------------------------------

def solo_requests() -> list[Generate]:
    """Greedy, seeded and penalised requests, one of them past two prefill chunks."""
    long_text = "The tide came in over the rocks while the gulls argued. " * 12
    return [
        gen(60, "Once upon a time", max_tokens=20),
        gen(61, long_text, max_tokens=12),
        gen(62, "The quick brown fox", temperature=0.8, seed=7, max_tokens=20),
        gen(63, "A list of birds:", temperature=1.0, top_k=5, top_p=0.9, seed=11, repetition_penalty=1.3),
        gen(64, messages=chat("What is the weather like?")),
    ]


# What each request gets alone on an engine's batch path, worked out once per engine: the fast-path tests
# compare 21 runs per family against the same few (greedy or seeded, so the same ids each time).
_BATCH_IDS: weakref.WeakKeyDictionary[Engine, dict[bytes, list[int]]] = weakref.WeakKeyDictionary()


def through_batch(engine: Engine, req: Generate) -> list[int]:
    """The ids `req` gets alone on the BatchGenerator path (fast path off)."""
    known = _BATCH_IDS.setdefault(engine, {})
    key = msgspec.msgpack.encode(req)
    if key not in known:
        engine.solo_enabled = False
        try:
            known[key] = run_alone(engine, req)[0]
        finally:
            engine.solo_enabled = True
    return list(known[key])


def test_lone_request_takes_the_fast_path_with_the_batch_ids(engines):
    """A lone greedy or seeded request is decoded outside the batch and gets the ids the batch gives."""
    name, on, off = engines
    for req in solo_requests():
        want = through_batch(off, req)
        before, tokens = off.solo_requests, off.solo_tokens
        got, st = run_alone(off, req)
        assert got == want, (name, req.id)
        assert off.solo_requests == before + 1 and off.solo_tokens - tokens == len(got)
        assert st.mean_batch_size == 1.0 and st.generation_tokens == len(got)


@pytest.mark.parametrize("after", [1, 2, 6])
def test_second_request_moves_the_lone_one_into_the_batch(engines, after):
    """A request arriving after `after` steps of a lone one (prefill or decode): both keep their ids."""
    name, on, off = engines
    for engine in (off, on):
        for first, second in [(solo_requests()[1], solo_requests()[2]), (solo_requests()[3], gen(65, "Hi")),
                              (solo_requests()[4], gen(66, messages=chat("And the sea?")))]:
            want = {r.id: through_batch(engine, r) for r in (first, second)}
            if engine is on:
                engine.clear_cache()
            rec = run_handed_over(engine, first, second, after)
            assert not rec.errors
            assert rec.ids == want, (name, after, first.id)
            assert rec.stats[first.id].mean_batch_size > 1


def test_cancel_on_the_fast_path():
    """Cancelling a lone request ends it as cancelled; the engine serves the next one as before."""
    from mlxrt.synthetic.build import ensure_model

    engine = Engine(str(ensure_model("tiny")), options=EngineOptions())
    rec = Recorder()
    engine.submit(gen(1, "A request that will be cancelled", max_tokens=200), rec)
    for _ in range(5):
        engine.step()
    assert engine._solo is not None
    assert engine.cancel(1)
    assert not engine.busy and rec.stats[1].finish_reason == "cancelled"
    assert 0 < len(rec.ids[1]) < 200
    req = gen(2, "Once upon a time")
    assert run_alone(engine, req)[0] == through_batch(engine, req)


def test_stop_strings_stop_ids_and_max_tokens_on_the_fast_path():
    """Stop strings, stop ids and max_tokens end a lone request as they end it in the batch."""
    from mlxrt.synthetic.build import ensure_model

    engine = Engine(str(ensure_model("tiny")), options=EngineOptions(prompt_cache_bytes=0))
    free = through_batch(engine, gen(1, "Once upon a time", max_tokens=30))
    text = engine.tokenizer.decode(free)
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    reqs = [gen(2, "Once upon a time", max_tokens=30, stop=[stop]),
            gen(3, "Once upon a time", max_tokens=30, stop_token_ids=[free[5]]),
            gen(4, "Once upon a time", max_tokens=7)]
    got = {}
    for req in reqs:
        engine.solo_enabled = False
        want = run_batch(engine, [req])
        engine.solo_enabled = True
        got[req.id] = run_batch(engine, [req])
        assert (got[req.id].ids, got[req.id].text) == (want.ids, want.text), req.id
        assert got[req.id].stats[req.id].finish_reason == want.stats[req.id].finish_reason
    assert got[2].stats[2].finish_reason == "stop" and stop not in got[2].text[2]
    assert got[3].ids[3] == free[:5] and got[3].stats[3].finish_reason == "stop"
    assert got[4].ids[4] == free[:7] and got[4].stats[4].finish_reason == "length"
    assert engine.solo_requests == 3


@pytest.mark.parametrize("message, relieved", [("sampler broke", False), (OOM, True)])
def test_failure_on_the_fast_path_fails_that_request_alone(message, relieved):
    """A step of the lone request that raises fails it; the engine then serves requests as before."""
    # Out of memory, it also drops the prefix cache, with one warning (`limits.relieve`).
    from mlxrt.synthetic.build import ensure_model
    from mlxrt.worker.engine import BatchStepError
    from structlog.testing import capture_logs

    engine = Engine(str(ensure_model("tiny")), options=EngineOptions())
    seeded = gen(2, "The quick brown fox", temperature=0.9, seed=3)
    before = run_alone(engine, seeded)[0]
    assert len(engine.prefix_cache) > 0
    rec = Recorder()
    engine.submit(gen(1, "This one breaks", max_tokens=50), rec)
    for _ in range(3):
        engine.step()

    def boom(logprobs):
        raise RuntimeError(message)

    engine._solo.seq.sampler = boom
    with capture_logs() as logs:
        while engine.busy:
            engine.step()
    assert isinstance(rec.errors[1], BatchStepError) and 1 not in rec.stats
    warned = [e["event"] for e in logs if e["log_level"] == "warning"]
    assert (len(engine.prefix_cache) == 0) == relieved and warned == ["engine.out_of_memory"] * relieved
    assert run_alone(engine, seeded)[0] == before
    assert run_batch(engine, [gen(3, "Hello"), gen(4, "World")]).errors == {}


def test_moe_prefill_steps_fit_cudas_grid(monkeypatch):
    """On MLX's CUDA backend (pretended), MoE prefill calls carry at most 65535 (token, expert) pairs."""
    # The batched step is cut so that `prompt_concurrency` prompts fit, the lone step only past the cap,
    # and the ids are the uncut engine's. Dense models and the other backends keep the options' step.
    from mlxrt.synthetic.build import ensure_model
    from mlxrt.worker import limits

    moe, dense = (str(ensure_model(p)) for p in ("tiny-qwen3-moe", "tiny-llama"))  # MoE: 2 experts a token
    opts = EngineOptions(prompt_concurrency=64, prefill_step_size=1024, single_stream=False)
    monkeypatch.setattr(limits, "on_cuda", lambda: False)
    plain = Engine(moe, options=opts)
    assert plain.prefill == limits.PrefillSteps(1024, 1024, 64)
    monkeypatch.setattr(limits, "on_cuda", lambda: True)
    cut = Engine(moe, options=opts)
    assert limits.prefill_token_cap(cut.model, {"num_experts_per_tok": 2}) == 32767
    assert limits.prefill_token_cap(cut.model, {}) == 65535 // 8  # experts under an unknown name
    assert limits.prefill_token_cap(Engine(dense, options=opts).model, {}) is None  # no experts: no limit
    assert cut.prefill == limits.PrefillSteps(1024, 448, 64, 32767)  # 32767 // 64 = 511, in 64s
    assert cut._batch.prefill_step_size == 448 and 64 * 448 * 2 <= limits.CUDA_GRID_LIMIT
    lone = Engine(moe, options=EngineOptions(prompt_concurrency=1, prefill_step_size=40000))
    assert lone.prefill == limits.PrefillSteps(32767, 32704, 1, 32767)
    many = limits.prefill_steps(2048, prompts=600, cap=8191, model="m")  # under 64 tokens a row
    assert many == limits.PrefillSteps(2048, 64, 127, 8191) and many.batch * many.batch_prompts <= 8191
    # prompts of two steps when cut, all through the batch (single_stream off)
    reqs = [gen(i, ids=[(7 * i + 3 * j) % 200 + 5 for j in range(470 + i)], max_tokens=8) for i in range(3)]
    got = run_batch(cut, reqs)
    assert not got.errors and got.ids == run_batch(plain, reqs).ids


def test_prefix_cache_cap_follows_the_machine_unless_given(monkeypatch):
    """No prompt_cache_bytes: an eighth of the memory MLX may use, 1-64 GiB; a given cap is kept."""
    import psutil
    from mlxrt.synthetic.build import ensure_model
    from mlxrt.worker import limits

    path = str(ensure_model("tiny"))
    monkeypatch.setattr(limits.mx, "device_info", lambda: {}, raising=False)  # as on this VM: the RAM
    want = max(1 << 30, min(psutil.virtual_memory().total // 8, 64 << 30))
    assert EngineOptions().prompt_cache_bytes is None and limits.auto_prompt_cache_bytes() == want
    auto = Engine(path, options=EngineOptions(prompt_cache_bytes=None))
    assert auto.prompt_cache_bytes == auto.prefix_cache.max_bytes == want
    for given in (0, 123_456):
        e = Engine(path, options=EngineOptions(prompt_cache_bytes=given))
        assert e.prompt_cache_bytes == e.prefix_cache.max_bytes == given
    for memory, cap in ((16 << 30, 2 << 30), (4 << 30, 1 << 30), (1 << 40, 64 << 30)):
        monkeypatch.setattr(limits.mx, "device_info", lambda m=memory: {"total_memory": m}, raising=False)
        assert limits.auto_prompt_cache_bytes() == cap
    monkeypatch.setattr(limits.mx, "device_info", lambda: {"max_recommended_working_set_size": 24 << 30,
                                                           "memory_size": 32 << 30}, raising=False)
    assert limits.auto_prompt_cache_bytes() == 3 << 30  # Metal's working set, not the whole memory
    with pytest.raises(ValueError, match="prompt_cache_bytes"):
        EngineOptions(prompt_cache_bytes=-1).validate()


@pytest.mark.parametrize("message", [
    OOM,
    "[METAL] Command buffer execution failed: Insufficient Memory "
    "(00000008:kIOGPUCommandBufferCallbackErrorOutOfMemory)",
    "[metal::malloc] Attempting to allocate 137438953472 bytes which is greater than the maximum allowed "
    "buffer size of 77309411328 bytes.",
    "[malloc] Unable to allocate 96905199616 bytes.",  # MLX's allocator, any backend
    "std::bad_alloc",
])
def test_an_allocation_that_fails_hands_the_caches_back(message):
    """A batch step out of memory fails its requests, then drops the caches with one warning; others don't."""
    # The worker goes on: the same requests again get the ids they got before.
    import mlx.core as mx
    from mlxrt.synthetic.build import ensure_model
    from mlxrt.worker.engine import BatchStepError
    from structlog.testing import capture_logs

    engine = Engine(str(ensure_model("tiny")), options=EngineOptions())
    reqs = [gen(1, "The quick brown fox"), gen(2, "Hello there, friend")]
    before = run_batch(engine, reqs)
    assert before.errors == {} and len(engine.prefix_cache) > 0

    for text, relieved in (("sampler broke", False), (message, True)):
        kept = engine.prefix_cache.nbytes
        fail_once(engine._batch, "next", RuntimeError(text))
        with capture_logs() as logs:
            failed = run_batch(engine, [gen(3, "One more"), gen(4, "And another")])
        assert set(failed.errors) == {3, 4}
        assert all(isinstance(e, BatchStepError) for e in failed.errors.values())
        warned = [e for e in logs if e["event"] == "engine.out_of_memory"]
        if relieved:
            assert len(engine.prefix_cache) == 0 and mx.get_cache_memory() == 0 and len(warned) == 1, warned
            assert warned[0]["dropped_bytes"] >= kept > 0 and "--prompt-cache-bytes" in warned[0]["hint"]
        else:
            assert engine.prefix_cache.nbytes >= kept and mx.get_cache_memory() > 0 and warned == []
    again = run_batch(engine, reqs)
    assert again.errors == {} and again.ids == before.ids


def test_a_prefix_that_cannot_be_kept_is_skipped():
    """Out of memory while keeping a prefix skips that prefix alone, with one warning."""
    # Its request ends as it would have, and the next one keeps its prefix.
    from mlxrt.synthetic.build import ensure_model
    from mlxrt.worker import prefix_cache
    from structlog.testing import capture_logs

    engine = Engine(str(ensure_model("tiny")), options=EngineOptions())
    lone = gen(1, "The quick brown fox", max_tokens=24)
    before = run_alone(engine, lone)[0]
    assert len(engine.prefix_cache) > 0
    engine.clear_cache()
    fail_once(prefix_cache, "owned", RuntimeError(OOM))
    with capture_logs() as logs:
        assert run_alone(engine, lone)[0] == before
    assert len(engine.prefix_cache) == 0
    assert [e["hint"].split(";")[0] for e in logs if e["event"] == "engine.out_of_memory"] == [
        "a prefix was not kept"]
    assert run_alone(engine, lone)[0] == before and len(engine.prefix_cache) > 0
