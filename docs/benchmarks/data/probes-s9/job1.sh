#!/usr/bin/env bash
# Lease 1 of session 9 (issue 28): what a first-met prefill chunk shape costs on CUDA (cuDNN's attention
# graphs), then the long-prompt mix with the scheduler back on, its chunks on the grid and off it, then
# bursts of 16 and 32 streams, then the probe without cuDNN attention.
cd "$(dirname "$0")/../../../.."
L=/tmp/lease1; mkdir -p $L
exec > >(tee -a $L/progress.txt) 2>&1
step() { echo "=== $(date +%T) $*"; }
step env; cat .gpu/b/commit; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
step shapes; timeout 420 python3 -m benchmarks.chunk_shapes synthetic:llama3.1-8b-4bit --tokens 25000 --json $L/shapes.json > $L/shapes.log 2>&1; echo "rc $?"; grep -v '"level"' $L/shapes.log | cut -c1-400 | tail -20
step interleave; timeout 900 python3 -m benchmarks.interleave --model synthetic:llama3.1-8b-4bit --b-tokens 25000 --rounds 2 --out $L/interleave.json > $L/interleave.log 2>&1; echo "rc $?"; grep -v '"level"' $L/interleave.log | cut -c1-300 | tail -24
step bursts; timeout 600 python3 -m benchmarks --model synthetic:qwen2.5-0.5b-4bit --part concurrency --streams 16,32 --rounds 2 --peers mlx_lm.server --no-plot --json $L/bursts.json > $L/bursts.log 2>&1; echo "rc $?"; grep -v '"level"' $L/bursts.log | cut -c1-300 | tail -30
step shapes-nocudnn; MLX_CUDA_USE_CUDNN_SDPA=0 timeout 300 python3 -m benchmarks.chunk_shapes synthetic:llama3.1-8b-4bit --tokens 25000 --parts stepped,short,batch --json $L/shapes-nocudnn.json > $L/shapes-nocudnn.log 2>&1; echo "rc $?"; grep -v '"level"' $L/shapes-nocudnn.log | cut -c1-400 | tail -14
step done
