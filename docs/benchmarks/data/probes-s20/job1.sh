#!/usr/bin/env bash
# Session 20, lease 1 (staged first: carry [".gpu/a"], `bash .gpu/a/stage.sh && cp -r .gpu/a/vmx .gpu/a/oai
# /root/stage/`; then this, carry [".gpu/b"]): does A's decode step overlap B's chunk on a stream of its own
# (overlap.py), an 8B shape, at three depths of B's cache and two chunk sizes.
#   source .gpu/b/install.sh > /tmp/install.log 2>&1; setsid bash THIS >/dev/null 2>&1 </dev/null &
#   sleep 2; L=/tmp/lease1 bash docs/benchmarks/data/probes-s20/poll.sh 540
cd "$(dirname "$0")/../../../.."
L=${L:-/tmp/lease1}; mkdir -p $L
exec > >(tee -a $L/progress.txt) 2>&1
step() { echo "=== $(date +%T) $*"; }
export MLXRT_COMMIT=$(cat .gpu/b/commit) MLX_PTX_CACHE_DIR=/tmp/ptx
echo $MLXRT_COMMIT > $L/commit; step env; echo "tree $MLXRT_COMMIT"; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
P=docs/benchmarks/data/probes-s20/overlap.py
for depth in 4096 12288 20480; do
  for chunk in 1024 512; do
    step "overlap depth $depth chunk $chunk"
    timeout 300 python3 $P synthetic:llama3.1-8b-4bit --depth $depth --chunk $chunk --steps 15 2>&1 | grep -v "^\[transformers\]\|elapsed_s" | tee -a $L/overlap.log
  done
done
step "overlap, A 2,048 tokens deep"
timeout 300 python3 $P synthetic:llama3.1-8b-4bit --depth 20480 --chunk 1024 --a-depth 2048 --steps 15 2>&1 | grep -v "^\[transformers\]\|elapsed_s" | tee -a $L/overlap.log
step pack; tar czf $L/all.tgz -C $L commit overlap.log progress.txt
step done
