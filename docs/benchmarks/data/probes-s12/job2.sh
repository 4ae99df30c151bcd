#!/usr/bin/env bash
# Lease 2 of session 12 (one call): why a worker's prefill calls run 3-5x longer than in-process (lease 1:
# 8 rows of 127 tokens 80-147 ms in a worker, 21-30 ms in-process). The harness's ring bursts, every
# worker traced, in variants run back to back: as is; mx.clear_cache a no-op; every prompt at its last
# token joining the batch in one call; cuDNN's attention off; as is again.
cd "$(dirname "$0")/../../../.."
L=${L:-/tmp/lease2}; mkdir -p $L
exec > >(tee -a $L/progress.txt) 2>&1
step() { echo "=== $(date +%T) $*"; }
step env; cat .gpu/b/commit; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
step compile; timeout 150 python3 docs/benchmarks/data/probes-s11/steps.py synthetic:qwen2.5-0.5b-4bit 16 0 0 200 > $L/compile.log 2>&1; echo "rc $?"
SITE=$PWD/docs/benchmarks/data/probes-s12/site
run() {  # NAME ENV...
  local name=$1; shift
  step "$name"
  env "$@" PYTHONPATH=$SITE:$PYTHONPATH MLXRT_PROBE_TRACE=$L/trace-$name timeout 90 python3 -m benchmarks --model synthetic:qwen2.5-0.5b-4bit --part concurrency,native,mlxrt-ring --workers 1 --streams 16,32 --rounds 2 --no-plot --peers none --json $L/bursts-$name.json > $L/bursts-$name.log 2>&1; echo "rc $?"
  grep -E "^(mlxrt-w1|native-batch) " $L/bursts-$name.log | cut -c1-150
  python3 docs/benchmarks/data/probes-s12/show.py $L/trace-$name 16 > $L/show-$name.log 2>&1; grep "^==" $L/show-$name.log
}
run base X=1
run noclear PROBE_NO_CLEAR=1
run joinall PROBE_JOIN_ALL=1
run nocudnn MLX_CUDA_USE_CUDNN_SDPA=0
run base2 X=1
tar czf $L/traces.tgz -C $L $(cd $L && ls -d trace-*)
step done
