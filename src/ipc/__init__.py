"""Inter-process plumbing between the orchestrator and its workers.

Nothing in this package imports MLX: it moves bytes and typed messages.
"""
