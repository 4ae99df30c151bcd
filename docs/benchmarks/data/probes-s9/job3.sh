#!/usr/bin/env bash
# Lease 3 of session 9: the agent part with the scheduler now on by default on CUDA (grid), against
# budget 0 (mlx-lm's prefill, last session's CUDA default) and mlx_lm.server, interleaved (issue 28).
cd "$(dirname "$0")/../../../.."
L=/tmp/lease1; mkdir -p $L
exec > >(tee -a $L/progress.txt) 2>&1
step() { echo "=== $(date +%T) $*"; }
step env; cat .gpu/b/commit; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -m pip install -q --no-index --no-deps --upgrade --target /tmp/site .gpu/b/oai/*.whl 2>&1 | tail -1
step agents; timeout 560 python3 -m benchmarks --model synthetic:qwen2.5-0.5b-4bit --part agent --agents 8 --turns 6 --reply-tokens 64 --system-words 1500 --agent-rounds 2 --peers mlx_lm.server --agent-mlxrt-args=--prefill-budget-ms=0 --no-plot --json $L/agents.json > $L/agents.log 2>&1; echo "rc $?"; grep -v '"level"' $L/agents.log | cut -c1-300 | tail -40
step done
