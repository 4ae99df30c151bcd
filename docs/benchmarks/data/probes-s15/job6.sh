#!/usr/bin/env bash
# Session 15, lease 1, second call (warm machine, compiled): both leads of job5 and the two together,
# in the same paired rounds as ring, HTTP and native-batch. PROBE_ROW_VIEWS was probes-s12/site's as at
# 1a4f91d (the engine's own way since c0f13bb, so the site's variant is gone).
#   export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1; setsid bash THIS >/dev/null 2>&1 </dev/null &
#   sleep 2; L=/tmp/lease6 bash docs/benchmarks/data/probes-s15/poll.sh 560
cd "$(dirname "$0")/../../../.."
L=${L:-/tmp/lease6}; mkdir -p $L
exec > >(tee -a $L/progress.txt) 2>&1
step() { echo "=== $(date +%T) $*"; }
step env; cat .gpu/b/commit; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
export PYTHONPATH=$PWD/docs/benchmarks/data/probes-s12/site:$PYTHONPATH
step bursts; timeout ${T:-480} python3 -m benchmarks --model synthetic:qwen2.5-0.5b-4bit --part concurrency,native,mlxrt-ring,mlxrt-http --workers 1 --streams 16,32 --rounds 2 --burst-rounds ${R:-10} --no-plot --peers none "--burst-mlxrt-args=PROBE_ROW_VIEWS=1" "--burst-mlxrt-args=--prompt-concurrency 32" "--burst-mlxrt-args=PROBE_ROW_VIEWS=1 --prompt-concurrency 32" --json $L/bursts-both.json > $L/bursts-both.log 2>&1; echo "rc $?"
grep -E "^(mlxrt-w1|mlxrt-http|native-batch)|quality gate" $L/bursts-both.log | cut -c1-220
step pack; tar czf $L/all.tgz -C $L $(cd $L && ls -d bursts-*)
step done
