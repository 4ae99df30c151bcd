#!/usr/bin/env bash
# Lease 1: resume breakdown, disk-load paths, disk eviction rerun, 16-stream bursts.
cd "$(dirname "$0")/../.."
L=/tmp/lease1; mkdir -p $L
exec > >(tee -a $L/progress.txt) 2>&1
export NCCL_NVLS_ENABLE=0
mkdir -p ~/.cache/huggingface/hub
step() { echo "=== $(date +%T) $*"; }
step env; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; python3 -c "import mlx.core as mx, mlx_lm; print(mx.__version__, mlx_lm.__version__, mx.default_device())"; git log --oneline -1 2>/dev/null || cat .gpu/b/commit
step resume; python3 -m benchmarks.resume --model synthetic:qwen2.5-0.5b-4bit --samples 4 --spares 1 --tokens 200 --after 50 --json $L/resume.json 2>&1 | grep -v '"level"'
step loadbench; python3 .gpu/b/loadbench.py 36 8 128 16000 /tmp/kv.safetensors
step disk_evict; python3 -m benchmarks.disk_evict --model synthetic:qwen3-8b-4bit --sessions 6 --prefix-tokens 8000 --memory-bytes 4000000000 --rounds 1 --json $L/disk-evict.json 2>&1 | grep -v '"level"' | tail -30
step bursts16; python3 -m benchmarks --only concurrency --streams 16 --rounds 2 --peers mlx_lm.server --prompt-tokens 512 --gen-tokens 256 --no-plot --json $L/bursts16.json 2>&1 | grep -v '"level"' | tail -40
step done
