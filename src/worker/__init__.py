"""The MLX side: the engine that generates, and the process that hosts it."""
