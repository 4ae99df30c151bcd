"""The synthetic presets: each family's config keys, special tokens and chat template, and each
preset's shape, dtype and tokenizer size; `synthetic:` model references parsed.

No MLX and no tokenizer library: the orchestrator reads a preset's config and tokenizer key
here before any worker starts (`orchestrator/options.py`). `build.py` writes the models.
"""

from __future__ import annotations

import copy
import dataclasses
import os
from pathlib import Path
from typing import Any

from .templates import GEMMA3_TEMPLATE, GEMMA3_VL_TEMPLATE, HARMONY_TEMPLATE, LLAMA3_TEMPLATE, chatml_template

FORMAT_VERSION = 2  # bump when the bytes a (preset, seed) produces change
EMBED_STD = 0.02  # embeddings, untied lm_head, biases and other 1-D parameters

_QWEN_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>")
_QWEN3_SPECIALS = (*_QWEN_SPECIALS, "<tool_response>", "</tool_response>", "<think>", "</think>")
# Qwen marks its tool and think tags special=False: they stay in decoded text for the parsers.
_QWEN_TEXT_TAGS = _QWEN3_SPECIALS[3:]
_QWEN_VL_SPECIALS = (*_QWEN_SPECIALS, "<|vision_start|>", "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>",
                     "<|video_pad|>")
#: Qwen2.5-VL's config keys for its vision tokens' ids.
_QWEN_VL_TOKENS = {"vision_start_token_id": "<|vision_start|>", "vision_end_token_id": "<|vision_end|>",
                   "vision_token_id": "<|vision_pad|>", "image_token_id": "<|image_pad|>",
                   "video_token_id": "<|video_pad|>"}


@dataclasses.dataclass(frozen=True)
class Family:
    """How one mlx-lm model_type is written: its config keys, special tokens and chat template."""

    model_type: str  # config.json "model_type": the mlx_lm.models module
    architecture: str  # config.json "architectures"[0], as the published checkpoint has it
    specials: tuple[str, ...]  # added tokens, given the top ids of the vocabulary in this order
    eos: tuple[str, ...]  # generation_config.json eos ids, in order; the first is the tokenizer's eos
    chat_template: str
    bos: str | None = None  # begins the chat template and every encode(); None: no BOS (Qwen)
    pad: str | None = None
    text_tags: tuple[str, ...] = ()  # specials that decode as text (special=False)
    norm_weight: float = 1.0  # the RMSNorm weight that is the identity: 0.0 where mlx-lm applies 1 + w
    text_config: str | None = None  # nest the shape under "text_config" with this model_type
    tokenizer_class: str = "PreTrainedTokenizerFast"
    defaults: dict[str, Any] = dataclasses.field(default_factory=dict)  # config keys of every preset
    #: A vision-language family (built from mlx-vlm's model classes): config key -> special token
    #: of its image markers; empty for a text model.
    vision_tokens: dict[str, str] = dataclasses.field(default_factory=dict)
    #: tokenizer_config.json "extra_special_tokens" (Gemma 3's processor reads its image tokens there).
    extra_special_tokens: dict[str, str] = dataclasses.field(default_factory=dict)


FAMILIES: dict[str, Family] = {
    "qwen2": Family(
        "qwen2", "Qwen2ForCausalLM", _QWEN_SPECIALS, ("<|im_end|>", "<|endoftext|>"),
        chatml_template(default_system="You are a helpful assistant.", thinking=None),
        pad="<|endoftext|>", text_tags=_QWEN_TEXT_TAGS, tokenizer_class="Qwen2Tokenizer",
        defaults={"attention_dropout": 0.0, "hidden_act": "silu", "initializer_range": EMBED_STD,
                  "rms_norm_eps": 1e-6, "rope_theta": 1_000_000.0, "use_cache": True,
                  "use_sliding_window": False},
    ),
    "llama": Family(
        "llama", "LlamaForCausalLM",
        ("<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
         "<|eom_id|>", "<|eot_id|>", "<|python_tag|>", "<|finetune_right_pad_id|>"),
        ("<|eot_id|>", "<|end_of_text|>", "<|eom_id|>"), LLAMA3_TEMPLATE, bos="<|begin_of_text|>",
        defaults={"attention_bias": False, "hidden_act": "silu", "mlp_bias": False, "rms_norm_eps": 1e-5,
                  "rope_theta": 500_000.0},
    ),
    "qwen3": Family(
        "qwen3", "Qwen3ForCausalLM", _QWEN3_SPECIALS, ("<|im_end|>", "<|endoftext|>"),
        chatml_template(default_system=None, thinking="qwen3"),
        pad="<|endoftext|>", text_tags=_QWEN_TEXT_TAGS, tokenizer_class="Qwen2Tokenizer",
        defaults={"attention_bias": False, "hidden_act": "silu", "rms_norm_eps": 1e-6,
                  "rope_theta": 1_000_000.0},
    ),
    "qwen3_moe": Family(
        "qwen3_moe", "Qwen3MoeForCausalLM", _QWEN3_SPECIALS, ("<|im_end|>", "<|endoftext|>"),
        chatml_template(default_system=None, thinking="qwen3"),
        pad="<|endoftext|>", text_tags=_QWEN_TEXT_TAGS, tokenizer_class="Qwen2Tokenizer",
        defaults={"attention_bias": False, "decoder_sparse_step": 1, "hidden_act": "silu",
                  "mlp_only_layers": [], "norm_topk_prob": True, "rms_norm_eps": 1e-6,
                  "rope_theta": 1_000_000.0},
    ),
    "qwen3_5": Family(
        "qwen3_5", "Qwen3_5ForConditionalGeneration", _QWEN3_SPECIALS, ("<|im_end|>", "<|endoftext|>"),
        chatml_template(default_system=None, thinking="qwen3.5"),
        pad="<|endoftext|>", text_tags=_QWEN_TEXT_TAGS, tokenizer_class="Qwen2Tokenizer",
        text_config="qwen3_5_text",
        defaults={"attention_bias": False, "attn_output_gate": True, "hidden_act": "silu",
                  "linear_conv_kernel_dim": 4, "rms_norm_eps": 1e-6},
    ),
    # Qwen2.5-VL as mlx-vlm loads it: the language model's keys at the top, "vision_config" beside them.
    "qwen2_5_vl": Family(
        "qwen2_5_vl", "Qwen2_5_VLForConditionalGeneration", _QWEN_VL_SPECIALS,
        ("<|im_end|>", "<|endoftext|>"),
        chatml_template(default_system="You are a helpful assistant.", thinking=None, vision=True),
        pad="<|endoftext|>", text_tags=_QWEN_TEXT_TAGS, tokenizer_class="Qwen2Tokenizer",
        defaults={"attention_dropout": 0.0, "hidden_act": "silu", "rms_norm_eps": 1e-6,
                  "rope_theta": 1_000_000.0, "use_sliding_window": False},
        vision_tokens=_QWEN_VL_TOKENS,
    ),
    # Gemma 3 as mlx-vlm loads it: "text_config" (gemma3_text) and a SigLIP "vision_config".
    "gemma3": Family(
        "gemma3", "Gemma3ForConditionalGeneration",
        ("<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>", "<start_of_image>",
         "<end_of_image>", "<image_soft_token>"),
        ("<eos>", "<end_of_turn>"), GEMMA3_VL_TEMPLATE, bos="<bos>", pad="<pad>", norm_weight=0.0,
        text_config="gemma3_text",
        defaults={"hidden_activation": "gelu_pytorch_tanh", "rms_norm_eps": 1e-6,
                  "rope_local_base_freq": 10_000.0, "rope_theta": 1_000_000.0},
        vision_tokens={"boi_token_index": "<start_of_image>", "eoi_token_index": "<end_of_image>",
                       "image_token_index": "<image_soft_token>"},
        extra_special_tokens={"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>",
                              "image_token": "<image_soft_token>"},
    ),
    "gemma3_text": Family(
        "gemma3_text", "Gemma3ForCausalLM",
        ("<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"),
        ("<eos>", "<end_of_turn>"), GEMMA3_TEMPLATE, bos="<bos>", pad="<pad>", norm_weight=0.0,
        defaults={"hidden_activation": "gelu_pytorch_tanh", "rms_norm_eps": 1e-6,
                  "rope_local_base_freq": 10_000.0, "rope_theta": 1_000_000.0},
    ),
    "gpt_oss": Family(
        "gpt_oss", "GptOssForCausalLM",
        ("<|startoftext|>", "<|endoftext|>", "<|return|>", "<|constrain|>", "<|channel|>", "<|start|>",
         "<|end|>", "<|message|>", "<|call|>"),
        ("<|return|>", "<|endoftext|>", "<|call|>"), HARMONY_TEMPLATE, bos="<|startoftext|>",
        pad="<|endoftext|>",
        defaults={"attention_bias": True, "hidden_act": "silu", "rms_norm_eps": 1e-5,
                  "rope_theta": 150_000.0, "swiglu_limit": 7.0, "tie_word_embeddings": False},
    ),
}
SPECIAL_TOKENS = FAMILIES["qwen2"].specials  # the Qwen2 presets' added tokens (top ids), kept for callers


@dataclasses.dataclass(frozen=True)
class Preset:
    """One synthetic model: family, shape, storage dtype, quantization and tokenizer size."""

    family: str  # key of FAMILIES
    shape: dict[str, Any]  # the config keys that size the model, named as mlx-lm's ModelArgs name them
    vocab_size: int  # rows of the embedding; the tokenizer is padded to exactly this
    dtype: str  # mlx dtype name of the float tensors (and of the quantization scales)
    quant_bits: int | None  # None: float weights; 4: affine 4-bit like mlx_lm.convert -q
    bpe_vocab: int  # target size of the trained BPE, before padding to vocab_size
    description: str
    source: str = "synthetic"  # the published config.json the shape copies
    quant_group_size: int = 64
    #: An embedding model, written as Qwen3-Embedding ships: its sentence-transformers pooling mode
    #: (``"lasttoken"``), an EOS appended by the tokenizer, a bare backbone's weights (no ``model.``
    #: prefix, no head). None: a generative model.
    embedding: str | None = None
    #: A vision-language model's vision tower ("vision_config", as mlx-vlm names its keys) and its image
    #: processor's preprocessor_config.json; None: a text model.
    vision: dict[str, Any] | None = None
    image_processor: dict[str, Any] | None = None

    @property
    def quantized(self) -> bool:
        """True for presets stored 4-bit (QuantizedLinear / QuantizedEmbedding after load)."""
        return self.quant_bits is not None

    @property
    def fam(self) -> Family:
        """The preset's Family."""
        return FAMILIES[self.family]

    @property
    def tokenizer_key(self) -> tuple:
        """What decides the tokenizer `make_model` writes: equal keys, equal tokenizers."""
        fam = self.fam
        return (FORMAT_VERSION, self.bpe_vocab, self.vocab_size, fam.specials, fam.text_tags, fam.bos)

    @property
    def special_ids(self) -> dict[str, int]:
        """The family's special tokens take the top ids, in the family's order."""
        specials = self.fam.specials
        first = self.vocab_size - len(specials)
        return {tok: first + i for i, tok in enumerate(specials)}

    def quantization(self) -> dict[str, Any] | None:
        """The top-level "quantization" entry mlx-lm writes into config.json, or None.

        MoE families also get per-layer entries (8-bit routers) from the model's
        quant_predicate when written; see `_build`.
        """
        if self.quant_bits is None:
            return None
        return {"group_size": self.quant_group_size, "bits": self.quant_bits, "mode": "affine"}

    def config(self) -> dict[str, Any]:
        """config.json before quantization, as the family's checkpoint has it (keys sorted)."""
        fam, ids = self.fam, self.special_ids
        # A deep copy: mlx-lm's model args rewrite nested dicts (rope_parameters) in place, which would
        # change the preset, and so its marker, once a model is built: every later check rewrote it.
        shape = copy.deepcopy({**fam.defaults, **self.shape, "vocab_size": self.vocab_size})
        cfg: dict[str, Any] = {
            "architectures": [fam.architecture],
            "bos_token_id": ids[fam.bos or fam.pad or fam.eos[0]],
            "eos_token_id": ids[fam.eos[0]],
            "model_type": fam.model_type,
            "tie_word_embeddings": bool(shape.get("tie_word_embeddings", False)),
            "torch_dtype": self.dtype,
        }
        if self.vision is not None:
            cfg["vision_config"] = dict(sorted(self.vision.items()))
            cfg.update({key: ids[tok] for key, tok in fam.vision_tokens.items()})
        if fam.text_config is None:
            cfg.update(shape)
        else:  # a multimodal checkpoint's language model (vision weights absent)
            cfg["text_config"] = dict(sorted({**shape, "model_type": fam.text_config}.items()))
        return dict(sorted(cfg.items()))


#: A test-sized Qwen2.5-VL vision tower; out_hidden_size is the language model's width (`_tiny`'s 64).
QWEN2_5_VL_TINY_VISION = {
    "model_type": "qwen2_5_vl", "depth": 2, "hidden_size": 32, "intermediate_size": 64, "out_hidden_size": 64,
    "num_heads": 2, "in_channels": 3, "patch_size": 14, "spatial_patch_size": 14, "spatial_merge_size": 2,
    "temporal_patch_size": 2, "window_size": 56, "fullatt_block_indexes": [1], "tokens_per_second": 2,
}

#: Qwen/Qwen2.5-VL-3B-Instruct's "vision_config" ("in_chans" named as mlx-vlm reads it, "in_channels"); its
#: merger projects to the language model's 2048.
QWEN2_5_VL_3B_VISION = {
    "model_type": "qwen2_5_vl", "depth": 32, "hidden_size": 1280, "intermediate_size": 3420,
    "out_hidden_size": 2048, "num_heads": 16, "in_channels": 3, "patch_size": 14, "spatial_patch_size": 14,
    "spatial_merge_size": 2, "temporal_patch_size": 2, "window_size": 112,
    "fullatt_block_indexes": [7, 15, 23, 31], "tokens_per_second": 2,
}


def qwen_vl_image_processor(*, max_tokens: int, min_tokens: int = 4) -> dict[str, Any]:
    """Qwen2-VL's preprocessor_config.json: 14-pixel patches merged 2x2, so one image token is 28x28
    pixels; an image is resized to between `min_tokens` and `max_tokens` of them (Qwen's own defaults:
    4 to 16384), with CLIP's mean and std."""
    return {
        "image_processor_type": "Qwen2VLImageProcessor", "processor_class": "Qwen2_5_VLProcessor",
        "patch_size": 14, "temporal_patch_size": 2, "merge_size": 2,
        "min_pixels": 28 * 28 * min_tokens, "max_pixels": 28 * 28 * max_tokens,
        "image_mean": [0.48145466, 0.4578275, 0.40821073], "image_std": [0.26862954, 0.26130258, 0.27577711],
        "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True, "do_convert_rgb": True,
    }


#: A test-sized SigLIP tower for Gemma 3: 56-pixel images, 16 patches, pooled to the text config's
#: mm_tokens_per_image.
GEMMA3_TINY_VISION = {
    "model_type": "siglip_vision_model", "num_hidden_layers": 2, "hidden_size": 32, "intermediate_size": 64,
    "num_attention_heads": 2, "patch_size": 14, "image_size": 56, "num_channels": 3,
}


def gemma3_image_processor(*, side: int) -> dict[str, Any]:
    """Gemma 3's preprocessor_config.json: every image resized to `side` x `side`, SigLIP's mean and std."""
    return {
        "image_processor_type": "Gemma3ImageProcessor", "processor_class": "Gemma3Processor",
        "size": {"height": side, "width": side}, "resample": 2, "do_resize": True, "do_rescale": True,
        "rescale_factor": 1 / 255, "do_normalize": True, "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5], "do_convert_rgb": True, "do_pan_and_scan": False,
    }


def _tiny(family: str, description: str, **shape: Any) -> Preset:
    """A float32 CPU test model: 64 wide, vocab 2048, 512-token context."""
    base = {"hidden_size": 64, "intermediate_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2,
            "max_position_embeddings": 512, "tie_word_embeddings": True}
    return Preset(family, {**base, **shape}, vocab_size=2048, dtype="float32", quant_bits=None,
                  bpe_vocab=1024, description=description)


def _real(family: str, source: str, vocab_size: int, description: str, **shape: Any) -> Preset:
    """A published shape, bfloat16 quantized to affine 4-bit group 64: for the GPU machine."""
    return Preset(family, shape, vocab_size=vocab_size, dtype="bfloat16", quant_bits=4, bpe_vocab=2048,
                  description=description, source=source)


PRESETS: dict[str, Preset] = {
    "tiny": Preset(
        "qwen2", {"hidden_size": 64, "num_hidden_layers": 2, "intermediate_size": 256,
                  "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 512,
                  "tie_word_embeddings": True},
        vocab_size=2048, dtype="float32", quant_bits=None, bpe_vocab=1024,
        description="tests: sub-ms CPU decode, 512-token context to hit limits cheaply",
    ),
    "small": Preset(
        "qwen2", {"hidden_size": 256, "num_hidden_layers": 4, "intermediate_size": 1024,
                  "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 4096,
                  "tie_word_embeddings": True},
        vocab_size=8192, dtype="bfloat16", quant_bits=None, bpe_vocab=2048,
        description="CPU benchmark default: a few ms per decoded token on the MLX CPU backend",
    ),
    "tiny-llama": _tiny("llama", "tests: Llama 3 layout, KV caches only", num_hidden_layers=2),
    "tiny-qwen3": _tiny("qwen3", "tests: Qwen3 with q/k norms, <think> and <tool_call>",
                        num_hidden_layers=2, head_dim=16),
    # Qwen3-Embedding's layout (modules.json, last-token pooling, EOS appended, bare backbone weights).
    "tiny-qwen3-embedding": dataclasses.replace(
        _tiny("qwen3", "tests: Qwen3-Embedding layout, last-token pooling, L2-normalised",
              num_hidden_layers=2, head_dim=16), embedding="lasttoken"),
    "tiny-qwen3-moe": _tiny("qwen3_moe", "tests: Qwen3 MoE, 8 experts top-2",
                            num_hidden_layers=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
                            moe_intermediate_size=64),
    # 3 gated-delta (ArraysCache) layers then 1 attention (KVCache) layer, Qwen3.5's 3:1 pattern.
    "tiny-qwen3.5": _tiny("qwen3_5", "tests: Qwen3.5 hybrid linear attention, ArraysCache + KVCache",
                          num_hidden_layers=4, head_dim=16, full_attention_interval=4,
                          linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                          linear_value_head_dim=16,
                          rope_parameters={"rope_type": "default", "rope_theta": 10_000_000.0,
                                           "partial_rotary_factor": 0.25}),
    # Sliding, global, sliding, global; a 32-token window so test prompts make the caches rotate.
    "tiny-gemma3": _tiny("gemma3_text", "tests: Gemma 3 sliding-window layers, RotatingKVCache + KVCache",
                         num_hidden_layers=4, head_dim=16, query_pre_attn_scalar=16, sliding_window=32,
                         sliding_window_pattern=2),
    # Qwen2.5-VL's layout at test size: a 2-block vision tower (14-pixel patches, 2x2 merged into one
    # token), at most 64 image tokens an image (the processor's max_pixels), mRoPE over the image grid.
    "tiny-qwen2.5-vl": dataclasses.replace(
        _tiny("qwen2_5_vl", "tests: Qwen2.5-VL vision tower + mRoPE language model, images in every API",
              num_hidden_layers=2, max_position_embeddings=2048,
              rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]}),
        vision=QWEN2_5_VL_TINY_VISION, image_processor=qwen_vl_image_processor(max_tokens=64)),
    # Gemma 3's layout at test size: a 2-layer SigLIP tower (56-pixel images, 14-pixel patches) pooled to
    # 4 soft tokens an image, sliding and global layers; a 64-token window, so a test's image chat fits it
    # (the image cache keeps prompts that have not rotated their windows).
    "tiny-gemma3-vl": dataclasses.replace(
        _tiny("gemma3", "tests: Gemma 3 SigLIP tower + sliding-window language model, images in every API",
              num_hidden_layers=2, head_dim=16, query_pre_attn_scalar=16, sliding_window=64,
              sliding_window_pattern=2, mm_tokens_per_image=4),
        vision=GEMMA3_TINY_VISION, image_processor=gemma3_image_processor(side=56)),
    # Qwen/Qwen2.5-VL-3B-Instruct config.json and preprocessor_config.json, written as mlx-vlm's convert -q
    # writes mlx-community's 4-bit conversion: the language model 4-bit group 64, the vision tower bfloat16.
    "qwen2.5-vl-3b-4bit": dataclasses.replace(
        _real("qwen2_5_vl", "Qwen/Qwen2.5-VL-3B-Instruct config.json", 151936,
              "Qwen2.5-VL-3B shape, 4-bit language model, bfloat16 vision tower: the GPU vision benchmark",
              hidden_size=2048, num_hidden_layers=36, intermediate_size=11008, num_attention_heads=16,
              num_key_value_heads=2, max_position_embeddings=128000, tie_word_embeddings=True,
              rope_scaling={"type": "mrope", "mrope_section": [16, 24, 24]}),
        vision=QWEN2_5_VL_3B_VISION, image_processor=qwen_vl_image_processor(max_tokens=16384)),
    "tiny-gpt-oss": _tiny("gpt_oss", "tests: gpt-oss MoE with sinks and sliding windows",
                          num_hidden_layers=4, intermediate_size=64, head_dim=16, num_local_experts=8,
                          num_experts_per_tok=2, sliding_window=32, tie_word_embeddings=False,
                          layer_types=["sliding_attention", "full_attention"] * 2,
                          rope_scaling={"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0,
                                        "original_max_position_embeddings": 16, "rope_type": "yarn",
                                        "truncate": False}),
    # Qwen/Qwen2.5-0.5B-Instruct config.json
    "qwen2.5-0.5b-4bit": Preset(
        "qwen2", {"hidden_size": 896, "num_hidden_layers": 24, "intermediate_size": 4864,
                  "num_attention_heads": 14, "num_key_value_heads": 2, "max_position_embeddings": 32768,
                  "tie_word_embeddings": True},
        vocab_size=151936, dtype="bfloat16", quant_bits=4, bpe_vocab=2048,
        description="Qwen2.5-0.5B shape, 4-bit group 64: the GPU benchmark default",
        source="Qwen/Qwen2.5-0.5B-Instruct config.json",
    ),
    # Qwen/Qwen2.5-7B-Instruct config.json
    "qwen2.5-7b-4bit": Preset(
        "qwen2", {"hidden_size": 3584, "num_hidden_layers": 28, "intermediate_size": 18944,
                  "num_attention_heads": 28, "num_key_value_heads": 4, "max_position_embeddings": 32768,
                  "tie_word_embeddings": False},
        vocab_size=152064, dtype="bfloat16", quant_bits=4, bpe_vocab=2048,
        description="Qwen2.5-7B shape, 4-bit group 64: realistic load size and memory",
        source="Qwen/Qwen2.5-7B-Instruct config.json",
    ),
    # meta-llama/Llama-3.1-8B-Instruct config.json
    "llama3.1-8b-4bit": _real(
        "llama", "meta-llama/Llama-3.1-8B-Instruct config.json", 128256, "Llama-3.1-8B shape, 4-bit",
        hidden_size=4096, num_hidden_layers=32, intermediate_size=14336, num_attention_heads=32,
        num_key_value_heads=8, head_dim=128, max_position_embeddings=131072, tie_word_embeddings=False,
        rope_scaling={"factor": 8.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                      "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    ),
    # meta-llama/Llama-3.3-70B-Instruct config.json: a shape for worker groups across GPUs (about 40 GB)
    "llama3.3-70b-4bit": _real(
        "llama", "meta-llama/Llama-3.3-70B-Instruct config.json", 128256, "Llama-3.3-70B shape, 4-bit",
        hidden_size=8192, num_hidden_layers=80, intermediate_size=28672, num_attention_heads=64,
        num_key_value_heads=8, head_dim=128, max_position_embeddings=131072, tie_word_embeddings=False,
        rope_theta=500000.0,
        rope_scaling={"factor": 8.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                      "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    ),
    # Qwen/Qwen3-8B config.json
    "qwen3-8b-4bit": _real(
        "qwen3", "Qwen/Qwen3-8B config.json", 151936, "Qwen3-8B shape, 4-bit",
        hidden_size=4096, num_hidden_layers=36, intermediate_size=12288, num_attention_heads=32,
        num_key_value_heads=8, head_dim=128, max_position_embeddings=40960, tie_word_embeddings=False,
    ),
    # Qwen/Qwen3-Embedding-0.6B config.json, bfloat16 as published (not quantised)
    "qwen3-embedding-0.6b": Preset(
        "qwen3", {"hidden_size": 1024, "num_hidden_layers": 28, "intermediate_size": 3072,
                  "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128,
                  "max_position_embeddings": 32768, "tie_word_embeddings": True},
        vocab_size=151669, dtype="bfloat16", quant_bits=None, bpe_vocab=2048,
        description="Qwen3-Embedding-0.6B shape, bfloat16: the GPU embedding benchmark",
        source="Qwen/Qwen3-Embedding-0.6B config.json", embedding="lasttoken",
    ),
    # Qwen/Qwen3-30B-A3B config.json
    "qwen3-30b-a3b-4bit": _real(
        "qwen3_moe", "Qwen/Qwen3-30B-A3B config.json", 151936,
        "Qwen3-30B-A3B shape, 128 experts top-8, 4-bit",
        hidden_size=2048, num_hidden_layers=48, intermediate_size=6144, num_attention_heads=32,
        num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8,
        moe_intermediate_size=768, max_position_embeddings=40960, tie_word_embeddings=False,
    ),
    # Qwen/Qwen3.5-27B config.json "text_config" (the vision tower is not made)
    "qwen3.5-27b-4bit": _real(
        "qwen3_5", "Qwen/Qwen3.5-27B config.json (text_config)", 248320, "Qwen3.5-27B shape, 4-bit",
        hidden_size=5120, num_hidden_layers=64, intermediate_size=17408, num_attention_heads=24,
        num_key_value_heads=4, head_dim=256, full_attention_interval=4, linear_num_key_heads=16,
        linear_num_value_heads=48, linear_key_head_dim=128, linear_value_head_dim=128,
        max_position_embeddings=262144, tie_word_embeddings=False,
        rope_parameters={"mrope_interleaved": True, "mrope_section": [11, 11, 10],
                         "partial_rotary_factor": 0.25, "rope_theta": 10_000_000, "rope_type": "default"},
    ),
    # google/gemma-3-12b-it config.json "text_config", written as the text-only gemma3_text
    "gemma3-12b-4bit": _real(
        "gemma3_text", "google/gemma-3-12b-it config.json (text_config)", 262208, "Gemma-3-12B shape, 4-bit",
        hidden_size=3840, num_hidden_layers=48, intermediate_size=15360, num_attention_heads=16,
        num_key_value_heads=8, head_dim=256, query_pre_attn_scalar=256, sliding_window=1024,
        sliding_window_pattern=6, max_position_embeddings=131072, tie_word_embeddings=True,
        rope_scaling={"factor": 8.0, "rope_type": "linear"},
    ),
    # openai/gpt-oss-20b config.json (published as MXFP4 experts; here affine 4-bit throughout)
    "gpt-oss-20b-4bit": _real(
        "gpt_oss", "openai/gpt-oss-20b config.json", 201088, "gpt-oss-20b shape, 32 experts top-4, 4-bit",
        hidden_size=2880, num_hidden_layers=24, intermediate_size=2880, num_attention_heads=64,
        num_key_value_heads=8, head_dim=64, num_local_experts=32, num_experts_per_tok=4,
        sliding_window=128, max_position_embeddings=131072,
        layer_types=["sliding_attention", "full_attention"] * 12,
        rope_scaling={"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0,
                      "original_max_position_embeddings": 4096, "rope_type": "yarn", "truncate": False},
    ),
}


def get_preset(name: str) -> Preset:
    """The preset called `name`; ValueError naming the choices otherwise."""
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown synthetic preset {name!r}; choose from {sorted(PRESETS)}") from None


def default_model_dir(preset: str, seed: int = 0) -> Path:
    """Cache directory for (preset, seed): $MLXRT_MODELS_DIR or ~/.cache/mlxrt/models."""
    root = os.environ.get("MLXRT_MODELS_DIR") or Path.home() / ".cache" / "mlxrt" / "models"
    return Path(root).expanduser() / f"{preset}-s{seed}"


@dataclasses.dataclass(frozen=True)
class SyntheticRef:
    """What follows ``synthetic:`` in a model ref: ``PRESET[:SEED][?noise=X&layers=N&vocab=V&context=C]``.

    With `noise` or `layers` it names a *variant* of the preset (`variants.py`): its weights each
    multiplied by ``1 + noise * N(0, 1)``, its first `layers` layers kept; the tokenizer is the
    preset's, so a variant is a draft model for it whose acceptance `noise` and `layers` control.
    `vocab` makes the preset with another vocabulary size, and so another tokenizer: that of the
    family's presets of that size (``synthetic:qwen2.5-0.5b-4bit?vocab=152064`` drafts for
    ``synthetic:qwen2.5-7b-4bit``). `context` makes it with another context (max_position_embeddings,
    in tokens) and the same weights: ``synthetic:tiny-qwen3?context=131072`` takes agent-sized prompts.
    """

    preset: str
    seed: int = 0
    noise: float = 0.0
    layers: int | None = None
    vocab: int | None = None
    context: int | None = None

    @property
    def is_variant(self) -> bool:
        return self.noise != 0.0 or self.layers is not None


def parse_synthetic(ref: str) -> SyntheticRef:
    """Parse ``PRESET[:SEED][?noise=X&layers=N&vocab=V&context=C]``; `ValueError` naming what is wrong."""
    head, _, query = ref.partition("?")
    preset, _, seed = head.partition(":")
    try:
        out = SyntheticRef(preset, int(seed or 0))
        for item in filter(None, query.split("&")):
            key, _, value = item.partition("=")
            if key == "noise":
                out = dataclasses.replace(out, noise=float(value))
            elif key == "layers":
                out = dataclasses.replace(out, layers=int(value))
            elif key == "vocab":
                out = dataclasses.replace(out, vocab=int(value))
            elif key == "context":
                out = dataclasses.replace(out, context=int(value))
            else:
                raise ValueError(f"unknown key {key!r} (noise, layers, vocab, context)")
    except ValueError as exc:
        raise ValueError(f"invalid synthetic model 'synthetic:{ref}': {exc}") from None
    if (out.seed < 0 or not 0.0 <= out.noise <= 10.0 or (out.layers is not None and out.layers < 1)
            or (out.vocab is not None and out.vocab < 256) or (out.context is not None and out.context < 16)):
        raise ValueError(f"invalid synthetic model 'synthetic:{ref}': seed >= 0, noise in [0, 10], "
                         "layers >= 1, vocab >= 256, context >= 16")
    return out


def synthetic_preset(ref: SyntheticRef) -> Preset:
    """The preset `ref` is made from (its vocabulary and context replaced); KeyError for an unknown preset."""
    return resized(PRESETS[ref.preset], vocab_size=ref.vocab, context=ref.context)


def resized(spec: Preset, *, vocab_size: int | None, context: int | None) -> Preset:
    """`spec` with another vocabulary size and context (tokens) where given."""
    if vocab_size is not None:
        spec = dataclasses.replace(spec, vocab_size=vocab_size)
    if context is not None:
        spec = dataclasses.replace(spec, shape={**spec.shape, "max_position_embeddings": context})
    return spec
