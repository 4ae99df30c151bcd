"""The prefill scheduler in-process: who gets prefilled and who gets tokens when, and that each request's
tokens stay its tokens alone.

The model is slowed on purpose: every prefill call sleeps `SLOW_S`, longer than the 1 ms budget, so each
engine step runs exactly one prefill chunk of `STEP` tokens (the floor and the ceiling of the chunk size
are both `STEP`), then one decode step for every running sequence. The tests assert the order of events,
never how long anything took.
"""

from __future__ import annotations

import time

import pytest
from mlxrt import Runtime
from mlxrt.ipc.protocol import DEFAULT_PROMPT_CONCURRENCY, EngineOptions, Generate, SamplingParams
from mlxrt.orchestrator.config import engine_from_env
from mlxrt.worker.engine import BatchStepError, Engine
from mlxrt.worker.prefill import MAX_SKIPS, ChunkSizer
from support import TRANSPORTS

STEP = 32
SLOW_S = 0.005
LONG = [100 + (i * 7) % 100 for i in range(12 * STEP)]  # 12 chunks


def long_prompt(k: int, chunks: int) -> list[int]:
    """A prompt of `chunks` chunks, its own for each `k`."""
    return [100 + (i * 7 + k) % 100 for i in range(chunks * STEP)]


def short_prompt(k: int) -> list[int]:
    """A prompt of one chunk, one of 40."""
    return [5 + k % 40] + [50 + (i + k) % 40 for i in range(10)]


class Slow:
    """The engine's model, each prefill call (more than one token) sleeping `SLOW_S` and noted as
    ("chunk", the request it prefills)."""

    def __init__(self, engine: Engine, events: list) -> None:
        self._engine = engine
        self._model = engine.model
        self._events = events

    def __call__(self, x, cache=None, **kw):
        if x.shape[-1] > 1:
            e = self._engine
            owners = [p.seq for p in e._prefills if p.cache is cache]
            owners += [e._solo.seq] if e._solo is not None and e._solo.cache is cache else []
            self._events.append(("chunk", owners[0].req.id if owners else -1))
            time.sleep(SLOW_S)
        return self._model(x, cache=cache, **kw)

    def __getattr__(self, name):
        return getattr(self._model, name)


class Recording:
    """The engine's model, noting each prefill call's (tokens, cache length after) in `ends` and its
    (rows, tokens) in `shapes`."""

    def __init__(self, model) -> None:
        self._model, self.ends, self.shapes = model, [], []

    def __call__(self, x, cache=None, **kw):
        out = self._model(x, cache=cache, **kw)
        if x.shape[-1] > 1:
            self.ends.append((x.shape[-1], cache[0].offset))
            self.shapes.append(tuple(x.shape))
        return out

    def __getattr__(self, name):
        return getattr(self._model, name)


class Failing(Slow):
    """`Slow`, but a chunk of request `req_id` raises."""

    def __init__(self, engine: Engine, model, events: list, req_id: int) -> None:
        super().__init__(engine, events)
        self._model, self._req_id = model, req_id

    def __call__(self, x, cache=None, **kw):
        if x.shape[-1] > 1 and any(p.cache is cache and p.seq.req.id == self._req_id
                                   for p in self._engine._prefills):
            raise RuntimeError("a chunk failed on purpose")
        return super().__call__(x, cache=cache, **kw)


class Events:
    """A listener that writes started / token / done into one ordered list, beside the chunks."""

    def __init__(self) -> None:
        self.events: list[tuple[str, int]] = []
        self.ids: dict[int, list[int]] = {}
        self.stats: dict = {}
        self.errors: dict[int, BaseException] = {}

    def started(self, req_id: int) -> None:
        self.events.append(("started", req_id))

    def token(self, req_id: int, token: int, text: str, reasoning: str = "", calls=None, **kw) -> None:
        self.ids.setdefault(req_id, []).append(token)
        self.events.append(("token", req_id))

    def done(self, req_id: int, stats, text: str, reasoning: str = "", calls=None, **kw) -> None:
        self.stats[req_id] = stats
        self.events.append(("done", req_id))

    def failed(self, req_id: int, exc: BaseException) -> None:
        self.errors[req_id] = exc

    def first(self, kind: str, what: int) -> int:
        """Where the first (kind, what) event is."""
        return self.events.index((kind, what))


def gen(i: int, ids: list[int], max_tokens: int = 8) -> Generate:
    return Generate(id=i, prompt_ids=ids, params=SamplingParams(max_tokens=max_tokens, ignore_eos=True))


@pytest.fixture(scope="module")
def engine(tiny_model):
    """An engine with a 1 ms budget, chunks of `STEP` tokens and no prefix cache (each prompt prefilled)."""
    return Engine(tiny_model, options=EngineOptions(prefill_budget_ms=1, prefill_step_size=STEP,
                                                    prompt_cache_bytes=0))


@pytest.fixture(scope="module")
def alone(tiny_model):
    """Each request's tokens alone, on an engine of their own (memoised by prompt and length)."""
    engine = Engine(tiny_model, options=EngineOptions(prefill_budget_ms=1, prefill_step_size=STEP,
                                                      prompt_cache_bytes=0))
    memo: dict = {}

    def tokens(req: Generate) -> list[int]:
        key = (tuple(req.prompt_ids), req.params.max_tokens)
        if key not in memo:
            rec = Events()
            engine.submit(req, rec)
            while engine.busy:
                engine.step()
            memo[key] = rec.ids[req.id]
        return memo[key]

    return tokens


@pytest.fixture
def slowed(engine):
    """The engine with its prefill slowed; the events list that notes its chunks."""
    rec = Events()
    model = engine.model
    engine.model = Slow(engine, rec.events)
    yield engine, rec
    engine.model = model


def run(engine: Engine, rec: Events, arrivals: dict[int, list[Generate]]) -> None:
    """Step until idle, submitting arrivals[k] before step k; ("step", k) noted after step k."""
    k = 0
    while engine.busy or any(s >= k for s in arrivals):
        for req in arrivals.get(k, []):
            engine.submit(req, rec)
        engine.step()
        rec.events.append(("step", k))
        k += 1


def test_a_decodes_between_the_chunks_of_a_long_prompt(slowed, alone):
    """A keeps getting a token between every two prefill chunks of B; both keep their tokens alone."""
    engine, rec = slowed
    a, b = gen(1, short_prompt(0), max_tokens=40), gen(2, LONG, max_tokens=4)
    want = {1: alone(a), 2: alone(b)}
    run(engine, rec, {0: [a], 3: [b]})
    ev = rec.events
    b_chunks = [i for i, e in enumerate(ev) if e == ("chunk", 2)]
    assert len(b_chunks) == len(LONG) // STEP  # the whole prompt, one chunk per step
    assert rec.first("started", 2) < b_chunks[0] and b_chunks[-1] < rec.first("token", 2)
    # At B's first chunk A moves from the fast path into the batch; it decodes in that very step.
    for lo, hi in zip(b_chunks, b_chunks[1:], strict=False):
        assert ("token", 1) in ev[lo:hi], f"A got no token between B's chunks at {lo} and {hi}: {ev}"
    assert rec.ids == want
    assert rec.stats[2].prefill_ms > 0 and rec.stats[1].longest_gap_ms > 0


def test_a_short_prompt_goes_before_the_rest_of_a_long_one(slowed, alone):
    """C, arriving while B prefills, is prefilled next and gets its first token before B's; B waited."""
    engine, rec = slowed
    a, b, c = gen(1, short_prompt(1), max_tokens=30), gen(2, LONG, max_tokens=4), gen(3, short_prompt(2), 4)
    want = {1: alone(a), 2: alone(b), 3: alone(c)}
    run(engine, rec, {0: [a], 2: [b], 5: [c]})
    ev = rec.events
    after_c = [e for e in ev[rec.first("started", 3):] if e[0] == "chunk"]
    assert after_c[0] == ("chunk", 3)  # the next chunk is C's (its whole prompt)
    assert ("chunk", 2) in after_c[1:]  # B still had chunks to go
    assert rec.first("token", 3) < rec.first("token", 2)
    assert rec.ids == want
    assert rec.stats[2].prefill_wait_ms > 0  # B waited behind C's chunk
    assert rec.stats[3].prefill_wait_ms == 0


def test_a_lone_prompt_being_prefilled_lets_a_short_one_ahead(slowed, alone):
    """B alone (the fast path) is prefilling when C arrives: C's first token still comes before B's."""
    engine, rec = slowed
    b, c = gen(2, LONG, max_tokens=4), gen(3, short_prompt(3), max_tokens=4)
    want = {2: alone(b), 3: alone(c)}
    run(engine, rec, {0: [b], 3: [c]})
    assert rec.first("token", 3) < rec.first("token", 2)
    assert rec.ids == want


def test_a_prompt_gets_its_first_token_in_the_step_that_ends_its_prefill(slowed, alone):
    """C, prefilled in one chunk beside a decoding A, gets its first token in that chunk's step, not a
    step (a budget's prefill) later; B's last chunk likewise; all keep their tokens alone."""
    engine, rec = slowed
    a, b, c = gen(1, short_prompt(3), max_tokens=30), gen(2, long_prompt(5, 3), 4), gen(3, short_prompt(4), 4)
    want = {1: alone(a), 2: alone(b), 3: alone(c)}
    run(engine, rec, {0: [a], 2: [b], 3: [c]})
    ev = rec.events
    for rid in (3, 2):
        last_chunk = max(i for i, e in enumerate(ev) if e == ("chunk", rid))
        first_token = rec.first("token", rid)
        assert last_chunk < first_token
        assert not [e for e in ev[last_chunk:first_token] if e[0] == "step"], f"{rid} waited a step: {ev}"
    assert rec.ids == want


def test_a_stream_of_long_prompts_does_not_starve_a_short_one(slowed, alone):
    """Long prompts keep arriving; a short one arriving among them is prefilled at once, and long ones
    take turns: none is passed over more than MAX_SKIPS chunks in a row."""
    engine, rec = slowed
    longs = [gen(10 + k, long_prompt(k, 4), max_tokens=2) for k in range(4)]
    c = gen(3, short_prompt(4), max_tokens=4)
    want = {r.id: alone(r) for r in [*longs, c]}
    run(engine, rec, {0: longs[:2], 2: [longs[2], c], 3: [longs[3]]})
    assert all(rec.first("token", 3) < rec.first("token", r.id) for r in longs)
    assert rec.ids == want
    for r in longs:  # each waits at most MAX_SKIPS chunks, and its turn among the others passed over
        assert longest_pass_over(rec, r.id) <= MAX_SKIPS + len(longs)


def test_a_flood_of_short_prompts_does_not_starve_a_long_one(slowed, alone):
    """While B prefills, a short prompt is always waiting (the next arrives as soon as the last is
    prefilled): B still gets a chunk at least once in every MAX_SKIPS + 1, and its first token comes
    while the flood goes on."""
    engine, rec = slowed
    b = gen(2, LONG, max_tokens=2)
    shorts = [gen(100 + k, short_prompt(k), max_tokens=1) for k in range(12 * (MAX_SKIPS + 1) + 8)]
    want = {2: alone(b), **{s.id: alone(s) for s in shorts}}
    engine.submit(b, rec)
    sent = 0
    while engine.busy or sent < len(shorts):
        waiting = engine._waiting or any(p.seq.req.id != 2 for p in engine._prefills)
        if sent < len(shorts) and not waiting:
            engine.submit(shorts[sent], rec)
            sent += 1
        engine.step()
    assert rec.first("token", 2) < rec.first("started", shorts[-1].id)
    assert longest_pass_over(rec, 2) == MAX_SKIPS  # passed over, but never more than the bound
    assert rec.ids == want


def test_no_budget_keeps_mlx_lm_prefill_and_identity(tiny_model, alone):
    """prefill_budget_ms=0: mlx-lm's own prefill, as before; each request's tokens are its tokens alone."""
    e = Engine(tiny_model, options=EngineOptions(prefill_budget_ms=0, prefill_step_size=STEP,
                                                 prompt_cache_bytes=0))
    assert not e.scheduled
    reqs = [gen(1, short_prompt(5), 20), gen(2, LONG, 4), gen(3, short_prompt(6), 4)]
    rec = Events()
    run(e, rec, {0: reqs[:1], 2: reqs[1:2], 4: reqs[2:]})
    assert rec.ids == {r.id: alone(r) for r in reqs}


def test_cancel_and_failure_during_prefill_end_that_request_alone(slowed, alone):
    """B cancelled between two of its chunks ends as cancelled, D whose chunk raises fails alone; A keeps
    its tokens, and the engine ends idle and serves the next request as alone."""
    engine, rec = slowed
    a, b, d = gen(1, short_prompt(7), 30), gen(2, LONG, 4), gen(4, long_prompt(9, 3), 4)
    c = gen(3, short_prompt(8), 4)
    want = {1: alone(a), 3: alone(c)}
    engine.model = Failing(engine, engine.model._model, rec.events, req_id=4)
    engine.submit(a, rec)
    for _ in range(3):
        engine.step()
    engine.submit(b, rec)
    engine.submit(d, rec)
    engine.step()  # D has the fewest tokens left: its chunk raises, then B's first chunk runs
    engine.step()
    assert engine.cancel(2)
    while engine.busy:
        engine.step()
    assert isinstance(rec.errors[4], BatchStepError) and rec.stats[2].finish_reason == "cancelled"
    assert ("chunk", 2) in rec.events and 2 not in rec.ids and 4 not in rec.ids
    engine.submit(c, rec)
    while engine.busy:
        engine.step()
    assert rec.ids == want and not engine._prefills


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_prefill_figures_cross_the_wire(tiny_model, transport):
    """A worker process reports each request's prefill_ms, prefill_wait_ms and longest_gap_ms."""
    with Runtime(model=tiny_model, transport=transport, engine=EngineOptions(prompt_cache_bytes=0)) as rt:
        c = rt.generate("The harbour was quiet that night and the boats " * 6, max_tokens=6, ignore_eos=True)
    assert c.stats.prefill_ms > 0 and c.stats.longest_gap_ms > 0 and c.stats.prefill_wait_ms == 0


def test_chunks_follow_the_measured_rate_within_their_bounds():
    """A chunk is the measured tokens/ms times the budget left, in multiples of 64, within
    [32, prefill_step_size]; before any measure it is the floor; with no budget, the step size."""
    sizer = ChunkSizer(200, 2048)
    assert sizer.size() == 32
    sizer.record(640, 0.2)  # 3.2 tokens/ms
    assert sizer.size() == 640 and sizer.size(spent_ms=100) == 320 and sizer.size(spent_ms=199) == 32
    sizer.record(20_000, 0.2)  # a faster machine: the average climbs, the step size caps it
    assert sizer.size() == 2048
    assert ChunkSizer(0, 2048).size() == 2048


def test_on_the_grid_chunks_are_rungs_ending_on_their_multiples():
    """On the grid (CUDA): a chunk is a power of two of tokens, cut to end where the cache holds a
    multiple of it, sized so that its work and a graph's build fit the budget; the rung holds within
    its margin; a step's budget left too small for the next chunk, or under half of it, gives 0."""
    s = ChunkSizer(200, 2048, grid=True)
    assert s.size() == 2048 and s.size(cached=100) == 1948  # nothing timed yet: the top rung, as mlx-lm
    s.record(2048, 0.3, (1, 2048, 2048))  # a first-met shape: timed net of a build, 2048 in 250 ms
    assert s.rate == pytest.approx(2048 / 250)
    assert s.size() == 1024 and s.size(cached=1500) == 548  # 1,228 tokens in 200 ms less a build
    s.rate = 6.5  # 975 tokens: 1,024 is within the margin, kept
    assert s.size() == 1024
    s.rate = 6.0  # 900: 1,024 is not
    assert s.size() == 512
    s.rate = 14.0  # 2,100: twice the rung fits
    assert s.size() == 2048
    s.rate = 8.0
    assert s.size() == 1024
    assert s.size(spent_ms=100) == 0  # 128 ms of work and a build do not fit the 100 ms left
    assert s.size(spent_ms=100, cached=800) == 224  # 28 ms and a build do
    assert s.size(spent_ms=101, cached=800) == 0  # but under half the budget is left: no next call
    assert s.size(cached=1020) == 1028  # 4 tokens to the grid: they take a rung with them
    assert ChunkSizer(200, 2048).size(cached=100) == 32  # off the grid, nothing changes


def test_on_the_grid_a_segment_that_fits_the_budget_goes_whole_and_batches_fill_it():
    """On the grid, the rest of a segment whose work and build fit the budget left is one call, off the
    grid (an agent's turn); a longer one is cut on the rung. Short prompts batched together may fill the
    budget less a build."""
    s = ChunkSizer(200, 2048, grid=True)
    s.rate = 8.0
    assert s.size(cached=1020, rest=300) == 300  # 37.5 ms and a build
    assert s.size(cached=0, rest=1300) == 1024  # 162.5 ms and a build do not fit: the rung
    assert s.size(spent_ms=100, cached=0, rest=500) == 0  # 62.5 ms and a build: not in the 100 ms left
    assert s.room() == 1200 and s.room(spent_ms=100) == 400
    assert ChunkSizer(200, 2048).room() == ChunkSizer(200, 2048).size()  # off the grid: the chunk


def test_on_the_grid_a_shape_counts_as_met_while_mlx_would_keep_its_graph():
    """The grid remembers the last MAX_SHAPES shapes, as MLX keeps that many attention graphs: a shape
    met again costs no build and is timed whole; a new one is timed net of a build (at most half its
    time); one pushed out since is a first meeting again."""
    from mlxrt.worker.prefill import BUILD_MS, MAX_SHAPES

    s = ChunkSizer(200, 2048, grid=True)
    s.record(1024, 0.25, (1, 1024, 1024))  # first met: 200 ms of work
    assert s.rate == pytest.approx(5.12)
    s.record(1024, 0.2, (1, 1024, 1024))  # met again: 200 ms, no build
    assert s.rate == pytest.approx(5.12)
    assert s.cost_ms(1024, 0) == pytest.approx(200) and s.cost_ms(1024, 1024) == pytest.approx(200 + BUILD_MS)
    for k in range(MAX_SHAPES):
        s.record(1024, 0.25, (1, 1024, 2048 + k))
    assert s.cost_ms(1024, 2048 + MAX_SHAPES - 1024 - 1) == pytest.approx(200)  # still kept
    assert s.cost_ms(1024, 0) == pytest.approx(200 + BUILD_MS)  # pushed out by them: new again
    s.record(1024, 0.06, (1, 1024, 1))  # mostly a build: half of it counts as work, never less
    assert s.rate == pytest.approx((5.12 + 1024 / 30) / 2)


def test_on_the_grid_small_chunks_do_not_keep_the_rung_small():
    """Tiny chunks' times are mostly builds and overheads: a rate measured on them (here 32-token
    prompts of 100 ms) still gives rungs of at least GRID_MIN_RUNG tokens, and the rate taken net of
    the builds climbs as they run."""
    from mlxrt.worker.prefill import GRID_MIN_RUNG

    s = ChunkSizer(200, 2048, grid=True)
    s.record(32, 0.1, (1, 32, 32))
    assert s.size(cached=32) == GRID_MIN_RUNG - 32
    rates = []
    for k in range(4):  # 256-token chunks of new shapes, 90 ms each
        s.record(256, 0.09, (1, 256, 512 + 256 * k))
        rates.append(s.rate)
    assert rates == sorted(rates) and s.size(cached=1536) == 512  # 5.4 tokens/ms net: 805 tokens fit


def grid_engine(model: str, budget_ms: int, rate: float | None = None) -> tuple[Engine, Recording, Events]:
    """An engine whose chunks keep to the grid (as on CUDA), `budget_ms` a step (its rate preset to
    `rate` tokens/ms, if given), its prefill calls recorded, with 45 tokens of LONG already cached."""
    engine = Engine(model, options=EngineOptions(prefill_budget_ms=budget_ms, prefill_step_size=STEP))
    engine.sizer = ChunkSizer(budget_ms, STEP, grid=True)
    engine.sizer.rate = rate
    engine.model = recording = Recording(engine.model)
    rec = Events()
    run(engine, rec, {0: [gen(1, LONG[:45] + [7, 8, 9], max_tokens=2)]})
    recording.ends.clear()
    return engine, recording, rec


def test_on_the_grid_a_prompt_after_an_odd_prefix_is_cut_on_the_rung(tiny_model, alone):
    """A prompt that finds 45 tokens cached, prefilled on the grid: its first chunk fills the cache to
    the next multiple of the rung, every other chunk but its last ends on one; its tokens stay its own."""
    engine, recording, rec = grid_engine(tiny_model, 1)
    ends = recording.ends
    b = gen(2, LONG, max_tokens=4)
    run(engine, rec, {0: [b]})
    assert ends[0] == (STEP - 45 % STEP, 2 * STEP)
    assert all(end % STEP == 0 for _, end in ends[:-1]) and ends[-1][1] == len(LONG) - 1
    assert rec.ids[2] == alone(b)


def test_on_the_grid_the_scheduler_cuts_a_prompt_beside_a_stream_on_the_rung(tiny_model, alone):
    """With a stream decoding (so the scheduler, not the fast path, prefills), a prompt that finds 45
    tokens cached is cut on the grid as a lone one is; both keep their tokens alone."""
    engine, recording, rec = grid_engine(tiny_model, 1)
    a, b = gen(2, short_prompt(4), max_tokens=30), gen(3, LONG, max_tokens=4)
    run(engine, rec, {0: [a], 2: [b]})
    ends = [e for e in recording.ends if e[1] > len(short_prompt(4))]  # B's chunks, not A's prompt
    assert ends[0] == (STEP - 45 % STEP, 2 * STEP) and engine.prefill_calls >= len(ends)
    assert all(end % STEP == 0 for _, end in ends[:-1]) and ends[-1][1] == len(LONG) - 1
    assert rec.ids[2] == alone(a) and rec.ids[3] == alone(b)


def test_on_the_grid_what_fits_the_budget_goes_in_one_call(tiny_model, alone):
    """On the grid with a budget that holds them (a fast rate set), beside a decoding stream: a prompt's
    rest after an odd cached prefix is one call, not a piece and a rung; four short prompts arriving
    together are one call, past the chunk's tokens; each keeps its tokens alone."""
    engine, recording, rec = grid_engine(tiny_model, 10_000, rate=1e6)
    a, b = gen(2, short_prompt(0), max_tokens=30), gen(3, LONG[: 45 + STEP - 2], max_tokens=4)
    run(engine, rec, {0: [a], 2: [b]})
    assert [e for e in recording.ends if e[1] > len(short_prompt(0))] == [(STEP - 3, 45 + STEP - 3)]
    before = (engine.prefill_calls, engine.prefill_batched)
    c = gen(4, short_prompt(0), max_tokens=30)
    shorts = [gen(5 + k, short_prompt(k + 1), max_tokens=3) for k in range(4)]  # 4 x 11 > STEP tokens
    run(engine, rec, {0: [c], 2: shorts})
    # one call for the four (c, alone then, went the fast path's way)
    assert (engine.prefill_calls - before[0], engine.prefill_batched - before[1]) == (1, 4)
    for r in [a, b, c, *shorts]:
        assert rec.ids[r.id] == alone(r)


def test_on_the_grid_a_burst_keeps_to_few_shapes(tiny_model, alone, monkeypatch):
    """On the grid, six prompts of 5 to 10 tokens arriving together are prefilled in calls of a power of
    two of rows (four, then two), each padded to a multiple of CHUNK_MULTIPLE tokens, so the next burst,
    split otherwise, meets the same shapes, and MLX keeps its freed buffers for them; each keeps its
    tokens alone. Off the grid, each call hands MLX's buffers back."""
    import mlx.core as mx
    from mlxrt.worker.prefill import CHUNK_MULTIPLE

    engine, recording, rec = grid_engine(tiny_model, 10_000, rate=1e6)
    recording.shapes.clear()
    cleared, clear = [], mx.clear_cache
    monkeypatch.setattr(mx, "clear_cache", lambda: cleared.append(1) or clear())
    burst = [gen(600 + k, short_prompt(k)[: 5 + k], max_tokens=4) for k in range(6)]
    run(engine, rec, {0: burst})
    assert recording.shapes == [(4, CHUNK_MULTIPLE), (2, CHUNK_MULTIPLE)] and not cleared
    assert all(rec.ids[r.id] == alone(r) for r in burst)
    engine.sizer.grid = False
    calls, cleared[:] = engine.prefill_calls, []
    again = [gen(700 + k, short_prompt(k + 10)[: 5 + k], max_tokens=4) for k in range(6)]
    run(engine, rec, {0: again})
    assert len(cleared) == engine.prefill_calls - calls > 0
    assert all(rec.ids[r.id] == alone(r) for r in again)


def test_on_the_grid_a_lone_prompt_keeps_mlx_buffers_between_its_chunks(tiny_model, alone, monkeypatch):
    """A lone prompt on the fast path, on the grid (as on CUDA) with a budget: its chunks leave MLX's
    freed buffers cached for the next, as the scheduler's calls do, and its last chunk hands them back.
    Off the grid, or without the scheduler (budget 0), each chunk hands them back. Its tokens stay its
    own every way."""
    import mlx.core as mx

    engine, recording, rec = grid_engine(tiny_model, 1)
    cleared, clear = [], mx.clear_cache
    monkeypatch.setattr(mx, "clear_cache", lambda: cleared.append(1) or clear())
    b, c, d = (gen(2 + k, long_prompt(5 + k, 12), max_tokens=4) for k in range(3))
    expected = {r.id: alone(r) for r in (b, c, d)}  # before counting: the reference engine is off the grid
    cleared[:] = []
    run(engine, rec, {0: [b]})
    assert len(recording.ends) > 2 and len(cleared) == 1 and rec.ids[b.id] == expected[b.id]
    assert engine.prefill_calls == 0  # all of it on the fast path, not the scheduler's
    engine.sizer.grid = False
    recording.ends.clear()
    cleared[:] = []
    run(engine, rec, {0: [c]})
    assert len(cleared) == len(recording.ends) > 2 and rec.ids[c.id] == expected[c.id]
    unscheduled, recording, rec = grid_engine(tiny_model, 0)  # on the grid, budget 0: mlx-lm's steps
    cleared[:] = []
    run(unscheduled, rec, {0: [d]})
    assert len(cleared) == len(recording.ends) > 2 and rec.ids[d.id] == expected[d.id]


def counted_clears(monkeypatch, engine: Engine, rec: Events) -> list[tuple[int, int]]:
    """Each `mx.clear_cache` from now on, as (the scheduler's calls, the listener's events) at the time."""
    import mlx.core as mx

    cleared, clear = [], mx.clear_cache
    monkeypatch.setattr(mx, "clear_cache",
                        lambda: cleared.append((engine.prefill_calls, len(rec.events))) or clear())
    return cleared


def test_on_the_grid_a_long_prompt_hands_mlx_buffers_back_after_the_step_of_its_last_chunk(
        tiny_model, alone, monkeypatch):
    """On the grid, a long prompt prefilled beside a stream hands MLX's buffers back once: after its last
    chunk, and after its first token (the step's join reuses them), never between its chunks."""
    engine, recording, rec = grid_engine(tiny_model, 1)
    a, b = gen(2, short_prompt(5), max_tokens=30), gen(3, long_prompt(7, 12), max_tokens=4)
    run(engine, rec, {0: [a]})  # A alone first: the fast path's prompt and its own clearing
    a = gen(4, short_prompt(5), max_tokens=30)
    cleared = counted_clears(monkeypatch, engine, rec)
    calls = engine.prefill_calls
    run(engine, rec, {0: [a], 2: [b]})
    assert engine.prefill_calls - calls > 2
    (calls_then, events_then), = [c for c in cleared if c[0] > calls]  # past A's own prompt (the fast path's)
    assert calls_then == engine.prefill_calls and rec.first("token", b.id) < events_then
    assert rec.ids[a.id] == alone(a) and rec.ids[b.id] == alone(b)


def test_on_the_grid_a_chunk_runs_beside_the_decode_step_within_its_step(tiny_model, alone, monkeypatch):
    """On the grid, beside a decoding stream, a long prompt's chunk that ends inside its segment and leaves
    no budget for another call runs (on an MLX stream of its own) while the batch decodes: A's token comes
    between the chunk's launch and its wait, and the wait comes before the step ends. The chunk that ends
    the prompt runs before the decode, as every chunk does off the grid. Both keep their tokens alone."""
    from mlxrt.worker import prefill

    engine, recording, rec = grid_engine(tiny_model, 1)
    launch, wait = prefill.launch_chunk, prefill.Launched.wait

    def noted_launch(model, p, size, stream):
        rec.events.append(("launch", p.seq.req.id))
        return launch(model, p, size, stream)

    def noted_wait(self, keep):
        rec.events.append(("wait", self.p.seq.req.id))
        return wait(self, keep)

    monkeypatch.setattr(prefill, "launch_chunk", noted_launch)
    monkeypatch.setattr(prefill.Launched, "wait", noted_wait)
    for grid, k in [(True, 0), (False, 1)]:
        a = gen(2 + 2 * k, short_prompt(6 + k), max_tokens=40)
        b = gen(3 + 2 * k, long_prompt(8 + k, 12), max_tokens=4)
        engine.sizer.grid = grid
        before = engine.prefill_overlapped
        run(engine, rec, {0: [a], 2: [b]})
        ev = rec.events
        launches = [i for i, e in enumerate(ev) if e == ("launch", b.id)]
        waits = [i for i, e in enumerate(ev) if e == ("wait", b.id)]
        assert len(launches) == len(waits) == 12  # 383 tokens in chunks of 32, its last token the batch's
        assert all(lo < hi for lo, hi in zip(launches, waits, strict=True))
        spans = [ev[lo:hi] for lo, hi in zip(launches, waits, strict=True)]
        assert not any(e[0] == "step" for span in spans for e in span)  # each waited for within its step
        beside = [span for span in spans if ("token", a.id) in span]
        assert len(beside) == engine.prefill_overlapped - before == (11 if grid else 0)
        assert ("token", a.id) not in spans[-1]  # the prompt's last chunk: its join comes in its step
        assert rec.ids[a.id] == alone(a) and rec.ids[b.id] == alone(b)


def test_on_the_grid_only_a_step_s_last_chunk_inside_its_segment_goes_beside_the_decode(tiny_model):
    """On the grid, with sequences decoding, a chunk goes beside the decode step where it ends inside its
    segment and the budget left after it, at its expected cost (a build counted for a shape not met),
    holds no other call; not where it ends its segment, nor with nothing decoding, nor off the grid."""
    from mlxrt.worker.prefill import Prefill

    engine, _, rec = grid_engine(tiny_model, 200)
    p = Prefill(None, [], [list(range(2048)), [1]], [])  # a prompt's first segment, 2,048 tokens
    engine.sizer.rate = 10.0  # tokens a ms: 512 tokens and a build cost 101 ms
    assert not engine._overlaps(p, 512, 0.0)  # nothing decoding
    for k in range(2):
        engine.submit(gen(20 + k, short_prompt(20 + k), max_tokens=50), rec)
    while not engine._running:
        engine.step()
    engine.sizer.rate = 10.0
    assert engine._overlaps(p, 512, 0.0)  # 99 ms of 200 left after it: under half, no other call
    assert not engine._overlaps(p, 256, 0.0)  # 124 ms left: another call may follow
    assert engine._overlaps(p, 256, 0.03)  # 30 ms into the step: 94 ms left
    assert not engine._overlaps(p, 2048, 0.0)  # it ends its segment
    engine.sizer.grid = False
    assert not engine._overlaps(p, 512, 0.0)


def test_on_the_grid_a_chunk_beside_the_decode_times_the_rate_only_if_the_step_waited_for_it(tiny_model,
                                                                                             monkeypatch):
    """A chunk that ran beside the decode step is timed into the rate only where it was still running when
    the step came to wait for it: one that had ended meanwhile ended at a time not known."""
    from mlxrt.worker import prefill

    wait = prefill.Launched.wait
    for waited, timed in [(0.0, 1), (1.0, 12)]:  # of B's 12 chunks, 11 beside the decode
        engine, _, rec = grid_engine(tiny_model, 1)
        recorded: list[int] = []

        def waited_so(self, keep, waited=waited):
            seconds = wait(self, keep)
            self.waited = waited
            return seconds

        monkeypatch.setattr(prefill.Launched, "wait", waited_so)
        monkeypatch.setattr(engine.sizer, "record", lambda n, seconds, shape=None, to=recorded: to.append(n))
        run(engine, rec, {0: [gen(2, short_prompt(9), max_tokens=40)], 2: [gen(3, long_prompt(12, 12), 4)]})
        assert engine.prefill_overlapped == 11 and len(recorded) == 1 + timed  # A's prompt: the fast path's


def test_on_the_grid_a_chunk_that_fails_beside_the_decode_step_fails_its_prompt_alone(tiny_model, alone,
                                                                                        monkeypatch):
    """On the grid, a long prompt's chunk that fails while it runs beside the batch's decode step (MLX
    raises when it is waited for) fails that prompt, with the step's error, and is not counted as a call;
    the decoding stream goes on with its tokens alone, and the engine serves the next prompt as alone."""
    from mlxrt.worker import prefill

    engine, recording, rec = grid_engine(tiny_model, 1)
    a, b, c = (gen(2, short_prompt(8), max_tokens=40), gen(3, long_prompt(10, 12), max_tokens=4),
               gen(4, long_prompt(11, 4), max_tokens=4))
    wait, waits, done = prefill.Launched.wait, [], []

    def failing_wait(self, keep):
        waits.append(self.p.seq.req.id)
        if self.p.seq.req.id == b.id and waits.count(b.id) == 3:
            raise RuntimeError("a chunk failed on purpose")
        done.append(self.p.seq.req.id)
        return wait(self, keep)

    monkeypatch.setattr(prefill.Launched, "wait", failing_wait)
    calls = engine.prefill_calls
    run(engine, rec, {0: [a], 2: [b]})
    assert engine.prefill_overlapped == 2 and isinstance(rec.errors[b.id], BatchStepError)
    assert engine.prefill_calls - calls == len(done) == 2  # B's first two chunks (A's went the fast path)
    assert b.id not in rec.ids and rec.ids[a.id] == alone(a) and not engine._prefills
    run(engine, rec, {0: [a := gen(5, short_prompt(8), max_tokens=40)], 2: [c]})
    assert rec.ids[a.id] == alone(a) and rec.ids[c.id] == alone(c) and list(rec.errors) == [b.id]


def test_on_the_grid_chats_under_new_system_prompts_keep_mlx_buffers(tiny_model, monkeypatch):
    """On the grid, a burst of short chats whose system prompts are not cached yet goes in two calls each
    (the system prompt, then the rest), none in pieces: MLX's buffers stay cached for the next calls; so
    too where the first began alone on the fast path and was handed over."""
    from support import chat, run_batch
    from support import gen as request

    opts = EngineOptions(prefill_budget_ms=10_000, prefill_step_size=512)
    engine, ref = Engine(tiny_model, options=opts), Engine(tiny_model, options=opts)
    engine.sizer = ChunkSizer(10_000, 512, grid=True)
    engine.sizer.rate = 1e6
    reqs = [request(800 + k, max_tokens=4,
                    messages=chat(f"Ship {k}: what did you see?", system=f"Lighthouse {k} log. " * 3))
            for k in range(4)]
    cleared = counted_clears(monkeypatch, engine, Events())
    burst = run_batch(engine, reqs)
    assert engine.prefill_calls >= 2 and engine.prefill_batched >= 8 and not burst.errors and cleared == []
    first, *rest = [request(900 + k, max_tokens=4, messages=chat(f"Ship {k}?", system=f"Tower {k} log. " * 3))
                    for k in range(4)]
    late = Events()
    engine.submit(first, late)
    engine.step()  # alone: the fast path runs its system prompt, whole
    assert engine._solo is not None and engine._solo.prefilling
    run(engine, late, {0: rest})  # the others hand it over to the scheduler
    assert cleared == [] and all(late.ids[r.id] == run_batch(ref, [r]).ids[r.id] for r in [first, *rest])
    assert all(burst.ids[r.id] == run_batch(ref, [r]).ids[r.id] for r in reqs)


def test_on_the_grid_a_prompt_handed_over_from_the_fast_path_hands_its_buffers_back(
        tiny_model, alone, monkeypatch):
    """A long prompt that began alone on the fast path (its chunks keeping MLX's buffers) and went on in
    the scheduler when a stream arrived, its rest in one call there, still hands them back once it is in."""
    engine, recording, rec = grid_engine(tiny_model, 1)
    b, a = gen(3, long_prompt(8, 12), max_tokens=4), gen(4, short_prompt(6), max_tokens=20)
    cleared = counted_clears(monkeypatch, engine, rec)
    engine.submit(b, rec)
    engine.step()
    engine.step()
    assert engine.prefill_calls == 0 and len(recording.ends) == 2 and cleared == []  # two fast-path chunks
    engine.sizer.budget_ms, engine.sizer.rate = 10_000, 1e6  # the rest fits one call
    run(engine, rec, {0: [a]})
    assert engine.prefill_calls == 1  # B's rest, beside A's prompt: B itself cut nothing in the scheduler
    assert len(cleared) == 1 and rec.first("token", b.id) < cleared[0][1]
    assert rec.ids[a.id] == alone(a) and rec.ids[b.id] == alone(b)


def test_on_the_grid_a_long_prompt_cancelled_between_its_chunks_hands_its_buffers_back(
        tiny_model, alone, monkeypatch):
    """A long prompt cancelled between two of its chunks in the scheduler hands MLX's buffers back at
    once (the engine may step no more); the stream beside it keeps its tokens."""
    engine, recording, rec = grid_engine(tiny_model, 1)
    a, b = gen(2, short_prompt(7), max_tokens=20), gen(3, long_prompt(9, 12), max_tokens=4)
    engine.submit(a, rec)
    engine.step()
    engine.submit(b, rec)
    for _ in range(3):
        engine.step()
    cleared = counted_clears(monkeypatch, engine, rec)
    calls = engine.prefill_calls
    assert calls >= 2 and any(p.seq.req.id == b.id for p in engine._prefills)
    assert engine.cancel(b.id) and len(cleared) == 1
    run(engine, rec, {})
    assert len(cleared) == 1 and rec.ids[a.id] == alone(a)  # (`alone`'s own engine clears: counted last)


def test_on_the_grid_a_lone_prompt_cancelled_between_its_chunks_hands_its_buffers_back(
        tiny_model, monkeypatch):
    """A long prompt alone on the fast path, cancelled between two of its chunks (which kept MLX's
    buffers), hands them back at once."""
    engine, recording, rec = grid_engine(tiny_model, 1)
    b = gen(3, long_prompt(10, 12), max_tokens=4)
    cleared = counted_clears(monkeypatch, engine, rec)
    engine.submit(b, rec)
    engine.step()
    engine.step()
    assert engine._solo is not None and len(recording.ends) == 2 and cleared == []
    assert engine.cancel(b.id) and len(cleared) == 1 and not engine.busy


def test_prefill_budget_is_checked_and_read_from_the_environment(monkeypatch):
    """A negative budget is refused naming the field; MLXRT_PREFILL_BUDGET_MS sets it."""
    with pytest.raises(ValueError, match="prefill_budget_ms"):
        EngineOptions(prefill_budget_ms=-1).validate()
    monkeypatch.setenv("MLXRT_PREFILL_BUDGET_MS", "75")
    assert engine_from_env().prefill_budget_ms == 75


def longest_pass_over(rec: Events, rid: int) -> int:
    """The most chunks of other requests in a row while `rid` was admitted and not yet prefilled."""
    lo, hi = rec.first("started", rid), max(i for i, e in enumerate(rec.events) if e == ("chunk", rid))
    longest = run_ = 0
    for e in rec.events[lo:hi]:
        if e[0] == "chunk":
            run_ = 0 if e[1] == rid else run_ + 1
            longest = max(longest, run_)
    return longest


def test_the_budget_left_on_auto_schedules_and_chunks_on_the_grid_on_cuda(tiny_model):
    """prefill_budget_ms left on auto: the scheduler runs with the default budget on every backend, its
    chunks on the grid on MLX's CUDA backend, where each new shape costs an attention graph (measured
    there: the docs), and the batch takes every ready prompt in one call; 0 keeps mlx-lm's prefill, its
    prompts `prompt_concurrency` a call (mlx-lm's 8 on auto)."""
    from mlxrt.ipc.protocol import DEFAULT_PREFILL_BUDGET_MS
    from mlxrt.worker.limits import on_cuda

    assert EngineOptions().prefill_budget_ms is None
    e = Engine(tiny_model, options=EngineOptions(prompt_cache_bytes=0))
    assert e.scheduled and e.sizer.budget_ms == DEFAULT_PREFILL_BUDGET_MS and e.sizer.grid is on_cuda()
    assert e._batch.prefill_batch_size == e.decode_concurrency
    off = Engine(tiny_model, options=EngineOptions(prompt_cache_bytes=0, prefill_budget_ms=0))
    assert not off.scheduled and off.sizer.budget_ms == 0
    assert off._batch.prefill_batch_size == off.prefill.batch_prompts == DEFAULT_PROMPT_CONCURRENCY


def test_a_burst_of_short_prompts_is_prefilled_in_batched_calls(slowed, alone):
    """Six short prompts arriving together are prefilled three to a call (as many as fit the 32-token
    chunk, padding counted), not one per call; each keeps its tokens alone, and the report counts them."""
    engine, rec = slowed
    shorts = [gen(200 + k, short_prompt(10 + k), max_tokens=6) for k in range(6)]
    want = {s.id: alone(s) for s in shorts}
    calls, batched = engine.prefill_calls, engine.prefill_batched
    run(engine, rec, {0: shorts})
    assert engine.prefill_calls - calls == 2 and engine.prefill_batched - batched == 6
    report = engine.report()
    assert (report.prefill_calls, report.prefill_batched) == (engine.prefill_calls, engine.prefill_batched)
    assert rec.ids == want
    assert all(rec.stats[s.id].prefill_ms > 0 for s in shorts)


def test_a_burst_keeps_short_first_and_a_long_prompt_in_chunks(slowed, alone):
    """A long prompt arriving in a burst of short ones: the short ones are prefilled first, together,
    and every one gets its first token before the long one; the long one still goes one chunk a call."""
    engine, rec = slowed
    b = gen(2, LONG, max_tokens=4)
    shorts = [gen(300 + k, short_prompt(20 + k), max_tokens=4) for k in range(4)]
    want = {r.id: alone(r) for r in [b, *shorts]}
    batched = engine.prefill_batched
    run(engine, rec, {0: [b, *shorts]})
    assert engine.prefill_batched - batched >= 3  # three fit one call beside each other
    assert all(rec.first("token", s.id) < rec.first("token", 2) for s in shorts)
    assert sum(1 for e in rec.events if e == ("chunk", 2)) == len(LONG) // STEP
    assert rec.ids == want


def test_a_burst_ready_together_joins_the_batch_in_one_step(tiny_model, alone, monkeypatch):
    """Six short prompts of 11 down to 6 tokens prefilled in one step, two to a call
    (`prompt_concurrency`), all get their first tokens in that step, as their tokens alone; the batch
    takes the three calls' caches whole (in its own order, not the calls'), merging no row of them one by
    one."""
    from mlx_lm.models.cache import BatchKVCache
    from mlxrt.worker import prefill

    merge, merged, whole, wholes = BatchKVCache.merge.__func__, [], prefill.whole_calls, []

    def spy(cls, caches):
        merged.append(sum(type(c) is prefill.CallRow for c in caches))
        return merge(cls, caches)

    def whole_spy(caches):
        out = whole(caches)
        rows = [(id(c.call), c.index) for c in caches]
        calls = list(dict.fromkeys(call for call, _ in rows))  # as `whole_calls` joins them
        grouped = sorted(rows, key=lambda r: (calls.index(r[0]), r[1]))
        wholes.append((len(caches), out is not None, rows != grouped))
        return out

    monkeypatch.setattr(BatchKVCache, "merge", classmethod(spy))
    monkeypatch.setattr(prefill, "whole_calls", whole_spy)
    engine = Engine(tiny_model, options=EngineOptions(prefill_budget_ms=60_000, prefill_step_size=STEP,
                                                      prompt_cache_bytes=0, prompt_concurrency=2,
                                                      decode_concurrency=8))
    rec = Events()
    shorts = [gen(400 + k, short_prompt(30 + k)[: 11 - k], max_tokens=5) for k in range(6)]
    run(engine, rec, {0: shorts})
    layers = len(engine.model.layers)
    assert len(wholes) == layers and all(n == 6 and took for n, took, _ in wholes) and not any(merged)
    assert wholes[0][2]  # the rows reach the batch out of their calls' order: `whole_calls` reorders them
    assert engine.prefill_calls == 3 and engine.prefill_batched == 6
    firsts = {rec.events[:rec.first("token", s.id)].count(("step", 0)) for s in shorts}
    assert firsts == {0}  # no ("step", 0) before any first token: all came in step 0
    assert rec.ids == {s.id: alone(s) for s in shorts}


@pytest.mark.parametrize("family", ["tiny", "tiny-qwen3"])
def test_the_rows_of_whole_calls_merge_as_mlx_lm_merges_them(family):
    """The rows of two batched calls (three uneven rows, one after a cached prefix; and two padded to 16
    tokens), in a shuffled order: `whole_calls` gives each row, at its place, the keys, values and length
    mlx-lm's merge of the same rows gives, and refuses part of a call or a row of another kind (mlx-lm
    merges those)."""
    import copy

    import mlx.core as mx
    from mlx_lm.generate import PromptProcessingBatch
    from mlx_lm.models.cache import BatchKVCache, KVCache, make_prompt_cache
    from mlxrt.synthetic.build import ensure_model
    from mlxrt.worker.prefill import padded_prompt, row_caches, whole_calls

    model = Engine(str(ensure_model(family)), options=EngineOptions(prompt_cache_bytes=0)).model

    def call(chunks: list[list[int]], width: int = 0, prefix: list[int] | None = None) -> list[list]:
        caches = [make_prompt_cache(model) for _ in chunks]
        if prefix is not None:  # the first row's cache holds a prefix already
            model(mx.array(prefix)[None], cache=caches[0])
            mx.eval([c.state for c in caches[0]])
        batch = PromptProcessingBatch(model, list(range(len(chunks))), caches, prefill_step_size=16)
        padded_prompt(batch, chunks, width)
        return row_caches(batch, [True] * len(chunks))

    rows = call([short_prompt(1)[:5], short_prompt(2)[:9], short_prompt(3)[:3]], prefix=short_prompt(9)[:4])
    rows += call([short_prompt(4)[:7], short_prompt(5)[:2]], width=16)
    order = [3, 0, 4, 2, 1]
    for layer in range(len(rows[0])):
        caches = [rows[i][layer] for i in order]
        plain = BatchKVCache.merge([copy.deepcopy(c) for c in caches])  # a copy is a plain KVCache
        whole = whole_calls(caches)
        assert whole is not None and whole.offset.tolist() == plain.offset.tolist()
        for i in range(len(order)):
            got, want = whole.extract(i), plain.extract(i)
            assert got.offset == want.offset and mx.array_equal(got.keys, want.keys).item()
            assert mx.array_equal(got.values, want.values).item()
        assert whole_calls(caches[:-1]) is None
        assert whole_calls([*caches[:-1], copy.deepcopy(caches[-1])]) is None
    assert all(type(copy.deepcopy(c)) is KVCache for c in rows[0])


def test_a_batched_prefill_that_fails_fails_its_rows_alone(tiny_model, alone):
    """A batched prefill call that raises fails the prompts it carried; A, decoding beside them, keeps
    its tokens, and the engine then serves the next burst as alone."""
    e = Engine(tiny_model, options=EngineOptions(prefill_budget_ms=1, prefill_step_size=STEP,
                                                 prompt_cache_bytes=0))
    a = gen(1, short_prompt(30), max_tokens=12)
    burst = [gen(400 + k, short_prompt(31 + k), max_tokens=4) for k in range(3)]
    rec, model = Events(), e.model
    e.model = FailingBatch(model)
    run(e, rec, {0: [a], 3: burst})
    e.model = model
    assert all(isinstance(rec.errors[r.id], BatchStepError) for r in burst)
    assert rec.ids[1] == alone(a) and all(r.id not in rec.ids for r in burst)
    after = [gen(500 + k, short_prompt(40 + k), 4) for k in range(3)]
    batched = e.prefill_batched
    run(e, rec, {0: after})
    assert e.prefill_batched - batched == 3 and all(rec.ids[r.id] == alone(r) for r in after)


@pytest.mark.parametrize("family", ["tiny", "tiny-gemma3", "tiny-qwen3.5"])
def test_a_joining_rows_cache_is_mlx_lms_row_without_the_copy(family):
    """`row_caches` after one batched call of three uneven rows, the middle one going on: every row
    holds, layer by layer, what mlx-lm's `extract_cache` gives (its left padding cut off), as caches of
    its own kinds, not the batch's layers. A joining row's `KVCache` layers are views: kept alone, it
    keeps the whole call's arrays; a row that goes on holds its own bytes (checked where every layer is a
    `KVCache`: mlx-lm's extract of a recurrent state is a view too)."""
    import gc

    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.generate import PromptProcessingBatch
    from mlx_lm.models.cache import KVCache, make_prompt_cache
    from mlxrt.synthetic.build import ensure_model
    from mlxrt.worker.prefill import CallRow, row_caches

    model = Engine(str(ensure_model(family)), options=EngineOptions(prompt_cache_bytes=0)).model
    chunks = [short_prompt(1)[:5], short_prompt(2)[:9], short_prompt(3)[:3]]

    def call() -> tuple[PromptProcessingBatch, list[list]]:
        batch = PromptProcessingBatch(model, [0, 1, 2], [make_prompt_cache(model) for _ in chunks],
                                      prefill_step_size=9)
        batch.prompt(chunks)
        return batch, row_caches(batch, [True, False, True])

    batch, seen = call()
    for i, row in enumerate(seen):
        want = batch.extract_cache(i)
        assert all(isinstance(c, type(w)) for c, w in zip(row, want, strict=True))
        assert not any(c is b for c in row for b in batch.prompt_cache)
        for c, w in zip(row, want, strict=True):
            got, exp = tree_flatten(c.state), tree_flatten(w.state)
            assert [k for k, _ in got] == [k for k, _ in exp]
            for (_, x), (_, y) in zip(got, exp, strict=True):
                assert mx.array_equal(x, y).item() if isinstance(x, mx.array) else x == y
        assert all(c.offset == len(chunks[i]) for c in row if isinstance(c, KVCache))
        assert all(type(c) is CallRow for c in row if isinstance(c, KVCache)) == (i != 1)
    del batch, seen, row, want, c, w, got, exp, x, y

    def held(i: int) -> tuple[int, int]:
        """What row `i` alone keeps alive, and the bytes it counts."""
        batch, seen = call()
        row = seen[i]
        mx.eval([c.state for c in row])
        del batch, seen
        gc.collect()
        before, counted = mx.get_active_memory(), sum(c.nbytes for c in row)
        del row
        gc.collect()
        return before - mx.get_active_memory(), counted

    freed, counted = held(0)
    assert freed > 2 * counted
    if all(type(c) is KVCache for c in make_prompt_cache(model)):
        freed, counted = held(1)
        assert freed <= counted


@pytest.mark.parametrize("family", ["tiny", "tiny-qwen3.5"])
def test_a_choice_waiting_for_room_holds_only_its_own_start(family):
    """A request with two choices whose prompt ends in a batched call while the decode batch is full:
    the second choice waits, and its start (a copy of the prompt's cache) holds the bytes it counts, not
    the call's arrays (13x before the start was settled once, `kvcache.owned`, and kept rows were kept
    out of the views)."""
    import gc

    import mlx.core as mx
    from mlxrt.synthetic.build import ensure_model

    def active() -> int:
        gc.collect()
        return mx.get_active_memory()

    e = Engine(str(ensure_model(family)), options=EngineOptions(decode_concurrency=3, prompt_cache_bytes=0,
                                                                 prefill_budget_ms=60_000))
    rec = Events()
    warm = [gen(90 + i, [5 + (i * 3 + j) % 100 for j in range(30)], max_tokens=1) for i in range(2)]
    run(e, rec, {0: warm})
    batched = e.prefill_batched
    for r in (gen(1, [5 + j % 100 for j in range(200)], max_tokens=40),
              gen(2, [7 + j % 100 for j in range(120)], max_tokens=40)):
        e.submit(r, rec)
    two = Generate(id=3, prompt_ids=[9 + j % 100 for j in range(60)],
                   params=SamplingParams(max_tokens=40, ignore_eos=True, n=2))
    e.submit(two, rec)
    waiting = []
    for _ in range(50):
        e.step()
        waiting = [s for s in e._waiting if s.start is not None]
        if waiting and e._running and not e._prefills:
            break
    assert waiting and e.prefill_batched > batched  # the prompts went in a batched call
    fork = waiting[0]
    counted = sum(c.nbytes for c in fork.start[0])
    before = active()
    fork.start = None
    assert before - active() <= 1.25 * counted  # the allocator rounds a small buffer up
    while e.busy:
        e.step()


class FailingBatch:
    """The engine's model, a prefill call of several prompts raising."""

    def __init__(self, model) -> None:
        self._model = model

    def __call__(self, x, cache=None, **kw):
        if x.shape[0] > 1 and x.shape[-1] > 1:
            raise RuntimeError("a batched prefill failed on purpose")
        return self._model(x, cache=cache, **kw)

    def __getattr__(self, name):
        return getattr(self._model, name)


def test_the_decode_batch_on_auto_follows_the_memory(tiny_model):
    """Left on auto, the decode batch is what the memory holds at each sequence's whole context, within
    [prompt_concurrency (8 on auto), 32]: the cap for the tiny model; a given one is kept; a burst of that
    many is admitted together."""
    from mlxrt.ipc.protocol import MAX_AUTO_DECODE_CONCURRENCY
    from mlxrt.worker.limits import batch_that_fits

    assert batch_that_fits(1 << 20, 100 << 20, 8) == MAX_AUTO_DECODE_CONCURRENCY
    assert batch_that_fits(1 << 20, 20 << 20, 8) == 20
    assert batch_that_fits(1 << 30, 2 << 30, 8) == 8  # never fewer than mlx-lm prefills together
    assert EngineOptions().decode_concurrency is None
    auto = Engine(tiny_model, options=EngineOptions(prompt_cache_bytes=0))
    assert auto.decode_concurrency == MAX_AUTO_DECODE_CONCURRENCY
    assert auto._batch.completion_batch_size == MAX_AUTO_DECODE_CONCURRENCY
    burst = [gen(600 + k, short_prompt(k), max_tokens=2) for k in range(MAX_AUTO_DECODE_CONCURRENCY)]
    for r in burst:
        auto.submit(r, Events())
    auto.step()
    assert auto.report().queued == 0 and auto.report().batch_size == len(burst)
    while auto.busy:
        auto.step()
    assert Engine(tiny_model, options=EngineOptions(decode_concurrency=3)).decode_concurrency == 3


def test_prompt_concurrency_on_auto_follows_the_decode_batch_under_the_scheduler(tiny_model, monkeypatch):
    """Left on auto, the prompts prefilled together are the decode batch's under the prefill budget (a
    burst of twelve short prompts in one call), mlx-lm's 8 without a budget, and a given number is kept
    (two calls for the same burst at 8). 0 is refused naming the field; MLXRT_PROMPT_CONCURRENCY sets
    it, unset leaves auto."""
    assert EngineOptions().prompt_concurrency is None
    with pytest.raises(ValueError, match="prompt_concurrency"):
        EngineOptions(prompt_concurrency=0).validate()
    monkeypatch.setenv("MLXRT_PROMPT_CONCURRENCY", "12")
    assert engine_from_env().prompt_concurrency == 12
    monkeypatch.delenv("MLXRT_PROMPT_CONCURRENCY")
    assert engine_from_env().prompt_concurrency is None
    unbudgeted = Engine(tiny_model, options=EngineOptions(prefill_budget_ms=0, prompt_cache_bytes=0))
    assert unbudgeted.prefill.batch_prompts == DEFAULT_PROMPT_CONCURRENCY
    assert Engine(tiny_model, options=EngineOptions(decode_concurrency=5)).prefill.batch_prompts == 5
    burst = [gen(700 + k, short_prompt(k), max_tokens=2) for k in range(12)]
    for given, calls in ((None, 1), (DEFAULT_PROMPT_CONCURRENCY, 2)):
        e = Engine(tiny_model, options=EngineOptions(prefill_budget_ms=60_000, prompt_cache_bytes=0,
                                                     prompt_concurrency=given))
        assert e.prefill.batch_prompts == (given or e.decode_concurrency)
        rec = Events()
        run(e, rec, {0: [gen(690 + k, short_prompt(40 + k), max_tokens=1) for k in range(2)]})
        assert e.sizer.rate is not None  # measured: the burst's chunk is the budget's, not the first guess
        before = e.prefill_calls, e.prefill_batched
        run(e, rec, {0: burst})
        assert (e.prefill_calls - before[0], e.prefill_batched - before[1]) == (calls, 12)
        assert all(len(rec.ids[r.id]) == 2 for r in burst)


def test_decode_concurrency_is_checked_read_from_the_environment_and_reported(tiny_model, monkeypatch):
    """decode_concurrency=0 is refused naming the field; MLXRT_DECODE_CONCURRENCY sets it, unset leaves
    auto; a worker reports the batch it runs, auto resolved, in its ready message."""
    with pytest.raises(ValueError, match="decode_concurrency"):
        EngineOptions(decode_concurrency=0).validate()
    monkeypatch.setenv("MLXRT_DECODE_CONCURRENCY", "5")
    assert engine_from_env().decode_concurrency == 5
    monkeypatch.delenv("MLXRT_DECODE_CONCURRENCY")
    assert engine_from_env().decode_concurrency is None
    with Runtime(model=tiny_model, engine=EngineOptions(decode_concurrency=5)) as rt:
        assert rt.model_info().decode_concurrency == 5
    with Runtime(model=tiny_model) as rt:
        assert rt.model_info().decode_concurrency >= DEFAULT_PROMPT_CONCURRENCY


def test_choices_admitted_mid_step_beside_a_system_prompt_are_never_prefilled_past_their_prompt(tiny_model):
    """A chat's system prompt landing in a step admits what waited behind it in that step, an n = 2
    request's second choice among them (its prompt down to its last token): it joins the batch, is not
    prefilled a token too far, and every choice's reply is the one alone."""
    from support import chat, run_batch
    from support import gen as request

    class ByChoice(Events):
        def token(self, req_id: int, token: int, *args, index: int = 0, **kw) -> None:
            self.ids.setdefault((req_id, index), []).append(token)

    opts = EngineOptions(prefill_budget_ms=10_000, prefill_step_size=512)
    engine, ref = Engine(tiny_model, options=opts), Engine(tiny_model, options=opts)
    run_batch(engine, [request(1, "the rate is timed on these"), request(2, "and on this one")])
    reqs = [request(10, "a short prompt with choices", n=2, max_tokens=6),
            request(11, messages=chat("Ship 1: what did you see?",
                                      system="You keep a lighthouse and log ships. " * 3), max_tokens=6)]
    rec = run_batch(engine, reqs, ByChoice())
    assert not rec.errors
    want = {k: v for r in reqs for k, v in run_batch(ref, [r], ByChoice()).ids.items()}
    assert set(want) == {(10, 0), (10, 1), (11, 0)} and rec.ids == want
