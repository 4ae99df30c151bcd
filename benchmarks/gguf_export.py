"""Export an mlx-lm Qwen2 model directory to GGUF, so llama.cpp and Ollama run the same weights.

    python -m benchmarks.gguf_export MODEL_DIR [OUT.gguf] [--dtype auto|f16|f32]

Tensors get llama.cpp's names through gguf-py's own name map (the one
llama.cpp's ``convert_hf_to_gguf.py`` uses): ``model.layers.0.self_attn.q_proj.weight``
becomes ``blk.0.attn_q.weight``, a tied ``lm_head`` is left out as llama.cpp
expects. 4-bit MLX weights are dequantized first (mlx ``dequantize`` with the
group size and bits from config.json), so the export is a float model:
``auto`` keeps float32 models in F32 and writes bfloat16, float16 and
quantized ones as F16; 1-D tensors (norms, biases) are always F32, as in
llama.cpp's own conversions. The tokenizer goes in as a gpt2-style byte-level
BPE with the ``qwen2`` pre-tokenizer: vocabulary in id order, merges, token
types (added special tokens are CONTROL), bos/eos/pad ids and the chat template.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

DTYPES = ("auto", "f16", "f32")
ARCH = "qwen2"


def _config(model_dir: Path) -> dict[str, Any]:
    cfg = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
    if cfg.get("model_type") != ARCH:
        raise ValueError(f"{model_dir}: model_type {cfg.get('model_type')!r} is not supported; only {ARCH!r}")
    return cfg


def _float_dtype(cfg: dict[str, Any], dtype: str) -> str:
    """The GGUF float type of 2-D tensors: ``f16`` or ``f32``."""
    if dtype not in DTYPES:
        raise ValueError(f"invalid dtype={dtype!r}: choose from {DTYPES}")
    if dtype != "auto":
        return dtype
    return "f32" if cfg.get("torch_dtype") == "float32" and "quantization" not in cfg else "f16"


def _quant_params(cfg: dict[str, Any], module: str) -> tuple[int, int]:
    """(group_size, bits) of one quantized module, honouring per-layer overrides in config.json."""
    q = cfg.get("quantization") or cfg.get("quantization_config") or {}
    own = q.get(module)
    if isinstance(own, dict):
        return int(own.get("group_size", q.get("group_size", 64))), int(own.get("bits", q.get("bits", 4)))
    return int(q.get("group_size", 64)), int(q.get("bits", 4))


def float_tensors(model_dir: Path, cfg: dict[str, Any]) -> Iterator[tuple[str, np.ndarray]]:
    """(mlx name, float32 numpy array) for every parameter, dequantizing 4-bit weights."""
    import mlx.core as mx

    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{model_dir} has no *.safetensors files")
    for f in files:
        arrays = mx.load(str(f))
        for name in sorted(arrays):
            if name.endswith((".scales", ".biases")) and name.rsplit(".", 1)[0] + ".weight" in arrays:
                continue  # folded into their weight below
            a = arrays[name]
            base = name.removesuffix(".weight")
            if name.endswith(".weight") and f"{base}.scales" in arrays:
                group, bits = _quant_params(cfg, base)
                a = mx.dequantize(a, arrays[f"{base}.scales"], arrays[f"{base}.biases"], group, bits)
            yield name, np.array(a.astype(mx.float32))
        del arrays


def _tokenizer(model_dir: Path, cfg: dict[str, Any]) -> dict[str, Any]:
    """Token list in id order, token types, merges and special ids, from tokenizer.json."""
    import gguf

    tj = json.loads((model_dir / "tokenizer.json").read_text(encoding="utf-8"))
    model = tj["model"]
    if model.get("type") != "BPE":
        raise ValueError(f"{model_dir}: tokenizer model {model.get('type')!r} is not BPE")
    by_id: dict[int, str] = {i: t for t, i in model["vocab"].items()}
    types: dict[int, int] = dict.fromkeys(by_id, gguf.TokenType.NORMAL)
    for added in tj.get("added_tokens", []):
        by_id[added["id"]] = added["content"]
        types[added["id"]] = gguf.TokenType.CONTROL if added.get("special") else gguf.TokenType.USER_DEFINED
    n = max(int(cfg.get("vocab_size") or 0), max(by_id) + 1)
    tokens, token_types = [], []
    for i in range(n):  # ids the embedding has but the tokenizer lacks are padding, as in convert_hf_to_gguf
        tokens.append(by_id.get(i, f"[PAD{i}]"))
        token_types.append(types.get(i, gguf.TokenType.UNUSED))
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    tc_path = model_dir / "tokenizer_config.json"
    tc = json.loads(tc_path.read_text(encoding="utf-8")) if tc_path.is_file() else {}
    vocab = {t: i for i, t in enumerate(tokens)}
    eos = cfg.get("eos_token_id")
    return {
        "tokens": tokens,
        "types": token_types,
        "merges": merges,
        "eos": eos[0] if isinstance(eos, list) else eos,
        "bos": cfg.get("bos_token_id"),
        "pad": vocab.get(tc.get("pad_token")) if isinstance(tc.get("pad_token"), str) else None,
        "add_bos": bool(tc.get("add_bos_token", False)),
        "chat_template": tc.get("chat_template") if isinstance(tc.get("chat_template"), str) else None,
    }


def export(model_dir: str | os.PathLike[str], out: str | os.PathLike[str], *, dtype: str = "auto") -> Path:
    """Write `model_dir` (an mlx-lm Qwen2 directory) as a GGUF file at `out`; return `out`."""
    import gguf

    src, dst = Path(model_dir), Path(out)
    cfg = _config(src)
    ftype = _float_dtype(cfg, dtype)
    n_layers = int(cfg["num_hidden_layers"])
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.QWEN2, n_layers)
    tok = _tokenizer(src, cfg)

    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.with_name(f".{dst.name}.{os.getpid()}.tmp")
    w = gguf.GGUFWriter(str(tmp), ARCH)
    try:
        w.add_name(src.name)
        w.add_file_type(gguf.LlamaFileType.MOSTLY_F16 if ftype == "f16" else gguf.LlamaFileType.ALL_F32)
        w.add_context_length(int(cfg["max_position_embeddings"]))
        w.add_embedding_length(int(cfg["hidden_size"]))
        w.add_block_count(n_layers)
        w.add_feed_forward_length(int(cfg["intermediate_size"]))
        w.add_head_count(int(cfg["num_attention_heads"]))
        w.add_head_count_kv(int(cfg.get("num_key_value_heads", cfg["num_attention_heads"])))
        w.add_rope_freq_base(float(cfg.get("rope_theta", 1_000_000.0)))
        w.add_layer_norm_rms_eps(float(cfg.get("rms_norm_eps", 1e-6)))
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("qwen2")
        w.add_token_list(tok["tokens"])
        w.add_token_types(tok["types"])
        w.add_token_merges(tok["merges"])
        for key, add in (
            ("bos", w.add_bos_token_id),
            ("eos", w.add_eos_token_id),
            ("pad", w.add_pad_token_id),
        ):
            if tok[key] is not None:
                add(int(tok[key]))
        w.add_add_bos_token(tok["add_bos"])
        if tok["chat_template"]:
            w.add_chat_template(tok["chat_template"])
        tied = bool(cfg.get("tie_word_embeddings"))
        for name, arr in float_tensors(src, cfg):
            if tied and name.startswith("lm_head."):
                continue  # llama.cpp reuses token_embd when output.weight is absent
            gg = names.get_name(name, try_suffixes=(".weight", ".bias"))
            if gg is None:
                raise ValueError(f"no llama.cpp name for tensor {name!r}")
            w.add_tensor(gg, arr.astype(np.float16 if ftype == "f16" and arr.ndim > 1 else np.float32))
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
    finally:
        w.close()
    os.replace(tmp, dst)
    return dst


def _signature(model_dir: Path, dtype: str) -> str:
    """Changes whenever the source files change: names, sizes and mtimes, plus the dtype."""
    h = hashlib.sha256(dtype.encode())
    for p in sorted(model_dir.iterdir()):
        if p.is_file():
            st = p.stat()
            h.update(f"{p.name}:{st.st_size}:{st.st_mtime_ns}".encode())
    return h.hexdigest()[:16]


def cache_dir() -> Path:
    """Where exports are kept: $MLXRT_GGUF_DIR, else ~/.cache/mlxrt/gguf."""
    root = os.environ.get("MLXRT_GGUF_DIR") or Path.home() / ".cache" / "mlxrt" / "gguf"
    return Path(root).expanduser()


def ensure_gguf(model_dir: str | os.PathLike[str], *, dtype: str = "auto") -> Path:
    """The cached GGUF export of `model_dir`, exported first if missing or stale."""
    src = Path(model_dir).resolve()
    out = cache_dir() / f"{src.name}-{_signature(src, dtype)}.gguf"
    return out if out.is_file() else export(src, out, dtype=dtype)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.gguf_export", description=__doc__.splitlines()[0])
    p.add_argument("model_dir")
    p.add_argument("out", nargs="?", help="output path (default: the cache, see cache_dir)")
    p.add_argument("--dtype", choices=DTYPES, default="auto")
    args = p.parse_args(argv)
    path = (
        export(args.model_dir, args.out, dtype=args.dtype)
        if args.out
        else ensure_gguf(args.model_dir, dtype=args.dtype)
    )
    print(path)


if __name__ == "__main__":
    main()
