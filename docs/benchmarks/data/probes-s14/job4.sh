#!/usr/bin/env bash
# Lease 3 of session 14 (one call): the scheduler's rows per prefill call (--prompt-concurrency, 8 by
# default, as mlx-lm's prefill_batch_size) at 16 and 32 against 8, in the same paired rounds as mlxrt-w1
# (ring), mlxrt-http and native-batch. Leases 1-2: at 16 streams a burst's TTFT was 1.15-1.43x
# native-batch's; every prompt of a 16-burst gets its first token after two calls of 8 rows.
cd "$(dirname "$0")/../../../.."
L=${L:-/tmp/lease3}; mkdir -p $L
exec > >(tee -a $L/progress.txt) 2>&1
step() { echo "=== $(date +%T) $*"; }
step env; cat .gpu/b/commit; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
[ -z "$NO_COMPILE" ] && step compile && timeout 150 python3 docs/benchmarks/data/probes-s11/steps.py synthetic:qwen2.5-0.5b-4bit 16 0 0 200 > $L/compile.log 2>&1 && echo "rc $?"
step bursts; timeout ${T:-340} python3 -m benchmarks --model synthetic:qwen2.5-0.5b-4bit --part ${PART:-concurrency,native,mlxrt-ring,mlxrt-http} --workers 1 --streams 16,32 --rounds 2 --burst-rounds ${R:-5} --no-plot --peers none "--burst-mlxrt-args=--prompt-concurrency 16" "--burst-mlxrt-args=--prompt-concurrency 32" --json $L/bursts-pc.json > $L/bursts-pc.log 2>&1; echo "rc $?"
grep -E "^(mlxrt-w1|mlxrt-http|native-batch)|quality gate" $L/bursts-pc.log | cut -c1-220
step pack; tar czf $L/all.tgz -C $L $(cd $L && ls -d bursts-* compile.log 2>/dev/null)
step done
