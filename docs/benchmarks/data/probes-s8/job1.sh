#!/usr/bin/env bash
# Lease 1 of session 8, as run at 7a26cdf: the 3B vision figure (issue 31), eviction after the
# pop_prefixes fix, and the restart beside vllm-mlx (issue 29). The restart step did not finish: the
# lease went back while it ran; job2.sh ran it again.
cd "$(dirname "$0")/../.."
L=/tmp/lease1; mkdir -p $L
exec > >(tee -a $L/progress.txt) 2>&1
step() { echo "=== $(date +%T) $*"; }
step env; cat .gpu/b/commit; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -m pip install -q --no-index --no-deps --target /tmp/site /root/stage/vlm/*.whl 2>&1 | tail -2
python3 -m pip install -q --no-index --no-deps --target /tmp/vsite .gpu/b/vmx/*.whl 2>&1 | tail -2
step vision; timeout 420 python3 -m benchmarks.vision --model synthetic:qwen2.5-vl-3b-4bit --rounds 5 --tokens 64 --json $L/vision.json > $L/vision.log 2>&1; echo "rc $?"; grep -v '"level"' $L/vision.log | cut -c1-300 | tail -30
step evict; timeout 600 python3 -m benchmarks.disk_evict --model synthetic:qwen3-8b-4bit --sessions 6 --prefix-tokens 8000 --memory-bytes 4000000000 --rounds 1 --json $L/evict.json > $L/evict.log 2>&1; echo "rc $?"; grep -v '"level"' $L/evict.log | cut -c1-300 | tail -30
step restart; MLXRT_BENCH_VLLM_MLX_SITE=/tmp/vsite MLXRT_BENCH_PEER_START_S=600 timeout 1200 python3 -m benchmarks.disk_restart --model synthetic:qwen3-8b-4bit --prefix-tokens 16000 --rounds 3 --peers vllm-mlx --json $L/restart.json > $L/restart.log 2>&1; echo "rc $?"; grep -v '"level"' $L/restart.log | cut -c1-300 | tail -30
step done
