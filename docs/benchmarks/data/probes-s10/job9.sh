#!/usr/bin/env bash
# Lease 3 of session 10: the grid sized with a build's cost (ChunkSizer: BUILD_MS, a segment that fits
# goes whole), on the long-prompt mix (8B shape; MLXRT_PREFILL_BUDGET_MS=200 makes mlxrt serve's budget
# 200, as the in-process engine's), then its trace.
cd "$(dirname "$0")/../../../.."
L=/tmp/lease3; mkdir -p $L
exec > >(tee -a $L/progress.txt) 2>&1
step() { echo "=== $(date +%T) $*"; }
step env; cat .gpu/b/commit; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -m pip install -q --no-index --no-deps --upgrade --target /tmp/site .gpu/b/oai/*.whl 2>&1 | tail -1
step interleave
MLXRT_PREFILL_BUDGET_MS=200 timeout 420 python3 -m benchmarks.interleave --model synthetic:llama3.1-8b-4bit --b-tokens 25000 --rounds 2 --out $L/interleave.json > $L/interleave.log 2>&1; echo "rc $?"; grep -v '"level"' $L/interleave.log | grep -v transformers | cut -c1-250 | tail -22
step mix
timeout 120 python3 docs/benchmarks/data/probes-s10/trace.py mix synthetic:llama3.1-8b-4bit 25000 200 2 > $L/mix.log 2>&1; echo "rc $?"; grep -E "^round|prefill calls" $L/mix.log
step done
