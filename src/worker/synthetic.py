"""Synthetic models: real mlx-lm Qwen2 architectures with seeded random weights.

No model hub is reachable from CI, so tests and benchmarks make their own
models. `make_model` writes an ordinary mlx-lm model directory that
``mlx_lm.load(path)`` loads like a downloaded checkpoint::

    config.json                      Qwen2 config (+ "quantization" for 4-bit presets)
    generation_config.json           eos ids, as Qwen2.5-Instruct ships them
    model.safetensors                or model-0000i-of-0000n.safetensors shards
    model.safetensors.index.json     weight map, as mlx_lm.utils.save_model writes it
    tokenizer.json                   byte-level BPE trained here on corpus.txt
    tokenizer_config.json            ChatML template, eos <|im_end|>, pad <|endoftext|>
    mlxrt-synthetic.json             marker: generator, preset parameters, seed

Determinism: each tensor is drawn in row blocks, every block from an MLX key
hashed from (seed, tensor name, block index), and the tokenizer trainer is
deterministic for a fixed corpus, so the same (preset, seed) gives the same
bytes on the same MLX backend. Tensors are made and written one shard at a
time, so peak memory stays near one shard even for the 7B shape.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
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
    trainers,
)

# MLX is imported where weights are drawn, so PRESETS and paths need no MLX (orchestrator side).
if TYPE_CHECKING:
    import mlx.core as mx

log = structlog.get_logger("mlxrt.worker")

MARKER_FILE = "mlxrt-synthetic.json"
FORMAT_VERSION = 1  # bump when the bytes a (preset, seed) produces change
DEFAULT_SHARD_BYTES = 1 << 30  # small shards keep peak memory low while writing
BLOCK_ROWS = 4096  # rows drawn per key: bounds the float32 scratch for big tensors
EMBED_STD = 0.02  # embeddings, untied lm_head and biases
BPE_MIN_FREQUENCY = 2
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
# Qwen2's pre-tokenizer split, so the BPE sees the same pieces a Qwen tokenizer would.
PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"""
    r"""| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
CHAT_TEMPLATE = (
    "{%- if messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if not (message['role'] == 'system' and loop.first) %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


@dataclasses.dataclass(frozen=True)
class Preset:
    """One synthetic model: Qwen2 shape, storage dtype, quantization and tokenizer size."""

    hidden_size: int
    num_hidden_layers: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int  # rows of the embedding; the tokenizer is padded to exactly this
    max_position_embeddings: int
    tie_word_embeddings: bool
    dtype: str  # mlx dtype name of the float tensors (and of the quantization scales)
    quant_bits: int | None  # None: float weights; 4: affine 4-bit like mlx_lm.convert -q
    bpe_vocab: int  # target size of the trained BPE, before padding to vocab_size
    description: str
    quant_group_size: int = 64
    rope_theta: float = 1_000_000.0
    rms_norm_eps: float = 1e-6

    @property
    def special_ids(self) -> dict[str, int]:
        """The special tokens take the top ids: endoftext, im_start, im_end."""
        first = self.vocab_size - len(SPECIAL_TOKENS)
        return {tok: first + i for i, tok in enumerate(SPECIAL_TOKENS)}

    def quantization(self) -> dict[str, Any] | None:
        """The "quantization" entry mlx-lm writes into config.json, or None."""
        if self.quant_bits is None:
            return None
        return {"group_size": self.quant_group_size, "bits": self.quant_bits, "mode": "affine"}

    def config(self) -> dict[str, Any]:
        """config.json as a Qwen2.5 checkpoint converted by mlx-lm would have it (keys sorted)."""
        ids = self.special_ids
        cfg: dict[str, Any] = {
            "architectures": ["Qwen2ForCausalLM"],
            "attention_dropout": 0.0,
            "bos_token_id": ids["<|endoftext|>"],
            "eos_token_id": ids["<|im_end|>"],
            "hidden_act": "silu",
            "hidden_size": self.hidden_size,
            "initializer_range": EMBED_STD,
            "intermediate_size": self.intermediate_size,
            "max_position_embeddings": self.max_position_embeddings,
            "max_window_layers": self.num_hidden_layers,
            "model_type": "qwen2",
            "num_attention_heads": self.num_attention_heads,
            "num_hidden_layers": self.num_hidden_layers,
            "num_key_value_heads": self.num_key_value_heads,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "sliding_window": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "torch_dtype": self.dtype,
            "use_cache": True,
            "use_sliding_window": False,
            "vocab_size": self.vocab_size,
        }
        if (quant := self.quantization()) is not None:
            # mlx_lm.utils.save_config mirrors "quantization" into "quantization_config".
            cfg["quantization"] = quant
            cfg["quantization_config"] = dict(quant)
        return dict(sorted(cfg.items()))


PRESETS: dict[str, Preset] = {
    "tiny": Preset(
        hidden_size=64, num_hidden_layers=2, intermediate_size=256,
        num_attention_heads=4, num_key_value_heads=2, vocab_size=2048,
        max_position_embeddings=512, tie_word_embeddings=True, dtype="float32",
        quant_bits=None, bpe_vocab=1024,
        description="tests: sub-ms CPU decode, 512-token context to hit limits cheaply",
    ),
    "small": Preset(
        hidden_size=256, num_hidden_layers=4, intermediate_size=1024,
        num_attention_heads=4, num_key_value_heads=2, vocab_size=8192,
        max_position_embeddings=4096, tie_word_embeddings=True, dtype="bfloat16",
        quant_bits=None, bpe_vocab=2048,
        description="CPU benchmark default: a few ms per decoded token on the MLX CPU backend",
    ),
    "qwen2.5-0.5b-4bit": Preset(
        hidden_size=896, num_hidden_layers=24, intermediate_size=4864,
        num_attention_heads=14, num_key_value_heads=2, vocab_size=151936,
        max_position_embeddings=32768, tie_word_embeddings=True, dtype="bfloat16",
        quant_bits=4, bpe_vocab=2048,
        description="Qwen2.5-0.5B shape, 4-bit group 64: the GPU benchmark default",
    ),
    "qwen2.5-7b-4bit": Preset(
        hidden_size=3584, num_hidden_layers=28, intermediate_size=18944,
        num_attention_heads=28, num_key_value_heads=4, vocab_size=152064,
        max_position_embeddings=32768, tie_word_embeddings=False, dtype="bfloat16",
        quant_bits=4, bpe_vocab=2048,
        description="Qwen2.5-7B shape, 4-bit group 64: realistic load size and memory",
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


def make_model(preset: str, out: str | os.PathLike[str], *, seed: int = 0, force: bool = False) -> Path:
    """Write a loadable mlx-lm model directory at `out` and return it.

    The same (preset, seed) writes the same bytes. If `out` already holds this
    preset and seed (per its marker file) it is returned untouched unless
    `force`. A non-empty `out` that is not a synthetic model is only replaced
    with `force`. The directory is built beside `out` and renamed into place,
    so readers never see a half-written model.
    """
    spec = get_preset(preset)
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
    return {
        "generator": "mlxrt.worker.synthetic",
        "format": FORMAT_VERSION,
        "preset": name,
        "seed": seed,
        "params": dataclasses.asdict(spec),
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
    """Write config, tokenizer and weights into `out`; returns the weight bytes."""
    _write_json(out / "config.json", spec.config(), indent=4)
    ids = spec.special_ids
    _write_json(out / "generation_config.json", {
        "bos_token_id": ids["<|endoftext|>"],
        "eos_token_id": [ids["<|im_end|>"], ids["<|endoftext|>"]],
        "pad_token_id": ids["<|endoftext|>"],
    })
    (out / "tokenizer.json").write_text(_tokenizer_json(spec.bpe_vocab, spec.vocab_size), encoding="utf-8")
    _write_json(out / "tokenizer_config.json", _tokenizer_config(spec))
    return _write_weights(out, spec, seed)


# ---------------------------------------------------------------- tokenizer


def _corpus() -> str:
    """The English text shipped with the package that the BPE is trained on."""
    return resources.files(__package__).joinpath("corpus.txt").read_text(encoding="utf-8")


@functools.lru_cache(maxsize=4)
def _tokenizer_json(bpe_vocab: int, vocab_size: int) -> str:
    """tokenizer.json text: a trained byte-level BPE padded to exactly `vocab_size` ids."""
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
    _pad_vocab(data["model"]["vocab"], vocab_size - len(SPECIAL_TOKENS))
    padded = Tokenizer.from_str(json.dumps(data))
    padded.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
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
    """tokenizer_config.json in the shape Qwen2.5-Instruct ships it."""
    ids = spec.special_ids
    return {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": {
            str(ids[t]): {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                          "single_word": False, "special": True}
            for t in SPECIAL_TOKENS
        },
        "bos_token": None,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "errors": "replace",
        "model_max_length": spec.max_position_embeddings,
        "pad_token": "<|endoftext|>",
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }


# ---------------------------------------------------------------- weights


@dataclasses.dataclass(frozen=True)
class _TensorSpec:
    """One parameter of the float model and how it is initialised and stored."""

    name: str
    shape: tuple[int, ...]
    std: float  # 0.0 means all ones (RMSNorm weights)
    quantized: bool  # stored as name.{weight,scales,biases} instead of one float tensor


def _tensor_plan(spec: Preset) -> list[_TensorSpec]:
    """Every parameter of the mlx-lm Qwen2 model for `spec`, in its own order."""
    from mlx.utils import tree_flatten
    from mlx_lm.models import qwen2

    # MLX is lazy: the model's own random init is never evaluated, so this costs no memory.
    model = qwen2.Model(qwen2.ModelArgs.from_dict(spec.config()))
    quantized = set()
    if spec.quant_bits is not None:
        # The same predicate as mlx_lm.utils.quantize_model (embeddings included).
        quantized = {
            path for path, m in model.named_modules()
            if hasattr(m, "to_quantized") and m.weight.shape[-1] % spec.quant_group_size == 0
        }
    params = cast("list[tuple[str, mx.array]]", tree_flatten(model.parameters()))
    plan = []
    for name, param in params:
        module, _, leaf = name.rpartition(".")
        shape = tuple(param.shape)
        is_quantized = leaf == "weight" and module in quantized
        plan.append(_TensorSpec(name, shape, _init_std(name, shape), is_quantized))
    return plan


def _init_std(name: str, shape: tuple[int, ...]) -> float:
    """Standard deviation of a parameter's init; 0.0 means ones."""
    if name.endswith("norm.weight"):
        return 0.0
    if name.endswith("bias") or "embed_tokens" in name or "lm_head" in name:
        return EMBED_STD
    # 1/sqrt(fan_in): with 0.02 everywhere the input token's embedding dominates the
    # residual stream and a tied head greedily echoes the same token forever.
    return 1.0 / math.sqrt(shape[-1])


def _stored_bytes(t: _TensorSpec, spec: Preset) -> int:
    """Bytes `t` takes on disk: packed uint32 weights plus scales and biases when quantized."""
    itemsize = 4 if spec.dtype == "float32" else 2
    if not t.quantized:
        return math.prod(t.shape) * itemsize
    rows, cols = t.shape
    assert spec.quant_bits is not None
    return rows * cols * spec.quant_bits // 8 + 2 * rows * (cols // spec.quant_group_size) * itemsize


def _shards(plan: list[_TensorSpec], spec: Preset, limit: int) -> list[list[_TensorSpec]]:
    """Group tensors in order into shards of at most `limit` bytes (mlx_lm's make_shards rule)."""
    shards: list[list[_TensorSpec]] = []
    size = 0
    for t in plan:
        n = _stored_bytes(t, spec)
        if not shards or size + n > limit:
            shards.append([])
            size = 0
        shards[-1].append(t)
        size += n
    return shards


def _key_seed(seed: int, name: str, block: int) -> int:
    """A 63-bit PRNG seed for one row block of one tensor, stable across runs and machines."""
    digest = hashlib.sha256(f"{seed}/{name}/{block}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def _tensor_arrays(t: _TensorSpec, spec: Preset, seed: int) -> dict[str, mx.array]:
    """The evaluated arrays stored for `t`: name -> array (three of them when quantized)."""
    import mlx.core as mx

    dtype = getattr(mx, spec.dtype)
    if t.std == 0.0:
        ones = mx.ones(t.shape, dtype=dtype)
        mx.eval(ones)
        return {t.name: ones}
    bound = t.std * math.sqrt(3.0)  # uniform(-b, b) has standard deviation b / sqrt(3)
    parts = []
    for block, start in enumerate(range(0, t.shape[0], BLOCK_ROWS)):
        shape = (min(BLOCK_ROWS, t.shape[0] - start), *t.shape[1:])
        key = mx.random.key(_key_seed(seed, t.name, block))
        x = mx.random.uniform(-bound, bound, shape, key=key).astype(dtype)
        part = mx.quantize(x, spec.quant_group_size, spec.quant_bits) if t.quantized else (x,)
        mx.eval(*part)
        parts.append(part)
    arrays = [mx.concatenate(list(p), axis=0) if len(parts) > 1 else p[0] for p in zip(*parts, strict=True)]
    mx.eval(*arrays)
    if not t.quantized:
        return {t.name: arrays[0]}
    prefix = t.name.removesuffix(".weight")
    names = (f"{prefix}.weight", f"{prefix}.scales", f"{prefix}.biases")
    return dict(zip(names, arrays, strict=True))


def _write_weights(out: Path, spec: Preset, seed: int, *, shard_bytes: int = DEFAULT_SHARD_BYTES) -> int:
    """Write safetensors shards and their index one shard at a time; returns total bytes."""
    import mlx.core as mx

    plan = _tensor_plan(spec)
    shards = _shards(plan, spec, shard_bytes)
    weight_map: dict[str, str] = {}
    total = 0
    for i, shard in enumerate(shards, start=1):
        fname = "model.safetensors" if len(shards) == 1 else f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        arrays: dict[str, mx.array] = {}
        for t in shard:
            arrays.update(_tensor_arrays(t, spec, seed))
        mx.save_safetensors(str(out / fname), arrays, metadata={"format": "mlx"})
        weight_map.update(dict.fromkeys(arrays, fname))
        total += sum(a.nbytes for a in arrays.values())
        del arrays
        mx.clear_cache()  # hand the shard's buffers back before drawing the next one
    index = {
        "metadata": {"total_size": total, "total_parameters": sum(math.prod(t.shape) for t in plan)},
        "weight_map": dict(sorted(weight_map.items())),
    }
    _write_json(out / "model.safetensors.index.json", index, indent=4)
    return total
