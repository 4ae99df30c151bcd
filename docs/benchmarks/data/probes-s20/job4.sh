#!/usr/bin/env bash
# Session 20, lease 2 again: issue 28's mix over HTTP, mlxrt alone (no peers: job2.sh's 4 rounds with both ran
# out of GPU memory in round 2), 3 rounds.
#   setsid bash THIS >/dev/null 2>&1 </dev/null & sleep 2; L=/tmp/lease4 bash docs/benchmarks/data/probes-s20/poll.sh 540
cd "$(dirname "$0")/../../../.."
L=${L:-/tmp/lease4}; mkdir -p $L
exec > >(tee -a $L/progress.txt) 2>&1
step() { echo "=== $(date +%T) $*"; }
export MLXRT_COMMIT=$(cat .gpu/b/commit) MLX_PTX_CACHE_DIR=/tmp/ptx
echo $MLXRT_COMMIT > $L/commit; step env; echo "tree $MLXRT_COMMIT"
step mix; timeout 500 python3 -m benchmarks.interleave --model synthetic:llama3.1-8b-4bit --b-tokens 25000 --rounds 3 \
  --peers none --out $L/mix.json > $L/mix.log 2>&1; echo "rc $?"
grep -E "^round|^\||skipped" $L/mix.log | cut -c1-260
# As run, the line below read `commit mix.* progress.txt`: the glob was expanded here, not in $L, so the
# tarball lost mix.json and mix.log; the rounds are in progress.txt (h200-s20-l4-mix.txt).
step pack; tar czf $L/all.tgz -C $L $(cd $L && ls -d commit mix.* progress.txt)
step done
