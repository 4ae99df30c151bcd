"""Synthetic models: deterministic bytes, loadable by mlx-lm, non-degenerate output."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from mlxrt.worker.synthetic import (
    MARKER_FILE,
    PRESETS,
    SPECIAL_TOKENS,
    default_model_dir,
    ensure_model,
    get_preset,
    make_model,
)


def _files(root: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(root.iterdir())}


@pytest.fixture(scope="module")
def tiny_loaded(tmp_path_factory):
    """The tiny model made into a fresh directory and loaded with mlx-lm."""
    import mlx_lm

    path = make_model("tiny", tmp_path_factory.mktemp("tiny") / "model")
    model, tokenizer = mlx_lm.load(str(path))
    return path, model, tokenizer


def test_same_seed_writes_identical_bytes(tmp_path):
    """Making tiny twice with one seed gives byte-identical directories (weights and tokenizer)."""
    a = make_model("tiny", tmp_path / "a", seed=3)
    b = make_model("tiny", tmp_path / "b", seed=3)
    assert _files(a) == _files(b)


def test_different_seed_changes_weights_not_tokenizer(tmp_path):
    """Another seed draws other weights; the tokenizer depends only on the preset."""
    a = _files(make_model("tiny", tmp_path / "a", seed=0))
    b = _files(make_model("tiny", tmp_path / "b", seed=1))
    assert a["model.safetensors"] != b["model.safetensors"]
    assert a["tokenizer.json"] == b["tokenizer.json"]


def test_current_directory_is_not_rewritten_unless_forced(tmp_path):
    """A directory already holding the preset and seed is returned as is; force rewrites it."""
    out = make_model("tiny", tmp_path / "m")
    weights = out / "model.safetensors"
    weights.write_bytes(b"sentinel")
    assert make_model("tiny", out) == out
    assert weights.read_bytes() == b"sentinel"
    make_model("tiny", out, force=True)
    assert weights.read_bytes() != b"sentinel"


def test_stale_directory_is_replaced(tmp_path):
    """A directory made with another seed is rewritten and its marker updated."""
    out = make_model("tiny", tmp_path / "m", seed=1)
    make_model("tiny", out, seed=2)
    assert json.loads((out / MARKER_FILE).read_text())["seed"] == 2


def test_foreign_directory_is_not_clobbered(tmp_path):
    """A non-empty directory without the marker (a real checkpoint, say) is kept unless forced."""
    out = tmp_path / "real"
    out.mkdir()
    (out / "config.json").write_text("{}")
    with pytest.raises(FileExistsError, match="force"):
        make_model("tiny", out)
    assert (out / "config.json").read_text() == "{}"


def test_concurrent_makers_agree(tmp_path):
    """Two processes making the same model at once both succeed and leave one valid directory."""
    out = tmp_path / "m"
    code = f"from mlxrt.worker.synthetic import make_model; make_model('tiny', {str(out)!r})"
    procs = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.DEVNULL) for _ in range(2)]
    assert [p.wait(timeout=120) for p in procs] == [0, 0]
    assert _files(out) == _files(make_model("tiny", tmp_path / "ref"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m", "ref"]


def test_unknown_preset_names_the_choices(tmp_path):
    """An unknown preset is a ValueError that names it and lists the presets."""
    with pytest.raises(ValueError, match="no-such.*tiny"):
        make_model("no-such", tmp_path / "x")


def test_ensure_model_uses_the_cache_dir(tmp_path, monkeypatch):
    """ensure_model makes into $MLXRT_MODELS_DIR/<preset>-s<seed> once, then reuses it."""
    monkeypatch.setenv("MLXRT_MODELS_DIR", str(tmp_path))
    path = ensure_model("tiny", seed=5)
    assert path == default_model_dir("tiny", 5) == tmp_path / "tiny-s5"
    mtime = (path / "model.safetensors").stat().st_mtime_ns
    assert ensure_model("tiny", seed=5) == path
    assert (path / "model.safetensors").stat().st_mtime_ns == mtime


def test_tiny_greedy_output_is_varied(tiny_loaded):
    """32 greedy tokens from tiny are not one token repeated (tests need real streams)."""
    import mlx_lm
    from mlx_lm.sample_utils import make_sampler

    _, model, tokenizer = tiny_loaded
    prompt = tokenizer.encode("The morning train left the station")
    ids = [r.token for r in mlx_lm.stream_generate(
        model, tokenizer, prompt, max_tokens=32, sampler=make_sampler(0.0))]
    assert len(ids) == 32
    assert len(set(ids)) >= 5


def test_every_id_decodes(tiny_loaded):
    """Every id the model can emit, the highest included, decodes; the tokenizer spans the vocab."""
    _, model, tokenizer = tiny_loaded
    vocab = PRESETS["tiny"].vocab_size
    assert len(tokenizer) == vocab == model.model.embed_tokens.weight.shape[0]
    text = tokenizer.decode(list(range(vocab)))
    assert text.endswith("".join(SPECIAL_TOKENS))
    pads = tokenizer.decode(list(range(vocab - 50, vocab - len(SPECIAL_TOKENS))))
    assert pads.strip() and "\ufffd" not in pads


def test_streaming_detokenizer_matches_decode(tiny_loaded):
    """mlx-lm picks its BPE streaming detokenizer, and it streams the text decode() gives."""
    from mlx_lm.tokenizer_utils import BPEStreamingDetokenizer

    _, _, tokenizer = tiny_loaded
    text = "Café déjà vu: the fox, 42 grapes and €3.50!"
    ids = tokenizer.encode(text)
    assert tokenizer.decode(ids) == text
    detok = tokenizer.detokenizer
    assert isinstance(detok, BPEStreamingDetokenizer)
    detok.reset()
    for i in ids:
        detok.add_token(i)
    detok.finalize()
    assert detok.text == text


def test_chat_template_is_chatml(tiny_loaded):
    """The chat template renders Qwen-style ChatML and ends with the assistant prompt."""
    _, _, tokenizer = tiny_loaded
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    assert ids[0] == tokenizer.convert_tokens_to_ids("<|im_start|>")


def test_eos_and_pad_ids(tiny_loaded):
    """<|im_end|> and <|endoftext|> end generation; <|endoftext|> pads, as in Qwen2.5."""
    path, _, tokenizer = tiny_loaded
    ids = PRESETS["tiny"].special_ids
    assert tokenizer.eos_token_ids == {ids["<|im_end|>"], ids["<|endoftext|>"]}
    assert tokenizer.pad_token_id == ids["<|endoftext|>"]
    assert json.loads((path / "config.json").read_text())["eos_token_id"] == ids["<|im_end|>"]


def test_weight_index_names_every_tensor(tiny_loaded):
    """model.safetensors.index.json maps every stored tensor to its shard, as mlx-lm writes it."""
    import mlx.core as mx

    path, _, _ = tiny_loaded
    index = json.loads((path / "model.safetensors.index.json").read_text())
    stored = mx.load(str(path / "model.safetensors"))
    assert set(index["weight_map"]) == set(stored)
    assert index["metadata"]["total_size"] == sum(a.nbytes for a in stored.values())


@pytest.mark.parametrize("name,hidden,layers,heads,kv,inter,vocab,tied", [
    ("qwen2.5-0.5b-4bit", 896, 24, 14, 2, 4864, 151936, True),
    ("qwen2.5-7b-4bit", 3584, 28, 28, 4, 18944, 152064, False),
])
def test_real_shape_configs(name, hidden, layers, heads, kv, inter, vocab, tied):
    """The Qwen2.5-shaped presets keep the real shapes and mlx-lm's 4-bit quantization entry."""
    cfg = get_preset(name).config()
    shape = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
             "intermediate_size", "vocab_size")
    assert tuple(cfg[k] for k in shape) == (hidden, layers, heads, kv, inter, vocab)
    assert cfg["tie_word_embeddings"] is tied and cfg["rope_theta"] == 1e6
    assert cfg["model_type"] == "qwen2" and cfg["max_position_embeddings"] == 32768
    quant = {"group_size": 64, "bits": 4, "mode": "affine"}
    assert cfg["quantization"] == cfg["quantization_config"] == quant


def test_qwen05b_4bit_loads_quantized_and_decodes(tmp_path):
    """The real-shape 0.5B 4-bit model loads with quantized layers and yields a finite first token."""
    import mlx.core as mx
    import mlx.nn as nn
    import mlx_lm

    model, tokenizer = mlx_lm.load(str(make_model("qwen2.5-0.5b-4bit", tmp_path / "q")))
    assert isinstance(model.model.embed_tokens, nn.QuantizedEmbedding)
    assert isinstance(model.model.layers[0].mlp.down_proj, nn.QuantizedLinear)
    assert len(tokenizer) == PRESETS["qwen2.5-0.5b-4bit"].vocab_size
    logits = model(mx.array([tokenizer.encode("Hi")]))[0, -1]
    assert bool(mx.isfinite(logits).all())
    assert tokenizer.decode([int(logits.argmax())]) is not None
