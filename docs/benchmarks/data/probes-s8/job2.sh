#!/usr/bin/env bash
# Lease 2 of session 8: eviction and restart beside vllm-mlx after the disk tier trims longer entries (issue 29).
cd "$(dirname "$0")/../.."
L=/tmp/lease1; mkdir -p $L
exec > >(tee -a $L/progress.txt) 2>&1
step() { echo "=== $(date +%T) $*"; }
step env; cat .gpu/b/commit; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -m pip install -q --no-index --no-deps --target /tmp/vsite .gpu/b/vmx/*.whl 2>&1 | tail -2
PYTHONPATH=/tmp/vsite:$PYTHONPATH python3 -c "import vllm_mlx, mlx_lm; print('vllm-mlx', vllm_mlx.__version__, 'its mlx-lm', mlx_lm.__version__)" 2>&1 | tail -1
step evict; timeout 600 python3 -m benchmarks.disk_evict --model synthetic:qwen3-8b-4bit --sessions 6 --prefix-tokens 8000 --memory-bytes 4000000000 --rounds 1 --json $L/evict.json > $L/evict.log 2>&1; echo "rc $?"; grep -v '"level"' $L/evict.log | cut -c1-300 | tail -12
step restart; MLXRT_BENCH_VLLM_MLX_SITE=/tmp/vsite MLXRT_BENCH_PEER_START_S=600 timeout 1100 python3 -m benchmarks.disk_restart --model synthetic:qwen3-8b-4bit --prefix-tokens 16000 --rounds 3 --peers vllm-mlx --json $L/restart.json > $L/restart.log 2>&1; echo "rc $?"; grep -v '"level"' $L/restart.log | cut -c1-300 | tail -30
step done
