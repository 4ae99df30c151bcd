#!/usr/bin/env bash
# Lease 1 of session 11: a burst step by step in-process (native-batch against the engine, all at once and
# 1 ms apart), then session 10's job11: the long-prompt mix's trace on the grid of 9567aaa, and the agent
# part with a 200 ms budget against budget 0 (CUDA's default) and mlx_lm.server.
cd "$(dirname "$0")/../../../.."
L=${L:-/tmp/lease1}; mkdir -p $L
exec > >(tee -a $L/progress.txt) 2>&1
step() { echo "=== $(date +%T) $*"; }
step env; cat .gpu/b/commit; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -m pip install -q --no-index --no-deps --upgrade --target /tmp/site .gpu/b/oai/*.whl 2>&1 | tail -1
step steps
timeout 200 python3 docs/benchmarks/data/probes-s11/steps.py synthetic:qwen2.5-0.5b-4bit 16,32 0,1 2 > $L/steps.log 2>&1; echo "rc $?"; grep -v Warn $L/steps.log | cut -c1-250
step mix
timeout 150 python3 docs/benchmarks/data/probes-s10/trace.py mix synthetic:llama3.1-8b-4bit 25000 200 2 > $L/mix.log 2>&1; echo "rc $?"; grep -E "^round|prefill calls" $L/mix.log
step agents; timeout 260 python3 -m benchmarks --model synthetic:qwen2.5-0.5b-4bit --part agent --agents 8 --turns 6 --reply-tokens 64 --system-words 1500 --agent-rounds 2 --peers mlx_lm.server --agent-mlxrt-args=--prefill-budget-ms=200 --no-plot --json $L/agents.json > $L/agents.log 2>&1; echo "rc $?"; grep -E "aggregate|replies identical" $L/agents.log | cut -c1-200
step done
