"""Synthetic models for tests and benchmarks: real mlx-lm architectures with seeded random weights.

``presets`` (the catalogue, no MLX: the orchestrator reads it), ``templates``
(the families' chat templates), ``build`` (writes a model directory with MLX)
and ``variants`` (draft variants and LoRA adapters of a built model).
"""
