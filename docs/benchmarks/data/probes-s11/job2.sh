#!/usr/bin/env bash
# Lease 2 of session 11: after the same-step first token and the half-budget rule (the grid's next
# call): a burst step by step in-process at budget 0 and 200; the long-prompt mix's trace at 200; the
# harness's bursts (ring, HTTP, mlx_lm.server) at budget 0 (CUDA's default) and 200.
cd "$(dirname "$0")/../../../.."
L=${L:-/tmp/lease2}; mkdir -p $L
exec > >(tee -a $L/progress.txt) 2>&1
step() { echo "=== $(date +%T) $*"; }
step env; cat .gpu/b/commit; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -m pip install -q --no-index --no-deps --upgrade --target /tmp/site .gpu/b/oai/*.whl 2>&1 | tail -1
step steps
timeout 240 python3 docs/benchmarks/data/probes-s11/steps.py synthetic:qwen2.5-0.5b-4bit 16,32 0,1 2 0,200 > $L/steps.log 2>&1; echo "rc $?"; grep -v Warn $L/steps.log | grep -v "^\[\|^20" | cut -c1-230
step mix
timeout 120 python3 docs/benchmarks/data/probes-s10/trace.py mix synthetic:llama3.1-8b-4bit 25000 200 2 > $L/mix.log 2>&1; echo "rc $?"; grep -E "^round|prefill calls|gap of" $L/mix.log
for b in 0 200; do
  step bursts $b
  MLXRT_PREFILL_BUDGET_MS=$b timeout 200 python3 -m benchmarks --model synthetic:qwen2.5-0.5b-4bit --part concurrency,native,mlxrt-ring,mlxrt-http --streams 16,32 --rounds 2 --peers mlx_lm.server --no-plot --json $L/bursts-$b.json > $L/bursts-$b.log 2>&1; echo "rc $?"; grep -v "^\[\|^20" $L/bursts-$b.log | tail -22 | cut -c1-200
done
step done
