"""The MLX servers the benchmarks compare with over HTTP, as real processes on the tiny synthetic model:
vllm-mlx from its own site directory (`make peers` installs it), and the long-prompt mix
(`benchmarks.interleave`) with every peer beside mlxrt's targets."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks import http_scenario, interleave  # noqa: E402
from benchmarks.scenarios import Skipped  # noqa: E402


@pytest.fixture(scope="module")
def vllm_mlx_site() -> str:
    """vllm-mlx's site directory; where CI runs, its absence fails (`make test` installs it), else skips."""
    site, why = http_scenario.vllm_mlx_site()
    if site is None:
        (pytest.fail if os.environ.get("CI") else pytest.skip)(why)
    return site


def test_vllm_mlx_without_its_site_is_skipped_with_the_knob_to_set(tmp_path, monkeypatch):
    """No vllm-mlx in the site named: the server is skipped before anything starts, naming the variable."""
    monkeypatch.setenv(http_scenario.VLLM_MLX_SITE_ENV, str(tmp_path))
    server = http_scenario.VllmMlxServer(str(tmp_path / "no-model"))
    knob = http_scenario.VLLM_MLX_SITE_ENV
    with pytest.raises(Skipped, match=f"not installed in {tmp_path}.*{knob}.*make peers"):
        server.setup()
    assert server.proc is None  # nothing was started


#: Prompts (corpus paragraphs) whose greedy replies on tiny reach an EOS id within 10 tokens: vllm-mlx
#: as it ships stops there (after 9, 9, 7 and 3 tokens).
EOS_EARLY = (75, 84, 102, 108)


def test_vllm_mlx_streams_every_token_asked_for_with_its_eos_off(vllm_mlx_site, tiny_model):
    """Its launcher empties the scheduler's stop tokens: every reply is max_tokens long, as mlxrt's are
    with ignore_eos, counted from the usage, with one arrival per event that carries text."""
    from benchmarks.e2e import make_prompt, model_tokenizer

    _, tok = model_tokenizer(tiny_model)
    server = http_scenario.VllmMlxServer(tiny_model)
    server.setup()
    try:
        home = server._home.name
        info = server.describe()
        runs = [server.run(make_prompt(tok, 40, start=start)[0], 96) for start in EOS_EARLY]
    finally:
        server.close()
    assert info["server"] == "vllm-mlx 0.6.0 (serve --continuous-batching)" and info["site"] == vllm_mlx_site
    for r in runs:
        assert r.n_tokens == 96 and math.isfinite(r.ttft_ms)  # a first token arrived
        assert 0 < len(r.itl_ms) < 96 and r.prompt_tokens > 0  # the events with text, less the first
    assert not os.path.exists(home)  # its own HOME (vllm-mlx's caches) went with it


def test_the_long_prompt_mix_runs_every_target_and_peer_in_each_round(vllm_mlx_site, tiny_model, tmp_path):
    """`python -m benchmarks.interleave`: mlxrt's engine (scheduled and not), mlx-lm's BatchGenerator,
    mlxrt serve, mlx_lm.server and vllm-mlx each run B alone, the mix, C alone; every figure is there."""
    out = tmp_path / "mix.json"
    cmd = [sys.executable, "-m", "benchmarks.interleave", "--model", "synthetic:tiny", "--rounds", "1",
           "--b-tokens", "300", "--a-tokens", "24", "--b-after-s", "0.2", "--c-after-s", "0.05",
           "--out", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    names = ["mlxrt engine", "mlxrt engine, budget 0", "mlx-lm BatchGenerator", "mlxrt-http", "mlx_lm.server",
             "vllm-mlx"]
    assert list(doc["medians"]) == names and doc["skipped"] == {}, proc.stderr[-2000:]
    for name in names:
        m = doc["medians"][name]
        # Where B's TTFT went, from the engine's own stats.
        engine = {"prefill_b_ms", "prefill_wait_b_ms", "prefill_b_alone_ms"}
        engine = engine if name == "mlxrt engine" else set()  # the scheduler's; budget 0 counts neither
        assert set(m) == {"ttft_b_alone_ms", "ttft_a_ms", "ttft_b_ms", "ttft_c_ms", "a_longest_gap_ms",
                          "ttft_c_alone_ms"} | engine, name
        assert all(math.isfinite(v) for v in m.values()), (name, m)  # each request's first token came
        assert m["a_longest_gap_ms"] > 0, name  # A's tokens came in more than one arrival
    scheduled = doc["rounds"]["mlxrt engine"][0]  # B's own chunks are part of its TTFT, alone and mixed
    assert 0 < scheduled["prefill_b_ms"] < scheduled["ttft_b_ms"], scheduled
    assert 0 < scheduled["prefill_b_alone_ms"] < scheduled["ttft_b_alone_ms"], scheduled
    assert doc["servers"]["vllm-mlx"]["server"].startswith("vllm-mlx 0.6.0")
    assert doc["config"]["peers"] == ["mlx_lm.server", "vllm-mlx"]
    assert "| vllm-mlx |" in proc.stdout


def test_the_long_prompt_mix_leaves_out_a_peer_that_cannot_run_and_says_why(tmp_path):
    """A peer with no site is skipped with the reason in the document and the log; the rest still run
    (here the servers only: `--no-in-process`)."""
    env = {**os.environ, http_scenario.VLLM_MLX_SITE_ENV: str(tmp_path)}
    out = tmp_path / "alone.json"
    cmd = [sys.executable, "-m", "benchmarks.interleave", "--model", "synthetic:tiny", "--rounds", "1",
           "--b-tokens", "60", "--alone", "--peers", "vllm-mlx", "--no-in-process", "--out", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert list(doc["medians"]) == ["mlxrt-http"] and doc["config"]["in_process"] is False
    assert http_scenario.VLLM_MLX_SITE_ENV in doc["skipped"]["vllm-mlx"]
    assert f"vllm-mlx: skipped: vllm-mlx is not installed in {tmp_path}" in proc.stderr


def test_the_long_prompt_mix_refuses_an_unknown_peer_naming_the_known_ones(capsys):
    """--peers takes the MLX servers' names or none; anything else exits 2 naming the known ones."""
    with pytest.raises(SystemExit) as exc:
        interleave.main(["--peers", "mlx_lm.server,vllm"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "--peers: unknown peer vllm; choose from mlx_lm.server, vllm-mlx (or none)" in err
    assert interleave._peers("none") == [] and interleave._peers(" vllm-mlx ,") == ["vllm-mlx"]
    with pytest.raises(SystemExit) as exc:
        interleave.main(["--no-http", "--no-in-process"])
    assert exc.value.code == 2 and "leaves nothing to run" in capsys.readouterr().err
