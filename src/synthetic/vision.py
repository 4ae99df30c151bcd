"""Synthetic vision-language models: mlx-vlm's own model classes with seeded random weights.

`build.py` writes them like the text presets (tokenizer, weights, config, marker) and adds the
image processor's preprocessor_config.json; the model is built from its config exactly as
``mlx_vlm.load`` builds it (`get_model_and_args`, `ModelConfig.from_dict`, the nested configs),
so names and shapes are those mlx-vlm expects. A 4-bit preset is quantized as ``mlx_vlm.convert -q``
quantizes (its `quantize_model`, its default predicate): the language model only, the vision tower and
projector left in the preset's dtype. Needs the ``vision`` extra (mlx-vlm).
"""

from __future__ import annotations

import contextlib
import copy
import io
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

from .presets import Preset

if TYPE_CHECKING:
    import mlx.core as mx
    import mlx.nn as nn


def build_vision(spec: Preset, seed: int) -> tuple[nn.Module, dict[str, Any]]:
    """The mlx-vlm model for vision preset `spec` holding seeded (lazy) weights, and its final config
    ("quantization" added where the preset is 4-bit)."""
    from mlx.utils import tree_flatten

    from .build import _draw

    model, config = vision_model(spec)
    params = cast("list[tuple[str, mx.array]]", tree_flatten(model.parameters()))
    norm = spec.fam.norm_weight
    weights = {name: _draw(name, tuple(p.shape), seed=seed, dtype=spec.dtype, norm_weight=norm)
               for name, p in params}
    model.load_weights(list(weights.items()))  # strict: every parameter drawn, shapes as built
    if spec.quant_bits is not None:
        from mlx_vlm.quant_utils import quantize_model

        with contextlib.redirect_stdout(io.StringIO()):  # quantize_model prints its bits per weight
            model, config = quantize_model(model, config, spec.quant_group_size, spec.quant_bits,
                                           quant_predicate=quant_predicate(model))
    return model, config


def vision_model(spec: Preset) -> tuple[nn.Module, dict[str, Any]]:
    """mlx-vlm's model for vision preset `spec`, built from its config as ``mlx_vlm.load`` builds it, with
    the model's own initial weights (lazy: nothing is computed until they are evaluated), and its config."""
    from mlx_vlm.utils import get_model_and_args, update_module_configs

    config = spec.config()
    arch, _ = get_model_and_args(copy.deepcopy(config))
    loaded = copy.deepcopy(config)  # mlx-vlm's from_dict rewrites the dict it is given
    loaded.setdefault("text_config", {})
    model_config = update_module_configs(arch.ModelConfig.from_dict(loaded), arch, loaded, ["text", "vision"])
    return arch.Model(model_config), config


def quant_predicate(model: nn.Module) -> Callable[[str, nn.Module], bool | dict]:
    """``mlx_vlm.convert``'s default predicate for `model`: False for the vision and audio towers and
    projectors (mlx-vlm's `skip_multimodal_module`), else the model's own `quant_predicate`, else True."""
    from mlx_vlm.utils import skip_multimodal_module

    own = getattr(model, "quant_predicate", None)

    def predicate(path: str, module: nn.Module) -> bool | dict:
        if skip_multimodal_module(path):
            return False
        return own(path, module) if own is not None else True

    return predicate
