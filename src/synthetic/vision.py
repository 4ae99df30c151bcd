"""Synthetic vision-language models: mlx-vlm's own model classes with seeded random weights.

`build.py` writes them like the text presets (tokenizer, weights, config, marker) and adds the
image processor's preprocessor_config.json; the model is built from its config exactly as
``mlx_vlm.load`` builds it (`get_model_and_args`, `ModelConfig.from_dict`, the nested configs),
so names and shapes are those mlx-vlm expects. Needs the ``vision`` extra (mlx-vlm).
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING, Any, cast

from .presets import Preset

if TYPE_CHECKING:
    import mlx.core as mx
    import mlx.nn as nn


def build_vision(spec: Preset, seed: int) -> tuple[nn.Module, dict[str, Any]]:
    """The mlx-vlm model for vision preset `spec` holding seeded (lazy) weights, and its config."""
    from mlx.utils import tree_flatten
    from mlx_vlm.utils import get_model_and_args, update_module_configs

    from .build import _draw

    config = spec.config()
    arch, _ = get_model_and_args(copy.deepcopy(config))
    loaded = copy.deepcopy(config)  # mlx-vlm's from_dict rewrites the dict it is given
    loaded.setdefault("text_config", {})
    model_config = update_module_configs(arch.ModelConfig.from_dict(loaded), arch, loaded, ["text", "vision"])
    model = arch.Model(model_config)
    params = cast("list[tuple[str, mx.array]]", tree_flatten(model.parameters()))
    norm = spec.fam.norm_weight
    weights = {name: _draw(name, tuple(p.shape), seed=seed, dtype=spec.dtype, norm_weight=norm)
               for name, p in params}
    model.load_weights(list(weights.items()))  # strict: every parameter drawn, shapes as built
    return model, config
