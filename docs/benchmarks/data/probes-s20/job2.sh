#!/usr/bin/env bash
# Session 20, lease 2 (staged first, as job1.sh says; then this, carry [".gpu/b"]): the mix in-process with a
# long prompt's chunks beside the decode step against before it (abover.py, 6 rounds), then issue 28's mix
# over HTTP with both MLX peers (4 rounds), at this tree.
#   source .gpu/b/install.sh > /tmp/install.log 2>&1; setsid bash THIS >/dev/null 2>&1 </dev/null &
#   sleep 2; L=/tmp/lease2 bash docs/benchmarks/data/probes-s20/poll.sh 540 ab-done
cd "$(dirname "$0")/../../../.."
L=${L:-/tmp/lease2}; mkdir -p $L
exec > >(tee -a $L/progress.txt) 2>&1
step() { echo "=== $(date +%T) $*"; }
export MLXRT_COMMIT=$(cat .gpu/b/commit) MLX_PTX_CACHE_DIR=/tmp/ptx
echo $MLXRT_COMMIT > $L/commit; step env; echo "tree $MLXRT_COMMIT"; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
step ab; timeout 900 python3 docs/benchmarks/data/probes-s20/abover.py --model synthetic:llama3.1-8b-4bit \
  --b-tokens 25000 --rounds 6 --no-http --out $L/ab.json > $L/ab.log 2>&1; echo "rc $?"
grep -E "^round|^\||beside the decode" $L/ab.log | cut -c1-260
tar czf $L/ab.tgz -C $L commit ab.json ab.log
step ab-done
python3 -m pip install -q --no-index --no-deps --target /tmp/vsite /root/stage/vmx/*.whl 2>&1 | tail -1
python3 -m pip install -q --no-index --no-deps --upgrade --target /tmp/site /root/stage/oai/*.whl 2>&1 | tail -1
export MLXRT_BENCH_VLLM_MLX_SITE=/tmp/vsite MLXRT_BENCH_PEER_START_S=300 MLXRT_BENCH_SERVER_LOGS=$L/servers
mkdir -p ~/.cache/huggingface/hub $L/servers
step mix; timeout 1200 python3 -m benchmarks.interleave --model synthetic:llama3.1-8b-4bit --b-tokens 25000 --rounds 4 \
  --out $L/mix.json > $L/mix.log 2>&1; echo "rc $?"
grep -E "^round|^\||skipped" $L/mix.log | cut -c1-260
step pack; tar czf $L/all.tgz -C $L $(cd $L && ls -d commit ab.* mix.* servers 2>/dev/null)
step done
