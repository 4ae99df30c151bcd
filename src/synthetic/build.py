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

from .presets import EMBED_STD, FORMAT_VERSION, Preset, SyntheticRef, default_model_dir, get_preset, resized

# MLX is imported where weights are drawn, so writing a tokenizer or a marker needs none.
if TYPE_CHECKING:
    import mlx.core as mx
    import mlx.nn as nn

log = structlog.get_logger("mlxrt.worker")

MARKER_FILE = "mlxrt-synthetic.json"
DEFAULT_SHARD_GB = 1  # mlx_lm.utils.make_shards limit; small shards keep peak memory low
BLOCK_ROWS = 4096  # rows drawn per key: bounds the float32 scratch for big tensors
BPE_MIN_FREQUENCY = 2
# Qwen2's pre-tokenizer split, so the BPE sees the same pieces a Qwen tokenizer would.
PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"""
    r"""| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)


def ensure_model(preset: str, seed: int = 0) -> Path:
    """The cached model directory for (preset, seed), made first if missing or stale."""
    return make_model(preset, default_model_dir(preset, seed), seed=seed)


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
    """The model `make_model` would write for (preset, seed), unevaluated, and its config: mlx-lm's
    classes, or mlx-vlm's for a vision preset.

    Costs no memory until its parameters are evaluated, so real shapes can be
    checked on a small machine.
    """
    return _build_any(get_preset(preset), seed)


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
    spec = resized(get_preset(preset), vocab_size=vocab_size, context=context)
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
    for added in ("embedding", "vision", "image_processor"):
        if params[added] is None:
            del params[added]  # added later: other models' markers stay as they were
    return {
        "generator": "mlxrt.worker.synthetic",  # the module's first name: kept, so caches stay valid
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
    model, config = _build_any(spec, seed)
    if spec.vision is not None:  # a vision-language model: its image processor
        _write_json(out / "preprocessor_config.json", spec.image_processor)
        tokens = _text_shape(spec).get("mm_tokens_per_image")
        if tokens is not None:  # Gemma 3: the processor's soft tokens an image (else 256)
            kind = spec.image_processor["processor_class"]
            _write_json(out / "processor_config.json", {"image_seq_length": tokens, "processor_class": kind})
    nbytes = _write_weights(out, model, strip="model." if spec.embedding else "")
    # mirrors "quantization" into "quantization_config"
    save_config(config, out / "config.json", keep_vision_config=spec.vision is not None)
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
        **({"extra_special_tokens": fam.extra_special_tokens} if fam.extra_special_tokens else {}),
    }


def _text_shape(spec: Preset) -> dict[str, Any]:
    """The language model's keys of `spec.config()`, nested or not."""
    cfg = spec.config()
    return dict(cfg.get("text_config", cfg))


# ---------------------------------------------------------------- weights


def _build_any(spec: Preset, seed: int) -> tuple[nn.Module, dict[str, Any]]:
    """`_build`, or `vision.build_vision` (mlx-vlm's classes) for a vision preset."""
    if spec.vision is not None:
        from .vision import build_vision

        return build_vision(spec, seed)
    return _build(spec, seed)


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
