"""The benchmark harness's own logic: statistics, the token gate, the record, skips, and a smoke run.

These assert what the harness computes and reports, never how fast anything is.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import socket
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from support import run_of

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # `benchmarks` is a top-level folder of the checkout, not an installed package
    sys.path.insert(0, str(ROOT))

from benchmarks import __main__ as bench  # noqa: E402
from benchmarks import agents, e2e, families, http_scenario, measure, records, report, runner  # noqa: E402
from benchmarks.peers import Ollama, ollama_base  # noqa: E402
from benchmarks.scenarios import Native, NativeBatch, Skipped  # noqa: E402


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------- statistics


def test_spread_reports_median_quartiles_and_drops_nan():
    """spread() gives median, min, max and quartiles, ignoring runs that produced no figure."""
    s = measure.spread([5.0, 1.0, math.nan, 3.0, 2.0, 4.0])
    assert (s["median"], s["min"], s["max"], s["p25"], s["p75"], s["n"]) == (3.0, 1.0, 5.0, 2.0, 4.0, 5)
    assert s["p90"] == pytest.approx(4.6)
    assert measure.spread([])["n"] == 0


def test_percentile_interpolates_linearly():
    """percentile() interpolates between ranks and is NaN for no data."""
    assert measure.percentile([10.0, 20.0], 50) == 15.0
    assert measure.percentile([1.0, 2.0, 3.0, 4.0, 5.0], 99) == pytest.approx(4.96)
    assert math.isnan(measure.percentile([], 50))


def test_ratio_and_difference_are_paired_by_round():
    """Ratios and differences pair round i with round i, not median with median."""
    num, den = [2.0, 4.0, 6.0], [1.0, 4.0, 3.0]
    assert measure.ratio_spread(num, den)["median"] == 2.0  # per-round 2, 1, 2; medians alone would give 4/3
    assert measure.diff_spread(num, den)["median"] == 1.0  # per-round 1, 0, 3
    with pytest.raises(ValueError):
        measure.ratio_spread([1.0], [1.0, 2.0])


def test_arrivals_count_tokens_not_chunks(monkeypatch):
    """A chunk of k tokens counts as k tokens, with k equal inter-token gaps; the longest gap is the
    longest wait between two arrivals, which the equal gaps would understate."""
    clock = iter([0.1, 0.4, 0.45, 0.5])
    monkeypatch.setattr(measure.time, "perf_counter", lambda: next(clock))
    arr = measure.Arrivals(0.0)
    arr.add([7])
    arr.add([8, 9, 10])
    arr.add([11])
    run = arr.run(prompt_tokens=20)
    assert run.tokens == [7, 8, 9, 10, 11] and run.n_tokens == 5
    assert run.ttft_ms == pytest.approx(100.0)
    assert run.decode_tps == pytest.approx(4 / 0.35)  # 4 tokens after the first, over 0.35 s
    assert run.itl_ms == pytest.approx([100.0, 100.0, 100.0, 50.0])
    assert run.longest_gap_ms == pytest.approx(300.0)  # the chunk of 3 came after 0.3 s with nothing
    assert run.prompt_tps == pytest.approx(200.0)


def test_agreement_is_the_common_prefix():
    """Agreement counts native's tokens before the first divergence; later coincidences do not count."""
    a = measure.agreement([1, 2, 3, 4], [1, 2, 9, 4])
    assert a["agree_pct"] == 50.0 and a["first_divergence"] == 2
    assert measure.agreement([1, 2], [1, 2, 3])["first_divergence"] == 2
    assert measure.agreement([1, 2], [1, 2]) == {"agree_pct": 100.0, "first_divergence": None, "basis": "ids"}


def test_text_agreement_matches_tokens_that_spell_a_prefix():
    """For text-only peers, native's tokens are decoded and matched against the peer's text."""
    words = {1: " the", 2: " fox", 3: " ran"}

    def decode(ids):
        return "".join(words[i] for i in ids)

    assert measure.text_agreement(decode, [1, 2, 3], " the fox ran")["first_divergence"] is None
    a = measure.text_agreement(decode, [1, 2, 3], " the fox sat")
    assert a["agree_pct"] == pytest.approx(200 / 3) and a["first_divergence"] == 2 and a["basis"] == "text"


def test_finite_turns_nan_into_null():
    """The JSON document is strict JSON: NaN and infinities become null."""
    doc = measure.finite({"a": [math.nan, 1.0], "b": {"c": math.inf}})
    assert json.dumps(doc, allow_nan=False) == '{"a": [null, 1.0], "b": {"c": null}}'


# ---------------------------------------------------------------- records


def _row(tps: str, spread: str = "1.0", status: str = "keep", model: str = "m", backend: str = "cpu") -> dict:
    return {"model": model, "backend": backend, "decode_tps": tps, "spread_tps": spread, "status": status}


def test_span_prints_median_and_range_or_the_median_alone():
    """Every study prints a figure as median [min-max]; one sample has no range, none prints a dash."""
    assert runner.span([3.0, 1.0, 2.0]) == "2.0 [1.0-3.0]"
    assert runner.span(measure.spread([0.5, 0.25]), ".3f") == "0.375 [0.250-0.500]"
    assert runner.span([7.0]) == "7.0" and runner.span([]) == "-" and runner.span(None) == "-"


def test_summary_line_stays_under_1_kb_and_keeps_status_and_paths():
    """A study's last line stays under 1 KB: long strings are cut, then figures dropped and named,
    never its name, status, error or paths."""
    line = runner.summary_line({"benchmark": "b", "status": "crash", "error": "x" * 5000,
                                "rows": list(range(300)), "outputs": {"json": "r.json"}})
    got = json.loads(line)
    assert len(line.encode()) < runner.SUMMARY_MAX_BYTES and got["truncated"] == ["rows"]
    assert got["status"] == "crash" and got["error"] == "x" * 300 + "..."
    assert got["outputs"] == {"json": "r.json"}


def test_decide_keeps_within_spread_of_the_best_and_discards_beyond():
    """keep unless slower than the best kept row of the same model+backend by more than the spread."""
    rows = [_row("100"), _row("90"), _row("500", status="discard"), _row("900", model="other")]
    assert records.decide([], model="m", backend="cpu", decode_tps=1.0, spread_tps=0.5) == "keep"
    assert records.decide(rows, model="m", backend="cpu", decode_tps=98.0, spread_tps=3.0) == "keep"
    assert records.decide(rows, model="m", backend="cpu", decode_tps=98.0, spread_tps=0.5) == "discard"
    assert records.decide(rows, model="m", backend="gpu", decode_tps=1.0, spread_tps=0.0) == "keep"


def test_record_appends_rows_under_one_header(tmp_path):
    """The TSV gets a header once, a decided status per row, and crash for a crashed run."""
    path = tmp_path / "results.tsv"
    common = {"commit": "abc", "model": "m", "backend": "cpu", "scenario": "mlxrt-ring", "ttft_ms": 5.0}
    first = records.record(
        path, **common, decode_tps=100.0, spread_tps=2.0, description="base", crashed=False
    )
    slower = records.record(
        path, **common, decode_tps=80.0, spread_tps=2.0, description="slow\tone", crashed=False
    )
    crash = records.record(
        path, **common, decode_tps=math.nan, spread_tps=math.nan, description="x", crashed=True
    )
    assert [first["status"], slower["status"], crash["status"]] == ["keep", "discard", "crash"]
    lines = path.read_text().splitlines()
    assert lines[0].split("\t") == list(records.COLUMNS) and len(lines) == 4
    assert [r["description"] for r in records.read(path)] == ["base", "slow one", "x"]


# ---------------------------------------------------------------- names and skips


def test_unknown_names_are_skipped_with_the_reason():
    """Unknown scenarios, parts and peers are reported as skipped; the known ones still run."""
    plan = bench.make_plan(bench.parse_args(["--only", "mlxrt-ring,warp-drive", "--peers", "ollama,vllm"]))
    assert plan.scenarios == ["native", "mlxrt-ring"] and plan.peers == ["ollama"]
    assert "unknown scenario" in plan.skipped["warp-drive"] and "unknown peer" in plan.skipped["vllm"]
    assert not plan.components and not plan.concurrency


def test_default_plan_runs_everything():
    """The default suite has every scenario, peer and part; concurrency at 1, 4 and 16 streams on a CPU."""
    plan = bench.make_plan(bench.parse_args([]))
    assert plan.scenarios == list(bench.SCENARIOS) and plan.peers == list(bench.PEERS) and plan.components
    assert plan.concurrency == [1, 4, 16] and plan.agent and plan.http_peers == ["mlx_lm.server", "vllm-mlx"]
    assert bench.make_plan(bench.parse_args(["--concurrency", "none"])).concurrency == []
    only = bench.make_plan(bench.parse_args(["--only", "concurrency", "--concurrency", "2,1"]))
    assert only.concurrency == [1, 2] and only.scenarios == ["native"] and not only.components
    bad = bench.make_plan(bench.parse_args(["--concurrency", "1,x"]))
    assert bad.concurrency == [] and "expected numbers" in bad.skipped["concurrency"]


def test_each_server_gets_the_agent_parts_prompt_cache_cap_in_its_own_flag():
    """mlxrt serve and mlx_lm.server take bytes; vllm-mlx whole MiB, rounded up, and 0 is its cache off."""
    def cap(n: int | None, server: str) -> list[str]:
        sizes = agents.Sizes(agents=1, turns=1, reply_tokens=1, system_words=1, prompt_cache_bytes=n)
        return agents.cap_args(sizes, server)

    assert cap(None, "vllm-mlx") == cap(None, "mlxrt-http") == []
    assert cap(50_000_000, "mlx_lm.server") == ["--prompt-cache-bytes", "50000000"]
    assert cap(50_000_000, "vllm-mlx") == ["--cache-memory-mb", "48"]  # 47.7 MiB
    assert cap(1 << 20, "vllm-mlx") == ["--cache-memory-mb", "1"]
    assert cap(0, "vllm-mlx") == ["--disable-prefix-cache"]
    assert cap(0, "mlxrt-http") == ["--prompt-cache-bytes", "0"]


def test_part_streams_and_full_choose_the_parts_and_sizes():
    """--part picks parts alone, --streams names the stream counts, --full adds 32 streams and full agents."""
    agent = bench.make_plan(bench.parse_args(["--part", "agent", "--peers", "none"]))
    assert agent.agent and agent.scenarios == [] and agent.concurrency == [] and not agent.components
    assert agent.http_peers == []  # --peers none leaves the MLX servers out of the parts too
    conc = bench.make_plan(bench.parse_args(["--part", "concurrency", "--streams", "4,1"]))
    assert conc.concurrency == [1, 4] and conc.scenarios == ["native"] and not conc.agent
    assert conc.http_peers == ["mlx_lm.server", "vllm-mlx"]
    vllm = bench.make_plan(bench.parse_args(["--part", "concurrency", "--peers", "vllm-mlx"]))
    assert vllm.http_peers == ["vllm-mlx"] and vllm.peers == [] and "vllm-mlx" not in vllm.skipped
    # --peers names the parts' peer; single-stream rounds run only where --part asks for them
    agent_peer = bench.make_plan(bench.parse_args(["--part", "agent", "--peers", "mlx_lm.server"]))
    assert agent_peer.http_peers == ["mlx_lm.server"] and agent_peer.peers == agent_peer.scenarios == []
    e2e_peer = bench.make_plan(bench.parse_args(["--part", "mlxrt-http,agent", "--peers", "mlx_lm.server"]))
    assert e2e_peer.peers == ["mlx_lm.server"] and e2e_peer.scenarios == ["native", "mlxrt-http"]
    full = bench.make_plan(bench.parse_args(["--part", "concurrency", "--full"]))
    assert full.concurrency == [1, 4, 16, 32]
    assert bench.make_plan(bench.parse_args(["--part", "components", "--agents", "3"])).agent
    sizes = bench.agent_sizes(bench.parse_args(["--quick", "--turns", "5", "--agent-rounds", "2"]))
    assert (sizes.agents, sizes.turns, sizes.rounds) == (agents.QUICK["agents"], 5, 2)
    assert sizes.user_words == agents.USER_WORDS
    assert bench.agent_sizes(bench.parse_args(["--user-words", "8"])).user_words == 8
    assert bench.agent_sizes(bench.parse_args(["--full"])).system_words == agents.FULL["system_words"]
    with pytest.raises(SystemExit):
        bench.parse_args(["--agents", "0"])
    ab = ["--part", "components", "--agent-mlxrt-args", "--gather-ms 0"]
    assert bench.make_plan(bench.parse_args(ab)).agent  # a variant asks for the agent part
    assert bench.parse_args(["--agent-mlxrt-args=--gather-ms 0"]).agent_mlxrt_args == [["--gather-ms", "0"]]
    burst = bench.make_plan(bench.parse_args(["--part", "agent", "--burst-mlxrt-args=A=1"]))
    assert burst.agent and burst.concurrency  # a burst variant asks for the concurrency part
    for bad in (["--agent-mlxrt-args="], ["--agent-mlxrt-args=-x 1", "--agent-mlxrt-args=-x  1"],
                ["--burst-mlxrt-args=A=1", "--burst-mlxrt-args=A=1 "],
                ["--streams", "none", "--burst-mlxrt-args=A=1"]):
        with pytest.raises(SystemExit):
            bench.parse_args(bad)  # no flags, the same variant twice, or a burst variant with no bursts
    quoted = bench.parse_args(["--agent-mlxrt-args=-x '1 2'", "--agent-mlxrt-args=-x 1 2"]).agent_mlxrt_args
    names = [agents.variant_name(v) for v in quoted]  # two servers, two names
    assert names == ["mlxrt-http -x '1 2'", "mlxrt-http -x 1 2"]


def test_unreachable_ollama_is_skipped_with_the_reason(monkeypatch):
    """No Ollama at OLLAMA_HOST: setup raises Skipped naming the address and the variable."""
    port = _closed_port()
    monkeypatch.setenv("OLLAMA_HOST", f"127.0.0.1:{port}")
    with pytest.raises(Skipped, match=rf"not reachable at http://127.0.0.1:{port}.*OLLAMA_HOST"):
        Ollama("/unused", tokenizer=None).setup()


def test_ollama_host_forms(monkeypatch):
    """OLLAMA_HOST may be host:port, a URL, or the bind-all address."""
    for value, want in [
        ("10.1.2.3:1234", "http://10.1.2.3:1234"),
        ("http://box", "http://box:11434"),
        ("0.0.0.0", "http://127.0.0.1:11434"),
    ]:
        monkeypatch.setenv("OLLAMA_HOST", value)
        assert ollama_base() == want
    monkeypatch.delenv("OLLAMA_HOST")
    assert ollama_base() == "http://127.0.0.1:11434"


class _FakeOllama(BaseHTTPRequestHandler):
    """Ollama's API as far as the peer uses it (Ollama itself cannot be installed here)."""

    created: list = []

    def log_message(self, *args):  # keep pytest's output clean
        pass

    def _json(self, obj, status=200):
        body = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        if self.path == "/api/version":
            self._json({"version": "0.0-fake"})
        else:  # /api/ps
            name = self.created[-1]["model"] if self.created else ""
            self._json({"models": [{"name": name + ":latest", "size": 100, "size_vram": 0, "details": {}}]})

    def do_HEAD(self):
        self.send_response(404)
        self.end_headers()

    def do_POST(self):
        body = self.rfile.read(int(self.headers["Content-Length"]))
        if self.path.startswith("/api/blobs/"):
            self._json({}, 201)
        elif self.path == "/api/create":
            self.created.append(json.loads(body))
            self._json({"status": "success"})
        else:  # /api/generate: three tokens, then the totals
            self.send_response(200)
            self.end_headers()
            for piece in (" the", " fox", " ran"):
                self.wfile.write(json.dumps({"response": piece, "done": False}).encode() + b"\n")
                self.wfile.flush()
            final = {
                "response": "",
                "done": True,
                "eval_count": 3,
                "eval_duration": 30_000_000,
                "prompt_eval_count": 5,
                "prompt_eval_duration": 10_000_000,
            }
            self.wfile.write(json.dumps(final).encode() + b"\n")


def test_ollama_peer_imports_the_gguf_and_reads_eval_counts(monkeypatch, tmp_path, tiny_model, reference):
    """Against a fake of its API: the GGUF becomes a model; eval_count/eval_duration become figures."""
    monkeypatch.setenv("MLXRT_GGUF_DIR", str(tmp_path))
    server = ThreadingHTTPServer(("127.0.0.1", 0), _FakeOllama)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        monkeypatch.setenv("OLLAMA_HOST", f"127.0.0.1:{server.server_address[1]}")
        peer = Ollama(tiny_model, tokenizer=reference[1])
        peer.setup()
        run = peer.run([10, 11, 12, 13, 14], 3)
    finally:
        server.shutdown()
        server.server_close()
    created = _FakeOllama.created[-1]
    assert created["model"] == peer.model and list(created["files"]) == ["model.gguf"]
    assert run.n_tokens == 3 and run.engine["decode_tps"] == pytest.approx(100.0)
    assert run.engine["prompt_tps"] == pytest.approx(500.0)
    assert peer.describe()["runner"]["processor"] == "CPU"


def test_gguf_export_uses_llama_cpp_names_and_the_bpe_vocab(tmp_path, tiny_model):
    """The export has llama.cpp tensor names, no tied output, and the full gpt2-style vocabulary."""
    import gguf

    from benchmarks.gguf_export import export

    path = export(tiny_model, tmp_path / "tiny.gguf")
    r = gguf.GGUFReader(str(path))
    names = {t.name for t in r.tensors}
    assert {
        "token_embd.weight",
        "output_norm.weight",
        "blk.0.attn_q.weight",
        "blk.0.attn_q.bias",
        "blk.1.ffn_down.weight",
    } <= names
    assert "output.weight" not in names  # tied embeddings: llama.cpp reuses token_embd
    field = r.fields["tokenizer.ggml.model"]
    assert bytes(field.parts[field.data[0]]).decode() == "gpt2"
    assert len(r.fields["tokenizer.ggml.tokens"].data) == 2048


# ---------------------------------------------------------------- the gate and a whole run


class _Corrupt(Native):
    """Stands in for mlxrt: native's tokens with the last one changed."""

    def __init__(self, model_path: str, transport: str, **_kw) -> None:
        super().__init__(model_path)
        self.name = f"mlxrt-{transport}"

    def run(self, prompt_ids, gen_tokens):
        run = super().run(prompt_ids, gen_tokens)
        run.tokens[-1] += 1
        return run


def test_token_mismatch_fails_the_run(monkeypatch, capsys, tmp_path):
    """A scenario whose ids differ from native's fails the quality gate: exit 1, status token-mismatch."""
    monkeypatch.setattr(e2e, "Embedded", _Corrupt)
    monkeypatch.setattr("mlxrt.logs.configure", lambda **_kw: None)  # leave this process's logging alone
    code = bench.main(
        [
            "--model",
            "synthetic:tiny",
            "--quick",
            "--only",
            "mlxrt-stdio",
            "--peers",
            "none",
            "--no-plot",
            "--json",
            str(tmp_path / "r.json"),
        ]
    )
    out = capsys.readouterr().out
    doc = json.loads(out.strip().splitlines()[-1])
    assert code == bench.EXIT_GATE and doc["status"] == "token-mismatch"
    assert doc["gate"]["mismatched"] == ["mlxrt-stdio"] and "QUALITY GATE FAILED" in out


def test_bench_ends_with_its_tables_and_paths_not_the_document(capsys, tmp_path):
    """`make bench`'s entry point ends stdout with its tables, the JSON's path and a summary line
    under 1 KB; the whole document, with the run's date beside the commit, is in the file."""
    argv = ["--model", "synthetic:tiny", "--quick", "--only", "mlxrt-stdio", "--peers", "none", "--no-plot"]
    out_json = tmp_path / "r.json"
    code = bench.main([*argv, "--json", str(out_json)])
    out = capsys.readouterr().out.strip().splitlines()
    doc = json.loads(out_json.read_text())
    s = doc["scenarios"]["mlxrt-stdio"]
    assert code == 0 and doc["status"] == "ok" and s["runs"]
    assert doc["env"]["commit"] and doc["env"]["date"].endswith("Z")
    assert len(out[-1].encode()) < 1024 and "runs" not in out[-1]
    head = {"scenario": "mlxrt-stdio", "decode_tps": s["decode_tps"]["median"],
            "ratio_to_native": s["ratio_to_native"]["median"]}
    assert json.loads(out[-1]) == {"benchmark": "mlxrt-bench", "status": "ok", "elapsed_s": doc["elapsed_s"],
                                   "gate": {"passed": True, "mismatched": []}, "headline": head,
                                   "outputs": {"json": str(out_json)}}
    assert out[-2] == f"written: json {out_json}"  # the tables end with where the document went
    assert any(line.startswith("end to end") for line in out) and "quality gate" in "\n".join(out).lower()


def test_crossed_streams_fail_the_gate():
    """Under concurrency every stream must get its own prompt's tokens: crossed streams fail the gate."""
    args = bench.parse_args(["--model", "synthetic:tiny"])
    suite = bench.Suite(args, bench.make_plan(args), lambda _msg: None)

    def run(tokens):
        return measure.Run(tokens=tokens, prompt_tokens=1, ttft_ms=1.0, decode_tps=1.0, total_s=1.0)

    suite.ref = [9]
    suite.conc_refs = {2: [[1, 2], [3, 4]]}
    suite.conc_prompts = {2: [[7], [8]]}
    native = {"native": {"token_checked": True, "tokens": {"identical": True}}}
    suite.concurrency_runs = {"mlxrt-w2": {2: [run([1, 2]), run([3, 4])]}}
    assert suite.gate(native)["passed"] is True
    suite.concurrency_runs = {"mlxrt-w2": {2: [run([3, 4]), run([1, 2])]}}
    gate = suite.gate(native)
    assert gate["passed"] is False and gate["mismatched"] == ["mlxrt-w2 under concurrency"]


def test_agent_workload_is_seeded_and_per_agent():
    """The system prompt has the asked-for words and is the same for a seed; each agent says its own thing."""
    a, b = agents.system_prompt(120, seed=0), agents.system_prompt(120, seed=0)
    assert a == b and a != agents.system_prompt(120, seed=1)
    assert len(a.split("\n\n", 1)[0].split()) == 120
    msgs = {agents.user_message(i, t, seed=0) for i in range(3) for t in range(2)}
    assert len(msgs) == 6


def test_agent_figures_per_turn_and_against_the_uncached_reference():
    """Per turn: TTFT spread over agents, cached tokens where reported, and the ratio to the uncached TTFT."""

    def reply(agent, turn, ttft, cached):
        return agents.Reply(
            agent=agent,
            turn=turn,
            round=0,
            ttft_ms=ttft,
            total_s=1.0,
            reply_tokens=4,
            prompt_tokens=100 * turn,
            cached_tokens=cached,
            finish_reason="length",
            text=f"{agent}{turn}",
        )

    replies = [reply(0, 1, 40.0, 0), reply(1, 1, 60.0, 0), reply(0, 2, 10.0, 100), reply(1, 2, 20.0, 100)]
    uncached = [reply(0, 0, 100.0, 0), reply(1, 0, 100.0, 0)]
    sizes = agents.Sizes(agents=2, turns=2, reply_tokens=4, system_words=10)
    doc = agents.server_figures(replies, [2.0], sizes, uncached)
    t1, t2 = doc["turns"]
    assert (t1["ttft_ms"]["median"], t2["ttft_ms"]["median"]) == (50.0, 15.0)
    assert t1["ttft_vs_uncached"] == pytest.approx(0.5) and t2["ttft_vs_uncached"] == pytest.approx(0.15)
    assert t2["cached_tokens"]["median"] == 100 and t2["reply_tokens"] == {"min": 4, "max": 4}
    assert doc["aggregate_tps"]["median"] == 8.0 and len(doc["requests"]) == 4  # 16 tokens over 2 s
    blind = agents.server_figures([reply(0, 1, 40.0, None)], [1.0], sizes, None)
    assert blind["turns"][0]["cached_tokens"] is None and not blind["cached_tokens_reported"]
    assert agents.same_replies(replies, replies) == 100.0


def test_native_batch_gives_each_prompt_its_own_greedy_tokens(tiny_model, reference):
    """mlx-lm's BatchGenerator in-process: every stream makes exactly gen_tokens of its own prompt's ids."""
    from mlx_lm import stream_generate

    model, tokenizer = reference
    prompts = [list(tokenizer.encode(t)) for t in ("The fox ran far", "A quiet river bends", "Stars")]
    nb = NativeBatch(tiny_model, model=model)
    nb.setup()
    runs = nb.run_batch(prompts, 6)
    eos, tokenizer.eos_token_ids = tokenizer.eos_token_ids, set()  # the fixture is shared: put it back
    try:
        want = [[r.token for r in stream_generate(model, tokenizer, p, max_tokens=6)] for p in prompts]
    finally:
        tokenizer.eos_token_ids = eos
    assert [r.tokens for r in runs] == want
    assert all(r.n_tokens == 6 and r.ttft_ms > 0 and r.ended_at >= r.started_at for r in runs)


class _NativeByPrompt:
    """Stands in for native: its tokens are a function of the prompt, so crossed streams show."""

    def run(self, prompt, gen_tokens):
        return run_of([prompt[0] * 10, prompt[0] * 10 + 1])


def test_crossed_streams_against_native_batch_fail_the_gate():
    """native-batch is the reference for mlxrt's streams; its own crossed streams fail the gate too."""
    args = bench.parse_args(["--model", "synthetic:tiny"])
    native = {"native": {"token_checked": True, "tokens": {"identical": True}}}

    def suite_with(batch_tokens, mlxrt_tokens):
        suite = bench.Suite(args, bench.make_plan(args), lambda _msg: None)
        suite.ref = [9]
        suite.live["native"] = _NativeByPrompt()
        suite.conc_prompts = {2: [[1], [2]]}
        suite.conc_refs = {2: batch_tokens}
        suite.conc_ref_basis = {2: bench.NATIVE_BATCH}
        suite.concurrency_runs = {"mlxrt-http": {2: [run_of(t) for t in mlxrt_tokens]}}
        suite.concurrency_references()
        return suite.gate(native)

    good = suite_with([[10, 11], [20, 21]], [[10, 11], [20, 21]])
    assert good["passed"] is True and "native-batch under concurrency" in good["checked"]
    crossed = suite_with([[10, 11], [20, 21]], [[20, 21], [10, 11]])
    assert crossed["passed"] is False and crossed["mismatched"] == ["mlxrt-http under concurrency"]
    assert crossed["streams"]["mlxrt-http"]["2"] == {  # which streams, where they parted
        "failed": [{"stream": 0, "ok": False, "first_divergence": 0},
                   {"stream": 1, "ok": False, "first_divergence": 0}],
        "max_deficit": None,  # ids compared, not teacher-forced
    }
    assert good["streams"]["mlxrt-http"]["2"]["failed"] == []
    line = report.gate_line({"gate": crossed})
    assert line.endswith("; failed under concurrency: mlxrt-http at 2: 2 of 2 streams")
    batch_crossed = suite_with([[20, 21], [10, 11]], [[20, 21], [10, 11]])  # mlxrt follows a wrong reference
    assert batch_crossed["mismatched"] == ["native-batch under concurrency"]


class _CharTokenizer:
    """Ids are characters: every text survives decode -> encode."""

    def encode(self, text, add_special_tokens=False):
        return [ord(c) for c in text]

    def decode(self, ids):
        return "".join(map(chr, ids))


def test_concurrency_targets_stop_once_their_last_stream_count_ran():
    """A server leaves the GPU to the next once it has run its last burst, or failed one; the
    in-process native-batch stays (it shares the harness's model)."""
    args = bench.parse_args(["--model", "synthetic:tiny", "--part", "concurrency", "--streams", "1,2",
                             "--prompt-tokens", "4", "--gen-tokens", "2"])
    suite = bench.Suite(args, bench.make_plan(args), lambda _msg: None)
    suite.model_path, suite.tokenizer, suite.prompt = "m", _CharTokenizer(), [1, 2, 3, 4]
    suite.prompts = [[1, 2, 3, 4]]
    open_at: list[tuple[str, int, set[str]]] = []  # (target, streams, the targets open while it ran)

    class Target:
        def __init__(self, name, fail_at=None, warm_fails=False, close_fails=False):
            self.name, self.fail_at, self.closed = name, fail_at, False
            self.warm_fails, self.close_fails = warm_fails, close_fails

        def run(self, prompt, gen_tokens):
            assert not self.closed
            if self.warm_fails:
                raise RuntimeError("out of memory")
            return run_of([1] * gen_tokens)

        def run_batch(self, prompts, gen_tokens):
            open_at.append((self.name, len(prompts), {k for k, v in suite.live.items() if not v.closed}))
            if len(prompts) == self.fail_at:
                raise RuntimeError("out of memory")
            return [self.run(p, gen_tokens) for p in prompts]

        def close(self):
            self.closed = True
            if self.close_fails:
                raise RuntimeError("the worker is gone")

    ring, http, peer, batch = Target("ring"), Target("http"), Target("peer", fail_at=1, close_fails=True), \
        Target("batch")
    cold = Target("cold", warm_fails=True)  # fails its warm-up: stopped before any burst
    suite.live.update({"mlxrt-ring": ring, "mlxrt-w2": cold, "mlxrt-http": http, "mlx_lm.server": peer})
    targets = [("mlxrt-w1 (ring)", ring), ("mlxrt-w2", cold), ("mlxrt-http", http), ("mlx_lm.server", peer),
               (bench.NATIVE_BATCH, batch)]
    suite.concurrency_targets = lambda: targets
    out = suite.concurrency()  # the peer's close raising stops nothing
    assert out["skipped"] == {"mlxrt-w2": "failed to warm up: RuntimeError: out of memory",
                              "mlx_lm.server": "failed at 1 streams: RuntimeError: out of memory"}
    assert set(out["targets"]) == {"mlxrt-w1 (ring)", "mlxrt-http", bench.NATIVE_BATCH}
    assert open_at == [
        ("ring", 1, {"mlxrt-ring", "mlxrt-http", "mlx_lm.server"}),
        ("http", 1, {"mlxrt-ring", "mlxrt-http", "mlx_lm.server"}),
        ("peer", 1, {"mlxrt-ring", "mlxrt-http", "mlx_lm.server"}),
        ("batch", 1, {"mlxrt-ring", "mlxrt-http"}),  # the peer failed: stopped at once
        ("ring", 2, {"mlxrt-ring", "mlxrt-http"}),
        ("http", 2, {"mlxrt-http"}),  # the ring worker is done
        ("batch", 2, set()),
    ]
    assert all(t.closed for t in (ring, cold, http, peer)) and not batch.closed and suite.live == {}


def test_prompts_past_the_corpus_repeat_none_before():
    """Burst rounds ask for more prompts than the corpus has paragraphs: each start is a prompt of its own."""
    prompts = [tuple(e2e.make_prompt(_CharTokenizer(), 60, start=s)[0]) for s in range(400)]
    assert len(set(prompts)) == 400


def test_burst_rounds_take_turns_with_prompts_of_their_own_and_report_against_native_batch_by_round():
    """--burst-rounds 3: each stream count's targets take turns round by round (A B, B A, A B), each round a
    burst of prompts no round had; a server stops after its last round; the first round is the one checked,
    and the report pairs each round with native-batch's."""
    args = bench.parse_args(["--model", "synthetic:tiny", "--part", "concurrency", "--streams", "1,2",
                             "--prompt-tokens", "40", "--gen-tokens", "2", "--burst-rounds", "3",
                             "--burst-warmup", "0"])
    suite = bench.Suite(args, bench.make_plan(args), lambda _msg: None)
    suite.model_path, suite.tokenizer, suite.prompt = "m", _CharTokenizer(), [1, 2, 3, 4]
    suite.prompts = [[1, 2, 3, 4]]
    ran: list[tuple[str, int, tuple]] = []  # (target, streams, its prompts)

    class Target:
        closed = False

        def __init__(self, name, speed):
            self.name, self.speed = name, speed

        def run(self, prompt, gen_tokens):
            return run_of([1] * gen_tokens)

        def run_batch(self, prompts, gen_tokens):
            assert not self.closed  # stopped only after its last round
            ran.append((self.name, len(prompts), tuple(map(tuple, prompts))))
            runs = [self.run(p, gen_tokens) for p in prompts]
            for r in runs:  # the same window for every burst: aggregate tok/s = speed
                r.started_at, r.ended_at = 0.0, sum(x.n_tokens for x in runs) / self.speed
            return runs

        def close(self):
            self.closed = True

    ring, batch = Target("ring", 100.0), Target("batch", 200.0)
    suite.live.update({"mlxrt-ring": ring})
    suite.concurrency_targets = lambda: [("mlxrt-w1 (ring)", ring), (bench.NATIVE_BATCH, batch)]
    out = suite.concurrency()
    measured = [(name, n) for name, n, _ in ran]
    turns = [("ring", 1), ("batch", 1), ("batch", 1), ("ring", 1), ("ring", 1), ("batch", 1)]
    assert measured == turns + [(name, 2) for name, _ in turns]
    for n in (1, 2):
        rounds = [p for name, k, p in ran if k == n and name == "ring"]
        assert rounds == [p for name, k, p in ran if k == n and name == "batch"]  # the same in a round
        assert len({q for p in rounds for q in p}) == 3 * n  # none sent twice
        assert rounds[0] == tuple(map(tuple, suite.conc_prompts[n]))  # the first round is the checked one
    assert ring.closed and suite.live == {}
    assert [len(out["targets"][t][n]["rounds"]) for t in out["targets"] for n in ("1", "2")] == [3, 3, 3, 3]
    table = report.concurrency_table({"concurrency": out})
    assert "over 3 rounds" in table and "x native-batch 0.50 [0.50-0.50]" in table


def test_a_server_failing_its_warm_up_round_is_skipped_with_its_answer():
    """A server failing a warm-up round is skipped with what it answered; the others' rounds run."""
    # mlx_lm.server answers any exception in generation with a 404 and a JSON body.
    import http.server

    class Failing(http.server.BaseHTTPRequestHandler):
        def do_POST(self):
            self.rfile.read(int(self.headers["Content-Length"]))
            body = b'{"error": "generation thread died"}'
            self.send_response(404)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    class Bad:
        model, chat_extra, closed = "bench", {}, False

        def __init__(self, port: int) -> None:
            self.base_url = f"http://127.0.0.1:{port}/v1"

        def close(self) -> None:
            self.closed = True

    class Good:
        closed = False

        def run_agents(self, sizes, *, round_):
            reply = agents.Reply(agent=0, turn=1, round=round_, ttft_ms=1.0, total_s=0.1, reply_tokens=2,
                                 prompt_tokens=9, cached_tokens=0, finish_reason="length", text="hi")
            return [reply], [[]], 0.1

        def close(self) -> None:
            self.closed = True

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Failing)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        bad, good = Bad(httpd.server_address[1]), Good()
        live = {"bad": bad, "good": good}
        sizes = agents.Sizes(agents=1, turns=1, reply_tokens=2, system_words=5, warmup_rounds=1)
        res, skipped, said = agents._Results(list(live)), {}, []
        agents._rounds(live, sizes, res, skipped, said.append)
    finally:
        httpd.shutdown()
        httpd.server_close()
    assert list(live) == ["good"] and bad.closed and not good.closed
    assert skipped["bad"].startswith("failed in warm-up round 1: NotFoundError")
    assert "generation thread died" in skipped["bad"]
    assert len(res.replies["good"]) == 1 and res.walls["good"] == [0.1] and not res.replies["bad"]


def test_agent_rounds_start_one_server_further_along_each_round():
    """Three servers over four rounds run A B C, B C A, C A B, A B C: none always first; one that fails
    leaves the others to take turns."""
    order: list[tuple[int, str]] = []

    class Server:
        closed = False

        def __init__(self, name, fail_in=None):
            self.name, self.fail_in = name, fail_in

        def run_agents(self, sizes, *, round_):
            order.append((round_, self.name))
            if round_ == self.fail_in:
                raise RuntimeError("gone")
            reply = agents.Reply(agent=0, turn=1, round=round_, ttft_ms=1.0, total_s=0.1, reply_tokens=2,
                                 prompt_tokens=9, cached_tokens=0, finish_reason="length", text="hi")
            return [reply], [[]], 0.1

        def close(self):
            self.closed = True

    live = {n: Server(n) for n in "ABC"}
    sizes = agents.Sizes(agents=1, turns=1, reply_tokens=2, system_words=5, rounds=4)
    agents._rounds(live, sizes, agents._Results(list(live)), {}, lambda _msg: None)
    assert "".join(n for _, n in order) == "ABC" "BCA" "CAB" "ABC"
    order.clear()
    live = {"A": Server("A"), "B": Server("B", fail_in=0), "C": Server("C")}
    agents._rounds(live, sizes, agents._Results(list(live)), {}, lambda _msg: None)
    assert "".join(n for _, n in order) == "ABC" "CA" "AC" "CA"


def test_a_failing_agent_part_keeps_the_parts_measured_before(tmp_path, monkeypatch, capsys):
    """An agent part that raises is reported as not run; the concurrency figures measured stand."""

    def boom(self):
        raise RuntimeError("agents broke")

    monkeypatch.setattr(bench.Suite, "agent", boom)
    out = tmp_path / "run.json"
    argv = ["--model", "synthetic:tiny", "--part", "concurrency,agent", "--streams", "2", "--quick",
            "--peers", "none", "--no-plot", "--json", str(out)]
    assert bench.main(argv) == 0
    doc = json.loads(out.read_text())
    assert doc["agent"]["not_run"] == "the agent part failed: RuntimeError: agents broke"
    assert doc["concurrency"]["levels"] == [2] and doc["concurrency"]["targets"]
    assert "agents broke" in capsys.readouterr().err  # its traceback, for whoever reads the log


def test_a_failing_concurrency_part_keeps_the_single_stream_figures(tmp_path, monkeypatch, capsys):
    """A concurrency part that raises after its streams ran (native's reference ids running out of
    memory, as on an H200) is reported as not run; the single-stream figures stand, and the gate
    names the streams it could not check."""

    def boom(self, *args):
        raise RuntimeError("out of memory")

    monkeypatch.setattr(NativeBatch, "setup", boom)  # as on the H200: no native-batch ids either
    monkeypatch.setattr(bench.Suite, "concurrency_references", boom)
    out = tmp_path / "run.json"
    argv = ["--model", "synthetic:tiny", "--part", "native,mlxrt-ring,concurrency", "--streams", "2",
            "--quick", "--peers", "none", "--no-plot", "--json", str(out)]
    assert bench.main(argv) == 0
    doc = json.loads(out.read_text())
    assert doc["concurrency"] == {"not_run": "the concurrency part failed: RuntimeError: out of memory"}
    assert doc["scenarios"]["mlxrt-ring"]["tokens"]["passed"] and doc["scenarios"]["native"]["decode_tps"]
    gate = doc["gate"]
    assert gate["checked"] == ["mlxrt-ring"] and "mlxrt-w1 (ring) under concurrency" in gate["unchecked"]
    captured = capsys.readouterr()
    assert "out of memory" in captured.err and "not checked, no reference ids: mlxrt-w1" in captured.out


def test_a_variants_leading_environment_words_reach_its_server(tiny_model):
    """A server variant's leading NAME=value words are its process's environment, as a shell's: a bad
    MLXRT_PREFILL_BUDGET_MS stops that server naming the knob; a later word stays a flag's value."""
    from benchmarks.http_scenario import HttpStream
    from benchmarks.scenarios import Skipped

    later = HttpStream(tiny_model, extra_args=["--chat-template", "A=1"])
    assert later.env == {} and later.extra_args == ["--chat-template", "A=1"]
    bad = HttpStream(tiny_model, extra_args=["MLXRT_PREFILL_BUDGET_MS=-1"])
    assert bad.env == {"MLXRT_PREFILL_BUDGET_MS": "-1"} and bad.extra_args == []
    with pytest.raises(Skipped, match="prefill.budget.ms"):
        bad.setup()


def test_a_burst_variant_takes_its_turn_in_the_rounds_and_is_token_checked(tmp_path):
    """--burst-mlxrt-args: mlxrt serve with its environment and a flag added is one more burst target, in
    every round beside mlxrt-http, checked against native-batch's tokens; a variant whose server cannot
    start is skipped naming why, and the others run."""
    out_json = tmp_path / "bursts.json"
    variant, bad = "mlxrt-http MLXRT_PREFILL_BUDGET_MS=0 --gather-ms=0", "mlxrt-http --no-such-flag"
    bad_env = "mlxrt-http MLXRT_PREFILL_BUDGET_MS=-1"  # its environment reaches it: the server refuses it
    cmd = [sys.executable, "-m", "benchmarks", "--model", "synthetic:tiny", "--part",
           "concurrency,native,mlxrt-http", "--peers", "none", "--workers", "1", "--streams", "2",
           "--prompt-tokens", "40", "--gen-tokens", "4", "--rounds", "1", "--burst-rounds", "2", "--no-plot",
           "--json", str(out_json),
           "--burst-mlxrt-args=MLXRT_PREFILL_BUDGET_MS=-1", "--burst-mlxrt-args=--no-such-flag",
           "--burst-mlxrt-args=MLXRT_PREFILL_BUDGET_MS=0 --gather-ms=0"]  # those that fail first
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(out_json.read_text())
    targets = doc["concurrency"]["targets"]
    assert set(targets) == {"mlxrt-w1", "mlxrt-http", variant, "native-batch"}, doc["concurrency"]["skipped"]
    assert len(targets[variant]["2"]["rounds"]) == 2 and targets[variant]["2"]["aggregate_tps"] > 0
    assert f"{variant} under concurrency" in doc["gate"]["checked"] and doc["gate"]["passed"]
    assert "--no-such-flag" in doc["skipped"][bad] and "--prefill-budget-ms=-1" in doc["skipped"][bad_env]
    assert doc["config"]["burst_mlxrt_args"] == [["MLXRT_PREFILL_BUDGET_MS=-1"], ["--no-such-flag"],
                                                 ["MLXRT_PREFILL_BUDGET_MS=0", "--gather-ms=0"]]
    said = [line.split("] ", 1)[1] for line in proc.stderr.splitlines() if f"concurrency {variant}:" in line]
    assert said == [f"concurrency {variant}: 2 stream(s), round {r}/2" for r in (1, 2)]
    assert any(line.startswith(variant) and "x native-batch" in line for line in proc.stdout.splitlines())


CAP = 50_000_000  # bytes: the agent test's prompt cache cap, ample for tiny's chats


def test_agent_part_on_tiny_writes_per_turn_figures(tmp_path):
    """--part agent: both servers run the agents; per-turn figures, reply counts, the uncached reference."""
    out_json = tmp_path / "agent.json"
    sizes = ["--agents", "2", "--turns", "2", "--reply-tokens", "4", "--system-words", "40"]
    sizes += ["--prompt-cache-bytes", str(CAP)]  # one cap on every server
    # and one more mlxrt serve, with a flag added and its environment set (CUDA's; a no-op on the CPU)
    sizes += ["--agent-mlxrt-args=MLX_CUDA_USE_CUDNN_SDPA=0 --gather-ms=0"]
    cmd = [sys.executable, "-m", "benchmarks", "--model", "synthetic:tiny", "--part", "agent", *sizes]
    cmd += ["--json", str(out_json)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    last = json.loads(proc.stdout.strip().splitlines()[-1])  # the summary line, not the document
    doc = json.loads(out_json.read_text())
    assert last["status"] == doc["status"] == "ok" and last["outputs"]["json"] == str(out_json)
    ag = doc["agent"]
    want = {"agents": 2, "turns": 2, "reply_tokens": 4, "system_words": 40, "user_words": agents.USER_WORDS,
            "rounds": 1, "warmup_rounds": 0, "prompt_cache_bytes": CAP}
    assert ag["sizes"] == want  # no warm-up round on a CPU
    variant = "mlxrt-http MLX_CUDA_USE_CUDNN_SDPA=0 --gather-ms=0"
    assert set(ag["servers"]) | set(ag["skipped"]) == {"mlxrt-http", variant, "mlx_lm.server", "vllm-mlx",
                                                       agents.NATIVE}
    assert {"mlxrt-http", variant} <= set(ag["servers"]), (ag["skipped"], proc.stderr[-3000:])
    if os.environ.get("CI") or http_scenario.vllm_mlx_site()[0] is not None:  # `make test` installs it
        assert "vllm-mlx" in ag["servers"], (ag["skipped"], proc.stderr[-3000:])
        assert all(r["reply_tokens"] == 4 for r in ag["servers"]["vllm-mlx"]["requests"])  # its EOS off
        assert ag["servers"]["vllm-mlx"]["uncached"]["ttft_ms"]["n"] == 2  # --disable-prefix-cache
    for sv in ag["servers"].values():
        t1, t2 = sv["turns"]
        assert t1["ttft_ms"]["n"] == t2["ttft_ms"]["n"] == 2 and t1["ttft_ms"]["median"] > 0
        assert t2["prompt_tokens"]["min"] > t1["prompt_tokens"]["max"]  # the conversation grows
        assert len(sv["requests"]) == 4 and sv["aggregate_tps"]["n"] == 1
        assert sv["uncached"] is not None or sv["uncached_skipped"]
        if sv["uncached"] is not None:
            assert sv["uncached"]["ttft_ms"]["n"] == 2 and t2["ttft_vs_uncached"] > 0
    assert all(r["reply_tokens"] == 4 for r in ag["servers"]["mlxrt-http"]["requests"])  # ignore_eos
    assert ag["servers"]["native-engine"]["uncached"] is None  # the in-process engine has no cache-off run
    assert ag["servers"]["native-engine"]["info"]["prompt_cache_bytes"] == CAP
    for name in set(ag["servers"]) - {"native-engine", variant}:  # vllm-mlx's cache cap is in MiB
        want = (["--cache-memory-mb", "48"] if name == "vllm-mlx"  # 47.7 MiB, rounded up
                else ["--prompt-cache-bytes", str(CAP)])
        assert ag["servers"][name]["info"]["args"] == want, name
    assert ag["servers"][variant]["info"]["args"] == ["--prompt-cache-bytes", str(CAP), "--gather-ms=0"]
    assert ag["servers"][variant]["info"]["env"] == {"MLX_CUDA_USE_CUDNN_SDPA": "0"}  # not a flag
    v = ag["servers"][variant]  # its uncached reference: mlxrt-http's (the same server with its cache off)
    assert v["uncached"] == ag["servers"]["mlxrt-http"]["uncached"] and v["uncached_from"] == "mlxrt-http"
    assert ag["same_replies_pct"]["native-engine"] == 100.0  # in-process, the same replies as the server
    assert ag["same_replies_pct"][variant] == 100.0  # gathering changes when requests start, not their ids
    assert doc["config"]["agent_mlxrt_args"] == [["MLX_CUDA_USE_CUDNN_SDPA=0", "--gather-ms=0"]]
    assert doc["config"]["agent"]["agents"] == 2 and doc["env"]["commit"]
    assert "agents: 2 agents at once x 2 turns" in proc.stdout
    assert f"{variant} aggregate" in proc.stdout
    assert Path(doc["outputs"]["png"]).is_file()


def test_quick_suite_on_tiny_writes_the_whole_document(tmp_path):
    """A whole quick run: tables, then the JSON document with every part, the PNG, and a record row."""
    out_json, tsv = tmp_path / "bench.json", tmp_path / "results.tsv"
    env = {**os.environ, "OLLAMA_HOST": f"127.0.0.1:{_closed_port()}"}
    cmd = [
        sys.executable,
        "-m",
        "benchmarks",
        "--model",
        "synthetic:tiny",
        "--quick",
        "--concurrency",
        "1,2",
        "--only",
        "native,mlxrt-ring,mlxrt-stdio,components,concurrency,ollama,nonsense",
        "--peers",
        "ollama",  # leaves the MLX servers out of the concurrency part: the agent test starts them
        "--json",
        str(out_json),
        "--log",
        "smoke test",
        "--results-tsv",
        str(tsv),
    ]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    last = json.loads(proc.stdout.strip().splitlines()[-1])
    doc = json.loads(out_json.read_text())
    assert last["outputs"] == doc["outputs"] and last["gate"]["passed"] is True
    assert doc["status"] == "ok" and doc["gate"]["passed"] is True, doc["gate"]
    assert {"native", "mlxrt-ring", "mlxrt-stdio"} <= set(doc["scenarios"]), (
        doc["skipped"],
        proc.stderr[-3000:],
    )
    for s in doc["scenarios"].values():
        assert s["decode_tps"]["n"] == 2 and s["ttft_ms"]["median"] > 0 and len(s["runs"]) == 2
        assert s["tokens"]["identical"] is True
    assert doc["scenarios"]["mlxrt-ring"]["ratio_to_native"]["n"] == 2
    assert set(doc["skipped"]) >= {"ollama", "nonsense"}
    assert "not reachable" in doc["skipped"]["ollama"]
    comp = doc["components"]
    assert {"codec", "outbox", "worker_loop_us", "e2e_gap_us", "largest"} <= set(comp)
    assert "transport" in comp or "transport" in comp["skipped"]
    assert set(comp["worker_loop_us"]) == {"mlxrt-ring", "mlxrt-stdio"}
    conc = doc["concurrency"]
    targets = conc["targets"]
    assert set(targets) == {"mlxrt-w1 (ring)", "mlxrt-w2", "mlxrt-http", "native-batch"}, conc["skipped"]
    assert all(set(levels) == {"1", "2"} for levels in targets.values())
    assert all(targets[t]["2"]["ttft_ms"]["p90"] > 0 for t in targets)
    assert conc["reference"] == {"1": "native-batch", "2": "native-batch"}
    assert all(c["ok"] for cs in conc["native_batch_vs_native"].values() for c in cs)
    assert {"mlxrt-w2 under concurrency", "mlxrt-http under concurrency"} <= set(doc["gate"]["checked"])
    assert "native-batch under concurrency" in doc["gate"]["checked"]
    assert doc["agent"] == {"not_run": "not asked for (--part without agent)"}
    assert doc["env"]["commit"] and doc["env"]["versions"]["mlx"]
    assert Path(doc["outputs"]["png"]).is_file()
    assert records.read(tsv)[0]["status"] == "keep" and "where the microseconds go" in proc.stdout


def test_a_connection_reset_before_the_response_is_retried():
    """A server that resets the first connection (a listen backlog overflowing in a burst): the
    stream retries as the openai client does, gets its events and counts the retry; a server that
    resets every attempt fails the stream once the retries are spent."""
    from benchmarks import http_scenario

    def serve(listener: socket.socket, resets: int, answer: bool) -> None:
        for _ in range(resets):
            conn, _ = listener.accept()
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
            conn.close()  # with a RST, not a FIN
        if answer:
            conn, _ = listener.accept()
            conn.recv(65536)
            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n\r\n"
                         b'data: {"choices": []}\n\ndata: [DONE]\n\n')
            conn.close()

    attempts = http_scenario.CONNECT_RETRIES + 1
    for resets, answer in ((1, True), (attempts, False)):
        with socket.socket() as listener:
            listener.bind(("127.0.0.1", 0))
            listener.listen()
            threading.Thread(target=serve, args=(listener, resets, answer), daemon=True).start()
            before = http_scenario.connect_retries.value
            stream = http_scenario.sse_data(listener.getsockname()[1], "/v1/completions", {})
            if answer:
                assert list(stream) == [b'{"choices": []}\n']
            else:
                with pytest.raises(OSError):
                    list(stream)
            assert http_scenario.connect_retries.value - before == (resets if answer else attempts - 1)


def _family_doc(preset: str, sizes: dict, status: str = "ok") -> dict:
    row = {"preset": preset, "model": f"synthetic:{preset}", "model_type": "llama", "status": status,
           "exit": 0 if status == "ok" else 1, "elapsed_s": 1.0, "listen_overflows": 0}
    return {"config": {"presets": [preset], "profile": "gpu", "quick": False, "sizes": sizes,
                       "peers": "mlx_lm.server", "parts": families.PARTS},
            "rows": [row], "notes": [], "env": {"commit": preset}, "elapsed_s": 2.0,
            "runs": {preset: {"k": 1}}}


def test_families_merge_joins_runs_and_refuses_ones_that_differ(tmp_path, capsys):
    """Per-family runs join into one document; runs of other sizes or a family twice are refused."""
    sizes = {"rounds": 3}
    docs = [_family_doc("a", sizes), _family_doc("b", sizes, status="token-mismatch")]
    paths = []
    for d in docs:
        paths.append(tmp_path / f"{d['config']['presets'][0]}.json")
        paths[-1].write_text(json.dumps(d))
    out = tmp_path / "all.json"
    rc = families.main(["--merge", *map(str, paths), "--out", str(out)])
    doc = json.loads(out.read_text())
    last = json.loads(capsys.readouterr().out.strip().splitlines()[-1])  # stdout ends in a summary line
    assert last["rows"] == [{"preset": "a", "status": "ok"}, {"preset": "b", "status": "token-mismatch"}]
    assert last["outputs"] == {"json": str(out)} and "runs" not in last
    assert rc == 1  # one family failed, as a single run would say
    assert doc["config"]["presets"] == ["a", "b"] and [r["preset"] for r in doc["rows"]] == ["a", "b"]
    assert doc["runs"] == {"a": {"k": 1}, "b": {"k": 1}} and doc["elapsed_s"] == 4.0
    assert [e["commit"] for e in doc["envs"]] == ["a", "b"]
    assert doc["notes"] == ["b: the harness exited 1 (token-mismatch)"]
    with pytest.raises(ValueError, match="sizes"):
        families.merge([_family_doc("a", sizes), _family_doc("c", {"rounds": 5})])
    # a size added since (the agents' cache cap) reads as its default in an older run's document
    assert families.merge([_family_doc("a", sizes), _family_doc("c", {**sizes, "prompt_cache_bytes": None})])
    with pytest.raises(ValueError, match="sizes"):
        families.merge([_family_doc("a", sizes), _family_doc("c", {**sizes, "prompt_cache_bytes": 1 << 30})])
    with pytest.raises(ValueError, match="more than one run"):
        families.merge([_family_doc("a", sizes), _family_doc("a", sizes)])
    assert families.main(["--merge", str(paths[0]), str(tmp_path / "absent.json")]) == 2


def test_families_runs_parts_apart_and_merge_joins_them(tmp_path):
    """--part runs some of a family's parts; --merge makes one row of two runs, each part from one."""
    # A GPU is lent minutes at a time: a family's parts may come from several runs; a part with figures
    # in two runs is refused.
    cmd = [sys.executable, "-m", "benchmarks.families", "--presets", "tiny", "--quick"]
    cmd += ["--peers", "mlx_lm.server"]
    docs = []
    for parts in ("single,streams", "agents"):
        out = tmp_path / f"{parts}.json"
        ab = ["--agent-mlxrt-args=--gather-ms=0"] if parts == "agents" else []  # the agents' A/B of a flag
        proc = subprocess.run([*cmd, "--part", parts, *ab, "--out", str(out)], cwd=ROOT, capture_output=True,
                              text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        docs.append(json.loads(out.read_text()))
    first, agent = (d["rows"][0] for d in docs)
    assert first["parts"] == ["single", "streams"] and first["single"]["mlxrt-ring"]["ids_identical"]
    assert first["streams"]["streams"] == 16 and "not_run" in first["agents"]
    assert agent["parts"] == ["agents"] and "not_run" in agent["single"] and "not_run" in agent["streams"]
    assert agent["agents"]["mlxrt-http"]["hit_rate"] > 0
    variant = agent["agents"]["mlxrt-http --gather-ms=0"]
    assert variant["x_mlxrt_http"]["n"] == 1 and variant["hit_rate"] > 0  # paired with mlxrt-http's round
    assert any(n.startswith("tiny: agents: mlxrt-http --gather-ms=0: ") for n in docs[1]["notes"])
    assert docs[1]["runs"]["tiny"]["scenarios"] == {}  # --peers named the agents' peer: no single stream ran
    merged = families.merge(docs)
    row = merged["rows"][0]
    assert row["single"] == first["single"] and row["streams"] == first["streams"]
    assert row["agents"] == agent["agents"] and row["parts"] == list(families.PARTS)
    assert merged["config"]["presets"] == ["tiny"] and set(merged["runs"]) == {"tiny", "tiny (agents)"}
    assert row["elapsed_s"] == first["elapsed_s"] + agent["elapsed_s"] and row["status"] == "ok"
    # a document from before --part asked for every part: its agents, not run, come from the later run
    before = "native,mlxrt-ring,mlxrt-http,concurrency,agent"  # the harness's parts, as such runs stored them
    old = {**docs[0], "config": {**docs[0]["config"], "parts": before},
           "rows": [{k: v for k, v in first.items() if k != "parts"}]}
    assert families.merge([old, docs[1]])["rows"][0]["agents"] == agent["agents"]
    again = families.merge([merged])  # a merged document merges again with its runs and machines
    assert again["rows"] == merged["rows"] and again["runs"] == merged["runs"]
    assert len(again["envs"]) == len(merged["envs"]) == 2
    failed = {**docs[1], "rows": [{**agent, "status": "crash", "exit": 3, "error": "boom",
                                   "agents": {"not_run": "boom"}}]}
    kept = families.merge([*docs, failed])
    assert kept["rows"][0] == {**row, "elapsed_s": row["elapsed_s"] + agent["elapsed_s"]}  # no figure, no say
    assert len(kept["runs"]) == 3 and len(kept["envs"]) == 3
    with pytest.raises(ValueError, match="agents in more than one run"):
        families.merge([docs[1], docs[1]])
    with pytest.raises(ValueError, match="single, streams in more than one run"):
        families.merge([old, docs[0]])


def test_families_pass_the_agents_cache_cap_only_when_given():
    """--prompt-cache-bytes reaches the harness with the agent part; unset, every server keeps its own."""
    def argv(sizes, parts):
        return families.harness_argv("m", sizes, parts=parts, peers="none", json_path=Path("x.json"))

    capped = dataclasses.replace(families.GPU, prompt_cache_bytes=1 << 30)
    assert "--prompt-cache-bytes" not in argv(families.GPU, ["agents"])
    assert "--prompt-cache-bytes" not in argv(capped, ["single"])
    got = argv(capped, ["agents"])
    assert got[got.index("--prompt-cache-bytes") + 1] == str(1 << 30)
    def with_variant(parts):
        return families.harness_argv("m", families.GPU, parts=parts, peers="none", json_path=Path("x.json"),
                                     variants=["--gather-ms=0"])

    assert "--agent-mlxrt-args=--gather-ms=0" in with_variant(["agents"])
    assert not any(a.startswith("--agent-mlxrt-args") for a in with_variant(["single"]))
    v = "mlxrt-http --gather-ms=0"  # a variant whose mlxrt-http failed: nothing to compare with
    alone = {"preset": "p", "exit": 0, "status": "ok", "agents": {v: {"hit_rate": 0.5}}}
    assert families.notes([alone]) == [f"p: agents: {v}: no mlxrt-http figures to compare with"]


def test_families_refuses_to_start_without_the_agent_client(monkeypatch, capsys):
    """A families run needs every part: a missing openai client stops it before the first family."""
    monkeypatch.setitem(sys.modules, "openai", None)  # import openai raises ImportError
    assert families.main(["--presets", "tiny", "--quick"]) == 2
    assert "openai" in capsys.readouterr().err


def test_mlxrt_commit_names_the_tree_over_git(monkeypatch):
    """MLXRT_COMMIT, where set, is the commit a figure records (a copied tree's .git can be stale)."""
    from benchmarks import env

    monkeypatch.setenv("MLXRT_COMMIT", "ff88b68")
    assert env.git_commit() == "ff88b68"
    monkeypatch.delenv("MLXRT_COMMIT")
    assert env.git_commit() != "ff88b68"
