#!/usr/bin/env bash
# Session 21: the 3-round mix with both MLX peers, with the harness's in-process parts given a 16 GiB cache
# limit and a clear after each part (49c18ec; taken out again in 8ee4805, as it did not keep the run within
# the H200): does it now fit one H200? Each process's GPU memory is logged every 5 s, as in probes-s20/job5.sh.
# Staged first (carry [".gpu/a"], as probes-s20/job1.sh says); then, carry [".gpu/b"]:
#   source .gpu/b/install.sh > /tmp/install.log 2>&1; setsid bash THIS >/dev/null 2>&1 </dev/null &
#   sleep 2; L=/tmp/lease1 bash docs/benchmarks/data/probes-s21/poll.sh 540
cd "$(dirname "$0")/../../../.."
L=${L:-/tmp/lease1}; mkdir -p $L
exec > >(tee -a $L/progress.txt) 2>&1
step() { echo "=== $(date +%T) $*"; }
export MLXRT_COMMIT=$(cat .gpu/b/commit) MLX_PTX_CACHE_DIR=/tmp/ptx
echo $MLXRT_COMMIT > $L/commit; step env; echo "tree $MLXRT_COMMIT"; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -m pip install -q --no-index --no-deps --target /tmp/vsite /root/stage/vmx/*.whl 2>&1 | tail -1
python3 -m pip install -q --no-index --no-deps --upgrade --target /tmp/site /root/stage/oai/*.whl 2>&1 | tail -1
export MLXRT_BENCH_VLLM_MLX_SITE=/tmp/vsite MLXRT_BENCH_PEER_START_S=300
mkdir -p ~/.cache/huggingface/hub $L/servers; export MLXRT_BENCH_SERVER_LOGS=$L/servers
( while true; do echo "# $(date +%T)"; nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader
    ps -eo pid,args --no-headers | grep -E "python|vllm" | grep -v grep | cut -c1-160; sleep 5; done ) > $L/gpu-mem.txt 2>&1 &
logger=$!
step mix
timeout 1500 python3 -m benchmarks.interleave --model synthetic:llama3.1-8b-4bit --b-tokens 25000 --rounds 3 \
  --out $L/mix.json > $L/mix.log 2>&1
echo "rc $?"; kill $logger
grep -E "^round|^\||skipped|out of memory" $L/mix.log | cut -c1-260
step pack; tar czf $L/all.tgz -C $L $(cd $L && ls -d commit mix.* gpu-mem.txt servers progress.txt)
step done
