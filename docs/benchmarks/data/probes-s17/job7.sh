#!/usr/bin/env bash
# Session 17, lease 7, second call (carry [".gpu/b"], after `bash .gpu/a/stage.sh`): the tree as it landed (MLX's
# buffers kept between prefill calls on CUDA) against the same tree merging joining rows one by one
# (PROBE_OLD_JOIN=1): lease 3 compared the two while the buffers were still handed back after each call.
#   source .gpu/b/install.sh > /tmp/install.log 2>&1; setsid bash THIS >/dev/null 2>&1 </dev/null &
#   sleep 2; L=/tmp/lease7 bash docs/benchmarks/data/probes-s17/poll.sh 540
cd "$(dirname "$0")/../../../.."
L=${L:-/tmp/lease7}; mkdir -p $L
exec > >(tee -a $L/progress.txt) 2>&1
step() { echo "=== $(date +%T) $*"; }
export MLXRT_COMMIT=$(cat .gpu/b/commit) MLX_PTX_CACHE_DIR=/tmp/ptx
echo $MLXRT_COMMIT > $L/commit; step env; echo "tree $MLXRT_COMMIT"; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
P=docs/benchmarks/data
export PYTHONPATH=$P/probes-s17/site:$PYTHONPATH
step bursts
timeout 900 python3 -m benchmarks --model synthetic:qwen2.5-0.5b-4bit --part concurrency,native,mlxrt-http \
  --workers 1 --streams 16,32 --prompt-tokens 512 --gen-tokens 256 --rounds 2 --burst-rounds ${R:-5} --no-plot \
  --peers none --burst-mlxrt-args=PROBE_OLD_JOIN=1 --json $L/bursts.json > $L/bursts.log 2>&1; echo "rc $?"
grep -E "^(mlxrt-w1|mlxrt-http|native-batch)|quality gate|skipped" $L/bursts.log | cut -c1-220
step pack; tar czf $L/all.tgz -C $L bursts.json bursts.log
step done
