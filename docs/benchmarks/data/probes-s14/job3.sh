#!/usr/bin/env bash
# Lease 2 of session 14 (one call): the bursts as they are, with mlx_lm.server in the same rounds and six
# paired rounds, and PROBE_READY_BREAK=1 once more (lease 1: no direction in four rounds).
cd "$(dirname "$0")/../../../.."
L=${L:-/tmp/lease2}; mkdir -p $L
exec > >(tee -a $L/progress.txt) 2>&1
step() { echo "=== $(date +%T) $*"; }
step env; cat .gpu/b/commit; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
step compile; timeout 150 python3 docs/benchmarks/data/probes-s11/steps.py synthetic:qwen2.5-0.5b-4bit 16 0 0 200 > $L/compile.log 2>&1; echo "rc $?"
export PYTHONPATH=$PWD/docs/benchmarks/data/probes-s12/site:$PYTHONPATH
step bursts; timeout ${T:-340} python3 -m benchmarks --model synthetic:qwen2.5-0.5b-4bit --part concurrency,native,mlxrt-ring,mlxrt-http --workers 1 --streams 16,32 --rounds 2 --burst-rounds ${R:-6} --no-plot --peers mlx_lm.server "--burst-mlxrt-args=PROBE_READY_BREAK=1" --json $L/bursts-six.json > $L/bursts-six.log 2>&1; echo "rc $?"
grep -E "^(mlxrt-w1|mlxrt-http|mlx_lm.server|native-batch)|quality gate" $L/bursts-six.log | cut -c1-220
step pack; tar czf $L/all.tgz -C $L $(cd $L && ls -d bursts-* compile.log)
step done
