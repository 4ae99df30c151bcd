"""The prefix cache's disk tier: prefixes that outlive the engine, every cache kind, and bad entries."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import pytest
from mlxrt import InvalidField, Runtime
from mlxrt.ipc.protocol import EngineOptions
from mlxrt.synthetic.build import ensure_model
from mlxrt.worker.engine import Engine
from support import chat, gen, metric, run_alone, running, wait_for

QUESTION = "What is the weather like by the sea today?"


def engine(preset: str, root: Path, **options) -> Engine:
    """An in-process engine whose prefix cache has a disk tier under `root`."""
    return Engine(str(ensure_model(preset)), options=EngineOptions(prompt_cache_dir=str(root), **options))


def entries(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*.safetensors") if not p.name.startswith("."))


def ask(e: Engine, i: int, question: str = QUESTION) -> tuple[list[int], object]:
    return run_alone(e, gen(i, messages=chat(question), max_tokens=12))


@pytest.mark.parametrize("preset, options", [
    ("tiny", {}),
    ("tiny-qwen3.5", {}),  # linear attention: ArraysCache checkpoints
    ("tiny-gemma3", {}),  # sliding-window layers: RotatingKVCache
    ("tiny", {"max_kv_size": 256}),  # every layer rotating
    ("small", {"kv_bits": 8, "quantized_kv_start": 0}),  # a lone request's quantized KV (small: head size 64)
], ids=["kv", "arrays", "gemma3-rotating", "rotating", "quantized"])
def test_a_new_engine_starts_from_the_prefixes_on_disk(tmp_path, preset, options):
    """A prefix kept by one engine is loaded by the next one (a restart) for every cache kind, and its
    reply is the reply without the cache."""
    first = engine(preset, tmp_path, **options)
    cold, cold_stats = ask(first, 1)
    first.close()
    assert cold_stats.cached_tokens == 0 and entries(tmp_path)
    second = engine(preset, tmp_path, **options)
    warm, warm_stats = ask(second, 2)
    assert warm == cold
    assert warm_stats.cached_tokens > 0
    report = second.report()
    assert report.disk_cache.hits >= 1 and report.disk_cache.entries >= 1
    second.close()


@pytest.mark.parametrize("preset, options, trims", [
    ("tiny", {}, True),
    ("small", {"kv_bits": 8, "quantized_kv_start": 0}, True),
    ("tiny", {"max_kv_size": 256}, False),  # rotating: only an exact checkpoint may serve
], ids=["kv", "quantized", "rotating"])
def test_a_chats_next_turn_after_a_restart_is_served_from_its_first_prompt_trimmed_back(
        tmp_path, preset, options, trims):
    """After a restart, a chat's next turn is served by its first prompt's entry, which it does not begin
    (that ended in the generation prompt), trimmed back to what they share where the cache can be
    trimmed; its reply is the reply without any cache. A rotating cache gets an exact entry or none."""
    first = engine(preset, tmp_path, **options)
    ask(first, 1)
    first.close()
    turn = chat(QUESTION, "Calm, with a light breeze.", "And tomorrow?")
    second = engine(preset, tmp_path, **options)
    second._disk._scan()
    lengths = {e.tokens for e in second._disk._entries.values()}  # the checkpoint, the first prompt, ...
    warm, stats = run_alone(second, gen(2, messages=turn, max_tokens=12))
    second.close()
    plain = Engine(str(ensure_model(preset)), options=EngineOptions(**options))
    cold, cold_stats = run_alone(plain, gen(3, messages=turn, max_tokens=12))
    plain.close()
    assert warm == cold and cold_stats.cached_tokens == 0
    assert stats.cached_tokens >= min(lengths)
    assert (stats.cached_tokens not in lengths) == trims, (stats.cached_tokens, sorted(lengths))


def test_a_corrupt_entry_is_removed_never_loaded(tmp_path):
    """A truncated entry is skipped and removed with a warning; the request is served as if uncached."""
    first = engine("tiny", tmp_path)
    cold, _ = ask(first, 1)
    first.close()
    for path in entries(tmp_path):
        path.write_bytes(path.read_bytes()[:100])
    second = engine("tiny", tmp_path)
    warm, stats = ask(second, 2)
    assert warm == cold and stats.cached_tokens == 0
    assert second.report().disk_cache.removed >= 1
    second.close()
    assert all(p.stat().st_size > 100 for p in entries(tmp_path))  # only whole entries written since


def test_another_models_entry_is_never_used(tmp_path):
    """Other options are another identity: their entries are never looked at, and one of theirs placed
    under this identity's name is refused by its metadata and removed."""
    first = engine("tiny", tmp_path, max_kv_size=256)
    ask(first, 1)
    first.close()
    foreign = entries(tmp_path)
    second = engine("tiny", tmp_path)
    cold, stats = ask(second, 2)
    assert stats.cached_tokens == 0  # nothing of the other identity's
    second.close()
    mine = [p for p in entries(tmp_path) if p.parent != foreign[0].parent]
    assert mine and len({p.parent for p in entries(tmp_path)}) == 2  # one directory per identity
    for path in mine:  # the other identity's bytes under this identity's names
        path.write_bytes(foreign[0].read_bytes())
    third = engine("tiny", tmp_path)
    again, stats = ask(third, 3)
    assert again == cold and stats.cached_tokens == 0
    assert third.report().disk_cache.removed >= 1
    third.close()


def test_the_disk_tier_stays_within_its_byte_budget(tmp_path):
    """Distinct prompts past the budget: least recently used entries go, the rest fit."""
    budget = 400_000
    e = engine("tiny", tmp_path, prompt_cache_disk_bytes=budget)
    for i in range(6):
        ask(e, i, f"Question number {i}: " + "tell me about the tides and the rocks. " * 6)
    e.close()
    assert entries(tmp_path)
    assert sum(p.stat().st_size for p in entries(tmp_path)) <= budget


def test_a_directory_that_goes_away_turns_the_tier_off(tmp_path):
    """The directory replaced by a file mid-run: writes fail, the tier turns off, serving goes on."""
    root = tmp_path / "cache"
    e = engine("tiny", root)
    for d in sorted(root.iterdir()):  # the identity's directory, empty so far
        d.rmdir()
        d.write_bytes(b"not a directory")
    ids, _ = ask(e, 1)
    e.close()
    assert len(ids) == 12 and not e.report().disk_cache.entries
    assert e._disk is not None and not e._disk.enabled


FULL_DISK = """
import json, resource, signal, sys
from pathlib import Path
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails (EFBIG) instead of killing us
sys.path.insert(0, sys.argv[2])
from test_disk_cache import ask, engine
e = engine("tiny", Path(sys.argv[1]))
resource.setrlimit(resource.RLIMIT_FSIZE, (4096, resource.RLIM_INFINITY))  # no file past 4 KB: a full disk
lengths = [len(ask(e, i)[0]) for i in (1, 2)]
e.close()
print(json.dumps({"lengths": lengths, "enabled": e._disk.enabled, "entries": e.report().disk_cache.entries}))
"""


def test_a_full_disk_turns_the_tier_off_and_serving_goes_on(tmp_path):
    """Every write fails for want of room (a file size limit, as a full disk fails them): the tier turns
    off with one warning, no half-written file stays, and both requests are answered."""
    root = tmp_path / "cache"
    out = subprocess.run([sys.executable, "-c", FULL_DISK, str(root), str(Path(__file__).parent)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout.splitlines()[-1])
    assert got == {"lengths": [12, 12], "enabled": False, "entries": 0}
    assert out.stdout.count("disk_cache.off") == 1, out.stdout
    assert not [p for p in root.rglob("*") if p.is_file()]


def test_runtime_restart_reuses_a_chat_prefix(tmp_path, tiny_model):
    """Real workers: a runtime closed and started again answers a chat's next request from disk, the
    same ids."""
    opts = EngineOptions(prompt_cache_dir=str(tmp_path), prompt_cache_warm_bytes=0)  # a lookup loads it
    msgs = [{"role": "system", "content": "You answer at length about the sea. " * 8},
            {"role": "user", "content": QUESTION}]
    with Runtime(model=tiny_model, engine=opts) as rt:
        cold = rt.generate(msgs, max_tokens=8, ignore_eos=True)
    with Runtime(model=tiny_model, engine=opts) as rt:
        warm = rt.generate(msgs, max_tokens=8, ignore_eos=True)
        (memory,) = rt.memory()
    disk = memory.disk_cache
    assert disk is not None and disk.hits >= 1 and disk.entries >= 1 and disk.nbytes > 0 and disk.warmed == 0
    assert warm.tokens == cold.tokens
    assert cold.stats.cached_tokens == 0 and warm.stats.cached_tokens > 0


def test_a_restarted_worker_reads_its_newest_prefixes_back_into_memory_while_idle(tmp_path, tiny_model):
    """Real workers: a runtime started again over a disk tier reads the newest entries back into its
    memory tier while idle (warming), so the chat's next request is a memory hit with no disk load, the
    same ids as the first run's."""
    opts = EngineOptions(prompt_cache_dir=str(tmp_path))
    msgs = [{"role": "system", "content": "You answer at length about the sea. " * 8},
            {"role": "user", "content": QUESTION}]
    with Runtime(model=tiny_model, engine=opts) as rt:
        cold = rt.generate(msgs, max_tokens=8, ignore_eos=True)
    with Runtime(model=tiny_model, engine=opts) as rt:
        wait_for(lambda: rt.memory()[0].disk_cache.warmed >= 1, what="a disk entry read back while idle")
        again = rt.generate(msgs, max_tokens=8, ignore_eos=True)
        (memory,) = rt.memory()
    assert again.tokens == cold.tokens and again.stats.cached_tokens > 0
    assert memory.disk_cache.hits == 0 and memory.prompt_cache_hits == 1


def test_warming_reads_a_layer_a_step_yields_to_requests_and_stops_under_pressure(tmp_path):
    """In-process: warming reads the newest entries back one layer per step, within its byte budget
    (none at 0); a request served between two steps gets the reply it gets without any cache, and
    is not loaded twice; a memory-pressure clear ends warming."""
    first = engine("small", tmp_path)
    for i, q in enumerate(["What is the weather like by the sea?", "Name three rivers of Europe."]):
        ask(first, i, q)
    first.close()
    layers = len(first.model.layers)

    off = engine("small", tmp_path, prompt_cache_warm_bytes=0)
    off.warmup(4)
    assert not off.warming
    off.close()

    e = engine("small", tmp_path)
    e.warmup(4)
    assert e.warming
    for _ in range(layers + 1):  # each layer of the newest entry, then the first of the next one
        e.warm_step()
    assert e.report().disk_cache.warmed == 1 and len(e.prefix_cache) == 1  # the newest entry, whole
    question = "What is the weather like by the sea?"
    mid, mid_stats = ask(e, 9, question)  # its entry is the one being read: the request loads it itself
    steps = layers + 1
    while e.warming:
        e.warm_step()
        steps += 1
    report = e.report().disk_cache
    assert mid_stats.cached_tokens > 0 and report.hits == 1
    assert steps == 3 * layers + 1  # one step a layer, and one to end
    assert report.entries == 3 and report.warmed == 2  # the one the request loaded is not added twice
    plain = Engine(str(ensure_model("small")), options=EngineOptions())
    assert mid == run_alone(plain, gen(10, messages=chat(question), max_tokens=12))[0]
    plain.close()
    e.close()

    pressed = engine("small", tmp_path)
    pressed.warmup(4)
    pressed.warm_step()
    pressed.clear_cache()
    assert not pressed.warming and len(pressed.prefix_cache) == 0
    pressed.close()


def test_metrics_show_the_prefix_cache_and_its_disk_tier(tmp_path, tiny_model):
    """/metrics, per model and worker: the prefix cache's bytes and hits, and the disk tier's entries,
    bytes and writes once the background writer has written the chat's prefix."""
    opts = EngineOptions(prompt_cache_dir=str(tmp_path))
    body = {"model": "tiny", "max_tokens": 4, "messages": [
        {"role": "system", "content": "You answer at length about the sea. " * 8},
        {"role": "user", "content": QUESTION}]}
    with running({"tiny": tiny_model}, engine=opts) as srv, \
            httpx.Client(base_url=srv.url, timeout=30) as http:
        for _ in range(2):
            assert http.post("/v1/chat/completions", json=body).status_code == 200
        labels = {"model": "tiny", "worker": srv.rt.workers[0].name}
        written = lambda: metric(http, "mlxrt_prompt_cache_disk_writes_total", **labels) >= 1  # noqa: E731
        wait_for(written, 30, "a disk write")
        assert metric(http, "mlxrt_prompt_cache_hits_total", **labels) >= 1
        assert metric(http, "mlxrt_prompt_cache_bytes", **labels) > 0
        assert metric(http, "mlxrt_prompt_cache_disk_entries", **labels) >= 1
        assert metric(http, "mlxrt_prompt_cache_disk_bytes", **labels) > 0
        text = http.get("/metrics").text
        assert 'mlxrt_prompt_cache_disk_evicted_writes_total{model="tiny"' in text
        assert 'mlxrt_prompt_cache_disk_warmed_total{model="tiny"' in text


def test_a_cache_dir_that_is_a_file_is_refused_naming_the_flag(tmp_path, tiny_model):
    """--prompt-cache-dir naming a file: refused before any worker starts, in Python by its field and
    by `mlxrt serve` by its flag."""
    file = tmp_path / "file"
    file.write_text("x")
    with pytest.raises(InvalidField) as err:
        Runtime(model=tiny_model, engine=EngineOptions(prompt_cache_dir=str(file)))
    assert err.value.field == "prompt_cache_dir"
    out = subprocess.run([sys.executable, "-m", "mlxrt", "serve", "--model", tiny_model, "--port", "0",
                          "--prompt-cache-dir", str(file), "--prompt-cache-disk-bytes", str(1 << 30)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode != 0
    assert "--prompt-cache-dir" in out.stderr and "not a directory" in out.stderr


def kv_cache(tokens: int):
    """A one-layer KVCache holding `tokens` positions of zeros."""
    import mlx.core as mx
    from mlx_lm.models.cache import KVCache

    c = KVCache()
    c.update_and_fetch(mx.zeros((1, 2, tokens, 16)), mx.zeros((1, 2, tokens, 16)))
    return [c]


def test_a_burst_of_writes_past_the_queue_flushes_promptly(tmp_path):
    """More writes than the queue holds: those past its bounds are refused (counted), the ones queued
    first land, and a flush returns as soon as the writer is done."""
    from mlxrt.worker.disk_cache import MAX_QUEUED_WRITES, DiskTier

    tier = DiskTier(str(tmp_path), "id", 1 << 30, kinds=["KVCache"])
    for i in range(4 * MAX_QUEUED_WRITES):
        tier.put([i] * 40, kv_cache(40))
    assert tier.flush(timeout=60)
    assert 1 <= tier.writes <= 4 * MAX_QUEUED_WRITES and len(entries(tmp_path)) == tier.writes
    assert tier.writes + tier.skipped == 4 * MAX_QUEUED_WRITES
    tier.close()


def test_a_prefix_is_loaded_until_the_disk_is_measured_then_by_the_rates(tmp_path):
    """Before any load is timed a prefix on disk is loaded (the load measures the disk); after, only where
    reading it is faster than prefilling the tokens it saves at the engine's rate."""
    e = engine("tiny", tmp_path)
    first, _ = ask(e, 1)
    e.close()
    later = engine("tiny", tmp_path)
    tier = later._disk
    tier._scan()
    (entry, *_) = sorted(tier._entries.values(), key=lambda x: -x.tokens)
    assert tier.read_bps is None and tier.worth_loading(entry, entry.tokens, prefill_tps=1e12)
    assert ask(later, 2)[0] == first and tier.hits == 1 and tier.read_bps > 0
    assert not tier.worth_loading(entry, entry.tokens, prefill_tps=1e12)  # prefill "infinitely" fast
    assert tier.worth_loading(entry, entry.tokens, prefill_tps=1e-3)
    later.close()


def test_two_tiers_writing_one_prefix_at_once_leave_one_whole_entry(tmp_path):
    """Two workers writing the same prefix concurrently: one entry, which loads."""
    from mlxrt.worker.disk_cache import DiskTier

    tiers = [DiskTier(str(tmp_path), "id", 1 << 30, kinds=["KVCache"]) for _ in range(2)]
    ids = list(range(64))
    for t in tiers:
        t.put(ids, kv_cache(64))
    for t in tiers:
        t.close()
    assert len(entries(tmp_path)) == 1
    reader = DiskTier(str(tmp_path), "id", 1 << 30, kinds=["KVCache"])
    found = reader.find([*ids, 1], 0)
    assert found is not None and reader.load(found, [*ids, 1]) is not None
    reader.close()


def test_a_scan_skips_vanished_entries_and_clears_stale_writes(tmp_path):
    """An entry gone between the listing and its stat is skipped (the tier stays on); a temporary file
    left by a killed writer is removed once stale; one being written now is left alone."""
    import os
    import time

    from mlxrt.worker.disk_cache import STALE_TMP_S, DiskTier

    root = tmp_path / "id"
    root.mkdir()
    (root / "40-deadbeef.safetensors").symlink_to(tmp_path / "gone")  # listed, but stat fails
    stale, fresh = root / ".tmp-1-2-abc.safetensors", root / ".tmp-3-4-def.safetensors"
    for f in (stale, fresh):
        f.write_bytes(b"half")
    old = time.time() - STALE_TMP_S - 60
    os.utime(stale, (old, old))
    tier = DiskTier(str(tmp_path), "id", 1 << 30, kinds=["KVCache"])
    assert tier.enabled and len(tier) == 0
    assert not stale.exists() and fresh.exists()
    tier.close()


def test_serve_without_a_writable_cache_home_keeps_serving(monkeypatch, tmp_path):
    """serve's default disk tier under a cache home it cannot write: the tier is off with a warning,
    not a refusal to start (the user never asked for it)."""
    from mlxrt.cli import _engine_options, build_parser

    home = tmp_path / "file"
    home.write_text("not a directory")
    monkeypatch.setenv("XDG_CACHE_HOME", str(home))
    monkeypatch.delenv("MLXRT_PROMPT_CACHE_DIR", raising=False)
    opts = _engine_options(build_parser().parse_args(["serve", "--model", "m"]))
    assert opts.prompt_cache_dir is None
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    opts = _engine_options(build_parser().parse_args(["serve", "--model", "m"]))
    assert opts.prompt_cache_dir == str((tmp_path / "cache" / "mlxrt" / "prompt-cache").resolve())


class PausedWriter:
    """Holds `tier`'s writer inside its next write until `release()`: the writer is "behind"."""

    def __init__(self, tier) -> None:
        self.tier, self.gate, self.inside = tier, threading.Event(), threading.Event()
        write = tier._write

        def paused(*args):
            self.inside.set()
            assert self.gate.wait(60), "the test never released the writer"
            return write(*args)

        tier._write = paused

    def release(self) -> None:
        self.gate.set()


def test_a_prefix_the_writer_was_behind_for_is_written_when_memory_evicts_it(tmp_path, monkeypatch):
    """A write-through refused while the writer was behind leaves the prefix in memory only; when the
    memory tier evicts it, it is written then, and a later process finds it on disk."""
    from mlxrt.worker import disk_cache
    from mlxrt.worker.disk_cache import DiskTier
    from mlxrt.worker.prefix_cache import PrefixCache

    monkeypatch.setattr(disk_cache, "MAX_QUEUED_WRITES", 1)
    tier = DiskTier(str(tmp_path), "id", 1 << 30, kinds=["KVCache"])
    size = sum(c.nbytes for c in kv_cache(64))
    memory = PrefixCache(2 * size, disk=tier)  # two entries fit
    a, b, c, d, e = ([i] * 64 for i in range(1, 6))
    paused = PausedWriter(tier)
    memory.insert(a, kv_cache(64))
    assert paused.inside.wait(30)  # a is being written
    memory.insert(b, kv_cache(64))  # waits
    memory.insert(c, kv_cache(64))  # refused: the writer is behind; a is evicted (being written anyway)
    assert tier.skipped == 1
    paused.release()
    assert tier.flush(timeout=60)
    assert tier.writes == 2 and tier.evicted_writes == 0 and len(entries(tmp_path)) == 2
    memory.insert(d, kv_cache(64))  # evicts b, on disk already
    assert tier.flush(timeout=60)
    memory.insert(e, kv_cache(64))  # evicts c: to disk now
    assert tier.flush(timeout=60)
    assert tier.evicted_writes == 1 and tier.lost == 0
    tier.close()
    later = DiskTier(str(tmp_path), "id", 1 << 30, kinds=["KVCache"])
    for ids in (a, b, c, d):
        found = later.find([*ids, 9], 0)
        assert found is not None and later.load(found, [*ids, 9]) is not None
    later.close()


def test_an_evicted_prefix_goes_ahead_of_a_waiting_write_through(tmp_path, monkeypatch):
    """The write queue is full of a write-through (still in memory) when an evicted prefix comes: the
    write-through is withdrawn (counted as skipped) and the evicted one is written."""
    from mlxrt.worker import disk_cache
    from mlxrt.worker.disk_cache import DiskTier

    monkeypatch.setattr(disk_cache, "MAX_QUEUED_WRITES", 1)
    tier = DiskTier(str(tmp_path), "id", 1 << 30, kinds=["KVCache"])
    paused = PausedWriter(tier)
    tier.put([1] * 40, kv_cache(40))
    assert paused.inside.wait(30)
    tier.put([2] * 40, kv_cache(40))  # waits
    tier.put([3] * 40, kv_cache(40), evicted=True)  # withdraws [2] * 40
    tier.put([4] * 40, kv_cache(40))  # refused: an evicted prefix waits
    paused.release()
    assert tier.flush(timeout=60)
    assert (tier.writes, tier.evicted_writes, tier.skipped, tier.lost) == (2, 1, 2, 0)
    found = [n for n in (1, 2, 3, 4) if tier.find([n] * 40 + [9], 0) is not None]
    assert found == [1, 3]
    tier.close()


def test_a_superseded_checkpoint_the_writer_was_behind_for_reaches_the_disk(tmp_path, monkeypatch):
    """A system prompt's checkpoint whose write-through was refused, then superseded in memory by the
    whole prompt's entry (a trimmable cache keeps only the longer one), is written as it leaves memory:
    a new chat under the same system prompt finds it on disk."""
    from mlxrt.worker import disk_cache
    from mlxrt.worker.disk_cache import DiskTier
    from mlxrt.worker.prefix_cache import PrefixCache

    monkeypatch.setattr(disk_cache, "MAX_QUEUED_WRITES", 1)
    tier = DiskTier(str(tmp_path), "id", 1 << 30, kinds=["KVCache"])
    memory = PrefixCache(1 << 30, disk=tier)
    system, chat = [7] * 40, [7] * 40 + [8] * 24
    paused = PausedWriter(tier)
    memory.insert([1] * 40, kv_cache(40))  # another prefix, being written
    assert paused.inside.wait(30)
    memory.insert([2] * 40, kv_cache(40))  # waits: the queue is full
    memory.insert(system, kv_cache(40), "system")  # refused
    memory.insert(chat, kv_cache(64))  # supersedes the checkpoint in memory: it goes to disk
    paused.release()
    assert tier.flush(timeout=60)
    assert tier.evicted_writes == 1 and len(memory) == 3
    assert tier.find([*system, 9, 9], 0) is not None
    tier.close()


def test_a_stopping_engine_writes_what_the_disk_lacks_but_memory_pressure_does_not(tmp_path):
    """Prefixes in memory only (refused while the writer was behind) are written when the engine stops
    (an unload, a shutdown); a clear under memory pressure drops them without a copy to write."""
    from mlxrt.worker.disk_cache import DiskTier
    from mlxrt.worker.prefix_cache import PrefixCache

    for stop in ("close", "clear"):
        root = tmp_path / stop
        tier = DiskTier(str(root), "id", 1 << 30, kinds=["KVCache"])
        memory = PrefixCache(1 << 30, disk=tier)
        paused = PausedWriter(tier)
        memory.insert([1] * 40, kv_cache(40))
        assert paused.inside.wait(30)
        for i in range(2, 3 + disk_cache_bound()):  # fill the queue, then one more: refused
            memory.insert([i] * 40, kv_cache(40))
        assert tier.skipped == 1
        if stop == "close":  # the writer catches up while the spill waits for room
            threading.Timer(0.2, paused.release).start()
            memory.spill(60)
        else:
            memory.clear()
            paused.release()
        tier.close()
        n = disk_cache_bound() + 2  # the one being written, those waiting, the refused one
        assert len(entries(root)) == (n if stop == "close" else n - 1), stop


def disk_cache_bound() -> int:
    from mlxrt.worker.disk_cache import MAX_QUEUED_WRITES

    return MAX_QUEUED_WRITES


def test_a_prefix_a_slightly_longer_entry_covers_is_not_written_and_is_served_trimmed(tmp_path):
    """Where caches can be trimmed, a checkpoint queued behind the writer is withdrawn when its chat's
    slightly longer prompt is queued, and one put after that prompt is on disk is not written: one file
    serves both, trimmed back. A much longer entry does not cover a short prefix (its read would cost
    more than the prefix saves), nor does any under a cache that cannot be trimmed."""
    from mlxrt.worker.disk_cache import COVER_RATIO, DiskTier

    tier = DiskTier(str(tmp_path / "kv"), "id", 1 << 30, kinds=["KVCache"])
    system, chat = [7] * 40, [7] * 40 + [8] * 8
    paused = PausedWriter(tier)
    tier.put([1] * 40, kv_cache(40))
    assert paused.inside.wait(30)
    tier.put(system, kv_cache(40))
    tier.put(chat, kv_cache(48))  # covers the queued checkpoint: it is withdrawn
    paused.release()
    assert tier.flush(timeout=60)
    tier.put(system, kv_cache(40))  # covered by the entry on disk
    long = [5] * 40
    tier.put([*long, *[6] * int(40 * COVER_RATIO)], kv_cache(40 + int(40 * COVER_RATIO)))
    tier.put(long, kv_cache(40))  # too short a part of that one: written itself
    assert tier.flush(timeout=60)
    assert sorted(e.tokens for e in tier._entries.values()) == [40, 40, 48, 90]
    found = tier.find([*system, 9, 9], 0)
    assert found is not None and (found.entry.tokens, found.tokens) == (48, 40)
    loaded = tier.load(found, [*system, 9, 9])
    assert loaded is not None and {c.offset for c in loaded} == {40}
    tier.close()
    rotating = DiskTier(str(tmp_path / "rotating"), "id", 1 << 30, kinds=["RotatingKVCache"])
    rotating.put(system, kv_cache(40))
    rotating.put(chat, kv_cache(48))
    assert rotating.flush(timeout=60) and not rotating.trimmable
    assert sorted(e.tokens for e in rotating._entries.values()) == [40, 48]  # each written: no cover
    assert rotating.find([*system, 9, 9], 0).tokens == 40  # the exact checkpoint, never a trimmed one
    rotating.close()


def test_an_evicted_prefix_a_new_write_covers_keeps_its_claim_to_the_queue(tmp_path):
    """A queued write of a prefix memory has dropped, withdrawn because a longer new write covers it, passes
    its claim on: the new write is not one a later evicted prefix may withdraw (it holds the only copy)."""
    from mlxrt.worker.disk_cache import DiskTier

    tier = DiskTier(str(tmp_path), "id", 1 << 30, kinds=["KVCache"])
    paused = PausedWriter(tier)
    tier.put([1] * 40, kv_cache(40))
    assert paused.inside.wait(30)
    tier.put([7] * 40, kv_cache(40), evicted=True)
    tier.put([7] * 40 + [8] * 8, kv_cache(48))  # a write-through that covers it
    assert [(len(w.tokens), w.evicted) for w in tier._waiting] == [(48, True)]
    paused.release()
    assert tier.flush(timeout=60)
    tier.close()


@pytest.mark.parametrize("tokens", ['"5"', "[99999999999999999999999]", '["a"]', "{}"],
                         ids=["scalar", "past-int64", "strings", "object"])
def test_an_entry_header_of_another_shape_is_no_entry_to_share_with(tmp_path, tokens):
    """A file named as an entry whose header's token ids are not a list of ids (damaged, foreign): a
    trimming lookup and a write's cover check pass it by; requests are served and the tier stays on."""
    import struct

    from mlxrt.worker.disk_cache import TOKENS_KEY, DiskTier

    tier = DiskTier(str(tmp_path), "id", 1 << 30, kinds=["KVCache"])
    header = json.dumps({"__metadata__": {f"0.{TOKENS_KEY}": tokens}}).encode()
    (tier.dir / f"50-{'f' * 40}.safetensors").write_bytes(struct.pack("<Q", len(header)) + header)
    listed = b"[1, 2]"  # a header that is not an object at all
    (tier.dir / f"51-{'e' * 40}.safetensors").write_bytes(struct.pack("<Q", len(listed)) + listed)
    tier._scan()
    assert tier.find([3] * 60, 0) is None
    tier.put([3] * 40, kv_cache(40))  # its cover check reads the same headers
    assert tier.flush(timeout=60) and tier.enabled
    found = tier.find([3] * 41, 0)
    assert found is not None and found.tokens == 40 and tier.load(found, [3] * 41) is not None
    tier.close()
