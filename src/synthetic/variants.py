"""Models derived from a synthetic one: draft variants and LoRA adapters, for tests and benchmarks.

Random weights make a draft model's acceptance meaningless: a random draft
agrees with a random target about as often as two dice. A *variant* of the
target makes it controllable (``synthetic:PRESET?noise=X&layers=N``):

- ``noise=0`` and no ``layers``: the target itself, every drafted token
  accepted (the mechanism's ceiling);
- ``noise=X``: every floating-point tensor (weights, quantization scales,
  norms) multiplied elementwise by ``1 + X * N(0, 1)``, seeded: the larger X,
  the fewer tokens the target accepts;
- ``layers=N``: only the first N layers kept (a truncated, cheaper draft).

The tokenizer and every other file are the target's, so the vocabulary is
shared. Shards are rewritten one at a time, so a real-shape variant needs no
more memory than one shard.

`make_adapter` writes a LoRA adapter directory in mlx-lm's format
(``adapter_config.json`` and ``adapters.safetensors``) with random non-zero
weights, so that loading it (``mlx_lm.load(path, adapter_path=...)``)
changes the model's output.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import tempfile
import time
from pathlib import Path

import mlx.core as mx
import structlog

from .build import (
    MARKER_FILE,
    _install,
    _key_seed,
    _read_marker,
    _write_json,
    ensure_synthetic,
)
from .presets import FORMAT_VERSION, SyntheticRef

log = structlog.get_logger("mlxrt.worker")

#: LoRA settings of `make_adapter`: large enough that a tiny model's greedy ids change.
ADAPTER_RANK = 4
ADAPTER_SCALE = 20.0
ADAPTER_STD = 0.1


def ensure_variant(ref: SyntheticRef) -> Path:
    """The cached variant directory for `ref`, made (with its preset) first if missing or stale."""
    base = ensure_synthetic(dataclasses.replace(ref, noise=0.0, layers=None))
    out = base.with_name(f"{base.name}-noise{ref.noise:g}-layers{ref.layers or 'all'}")
    return make_variant(base, out, noise=ref.noise, layers=ref.layers, seed=ref.seed)


def make_variant(src: str | Path, out: str | Path, *, noise: float = 0.0, layers: int | None = None,
                 seed: int = 0) -> Path:
    """Write a copy of the model directory `src` at `out`, perturbed by `noise`, cut to `layers`."""
    src, out = Path(src), Path(out).expanduser()
    marker = {"generator": "mlxrt.worker.variants", "format": FORMAT_VERSION, "source": str(src.resolve()),
              "source_marker": _read_marker(src), "noise": noise, "layers": layers, "seed": seed}
    if _read_marker(out) == marker:
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent))
    try:
        for f in src.iterdir():
            if f.is_file() and not f.name.startswith("model") and f.name not in (MARKER_FILE, "config.json"):
                shutil.copy2(f, tmp / f.name)
        config = json.loads((src / "config.json").read_text())
        _write_json(tmp / "config.json", _cut_config(config, layers))
        _write_weights(src, tmp, noise=noise, layers=layers, seed=seed)
        _write_json(tmp / MARKER_FILE, marker)
        _install(tmp, out, marker, force=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log.info("synthetic_variant.written", source=str(src), path=str(out), noise=noise, layers=layers,
             elapsed_s=round(time.perf_counter() - start, 3))
    return out


def _cut_config(config: dict, layers: int | None) -> dict:
    if layers is None:
        return config
    text = config.get("text_config", config)
    n = text["num_hidden_layers"]
    if layers > n:
        raise ValueError(f"layers={layers}: the model has only {n}")
    text["num_hidden_layers"] = layers
    if isinstance(text.get("layer_types"), list):
        text["layer_types"] = text["layer_types"][:layers]
    return config


def _layer_of(name: str) -> int | None:
    parts = name.split(".")
    for i, part in enumerate(parts[:-1]):
        if part == "layers" and parts[i + 1].isdigit():
            return int(parts[i + 1])
    return None


def _write_weights(src: Path, out: Path, *, noise: float, layers: int | None, seed: int) -> None:
    weight_map: dict[str, str] = {}
    total = 0
    for shard in sorted(src.glob("model*.safetensors")):
        weights = mx.load(str(shard))
        kept = {}
        for name, w in weights.items():
            layer = _layer_of(name)
            if layers is not None and layer is not None and layer >= layers:
                continue
            if noise and mx.issubdtype(w.dtype, mx.floating):
                key = mx.random.key(_key_seed(seed, "noise/" + name, 0))
                w = (w * (1 + noise * mx.random.normal(w.shape, key=key))).astype(w.dtype)
            kept[name] = w
        mx.eval(kept)
        mx.save_safetensors(str(out / shard.name), kept, metadata={"format": "mlx"})
        weight_map.update(dict.fromkeys(kept, shard.name))
        total += sum(w.nbytes for w in kept.values())
        del weights, kept
        mx.clear_cache()
    _write_json(out / "model.safetensors.index.json",
                {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}, indent=4)


def make_adapter(model: str | Path, out: str | Path, *, seed: int = 0, num_layers: int | None = None,
                 rank: int = ADAPTER_RANK, scale: float = ADAPTER_SCALE) -> Path:
    """Write a LoRA adapter for the model directory `model` at `out`: mlx-lm's `linear_to_lora_layers`
    on the attention projections of its last `num_layers` layers (None: all), random non-zero A and B."""
    from mlx.utils import tree_flatten
    from mlx_lm.tuner.utils import linear_to_lora_layers
    from mlx_lm.utils import load

    net, _ = load(str(model))
    n = num_layers or len(net.layers)
    params = {"rank": rank, "scale": scale, "dropout": 0.0, "keys": ["self_attn.q_proj", "self_attn.v_proj"]}
    net.freeze()
    linear_to_lora_layers(net, n, params)
    adapters = {}
    for name, w in tree_flatten(net.trainable_parameters()):
        key = mx.random.key(_key_seed(seed, "lora/" + name, 0))
        adapters[name] = (ADAPTER_STD * mx.random.normal(w.shape, key=key)).astype(w.dtype)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(out / "adapters.safetensors"), adapters)
    _write_json(out / "adapter_config.json", {"fine_tune_type": "lora", "num_layers": n,
                                               "lora_parameters": params})
    return out
