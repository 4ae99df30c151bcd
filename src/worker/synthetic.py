"""Synthetic models: real mlx-lm architectures of several families with seeded random weights.

No model hub is reachable from CI, so tests and benchmarks make their own
models. `make_model` writes an ordinary mlx-lm model directory that
``mlx_lm.load(path)`` loads like a downloaded checkpoint::

    config.json                      the family's config (+ "quantization" for 4-bit presets)
    generation_config.json           eos ids, as the family's instruct checkpoints ship them
    model.safetensors                or model-0000i-of-0000n.safetensors shards
    model.safetensors.index.json     weight map, as mlx_lm.utils.save_model writes it
    tokenizer.json                   byte-level BPE trained here on corpus.txt + the family's specials
    tokenizer_config.json            the family's chat template (thinking and tool-call markup)
    mlxrt-synthetic.json             marker: generator, preset parameters, seed

One path serves every family: the model is built from its config by mlx-lm
itself (``mlx_lm.utils._get_classes``, ``ModelArgs.from_dict``), so names and
shapes are exactly those ``mlx_lm.load`` expects; weights are drawn for that
tree, loaded back with ``load_weights`` (strict), quantised by
``mlx_lm.utils.quantize_model`` where the preset is 4-bit, and written with
mlx-lm's shard rule and ``save_config``. docs/models.md lists the families.

Determinism: each tensor is drawn in row blocks, every block from an MLX key
hashed from (seed, tensor name, block index), and the tokenizer trainer is
deterministic for a fixed corpus, so the same (preset, seed) gives the same
bytes on the same MLX backend (and two families draw equal values for a
tensor of equal name and shape: `tiny` and `tiny-llama` share most weights).
MLX is lazy: nothing is computed until a tensor is written, one tensor at a
time, a shard of at most 1 GiB held at once, so the 8B-27B shapes stay near
one shard plus twice their largest tensor while writing.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import io
import itertools
import json
import math
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import structlog
from tokenizers import (
    AddedToken,
    Regex,
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
    trainers,
)

# MLX is imported where weights are drawn, so PRESETS and paths need no MLX (orchestrator side).
if TYPE_CHECKING:
    import mlx.core as mx
    import mlx.nn as nn

log = structlog.get_logger("mlxrt.worker")

MARKER_FILE = "mlxrt-synthetic.json"
FORMAT_VERSION = 2  # bump when the bytes a (preset, seed) produces change
DEFAULT_SHARD_GB = 1  # mlx_lm.utils.make_shards limit; small shards keep peak memory low
BLOCK_ROWS = 4096  # rows drawn per key: bounds the float32 scratch for big tensors
EMBED_STD = 0.02  # embeddings, untied lm_head, biases and other 1-D parameters
BPE_MIN_FREQUENCY = 2
# Qwen2's pre-tokenizer split, so the BPE sees the same pieces a Qwen tokenizer would.
PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"""
    r"""| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

# ---------------------------------------------------------------- chat templates
# Each follows its family's published template in structure and markup; dates and
# model identities are fixed strings so a rendering is reproducible.

_QWEN_TOOLS = (
    "{{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and "
    "arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n"
    "{\"name\": <function-name>, \"arguments\": <args-json-object>}\\n</tool_call><|im_end|>\\n' }}"
)


def _chatml_template(*, default_system: str | None, thinking: str | None) -> str:
    """Qwen ChatML with <tool_call> JSON; `thinking` None, "qwen3" (model opens <think>) or "qwen3.5"."""
    if default_system is None:
        system_tools = "{{- '<|im_start|>system\\n' }}{%- if messages[0].role == 'system' %}" \
            "{{- messages[0].content + '\\n\\n' }}{%- endif %}"
        system_plain = ""
    else:  # Qwen2.5 always has a system turn
        system_tools = "{{- '<|im_start|>system\\n' }}{%- if messages[0].role == 'system' %}" \
            "{{- messages[0].content }}{%- else %}{{- '" + default_system + "' }}{%- endif %}{{- '\\n\\n' }}"
        system_plain = "{%- else %}{{- '<|im_start|>system\\n" + default_system + "<|im_end|>\\n' }}"
    if thinking is None:
        assistant = "{{- '<|im_start|>' + message.role }}{%- if content %}{{- '\\n' + content }}{%- endif %}"
        call_sep = "{{- '\\n' }}"
        prompt = ""
    else:
        # As Qwen3: reasoning is kept only for turns after the last user query.
        assistant = (
            "{%- set reasoning = '' %}"
            "{%- if message.reasoning_content is string %}{%- set reasoning = message.reasoning_content %}"
            "{%- elif '</think>' in content %}"
            "{%- set reasoning = content.split('</think>')[0].rstrip('\\n')"
            ".split('<think>')[-1].lstrip('\\n') %}"
            "{%- set content = content.split('</think>')[-1].lstrip('\\n') %}{%- endif %}"
            "{%- if loop.index0 > ns.last_query and (loop.last or reasoning) %}"
            "{{- '<|im_start|>assistant\\n<think>\\n' + reasoning.strip('\\n') + '\\n</think>\\n\\n'"
            " + content.lstrip('\\n') }}"
            "{%- else %}{{- '<|im_start|>assistant\\n' + content }}{%- endif %}"
        )
        call_sep = "{%- if content or not loop.first %}{{- '\\n' }}{%- endif %}"
        opened = "{%- else %}{{- '<think>\\n' }}" if thinking == "qwen3.5" else ""
        prompt = "{%- if enable_thinking is defined and enable_thinking is false %}" \
            "{{- '<think>\\n\\n</think>\\n\\n' }}" + opened + "{%- endif %}"
    return (
        "{%- if tools %}" + system_tools + _QWEN_TOOLS +
        "{%- elif messages[0].role == 'system' %}"
        "{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}" + system_plain +
        "{%- endif %}"
        "{%- set ns = namespace(multi_step_tool=true, last_query=messages|length - 1) %}"
        "{%- for message in messages[::-1] %}{%- set index = (messages|length - 1) - loop.index0 %}"
        "{%- if ns.multi_step_tool and message.role == 'user' and message.content is string"
        " and not message.content.startswith('<tool_response>') %}"
        "{%- set ns.multi_step_tool = false %}{%- set ns.last_query = index %}{%- endif %}{%- endfor %}"
        "{%- for message in messages %}"
        "{%- set content = message.content if message.content is string else '' %}"
        "{%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}"
        "{{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>\\n' }}"
        "{%- elif message.role == 'assistant' %}" + assistant +
        "{%- for tool_call in message.tool_calls or [] %}" + call_sep +
        "{%- if tool_call.function %}{%- set tool_call = tool_call.function %}{%- endif %}"
        "{{- '<tool_call>\\n{\"name\": \"' }}{{- tool_call.name }}{{- '\", \"arguments\": ' }}"
        "{%- if tool_call.arguments is string %}{{- tool_call.arguments }}"
        "{%- else %}{{- tool_call.arguments | tojson }}{%- endif %}{{- '}\\n</tool_call>' }}"
        "{%- endfor %}{{- '<|im_end|>\\n' }}"
        "{%- elif message.role == 'tool' %}"
        "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}"
        "{{- '<|im_start|>user' }}{%- endif %}"
        "{{- '\\n<tool_response>\\n' + content + '\\n</tool_response>' }}"
        "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
        "{%- endif %}{%- endfor %}"
        "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}" + prompt + "{%- endif %}"
    )


# Llama 3.1 Instruct: header turns, tools as JSON in the first user turn, results as "ipython".
LLAMA3_TEMPLATE = (
    "{{- bos_token }}"
    "{%- if messages[0].role == 'system' %}{%- set system_message = messages[0].content | trim %}"
    "{%- set messages = messages[1:] %}{%- else %}{%- set system_message = '' %}{%- endif %}"
    "{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' }}"
    "{%- if tools %}{{- 'Environment: ipython\\n' }}{%- endif %}"
    "{{- 'Cutting Knowledge Date: December 2023\\nToday Date: 26 Jul 2024\\n\\n' }}"
    "{{- system_message + '<|eot_id|>' }}"
    "{%- if tools and messages %}"
    "{{- '<|start_header_id|>user<|end_header_id|>\\n\\n' }}"
    "{{- 'Given the following functions, please respond with a JSON for a function call with its proper "
    "arguments that best answers the given prompt.\\n\\nRespond in the format {\"name\": function name, "
    "\"parameters\": dictionary of argument name and its value}.Do not use variables.\\n\\n' }}"
    "{%- for t in tools %}{{- t | tojson(indent=4) }}{{- '\\n\\n' }}{%- endfor %}"
    "{{- messages[0].content | trim + '<|eot_id|>' }}{%- set messages = messages[1:] %}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.tool_calls %}{%- set call = message.tool_calls[0] %}"
    "{%- if call.function %}{%- set call = call.function %}{%- endif %}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n{\"name\": \"' + call.name + '\", "
    "\"parameters\": ' }}{{- call.arguments | tojson }}{{- '}<|eot_id|>' }}"
    "{%- elif message.role == 'tool' or message.role == 'ipython' %}"
    "{{- '<|start_header_id|>ipython<|end_header_id|>\\n\\n' }}{{- message.content | tojson }}"
    "{{- '<|eot_id|>' }}"
    "{%- else %}{{- '<|start_header_id|>' + message.role + '<|end_header_id|>\\n\\n'"
    " + message.content | trim + '<|eot_id|>' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)

# Gemma 3: turns of user/model, the system text prefixed to the first user turn. Gemma 3 has no
# tool tokens; tools follow Google's prompt recipe (```tool_code``` calls, ```tool_output``` results).
GEMMA3_TEMPLATE = (
    "{{- bos_token }}"
    "{%- set ns = namespace(prefix='') %}"
    "{%- if messages[0].role == 'system' %}{%- set ns.prefix = messages[0].content + '\\n\\n' %}"
    "{%- set loop_messages = messages[1:] %}{%- else %}{%- set loop_messages = messages %}{%- endif %}"
    "{%- if tools %}{%- set ns.prefix = ns.prefix + 'You have access to functions. If you decide to "
    "invoke any of the function(s), you MUST put it in the format of\\n```tool_code\\n"
    "function_name(param=value)\\n```\\n"
    "You SHOULD NOT include any other text in the response if you call a function\\n' %}"
    "{%- for t in tools %}{%- set ns.prefix = ns.prefix + (t | tojson) + '\\n' %}{%- endfor %}"
    "{%- set ns.prefix = ns.prefix + '\\n' %}{%- endif %}"
    "{%- for message in loop_messages %}"
    "{%- set role = 'model' if message.role == 'assistant' else 'user' %}"
    "{{- '<start_of_turn>' + role + '\\n' + (ns.prefix if loop.first else '') }}"
    "{%- if message.role == 'tool' %}{{- '```tool_output\\n' + message.content + '\\n```' }}"
    "{%- else %}{{- (message.content or '') | trim }}{%- endif %}"
    "{%- for call in message.tool_calls or [] %}{%- if call.function %}{%- set call = call.function %}"
    "{%- endif %}{{- '```tool_code\\n' + call.name + '(' }}"
    "{%- for k, v in call.arguments.items() %}{{- k + '=' }}{{- v | tojson }}"
    "{%- if not loop.last %}{{- ', ' }}{%- endif %}{%- endfor %}{{- ')\\n```' }}{%- endfor %}"
    "{{- '<end_of_turn>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<start_of_turn>model\\n' }}{%- endif %}"
)

# gpt-oss harmony: system/developer/user turns, assistant analysis/commentary/final channels,
# tool calls to=functions.NAME ending in <|call|>, tools as a TypeScript-like namespace.
HARMONY_TEMPLATE = (
    "{{- '<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.\\n"
    "Knowledge cutoff: 2024-06\\n\\nReasoning: ' + (reasoning_effort | default('medium')) + '\\n\\n"
    "# Valid channels: analysis, commentary, final. Channel must be included for every message.' }}"
    "{%- if tools %}{{- '\\nCalls to these tools must go to the commentary channel: \\'functions\\'.' }}"
    "{%- endif %}{{- '<|end|>' }}"
    "{%- if messages[0].role in ('system', 'developer') %}{%- set instructions = messages[0].content %}"
    "{%- set loop_messages = messages[1:] %}{%- else %}{%- set instructions = '' %}"
    "{%- set loop_messages = messages %}{%- endif %}"
    "{%- if instructions or tools %}{{- '<|start|>developer<|message|>' }}"
    "{%- if instructions %}{{- '# Instructions\\n\\n' + instructions }}{%- endif %}"
    "{%- if instructions and tools %}{{- '\\n\\n' }}{%- endif %}"
    "{%- if tools %}{{- '# Tools\\n\\n## functions\\n\\nnamespace functions {\\n\\n' }}"
    "{%- for t in tools %}{%- set f = t.function if t.function is defined else t %}"
    "{{- '// ' + (f.description or '') + '\\ntype ' + f.name + ' = (_: ' }}"
    "{{- (f.parameters or {}) | tojson }}{{- ') => any;\\n\\n' }}{%- endfor %}"
    "{{- '} // namespace functions' }}{%- endif %}{{- '<|end|>' }}{%- endif %}"
    "{%- set ns = namespace(last_call='') %}"
    "{%- for message in loop_messages %}"
    "{%- if message.role == 'assistant' %}"
    "{%- if message.tool_calls %}"
    "{%- if message.thinking or message.reasoning_content %}"
    "{{- '<|start|>assistant<|channel|>analysis<|message|>'"
    " + (message.thinking or message.reasoning_content) + '<|end|>' }}{%- endif %}"
    "{%- for call in message.tool_calls %}{%- if call.function %}{%- set call = call.function %}{%- endif %}"
    "{%- set ns.last_call = call.name %}"
    "{{- '<|start|>assistant<|channel|>commentary to=functions.' + call.name"
    " + ' <|constrain|>json<|message|>' }}"
    "{%- if call.arguments is string %}{{- call.arguments }}{%- else %}{{- call.arguments | tojson }}"
    "{%- endif %}{{- '<|call|>' }}{%- endfor %}"
    "{%- else %}{{- '<|start|>assistant<|channel|>final<|message|>' + message.content + '<|end|>' }}"
    "{%- endif %}"
    "{%- elif message.role == 'tool' %}"
    "{{- '<|start|>functions.' + (message.name or ns.last_call) + ' to=assistant<|channel|>commentary"
    "<|message|>' + message.content + '<|end|>' }}"
    "{%- else %}{{- '<|start|>' + message.role + '<|message|>' + message.content + '<|end|>' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start|>assistant' }}{%- endif %}"
)

# ---------------------------------------------------------------- families

_QWEN_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>")
_QWEN3_SPECIALS = (*_QWEN_SPECIALS, "<tool_response>", "</tool_response>", "<think>", "</think>")
# Qwen marks its tool and think tags special=False: they stay in decoded text for the parsers.
_QWEN_TEXT_TAGS = _QWEN3_SPECIALS[3:]


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


FAMILIES: dict[str, Family] = {
    "qwen2": Family(
        "qwen2", "Qwen2ForCausalLM", _QWEN_SPECIALS, ("<|im_end|>", "<|endoftext|>"),
        _chatml_template(default_system="You are a helpful assistant.", thinking=None),
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
        _chatml_template(default_system=None, thinking="qwen3"),
        pad="<|endoftext|>", text_tags=_QWEN_TEXT_TAGS, tokenizer_class="Qwen2Tokenizer",
        defaults={"attention_bias": False, "hidden_act": "silu", "rms_norm_eps": 1e-6,
                  "rope_theta": 1_000_000.0},
    ),
    "qwen3_moe": Family(
        "qwen3_moe", "Qwen3MoeForCausalLM", _QWEN3_SPECIALS, ("<|im_end|>", "<|endoftext|>"),
        _chatml_template(default_system=None, thinking="qwen3"),
        pad="<|endoftext|>", text_tags=_QWEN_TEXT_TAGS, tokenizer_class="Qwen2Tokenizer",
        defaults={"attention_bias": False, "decoder_sparse_step": 1, "hidden_act": "silu",
                  "mlp_only_layers": [], "norm_topk_prob": True, "rms_norm_eps": 1e-6,
                  "rope_theta": 1_000_000.0},
    ),
    "qwen3_5": Family(
        "qwen3_5", "Qwen3_5ForConditionalGeneration", _QWEN3_SPECIALS, ("<|im_end|>", "<|endoftext|>"),
        _chatml_template(default_system=None, thinking="qwen3.5"),
        pad="<|endoftext|>", text_tags=_QWEN_TEXT_TAGS, tokenizer_class="Qwen2Tokenizer",
        text_config="qwen3_5_text",
        defaults={"attention_bias": False, "attn_output_gate": True, "hidden_act": "silu",
                  "linear_conv_kernel_dim": 4, "rms_norm_eps": 1e-6},
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
        shape = {**fam.defaults, **self.shape, "vocab_size": self.vocab_size}
        cfg: dict[str, Any] = {
            "architectures": [fam.architecture],
            "bos_token_id": ids[fam.bos or fam.pad or fam.eos[0]],
            "eos_token_id": ids[fam.eos[0]],
            "model_type": fam.model_type,
            "tie_word_embeddings": bool(shape.get("tie_word_embeddings", False)),
            "torch_dtype": self.dtype,
        }
        if fam.text_config is None:
            cfg.update(shape)
        else:  # a multimodal checkpoint's language model (vision weights absent)
            cfg["text_config"] = dict(sorted({**shape, "model_type": fam.text_config}.items()))
        return dict(sorted(cfg.items()))


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


def ensure_model(preset: str, seed: int = 0) -> Path:
    """The cached model directory for (preset, seed), made first if missing or stale."""
    return make_model(preset, default_model_dir(preset, seed), seed=seed)


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
    return _resized(PRESETS[ref.preset], vocab_size=ref.vocab, context=ref.context)


def _resized(spec: Preset, *, vocab_size: int | None, context: int | None) -> Preset:
    """`spec` with another vocabulary size and context (tokens) where given."""
    if vocab_size is not None:
        spec = dataclasses.replace(spec, vocab_size=vocab_size)
    if context is not None:
        spec = dataclasses.replace(spec, shape={**spec.shape, "max_position_embeddings": context})
    return spec


def ensure_synthetic(ref: SyntheticRef) -> Path:
    """The cached model directory `ref` names, made first if missing or stale."""
    if ref.is_variant:
        from .variants import ensure_variant  # MLX: drawn noise

        return ensure_variant(ref)
    out = default_model_dir(ref.preset, ref.seed)
    if ref.vocab is not None:
        out = out.with_name(f"{out.name}-v{ref.vocab}")
    if ref.context is not None:
        out = out.with_name(f"{out.name}-c{ref.context}")
    return make_model(ref.preset, out, seed=ref.seed, vocab_size=ref.vocab, context=ref.context)


def build_model(preset: str, *, seed: int = 0) -> tuple[nn.Module, dict[str, Any]]:
    """The mlx-lm model `make_model` would write for (preset, seed), unevaluated, and its config.

    Costs no memory until its parameters are evaluated, so real shapes can be
    checked on a small machine.
    """
    return _build(get_preset(preset), seed)


def make_model(preset: str, out: str | os.PathLike[str], *, seed: int = 0, force: bool = False,
               vocab_size: int | None = None, context: int | None = None) -> Path:
    """Write a loadable mlx-lm model directory at `out` and return it.

    The same (preset, seed) writes the same bytes. If `out` already holds this
    preset and seed (per its marker file) it is returned untouched unless
    `force`. A non-empty `out` that is not a synthetic model is only replaced
    with `force`. The directory is built beside `out` and renamed into place,
    so readers never see a half-written model. `vocab_size` replaces the
    preset's: presets of one family and one vocabulary size share a
    tokenizer, so a small preset can be made a draft for a large one. `context` replaces its
    max_position_embeddings (tokens); the weights stay the same.
    """
    spec = _resized(get_preset(preset), vocab_size=vocab_size, context=context)
    out = Path(out).expanduser()
    marker = _marker(preset, spec, seed)
    found = _read_marker(out)
    if found == marker and not force:
        return out
    if found is None and out.is_dir() and any(out.iterdir()) and not force:
        raise FileExistsError(f"{out} is not a synthetic model directory; pass force=True to replace it")
    out.parent.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent))
    try:
        os.chmod(tmp, 0o755)  # mkdtemp's 0700 would hide a shared cache from other users
        nbytes = _write_model(tmp, spec, seed)
        _write_json(tmp / MARKER_FILE, marker)
        _install(tmp, out, marker, force=force)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log.info("synthetic_model.written", preset=preset, seed=seed, path=str(out),
             weight_bytes=nbytes, elapsed_s=round(time.perf_counter() - start, 3))
    return out


# ---------------------------------------------------------------- directory


def _marker(name: str, spec: Preset, seed: int) -> dict[str, Any]:
    """What the marker file records; any difference means the directory is stale."""
    params = dataclasses.asdict(spec)
    if params["embedding"] is None:
        del params["embedding"]  # added later: generative models' markers stay as they were
    return {
        "generator": "mlxrt.worker.synthetic",
        "format": FORMAT_VERSION,
        "preset": name,
        "seed": seed,
        "params": params,
    }


def _read_marker(out: Path) -> dict[str, Any] | None:
    """The marker in `out`, or None when absent or unreadable."""
    try:
        with open(out / MARKER_FILE, encoding="utf-8") as f:
            found = json.load(f)
    except (OSError, ValueError):
        return None
    return found if isinstance(found, dict) else None


def _install(tmp: Path, out: Path, marker: dict[str, Any], *, force: bool) -> None:
    """Rename the finished `tmp` to `out`, replacing whatever `out` held."""
    if not force and _read_marker(out) == marker:
        return  # a concurrent maker finished first; its bytes equal ours
    old = None
    if out.exists():
        old = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".old", dir=out.parent))
        out.rename(old / "model")
    try:
        tmp.rename(out)
    except OSError:
        # A concurrent maker of the same model got there first; its bytes equal ours.
        if _read_marker(out) != marker:
            raise
    finally:
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)


def _write_json(path: Path, obj: Any, *, indent: int = 2) -> None:
    """Write `obj` as JSON with a trailing newline (stable bytes for a stable `obj`)."""
    path.write_text(json.dumps(obj, indent=indent, ensure_ascii=False) + "\n", encoding="utf-8")


def _write_model(out: Path, spec: Preset, seed: int) -> int:
    """Write tokenizer, weights and config into `out`; returns the weight bytes."""
    from mlx_lm.utils import save_config

    fam, ids = spec.fam, spec.special_ids
    _write_json(out / "generation_config.json", {
        "bos_token_id": ids[fam.bos or fam.pad or fam.eos[0]],
        "eos_token_id": [ids[t] for t in fam.eos],
        **({"pad_token_id": ids[fam.pad]} if fam.pad else {}),
    })
    # Qwen3-Embedding's tokenizer appends <|endoftext|>, the token whose hidden state is pooled.
    eos = fam.pad if spec.embedding else None
    tok = _tokenizer_json(spec.bpe_vocab, spec.vocab_size, fam.specials, fam.text_tags, fam.bos, eos)
    (out / "tokenizer.json").write_text(tok, encoding="utf-8")
    _write_json(out / "tokenizer_config.json", _tokenizer_config(spec))
    model, config = _build(spec, seed)
    nbytes = _write_weights(out, model, strip="model." if spec.embedding else "")
    save_config(config, out / "config.json")  # mirrors "quantization" into "quantization_config"
    if spec.embedding:
        _write_sentence_transformers(out, spec)
    return nbytes


def _write_sentence_transformers(out: Path, spec: Preset) -> None:
    """The sentence-transformers files that mark an embedding model, as Qwen3-Embedding ships them:
    modules.json (Transformer, Pooling, Normalize) and the Pooling module's config."""
    modules = [("0", "", "Transformer"), ("1", "1_Pooling", "Pooling"), ("2", "2_Normalize", "Normalize")]
    _write_json(out / "modules.json", [
        {"idx": i, "name": name, "path": path, "type": f"sentence_transformers.models.{kind}"}
        for i, (name, path, kind) in enumerate(modules)
    ])
    modes = ("cls_token", "mean_tokens", "max_tokens", "mean_sqrt_len_tokens", "weightedmean_tokens",
             "lasttoken")
    (out / "1_Pooling").mkdir()
    _write_json(out / "1_Pooling" / "config.json", {
        "word_embedding_dimension": _text_shape(spec)["hidden_size"],
        **{f"pooling_mode_{m}": m == spec.embedding for m in modes},
        "include_prompt": True,
    })
    _write_json(out / "config_sentence_transformers.json", {
        "prompts": {"query": "Instruct: Given a web search query, retrieve relevant passages that answer "
                             "the query\nQuery:", "document": ""},
        "default_prompt_name": None,
        "similarity_fn_name": "cosine",
    })


# ---------------------------------------------------------------- tokenizer


def _corpus() -> str:
    """The English text shipped with the package that the BPE is trained on."""
    return resources.files(__package__).joinpath("corpus.txt").read_text(encoding="utf-8")


@functools.lru_cache(maxsize=8)
def _tokenizer_json(bpe_vocab: int, vocab_size: int, specials: tuple[str, ...],
                    text_tags: tuple[str, ...] = (), bos: str | None = None, eos: str | None = None) -> str:
    """tokenizer.json text: a trained byte-level BPE, padded, then `specials` as the top ids.

    `text_tags` among the specials decode as text (special=False); `bos`, when
    given, is prepended by encode() as Llama 3 and Gemma tokenizers do; `eos`
    appended, as Qwen3-Embedding's tokenizer does.
    """
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()  # makes mlx-lm pick its BPE streaming detokenizer
    trainer = trainers.BpeTrainer(
        vocab_size=bpe_vocab, min_frequency=BPE_MIN_FREQUENCY, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=[],
    )
    tok.train_from_iterator(_corpus().split("\n\n"), trainer=trainer)
    data = json.loads(tok.to_str())
    _pad_vocab(data["model"]["vocab"], vocab_size - len(specials))
    padded = Tokenizer.from_str(json.dumps(data))
    padded.add_special_tokens(
        [AddedToken(t, special=t not in text_tags, normalized=False) for t in specials])
    if bos is not None or eos is not None:
        head, tail = (f"{bos}:0 " if bos else ""), (f" {eos}:0" if eos else "")
        pair = f"{head}$A:0{tail} {head.replace(':0', ':1')}$B:1{tail.replace(':0', ':1')}"
        padded.post_processor = processors.TemplateProcessing(
            single=f"{head}$A:0{tail}", pair=pair,
            special_tokens=[(t, padded.token_to_id(t)) for t in dict.fromkeys((bos, eos)) if t])
    if padded.get_vocab_size() != vocab_size:
        raise ValueError(f"BPE of {bpe_vocab} tokens does not fit a {vocab_size}-id vocabulary")
    return padded.to_str(pretty=True)


def _pad_vocab(vocab: dict[str, int], size: int) -> None:
    """Add plain entries until `vocab` has `size` ids, so every id the model emits decodes.

    The entries are pronounceable pseudo-words with a leading space ("Ġ"), so
    random ids decode to word-like text; no merge reaches them, so encoding is
    unchanged. Plain vocab entries load fast, unlike 150k added tokens.
    """
    words = _pseudo_words()
    while len(vocab) < size:
        word = next(words)
        if word not in vocab:
            vocab[word] = len(vocab)


def _pseudo_words() -> Iterator[str]:
    """Pseudo-words "Ġba", "Ġbe", ..., then two syllables, then three: 90 + 8,100 + 729,000."""
    syllables = [c + v for c in "bcdfghjklmnprstvwz" for v in "aeiou"]
    for n in itertools.count(1):
        for combo in itertools.product(syllables, repeat=n):
            yield "Ġ" + "".join(combo)


def _tokenizer_config(spec: Preset) -> dict[str, Any]:
    """tokenizer_config.json in the shape the family's instruct checkpoints ship it."""
    fam, ids = spec.fam, spec.special_ids
    return {
        "add_bos_token": fam.bos is not None,
        "add_prefix_space": False,
        "added_tokens_decoder": {
            str(ids[t]): {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                          "single_word": False, "special": t not in fam.text_tags}
            for t in fam.specials
        },
        "bos_token": fam.bos,
        "chat_template": fam.chat_template,
        "clean_up_tokenization_spaces": False,
        "eos_token": fam.eos[0],
        "errors": "replace",
        "model_max_length": _text_shape(spec)["max_position_embeddings"],
        "pad_token": fam.pad,
        "split_special_tokens": False,
        "tokenizer_class": fam.tokenizer_class,
        "unk_token": "<unk>" if "<unk>" in fam.specials else None,
    }


def _text_shape(spec: Preset) -> dict[str, Any]:
    """The language model's keys of `spec.config()`, nested or not."""
    cfg = spec.config()
    return dict(cfg.get("text_config", cfg))


# ---------------------------------------------------------------- weights


def _build(spec: Preset, seed: int) -> tuple[nn.Module, dict[str, Any]]:
    """The mlx-lm model for `spec` holding seeded (still lazy) weights, and its final config.

    Nothing is evaluated: the model's own random init is replaced before use,
    so this costs no memory even for the 27B shape.
    """
    from mlx.utils import tree_flatten
    from mlx_lm.utils import _get_classes, quantize_model

    config = spec.config()
    model_class, args_class = _get_classes(config)
    model = model_class(args_class.from_dict(config))
    tied = bool(_text_shape(spec).get("tie_word_embeddings"))
    keep_float = getattr(model, "cast_predicate", lambda _name: True)  # e.g. Qwen3.5's A_log stays fp32
    params = cast("list[tuple[str, mx.array]]", tree_flatten(model.parameters()))
    weights = {
        name: _draw(name, tuple(p.shape), seed=seed, dtype=spec.dtype if keep_float(name) else "float32",
                    norm_weight=spec.fam.norm_weight)
        for name, p in params
        if not (tied and name.startswith("lm_head."))  # Gemma builds a head that tied checkpoints lack
    }
    if hasattr(model, "sanitize"):
        weights = model.sanitize(weights)  # exactly what mlx_lm.load does to a checkpoint's weights
    model.load_weights(list(weights.items()))  # strict: names and shapes as mlx_lm.load expects
    if spec.quant_bits is not None:
        with contextlib.redirect_stdout(io.StringIO()):  # quantize_model prints its bits per weight
            model, config = quantize_model(model, config, spec.quant_group_size, spec.quant_bits)
    return model, config


def _draw(name: str, shape: tuple[int, ...], *, seed: int, dtype: str, norm_weight: float) -> mx.array:
    """A lazy seeded tensor for parameter `name`: constant for norms, else uniform blocks of rows."""
    import mlx.core as mx

    mx_dtype = getattr(mx, dtype)
    if name.endswith("norm.weight"):
        return mx.full(shape, norm_weight, dtype=mx_dtype)
    bound = _init_std(name, shape) * math.sqrt(3.0)  # uniform(-b, b) has standard deviation b / sqrt(3)
    rows, cols = math.prod(shape[:-1]), shape[-1]
    blocks: list[mx.array] = []
    for block, start in enumerate(range(0, rows, BLOCK_ROWS)):
        key = mx.random.key(_key_seed(seed, name, block))
        if blocks:  # draw after the previous block is cast, else MLX draws every float32 block first
            key = mx.depends(key, blocks[-1])
        part = mx.random.uniform(-bound, bound, (min(BLOCK_ROWS, rows - start), cols), key=key)
        blocks.append(part.astype(mx_dtype))  # the float32 scratch is freed once cast
    return (blocks[0] if len(blocks) == 1 else mx.concatenate(blocks)).reshape(shape)


def _init_std(name: str, shape: tuple[int, ...]) -> float:
    """Standard deviation of a (non-norm) parameter's init."""
    if len(shape) == 1 or "embed_tokens" in name or "lm_head" in name:
        return EMBED_STD  # biases, sinks, A_log, dt_bias: small, so gates and decays start near neutral
    # 1/sqrt(fan_in): with 0.02 everywhere the input token's embedding dominates the
    # residual stream and a tied head greedily echoes the same token forever.
    fan_in = math.prod(shape[1:]) if "conv" in name else shape[-1]  # MLX conv: (out, kernel, in/groups)
    return 1.0 / math.sqrt(fan_in)


def _key_seed(seed: int, name: str, block: int) -> int:
    """A 63-bit PRNG seed for one row block of one tensor, stable across runs and machines."""
    digest = hashlib.sha256(f"{seed}/{name}/{block}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def _write_weights(out: Path, model: nn.Module, *, shard_gb: int = DEFAULT_SHARD_GB, strip: str = "") -> int:
    """Write `model`'s parameters as safetensors shards and index, one tensor evaluated at a time.

    The model is emptied as it is written (mlx-lm's donate_model), so at most
    one shard of evaluated tensors is alive at once. `strip` is taken off the
    front of every name (a bare backbone's checkpoint). Returns the total bytes.
    """
    import mlx.core as mx
    from mlx.utils import tree_flatten, tree_map
    from mlx_lm.utils import get_total_parameters, make_shards

    arrays = {k.removeprefix(strip): v for k, v in tree_flatten(model.parameters())}
    total = sum(a.nbytes for a in arrays.values())
    n_params = get_total_parameters(model)
    shards = make_shards(arrays, max_file_size_gb=shard_gb)
    model.update(tree_map(lambda _: mx.array([]), model.parameters()))
    del arrays
    weight_map: dict[str, str] = {}
    n = len(shards)
    for i in range(n):
        shard, shards[i] = shards[i], {}
        fname = f"model-{i + 1:05d}-of-{n:05d}.safetensors" if n > 1 else "model.safetensors"
        for a in shard.values():
            mx.eval(a)  # one tensor's draw (and quantization) at a time
        mx.save_safetensors(str(out / fname), shard, metadata={"format": "mlx"})
        weight_map.update(dict.fromkeys(shard, fname))
        del shard
        mx.clear_cache()  # hand the shard's buffers back before drawing the next one
    index = {
        "metadata": {"total_size": total, "total_parameters": n_params},
        "weight_map": dict(sorted(weight_map.items())),
    }
    _write_json(out / "model.safetensors.index.json", index, indent=4)
    return total
