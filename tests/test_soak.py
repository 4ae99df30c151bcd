"""The soak harness: its statistics on synthetic series, its verdict, and short real runs."""

from __future__ import annotations

import csv
import json
import math
import random
import sys

import pytest
from mlxrt import cli, soak
from mlxrt.soak import SoakConfig, SoakSummary

MB = 1 << 20


# ---- the math ---------------------------------------------------------------------


def test_slope_of_an_exact_line():
    """Least squares recovers an exact line's slope with zero standard error."""
    ts = [0.0, 1.0, 2.0, 3.0, 4.0]
    slope, stderr = soak.least_squares_slope(ts, [5 + 2 * t for t in ts])
    assert slope == pytest.approx(2.0)
    assert stderr == pytest.approx(0.0, abs=1e-12)


def test_slope_needs_three_points_and_spread():
    """Fewer than three points, or all at one time, give no slope rather than a made-up one."""
    assert soak.least_squares_slope([0.0, 1.0], [1.0, 2.0]) is None
    assert soak.least_squares_slope([3.0, 3.0, 3.0], [1.0, 2.0, 3.0]) is None


def test_leak_slope_ignores_warmup_and_reads_mb_per_hour():
    """A 50 MB/h leak under noise reads as ~50 MB/h once the steep warm-up ramp is left out."""
    rng = random.Random(7)
    ts = [float(t) for t in range(0, 3600, 5)]
    warm = soak.warmup_seconds(ts[-1])
    rss = [400 * MB + (min(t, warm) * 200 * MB / warm) + t / 3600 * 50 * MB + rng.gauss(0, 2 * MB)
           for t in ts]
    slope, stderr = soak.leak_mb_per_hour(ts, rss, warm)
    assert slope == pytest.approx(50, abs=3 * stderr + 1)
    with_warmup, _ = soak.leak_mb_per_hour(ts, rss, 0.0)
    assert with_warmup > 100  # why the warm-up must be excluded


def test_flat_memory_has_no_leak():
    """Flat RSS with noise reads near zero MB/h."""
    rng = random.Random(3)
    ts = [float(t) for t in range(0, 7200, 10)]
    rss = [800 * MB + rng.gauss(0, 4 * MB) for _ in ts]
    slope, stderr = soak.leak_mb_per_hour(ts, rss, soak.warmup_seconds(ts[-1]))
    assert abs(slope) < 4 * stderr + 1


def _compile_step(t: float) -> float:
    """RSS of a worker compiling kernels: 1.6 GB, a 3.4 GB step at 40-75 s (the first long prompts),
    then 150 MB more as further prompt shapes compile, levelling off (as the H100 soak showed)."""
    if t < 40:
        return 1600 * MB
    if t < 75:
        return 1600 * MB + (t - 40) / 35 * 3400 * MB
    return 5000 * MB + 150 * MB * (1 - math.exp(-(t - 75) / 40))


def _judge(ts: list[float], rss: list[float], limit: float = 100.0) -> tuple[float, SoakSummary]:
    """The soak's leak judgement of one series: its warm-up end and the summary the verdict reads."""
    warm = soak.leak_warmup_s(ts, rss, ts[-1], limit)
    slope, stderr = soak.leak_mb_per_hour(ts, rss, warm)
    return warm, make_summary(warmup_s=warm, leak_mb_per_hour=slope, leak_stderr_mb_per_hour=stderr,
                              leak_gated_on=soak._leak_gate(ts[-1] - warm, killed=False))


def test_leak_check_passes_a_compile_step_that_levels_off():
    """A step and its trailing climb during warm-up, then flat: the warm-up lasts until RSS settled,
    and the run passes; judged from the fixed warm-up alone it would have failed."""
    rng = random.Random(11)
    ts = [float(t) for t in range(0, 601)]
    rss = [_compile_step(t) + rng.gauss(0, 1 * MB) for t in ts]
    warm, summary = _judge(ts, rss)
    assert soak.warmup_seconds(600) < warm < 300
    assert summary.leak_gated_on == "total"  # enforced: at least MIN_LEAK_WINDOW_S after warm-up
    assert verdict_passes(summary)
    fixed, _ = soak.leak_mb_per_hour(ts, rss, soak.warmup_seconds(600))
    assert fixed > 100  # the failure the H100 soak had


def test_leak_check_fails_memory_that_keeps_growing():
    """The same step, then a steady 300 MB/h: RSS never settles, the warm-up stops at half the run,
    and the rest of the run fails the check."""
    rng = random.Random(12)
    ts = [float(t) for t in range(0, 601)]
    rss = [_compile_step(t) + max(0.0, t - 75) / 3600 * 300 * MB + rng.gauss(0, 1 * MB) for t in ts]
    warm, summary = _judge(ts, rss)
    assert warm == 300
    assert summary.leak_gated_on == "total" and summary.leak_mb_per_hour > 250
    assert not verdict_passes(summary)


def verdict_passes(summary: SoakSummary) -> bool:
    failures = soak.verdict(summary, SoakConfig(max_leak_mb_per_hour=100))
    return not [f for f in failures if "--max-leak-mb-per-hour" in f]


@pytest.mark.parametrize(("duration", "warm"), [(30, 15), (600, 120), (8 * 3600, 0.2 * 8 * 3600)])
def test_warmup_is_a_fifth_at_least_a_minute_at_most_half(duration, warm):
    """Warm-up is 20 % of the run, at least 60 s, never more than half the run."""
    assert soak.warmup_seconds(duration) == pytest.approx(warm)


def test_throughput_thirds_see_degradation():
    """Cumulative tokens at 100 tok/s then 50 tok/s in the last third read as a 0.5 ratio."""
    ts = [float(t) for t in range(0, 301)]
    tokens, total = [], 0.0
    for t in ts:
        tokens.append(total)
        total += 100 if t < 200 else 50
    first, last = soak.throughput_thirds(ts, tokens)
    assert first == pytest.approx(100)
    assert last == pytest.approx(50)


def test_window_rate_needs_two_samples():
    """A window with fewer than two samples has no rate."""
    assert soak.window_rate([0.0, 10.0], [0.0, 100.0], 1.0, 9.0) is None
    assert soak.throughput_thirds([1.0], [5.0]) == (None, None)


def test_percentile_interpolates():
    """Percentiles interpolate linearly and are None for no data."""
    assert soak.percentile([1, 2, 3, 4], 50) == 2.5
    assert soak.percentile([5], 95) == 5
    assert soak.percentile([], 50) is None


# ---- the verdict ----------------------------------------------------------------------


def make_summary(**overrides) -> SoakSummary:
    base = dict(
        model="m", transport="ring", streams=2, workers=1, duration_s=600.0, samples=600, failed_samples=0,
        requests_started=100, requests_ok=100, tokens_total=10000, tok_s_mean=16.7, ttft_ms_p50=10.0,
        ttft_ms_p95=20.0, req_tok_s_p50=30.0, errors_unexpected=0, errors_worker_died=0,
        errors_by_type={}, hung=0, restarts=0, kills=[], recovered=None, warmup_s=120.0,
        leak_mb_per_hour=5.0, leak_stderr_mb_per_hour=1.0, leak_orchestrator_mb_per_hour=1.0,
        leak_gated_on="total", rss_total_mb_start=100.0, rss_total_mb_end=101.0, rss_total_mb_max=102.0,
        throughput_first_tok_s=100.0, throughput_last_tok_s=95.0, throughput_ratio=0.95,
        memory_levels={"normal": 600}, thermal_levels={"unavailable": 600}, thresholds={},
        files={"summary.json": "/x/summary.json"}, plot_note="disabled",
    )
    return SoakSummary(**{**base, **overrides})


CONFIG = SoakConfig(max_leak_mb_per_hour=50, min_throughput_ratio=0.8, max_errors=0)


def test_verdict_passes_within_thresholds():
    """Figures inside every threshold give no failure and exit code 0."""
    s = make_summary()
    s.failures = soak.verdict(s, CONFIG)
    assert s.failures == [] and s.exit_code == 0


@pytest.mark.parametrize(
    ("overrides", "knob"),
    [
        ({"leak_mb_per_hour": 80.0}, "--max-leak-mb-per-hour"),
        ({"leak_orchestrator_mb_per_hour": 80.0, "leak_gated_on": "orchestrator"}, "--max-leak-mb-per-hour"),
        ({"throughput_ratio": 0.6}, "--min-throughput-ratio"),
        ({"errors_unexpected": 2, "errors_by_type": {"RequestError": 2}}, "--max-errors"),
        ({"recovered": False}, "--chaos"),
        ({"hung": 1}, "still running"),
        ({"requests_ok": 0}, "no request completed"),
        ({"failed_samples": 3}, "samples could not be taken"),
    ],
    ids=["leak", "orchestrator-leak", "degradation", "errors", "not-recovered", "hung", "nothing-done",
         "failed-samples"],
)
def test_verdict_names_the_crossed_threshold(overrides, knob):
    """Each crossed threshold fails the soak with a message naming the option that sets it."""
    s = make_summary(**overrides)
    s.failures = soak.verdict(s, CONFIG)
    assert len(s.failures) == 1 and knob in s.failures[0]
    assert s.exit_code == 1


def test_verdict_ignores_disabled_and_ungated_checks():
    """A threshold set to None, or a leak window too short to gate, is reported but not enforced."""
    off = SoakConfig(max_leak_mb_per_hour=None, min_throughput_ratio=None, max_errors=None)
    s = make_summary(leak_mb_per_hour=900.0, throughput_ratio=0.1, errors_unexpected=5)
    assert soak.verdict(s, off) == []
    short = make_summary(leak_mb_per_hour=900.0, leak_gated_on="none (post-warm-up window 12 s < 300 s)")
    assert soak.verdict(short, CONFIG) == []


def test_chaos_gates_on_orchestrator_memory():
    """Under chaos the total-RSS slope (workers restart small) is not the leak gate; the orchestrator's is."""
    assert soak._leak_gate(600.0, killed=True) == "orchestrator"
    assert soak._leak_gate(600.0, killed=False) == "total"
    assert soak._leak_gate(100.0, killed=False).startswith("none")


def run_cli(argv: list[str]) -> int:
    """The subcommand as `mlxrt` dispatches it, minus `cli.main`'s global logging set-up: that would
    bind structlog to this test's captured stderr, closed once the test ends, for the rest of the session."""
    args = cli.build_parser().parse_args(argv)
    return int(args.func(args))


@pytest.mark.parametrize("failing", [False, True])
def test_cli_exit_code_follows_the_verdict(monkeypatch, capsys, tmp_path, failing):
    """`mlxrt soak` exits 1 when a threshold is crossed, else 0, ending stdout with the JSON summary."""
    seen = {}

    def fake_run(config, progress=None):
        seen["config"] = config
        return make_summary(failures=["throughput fell"] if failing else [])

    monkeypatch.setattr(soak, "run_soak", fake_run)
    code = run_cli(["soak", "--minutes", "1", "--out", str(tmp_path), "--max-leak-mb-per-hour", "none",
                    "--min-throughput-ratio", "0.5", "--max-tokens", "4:9", "--chaos", "7"])
    assert code == (1 if failing else 0)
    out = capsys.readouterr().out.strip().splitlines()
    assert json.loads(out[-1])["exit_code"] == code
    c = seen["config"]
    assert (c.max_leak_mb_per_hour, c.min_throughput_ratio) == (None, 0.5)
    assert (c.max_tokens, c.chaos_s) == ((4, 9), 7.0)


def test_cli_refuses_bad_config(capsys):
    """A config that cannot run exits 2 with the field named, before any worker starts."""
    assert run_cli(["soak", "--minutes", "0"]) == 2
    assert "minutes" in capsys.readouterr().err


def test_plot_is_skipped_without_matplotlib(monkeypatch, tmp_path):
    """Without matplotlib the plot is skipped with a reason instead of failing the soak."""
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    note = soak.write_plot(tmp_path / "soak.png", {"samples.csv": str(tmp_path / "none.csv")}, [])
    assert note.startswith("skipped: matplotlib")


# ---- real runs ----------------------------------------------------------------------------


def read_rows(path) -> tuple[list[str], list[dict]]:
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        return list(reader.fieldnames or []), list(reader)


def test_soak_smoke_writes_sane_series(tiny_model, tmp_path):
    """A 12 s soak on the tiny model writes the CSVs, summary and plot with sane, consistent values."""
    config = SoakConfig(model=tiny_model, minutes=12 / 60, streams=2, out=tmp_path, prompt_words=(4, 60),
                        max_tokens=(8, 48), sample_s=0.5, seed=1)
    s = soak.run_soak(config)
    assert (s.errors_unexpected, s.hung, s.errors_worker_died, s.failed_samples) == (0, 0, 0, 0)
    assert s.requests_ok > 0 and s.requests_ok == s.requests_started
    assert s.leak_gated_on.startswith("none")  # 12 s is far too short to call a leak

    header, rows = read_rows(tmp_path / "samples.csv")
    assert header == list(soak.SAMPLE_COLUMNS)
    assert len(rows) == s.samples >= 10
    tokens = [int(r["tokens_total"]) for r in rows]
    assert tokens == sorted(tokens) and tokens[-1] == s.tokens_total > 0
    prev_t, prev_tokens = 0.0, 0  # each sample's tok_s covers the tokens since the one before (or the start)
    for r in rows:
        t, tokens_now = float(r["t_s"]), int(r["tokens_total"])
        assert float(r["tok_s"]) == round((tokens_now - prev_tokens) / (t - prev_t), 2)
        prev_t, prev_tokens = t, tokens_now
        assert int(r["rss_total_bytes"]) == int(r["rss_orchestrator_bytes"]) + int(r["rss_workers_bytes"])
        assert int(r["rss_workers_bytes"]) > 0
        assert r["memory_level"] in ("normal", "warning", "critical", "unavailable")
        assert r["thermal_level"] in ("nominal", "fair", "serious", "critical", "unavailable")
        assert int(r["mlx_active_bytes"]) > 0
    assert any(r["ttft_ms_p50"] for r in rows)

    header, workers = read_rows(tmp_path / "workers.csv")
    assert header == list(soak.WORKER_COLUMNS)
    assert {int(w["pid"]) for w in workers} and all(int(w["rss_bytes"]) > 0 for w in workers)

    header, requests = read_rows(tmp_path / "requests.csv")
    assert header == list(soak.REQUEST_COLUMNS)
    assert len(requests) == s.requests_started
    for r in requests:
        assert r["outcome"] == "ok" and 1 <= int(r["tokens"]) <= int(r["max_tokens"])
        assert float(r["ttft_ms"]) > 0

    saved = json.loads((tmp_path / "summary.json").read_text())
    assert saved["requests_ok"] == s.requests_ok and saved["exit_code"] == s.exit_code
    assert s.ttft_ms_p50 > 0 and s.tok_s_mean > 0 and s.throughput_ratio > 0
    assert s.rss_total_mb_start > 0 and not math.isnan(s.leak_mb_per_hour)
    assert (tmp_path / "soak.png").exists() == s.plot_note.startswith("written")


def test_chaos_smoke_every_request_ends_clearly_and_pool_recovers(tiny_model, tmp_path):
    """A worker killed every 5 s for 20 s: each request ends in a result or WorkerDied; the pool recovers."""
    config = SoakConfig(model=tiny_model, minutes=20 / 60, streams=2, out=tmp_path, chaos_s=5.0,
                        prompt_words=(4, 60), max_tokens=(8, 48), max_leak_mb_per_hour=None,
                        min_throughput_ratio=None, seed=2)
    s = soak.run_soak(config)
    assert len(s.kills) >= 3
    assert s.errors_unexpected == 0, s.errors_by_type
    assert s.hung == 0
    assert s.requests_ok + s.errors_worker_died == s.requests_started
    assert s.recovered is True
    assert s.restarts >= 1
    assert s.passed, s.failures
    _, requests = read_rows(tmp_path / "requests.csv")
    assert {r["outcome"] for r in requests} <= {"ok", "WorkerDied", "ChannelError"}


def test_rolling_mean_skips_gaps():
    """The plot's smoothing is a trailing mean that skips missing samples."""
    nan = float("nan")
    out = soak._rolling_mean([1.0, nan, 3.0, 5.0], 2)
    assert out[0] == 1.0 and out[1] == 1.0 and out[2] == 3.0 and out[3] == 4.0
