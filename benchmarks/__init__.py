"""mlxrt's benchmarks: end-to-end speed against native MLX and peers, and per-component costs."""
