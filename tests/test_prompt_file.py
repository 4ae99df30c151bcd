"""Prompt-cache files: `mlxrt cache-prompt` saves a prompt's KV cache, a worker loads it at start."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from mlxrt import ModelLoadError, ModelSpec, Runtime
from support import native_tokens

SYSTEM = "You are a patient guide to the tides, the weather and the mountains. " * 6
CHAT = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "When is high tide?"}]
RAW_HEAD = "Once upon a time, in a small village by the sea,"
RAW = RAW_HEAD + " there lived an old fisherman"


def cache_prompt(model: str, out, *args: str) -> list[int]:
    """Run `mlxrt cache-prompt` as a user would; the token ids the file records."""
    from mlx_lm.models.cache import load_prompt_cache

    cmd = [sys.executable, "-m", "mlxrt", "cache-prompt", "--model", model, "--prompt-cache-file", str(out),
           *args]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "tokens" in done.stdout
    _, meta = load_prompt_cache(str(out), return_metadata=True)
    return json.loads(meta["mlxrt_tokens"])


def test_loaded_prompt_cache_gives_prefilled_ids_and_a_hit(tiny_model, reference, tmp_path):
    """A chat system prompt and a raw prompt head, cached to files and loaded by two models' workers:
    the first request that begins with either gets the ids a full prefill gives and reports the
    file's tokens as cached."""
    system_ids = cache_prompt(tiny_model, tmp_path / "system.safetensors", "--system", SYSTEM)
    raw_ids = cache_prompt(tiny_model, tmp_path / "raw.safetensors", "--prompt", RAW_HEAD)
    models = {"sys": ModelSpec(tiny_model, prompt_cache_file=str(tmp_path / "system.safetensors")),
              "raw": ModelSpec(tiny_model, prompt_cache_file=str(tmp_path / "raw.safetensors"))}
    with Runtime(models=models, transport="stdio") as rt:
        c = rt.generate(CHAT, model="sys", max_tokens=16, ignore_eos=True)
        assert c.tokens == native_tokens(reference, CHAT, 16, ignore_eos=True)
        assert c.stats.cached_tokens == len(system_ids) > 60
        c = rt.generate(RAW, model="raw", max_tokens=16, ignore_eos=True)
        assert c.tokens == native_tokens(reference, RAW, 16, ignore_eos=True)
        assert c.stats.cached_tokens == len(raw_ids) > 5
        rt.unload("sys")  # a fresh worker loads the file again
        rt.load("sys")
        c = rt.generate(CHAT, model="sys", max_tokens=4, ignore_eos=True)
        assert c.stats.cached_tokens == len(system_ids)


def test_prompt_cache_file_that_does_not_fit_is_refused(tiny_model, tmp_path):
    """A file made for another model, or one that records no token ids (not from cache-prompt):
    the worker fails to start with a clear reason, and no process is left (no_leaks)."""
    from mlx_lm import load
    from mlx_lm.models.cache import make_prompt_cache, save_prompt_cache
    from mlxrt.worker.engine import resolve_model_path

    other = tmp_path / "small.safetensors"
    cache_prompt("synthetic:small", other, "--prompt", RAW_HEAD)
    with pytest.raises(ModelLoadError, match="prompt_cache_file=.*(does not fit|caches)"):
        Runtime(model=ModelSpec(tiny_model, prompt_cache_file=str(other)), transport="stdio")
    bare = tmp_path / "bare.safetensors"
    model, _ = load(resolve_model_path("synthetic:tiny"))
    cache = make_prompt_cache(model)
    import mlx.core as mx

    model(mx.array([[1, 2, 3]]), cache=cache)
    save_prompt_cache(str(bare), cache)
    with pytest.raises(ModelLoadError, match="records no token ids"):
        Runtime(model=ModelSpec(tiny_model, prompt_cache_file=str(bare)), transport="stdio")
