#!/usr/bin/env bash
# Lease 3 of session 10, second job: the agent part with the grid sized with a build's cost, against
# budget 0 (CUDA's default) and mlx_lm.server; then bursts with the budget and without.
cd "$(dirname "$0")/../../../.."
L=/tmp/lease3; mkdir -p $L
exec > >(tee -a $L/progress.txt) 2>&1
step() { echo "=== $(date +%T) $*"; }
M=synthetic:qwen2.5-0.5b-4bit
step agents; timeout 300 python3 -m benchmarks --model $M --part agent --agents 8 --turns 6 --reply-tokens 64 --system-words 1500 --agent-rounds 2 --peers mlx_lm.server --agent-mlxrt-args=--prefill-budget-ms=200 --no-plot --json $L/agents.json > $L/agents.log 2>&1; echo "rc $?"; grep -E "aggregate|replies identical" $L/agents.log | cut -c1-200
for b in 200 0; do
  step bursts-$b
  MLXRT_PREFILL_BUDGET_MS=$b timeout 150 python3 -m benchmarks --model $M --part concurrency,native,mlxrt-ring,mlxrt-http --streams 16,32 --rounds 2 --peers none --no-plot --json $L/bursts-$b.json > $L/bursts-$b.log 2>&1; echo "rc $?"; grep -E "^(native-batch|mlxrt-w1|mlxrt-http) +(16|32) " $L/bursts-$b.log
done
step done2
