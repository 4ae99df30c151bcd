#!/usr/bin/env bash
# Lease 2: where the resume pause and the 16-stream burst lose their time; the eviction rerun.
cd "$(dirname "$0")/../.."
L=/tmp/lease2; mkdir -p $L
exec > >(tee -a $L/progress.txt) 2>&1
export NCCL_NVLS_ENABLE=0
step() { echo "=== $(date +%T) $*"; }
step env; cat .gpu/b/commit
step resume_probe; python3 .gpu/b/resume_probe.py qwen2.5-0.5b-4bit 2>&1 | grep -v '"level"'
step burst_probe; python3 .gpu/b/burst_probe.py qwen2.5-0.5b-4bit 512 256 16 2>&1 | grep -v '"level"'
step disk_evict; python3 -m benchmarks.disk_evict --model synthetic:qwen3-8b-4bit --sessions 6 --prefix-tokens 8000 --memory-bytes 4000000000 --rounds 1 --json $L/disk-evict.json 2>&1 | grep -v '"level"' | grep -v transformers | tail -12
step done
