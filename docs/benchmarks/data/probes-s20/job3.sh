#!/usr/bin/env bash
# Session 20, lease 2 again: MLX's memory after the mix, chunks beside the decode or before it (memprobe.py).
#   setsid bash THIS >/dev/null 2>&1 </dev/null & sleep 2; L=/tmp/lease3 bash docs/benchmarks/data/probes-s20/poll.sh 540
cd "$(dirname "$0")/../../../.."
L=${L:-/tmp/lease3}; mkdir -p $L
exec > >(tee -a $L/progress.txt) 2>&1
step() { echo "=== $(date +%T) $*"; }
export MLXRT_COMMIT=$(cat .gpu/b/commit) MLX_PTX_CACHE_DIR=/tmp/ptx
echo $MLXRT_COMMIT > $L/commit; step env; echo "tree $MLXRT_COMMIT"
for v in 0 1; do
  step "memprobe no-overlap=$v"
  if [ $v = 1 ]; then export PROBE_NO_OVERLAP=1; fi
  timeout 400 python3 docs/benchmarks/data/probes-s20/memprobe.py synthetic:llama3.1-8b-4bit 25000 3 2>&1 | grep -v "^\[transformers\]\|elapsed_s" | tee -a $L/mem.log
done
step pack; tar czf $L/all.tgz -C $L commit mem.log progress.txt
step done
