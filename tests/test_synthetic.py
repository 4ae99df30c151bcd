"""Synthetic models: deterministic bytes, loadable by mlx-lm, non-degenerate output."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from mlxrt.synthetic.build import MARKER_FILE, build_model, ensure_model, make_model
from mlxrt.synthetic.presets import FAMILIES, PRESETS, SPECIAL_TOKENS, default_model_dir, get_preset

# Tiny preset -> (mlx-lm model_type, the cache kinds its make_prompt_cache gives).
TINY_FAMILIES = {
    "tiny": ("qwen2", {"KVCache"}),
    "tiny-llama": ("llama", {"KVCache"}),
    "tiny-qwen3": ("qwen3", {"KVCache"}),
    "tiny-qwen3-moe": ("qwen3_moe", {"KVCache"}),
    "tiny-qwen3.5": ("qwen3_5", {"ArraysCache", "KVCache"}),
    "tiny-gemma3": ("gemma3_text", {"RotatingKVCache", "KVCache"}),
    "tiny-gpt-oss": ("gpt_oss", {"RotatingKVCache", "KVCache"}),
}
# Longer than the tiny sliding windows (32 tokens), so rotating caches wrap.
LONG_PROMPT = ("The morning train left the station and the river ran along the old road past the mill "
               "while the children watched the boats go by and the baker opened his door")
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
TOOL_CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": "",
     "tool_calls": [{"type": "function",
                     "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
    {"role": "tool", "name": "get_weather", "content": "sunny, 21 C"},
]


def _files(root: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(root.iterdir())}


@pytest.fixture(scope="module")
def tiny_loaded(tmp_path_factory):
    """The tiny model made into a fresh directory and loaded with mlx-lm."""
    import mlx_lm

    path = make_model("tiny", tmp_path_factory.mktemp("tiny") / "model")
    model, tokenizer = mlx_lm.load(str(path))
    return path, model, tokenizer


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    """Make and load a preset once per module: name -> (path, model, tokenizer)."""
    import mlx_lm

    cache: dict[str, tuple] = {}

    def load(name: str) -> tuple:
        if name not in cache:
            path = make_model(name, tmp_path_factory.mktemp(name) / "model")
            cache[name] = (path, *mlx_lm.load(str(path)))
        return cache[name]

    return load


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
    code = f"from mlxrt.synthetic.build import make_model; make_model('tiny', {str(out)!r})"
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


def test_context_variant_keeps_the_weights(tmp_path, monkeypatch):
    """``?context=C`` makes the preset with a C-token context (config, tokenizer, the orchestrator's view)
    and the same weights, in a directory of its own beside the preset's."""
    from mlxrt.synthetic.build import ensure_synthetic
    from mlxrt.synthetic.presets import parse_synthetic, synthetic_preset

    monkeypatch.setenv("MLXRT_MODELS_DIR", str(tmp_path))
    ref = parse_synthetic("tiny-qwen3?context=131072")
    long, base = ensure_synthetic(ref), ensure_model("tiny-qwen3")
    assert long.name == "tiny-qwen3-s0-c131072"
    assert json.loads((long / "config.json").read_text())["max_position_embeddings"] == 131072
    assert json.loads((base / "config.json").read_text())["max_position_embeddings"] == 512
    assert json.loads((long / "tokenizer_config.json").read_text())["model_max_length"] == 131072
    assert synthetic_preset(ref).config()["max_position_embeddings"] == 131072
    a, b = _files(long), _files(base)
    assert a["model.safetensors"] == b["model.safetensors"] and a["tokenizer.json"] == b["tokenizer.json"]


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
    spec = get_preset(name)
    cfg = spec.config()
    shape = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
             "intermediate_size", "vocab_size")
    assert tuple(cfg[k] for k in shape) == (hidden, layers, heads, kv, inter, vocab)
    assert cfg["tie_word_embeddings"] is tied and cfg["rope_theta"] == 1e6
    assert cfg["model_type"] == "qwen2" and cfg["max_position_embeddings"] == 32768
    assert spec.quantized and spec.quantization() == {"group_size": 64, "bits": 4, "mode": "affine"}


@pytest.mark.parametrize("name,billions,kinds,moe", [
    ("llama3.1-8b-4bit", 8.03, {"KVCache"}, False),
    ("qwen3-8b-4bit", 8.19, {"KVCache"}, False),
    ("qwen3-30b-a3b-4bit", 30.5, {"KVCache"}, True),
    ("qwen3.5-27b-4bit", 26.9, {"ArraysCache", "KVCache"}, False),
    ("gemma3-12b-4bit", 11.8, {"RotatingKVCache", "KVCache"}, False),
    ("gpt-oss-20b-4bit", 20.9, {"RotatingKVCache", "KVCache"}, True),
])
def test_real_shapes_build_lazily(name, billions, kinds, moe):
    """Each published shape builds through mlx-lm with the published size, unevaluated, 4-bit."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_lm.utils import get_total_parameters

    before = mx.get_active_memory()
    model, config = build_model(name)
    assert get_total_parameters(model) / 1e9 == pytest.approx(billions, rel=0.02)
    assert mx.get_active_memory() - before < 64 << 20  # nothing was drawn: MLX is lazy
    assert {type(c).__name__ for c in make_prompt_cache(model)} == kinds
    quant = config["quantization"]
    assert {k: quant[k] for k in ("group_size", "bits", "mode")} == get_preset(name).quantization()
    # MoE routers stay 8-bit, as mlx-lm's quant_predicate writes them per layer.
    assert any(isinstance(v, dict) and v["bits"] == 8 for v in quant.values()) is moe


def test_qwen05b_4bit_loads_quantized_and_decodes():
    """The real-shape 0.5B 4-bit model loads with quantized layers and yields a finite first token."""
    import mlx.core as mx
    import mlx.nn as nn
    import mlx_lm

    # Made once per cache (its marker names the preset, seed and format): about 20 s to draw.
    path = ensure_model("qwen2.5-0.5b-4bit")
    cfg = json.loads((path / "config.json").read_text())
    quant = {"group_size": 64, "bits": 4, "mode": "affine"}
    assert cfg["quantization"] == cfg["quantization_config"] == quant  # as mlx_lm.convert -q writes it
    model, tokenizer = mlx_lm.load(str(path))
    assert isinstance(model.model.embed_tokens, nn.QuantizedEmbedding)
    assert isinstance(model.model.layers[0].mlp.down_proj, nn.QuantizedLinear)
    assert len(tokenizer) == PRESETS["qwen2.5-0.5b-4bit"].vocab_size
    logits = model(mx.array([tokenizer.encode("Hi")]))[0, -1]
    assert bool(mx.isfinite(logits).all())
    assert logits.shape == (cfg["vocab_size"],) and cfg["vocab_size"] >= len(tokenizer)  # a score per token


@pytest.mark.parametrize("name", sorted(TINY_FAMILIES))
def test_tiny_family_loads_with_its_cache_kinds(name, loaded):
    """Every tiny preset loads with mlx_lm.load as its family and gets the family's cache kinds."""
    from mlx_lm.models.cache import make_prompt_cache

    path, model, _ = loaded(name)
    model_type, kinds = TINY_FAMILIES[name]
    assert json.loads((path / "config.json").read_text())["model_type"] == model_type
    caches = make_prompt_cache(model)
    assert len(caches) >= 2 and {type(c).__name__ for c in caches} == kinds


@pytest.mark.parametrize("name", sorted(TINY_FAMILIES))
def test_tiny_family_decodes_past_its_window(name, loaded):
    """Greedy decoding from a prompt longer than the sliding window runs, wraps rotating caches, varies."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step
    from mlx_lm.models.cache import RotatingKVCache, make_prompt_cache
    from mlx_lm.sample_utils import make_sampler

    _, model, tokenizer = loaded(name)
    prompt = tokenizer.encode(LONG_PROMPT)
    assert len(prompt) > 32
    cache = make_prompt_cache(model)
    steps = generate_step(mx.array(prompt), model, prompt_cache=cache, sampler=make_sampler(0.0))
    ids = [int(tok) for (tok, _), _ in zip(steps, range(12), strict=False)]
    assert len(ids) == 12 and all(0 <= i < len(tokenizer) for i in ids)
    assert len(set(ids)) >= 3
    for c in cache:
        if isinstance(c, RotatingKVCache):
            assert c.offset > c.max_size  # the window really rotated


def test_new_family_same_seed_same_bytes(tmp_path):
    """A hybrid Qwen3.5 model is byte-identical for one seed; another seed changes only the weights."""
    a = _files(make_model("tiny-qwen3.5", tmp_path / "a", seed=4))
    b = _files(make_model("tiny-qwen3.5", tmp_path / "b", seed=4))
    c = _files(make_model("tiny-qwen3.5", tmp_path / "c", seed=5))
    assert a == b
    assert a["model.safetensors"] != c["model.safetensors"] and a["tokenizer.json"] == c["tokenizer.json"]


@pytest.mark.parametrize("name,begins,parts,ends", [
    ("tiny", "<|im_start|>system\nBe brief.\n\n# Tools", [
        '<tools>\n{"type": "function", "function": {"name": "get_weather"',
        '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}'
        "\n</tool_call>",
        "<|im_start|>user\n<tool_response>\nsunny, 21 C\n</tool_response><|im_end|>"],
     "<|im_start|>assistant\n"),
    ("tiny-qwen3", "<|im_start|>system\nBe brief.\n\n# Tools", [
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
        "<tool_response>\nsunny, 21 C\n</tool_response>"], "<|im_start|>assistant\n"),
    ("tiny-qwen3.5", "<|im_start|>system\nBe brief.\n\n# Tools", [
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
        "<tool_response>\nsunny, 21 C\n</tool_response>"], "<|im_start|>assistant\n<think>\n"),
    ("tiny-llama", "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nEnvironment: ipython", [
        "Be brief.<|eot_id|>", '"name": "get_weather"',
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
        '{"name": "get_weather", "parameters": {"city": "Paris"}}<|eot_id|>',
        '<|start_header_id|>ipython<|end_header_id|>\n\n"sunny, 21 C"<|eot_id|>'],
     "<|start_header_id|>assistant<|end_header_id|>\n\n"),
    ("tiny-gemma3", "<bos><start_of_turn>user\nBe brief.\n\n", [
        '"name": "get_weather"', 'Weather in Paris?<end_of_turn>\n',
        '<start_of_turn>model\n```tool_code\nget_weather(city="Paris")\n```<end_of_turn>',
        "<start_of_turn>user\n```tool_output\nsunny, 21 C\n```<end_of_turn>"], "<start_of_turn>model\n"),
    ("tiny-gpt-oss", "<|start|>system<|message|>", [
        "<|start|>developer<|message|># Instructions\n\nBe brief.", "type get_weather = (_: {",
        "<|start|>user<|message|>Weather in Paris?<|end|>",
        '<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>'
        '{"city": "Paris"}<|call|>',
        "<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>sunny, 21 C<|end|>"],
     "<|start|>assistant"),
])
def test_chat_template_renders_tools_and_tool_turns(name, begins, parts, ends, loaded):
    """The family's template renders system, tools list, user, assistant tool call and tool result."""
    _, _, tokenizer = loaded(name)
    text = tokenizer.apply_chat_template(TOOL_CHAT, tools=TOOLS, add_generation_prompt=True, tokenize=False)
    assert text.startswith(begins) and text.endswith(ends)
    at = 0
    for part in parts:  # in this order
        at = text.index(part, at) + len(part)
    ids = tokenizer.apply_chat_template(TOOL_CHAT, tools=TOOLS, add_generation_prompt=True)
    specials = set(get_preset(name).special_ids.values())
    assert tokenizer.decode(ids) == text and specials & set(ids)  # markup tokenizes to the added tokens


@pytest.mark.parametrize("name,thinking,tools", [
    ("tiny", False, True),
    ("tiny-qwen3", True, True),
    ("tiny-qwen3-moe", True, True),
    ("tiny-qwen3.5", True, True),
    ("tiny-llama", False, False),  # Llama 3.1 calls are bare JSON: mlx-lm infers no parser
    ("tiny-gemma3", False, False),  # Gemma 3 has no tool tokens
    ("tiny-gpt-oss", False, False),  # mlx-lm 0.32 has no harmony parser (docs/models.md)
])
def test_mlx_lm_detects_thinking_and_tool_calling(name, thinking, tools, loaded):
    """mlx-lm's TokenizerWrapper infers the thinking and tool-call support docs/models.md states."""
    _, _, tokenizer = loaded(name)
    assert tokenizer.has_thinking is thinking and tokenizer.has_tool_calling is tools
    if thinking:
        assert (tokenizer.think_start, tokenizer.think_end) == ("<think>", "</think>")
        # Single tokens that stay in decoded text, where the reasoning parser looks for them.
        assert tokenizer.decode([tokenizer.think_start_id], skip_special_tokens=True) == "<think>"
    if tools:
        assert tokenizer.tool_call_start == "<tool_call>" and len(tokenizer.tool_call_start_tokens) == 1
        call = tokenizer.tool_parser('{"name": "get_weather", "arguments": {"city": "Paris"}}')
        assert call["name"] == "get_weather"


@pytest.mark.parametrize("name,off,default", [
    ("tiny-qwen3", "<|im_start|>assistant\n<think>\n\n</think>\n\n", "<|im_start|>assistant\n"),
    ("tiny-qwen3.5", "<|im_start|>assistant\n<think>\n\n</think>\n\n", "<|im_start|>assistant\n<think>\n"),
])
def test_enable_thinking_switches_the_prompt(name, off, default, loaded):
    """enable_thinking=False closes an empty think block; the default leaves thinking to the model."""
    _, _, tokenizer = loaded(name)
    chat = [{"role": "user", "content": "Hi"}]
    assert tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False).endswith(default)
    text = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False,
                                         enable_thinking=False)
    assert text.endswith(off)
    history = [*chat, {"role": "assistant", "content": "Hello", "reasoning_content": "greet back"}]
    rendered = tokenizer.apply_chat_template(history, tokenize=False)
    assert "<think>\ngreet back\n</think>\n\nHello<|im_end|>" in rendered


@pytest.mark.parametrize("name,eos", [
    ("tiny-llama", {"<|eot_id|>", "<|end_of_text|>", "<|eom_id|>"}),
    ("tiny-qwen3", {"<|im_end|>", "<|endoftext|>"}),
    ("tiny-qwen3.5", {"<|im_end|>", "<|endoftext|>"}),
    ("tiny-gemma3", {"<end_of_turn>", "<eos>"}),
    ("tiny-gpt-oss", {"<|return|>", "<|call|>", "<|endoftext|>"}),
])
def test_family_eos_ids(name, eos, loaded):
    """generation_config.json gives each family the end-of-turn tokens its instruct checkpoints stop on."""
    _, _, tokenizer = loaded(name)
    assert tokenizer.eos_token_ids == {tokenizer.convert_tokens_to_ids(t) for t in eos}
    assert set(FAMILIES[get_preset(name).family].eos) == eos


def test_llama_and_gemma_encode_with_bos(loaded):
    """Raw prompts get the BOS token Llama 3 and Gemma tokenizers prepend; chat templates add it once."""
    for name, bos in (("tiny-llama", "<|begin_of_text|>"), ("tiny-gemma3", "<bos>")):
        _, _, tokenizer = loaded(name)
        bos_id = tokenizer.convert_tokens_to_ids(bos)
        assert tokenizer.encode("Hi")[0] == bos_id
        ids = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True)
        assert ids[0] == bos_id and ids.count(bos_id) == 1


def test_building_a_model_leaves_its_preset_as_it_was():
    """Building every tiny preset's model changes nothing in the preset (mlx-lm's model args rewrite
    nested config dicts in place): its marker stays, so a made model is never made again."""
    import copy

    from mlxrt.synthetic.build import _build_any
    from mlxrt.synthetic.presets import PRESETS

    for name in [p for p in PRESETS if p.startswith("tiny")]:
        spec = PRESETS[name]
        before = copy.deepcopy(spec)
        _build_any(spec, 0)  # mlx-vlm's classes for a vision preset (the vision extra)
        assert spec == before, name
