#!/usr/bin/env bash
# Session 17, lease 6, second call (carry [".gpu/b"], after `bash .gpu/a/stage.sh`): bursts at issue 28's sizes,
# the tree as it landed (few shapes on the grid, whole calls joining, MLX's buffers kept between calls on
# CUDA) against the same tree with all three undone (probes-s17/site: the engine before session 17),
# native-batch and mlx_lm.server, paired rounds.
#   source .gpu/b/install.sh > /tmp/install.log 2>&1; setsid bash THIS >/dev/null 2>&1 </dev/null &
#   sleep 2; L=/tmp/lease6 bash docs/benchmarks/data/probes-s17/poll.sh 540
cd "$(dirname "$0")/../../../.."
L=${L:-/tmp/lease6}; mkdir -p $L
exec > >(tee -a $L/progress.txt) 2>&1
step() { echo "=== $(date +%T) $*"; }
export MLXRT_COMMIT=$(cat .gpu/b/commit) MLX_PTX_CACHE_DIR=/tmp/ptx
echo $MLXRT_COMMIT > $L/commit; step env; echo "tree $MLXRT_COMMIT"; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
P=docs/benchmarks/data
export PYTHONPATH=$P/probes-s17/site:$PYTHONPATH
mkdir -p ~/.cache/huggingface/hub; step bursts
timeout 900 python3 -m benchmarks --model synthetic:qwen2.5-0.5b-4bit --part concurrency,native,mlxrt-ring,mlxrt-http \
  --workers 1 --streams 16,32 --prompt-tokens 512 --gen-tokens 256 --rounds 2 --burst-rounds ${R:-5} --no-plot \
  --peers mlx_lm.server "--burst-mlxrt-args=PROBE_OLD_GRID=1 PROBE_OLD_JOIN=1 PROBE_CLEAR=1" --json $L/bursts.json > $L/bursts.log 2>&1; echo "rc $?"
grep -E "^(mlxrt-w1|mlxrt-http|native-batch|mlx_lm)|quality gate|skipped" $L/bursts.log | cut -c1-220
step pack; tar czf $L/all.tgz -C $L bursts.json bursts.log
step done
