#!/usr/bin/env bash
# Lease 1 of session 14 (one call): the bursts with PROBE_READY_BREAK=1 (a step's prefill ends once a call
# leaves prompts ready, so they get their first token before the next call) as one more target in the same
# paired rounds as mlxrt-w1 (ring), mlxrt-http and native-batch (--burst-mlxrt-args, a34f10d).
cd "$(dirname "$0")/../../../.."
L=${L:-/tmp/lease1}; mkdir -p $L
exec > >(tee -a $L/progress.txt) 2>&1
step() { echo "=== $(date +%T) $*"; }
step env; cat .gpu/b/commit; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
step compile; timeout 150 python3 docs/benchmarks/data/probes-s11/steps.py synthetic:qwen2.5-0.5b-4bit 16 0 0 200 > $L/compile.log 2>&1; echo "rc $?"
export PYTHONPATH=$PWD/docs/benchmarks/data/probes-s12/site:$PYTHONPATH
step bursts; timeout ${T:-300} python3 -m benchmarks --model synthetic:qwen2.5-0.5b-4bit --part concurrency,native,mlxrt-ring,mlxrt-http --workers 1 --streams 16,32 --rounds 2 --burst-rounds ${R:-4} --no-plot --peers none "--burst-mlxrt-args=PROBE_READY_BREAK=1" --json $L/bursts-brk.json > $L/bursts-brk.log 2>&1; echo "rc $?"
grep -E "^(mlxrt-w1|mlxrt-http|native-batch)|quality gate" $L/bursts-brk.log | cut -c1-220
step pack; tar czf $L/all.tgz -C $L $(cd $L && ls -d bursts-* compile.log)
step done
