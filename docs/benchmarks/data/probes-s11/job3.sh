#!/usr/bin/env bash
# Lease 3 of session 11 (one call: poll within it): the new defaults (budget 200 on CUDA, burst_ms 2)
# against the old (MLXRT_PREFILL_BUDGET_MS=0 MLXRT_BURST_MS=0) in the harness's bursts; the agent part,
# the default against --prefill-budget-ms=0 and mlx_lm.server; the long-prompt mix's trace.
cd "$(dirname "$0")/../../../.."
L=${L:-/tmp/lease3}; mkdir -p $L
exec > >(tee -a $L/progress.txt) 2>&1
step() { echo "=== $(date +%T) $*"; }
step env; cat .gpu/b/commit; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -m pip install -q --no-index --no-deps --upgrade --target /tmp/site .gpu/b/oai/*.whl 2>&1 | tail -1
B="python3 -m benchmarks --model synthetic:qwen2.5-0.5b-4bit --part concurrency,native,mlxrt-ring,mlxrt-http --streams 16,32 --rounds 2 --no-plot"
step bursts new; timeout 170 $B --peers mlx_lm.server --json $L/bursts-new.json > $L/bursts-new.log 2>&1; echo "rc $?"
grep -v "^\[\|^20" $L/bursts-new.log | grep -E "^(mlx|native)" | cut -c1-150
step bursts old; MLXRT_PREFILL_BUDGET_MS=0 MLXRT_BURST_MS=0 timeout 130 $B --peers none --json $L/bursts-old.json > $L/bursts-old.log 2>&1; echo "rc $?"
grep -v "^\[\|^20" $L/bursts-old.log | grep -E "^(mlx|native)" | cut -c1-150
step agents; timeout 200 python3 -m benchmarks --model synthetic:qwen2.5-0.5b-4bit --part agent --agents 8 --turns 6 --reply-tokens 64 --system-words 1500 --agent-rounds 2 --peers mlx_lm.server --agent-mlxrt-args=--prefill-budget-ms=0 --no-plot --json $L/agents.json > $L/agents.log 2>&1; echo "rc $?"; grep -E " aggregate |replies identical" $L/agents.log | cut -c1-200
step mix
timeout 70 python3 docs/benchmarks/data/probes-s10/trace.py mix synthetic:llama3.1-8b-4bit 25000 200 2 > $L/mix.log 2>&1; echo "rc $?"; grep -E "^round|prefill calls|gap of" $L/mix.log
step done
