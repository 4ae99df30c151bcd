#!/usr/bin/env bash
# Lease 1 of session 10, second job: the agent part with the scheduler on CUDA's grid (prompts batched, as
# the code now has it) and with cuDNN's attention off, against the default (budget 0) and mlx_lm.server.
# Needs the openai wheels (.gpu/b/oai), installed by job5.sh.
cd "$(dirname "$0")/../../../.."
L=/tmp/lease1; mkdir -p $L
exec > >(tee -a $L/progress.txt) 2>&1
step() { echo "=== $(date +%T) $*"; }
step agents; timeout 540 python3 -m benchmarks --model synthetic:qwen2.5-0.5b-4bit --part agent --agents 8 --turns 6 --reply-tokens 64 --system-words 1500 --agent-rounds 2 --peers mlx_lm.server --agent-mlxrt-args=--prefill-budget-ms=200 --agent-mlxrt-args=MLX_CUDA_USE_CUDNN_SDPA=0 --no-plot --json $L/agents.json > $L/agents.log 2>&1; echo "rc $?"; grep -v '"level"' $L/agents.log | cut -c1-300 | tail -40
step done2
