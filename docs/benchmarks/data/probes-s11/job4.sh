#!/usr/bin/env bash
# Lease 4 of session 11 (one call): kernels compiled first (a fresh machine's first use costs ~100 s:
# lease 3's first run died of it); the agent part, the default (budget 200 on CUDA) against
# --prefill-budget-ms=0, 3 rounds; the harness's bursts at the new defaults.
cd "$(dirname "$0")/../../../.."
L=${L:-/tmp/lease4}; mkdir -p $L
exec > >(tee -a $L/progress.txt) 2>&1
step() { echo "=== $(date +%T) $*"; }
step env; cat .gpu/b/commit; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -m pip install -q --no-index --no-deps --upgrade --target /tmp/site .gpu/b/oai/*.whl 2>&1 | tail -1
step compile; timeout 150 python3 docs/benchmarks/data/probes-s11/steps.py synthetic:qwen2.5-0.5b-4bit 16 0 0 200 > $L/compile.log 2>&1; echo "rc $?"
step agents; timeout 200 python3 -m benchmarks --model synthetic:qwen2.5-0.5b-4bit --part agent --agents 8 --turns 6 --reply-tokens 64 --system-words 1500 --agent-rounds 3 --peers none --agent-mlxrt-args=--prefill-budget-ms=0 --no-plot --json $L/agents.json > $L/agents.log 2>&1; echo "rc $?"; grep -E " aggregate |replies identical" $L/agents.log | cut -c1-200
step bursts; timeout 120 python3 -m benchmarks --model synthetic:qwen2.5-0.5b-4bit --part concurrency,native,mlxrt-ring,mlxrt-http --streams 16,32 --rounds 2 --no-plot --peers none --json $L/bursts.json > $L/bursts.log 2>&1; echo "rc $?"
grep -v "^\[\|^20" $L/bursts.log | grep -E "^(mlx|native)" | cut -c1-150
step done
