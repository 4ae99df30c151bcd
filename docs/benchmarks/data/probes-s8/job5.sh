#!/usr/bin/env bash
# Lease 5 of session 8, two GPUs: a worker group over NCCL after the wake-up semaphore (issue 30's fix):
# an idle group's CPU per rank, the group study's speed part.
cd "$(dirname "$0")/../.."
L=/tmp/lease1; mkdir -p $L
exec > >(tee -a $L/progress.txt) 2>&1
export NCCL_NVLS_ENABLE=0
step() { echo "=== $(date +%T) $*"; }
step env; cat .gpu/b/commit; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
step idle-nccl; timeout 240 python3 docs/benchmarks/data/probes-s8/idle_group.py nccl 2>&1 | grep -v '"level"' | tail -4
step group-speed; timeout 300 python3 -m benchmarks.group --model synthetic:qwen2.5-0.5b-4bit --backend nccl --sharding tensor --ranks 1,2 --batch 8 --rounds 2 --only speed --json $L/group.json > $L/group.log 2>&1; echo "rc $?"; grep -v '"level"' $L/group.log | cut -c1-250 | tail -12
step done
