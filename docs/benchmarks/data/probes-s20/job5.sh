#!/usr/bin/env bash
# For the next lease (written in session 20, not run yet): job2.sh's 4-round mix with both MLX peers, which
# ran out of GPU memory in its round 2 at c4bae69, twice: each chunk before the decode step
# (PROBE_NO_OVERLAP=1, probes-s20/site) and as landed, each process's GPU memory logged every 5 s.
# Staged first (carry [".gpu/a"], as job1.sh says); then, carry [".gpu/b"]:
#   source .gpu/b/install.sh > /tmp/install.log 2>&1; setsid bash THIS >/dev/null 2>&1 </dev/null &
#   sleep 2; L=/tmp/lease5 bash docs/benchmarks/data/probes-s20/poll.sh 540 off-done   (then: ... 540 done)
cd "$(dirname "$0")/../../../.."
L=${L:-/tmp/lease5}; mkdir -p $L
exec > >(tee -a $L/progress.txt) 2>&1
step() { echo "=== $(date +%T) $*"; }
export MLXRT_COMMIT=$(cat .gpu/b/commit) MLX_PTX_CACHE_DIR=/tmp/ptx
echo $MLXRT_COMMIT > $L/commit; step env; echo "tree $MLXRT_COMMIT"; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -m pip install -q --no-index --no-deps --target /tmp/vsite /root/stage/vmx/*.whl 2>&1 | tail -1
python3 -m pip install -q --no-index --no-deps --upgrade --target /tmp/site /root/stage/oai/*.whl 2>&1 | tail -1
export MLXRT_BENCH_VLLM_MLX_SITE=/tmp/vsite MLXRT_BENCH_PEER_START_S=300
mkdir -p ~/.cache/huggingface/hub
SITE=$PWD/docs/benchmarks/data/probes-s20/site
for v in off on; do
  mkdir -p $L/servers-$v; export MLXRT_BENCH_SERVER_LOGS=$L/servers-$v
  ( while true; do echo "# $(date +%T)"; nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader
      ps -eo pid,args --no-headers | grep -E "python|vllm" | grep -v grep | cut -c1-160; sleep 5; done ) > $L/gpu-mem-$v.txt 2>&1 &
  logger=$!
  step "mix overlap=$v"
  if [ $v = off ]; then P=1; else P=; fi
  PROBE_NO_OVERLAP=$P PYTHONPATH=$SITE:$PYTHONPATH timeout 1500 python3 -m benchmarks.interleave \
    --model synthetic:llama3.1-8b-4bit --b-tokens 25000 --rounds 4 --out $L/mix-$v.json > $L/mix-$v.log 2>&1
  echo "rc $?"; kill $logger
  grep -E "^round|^\||skipped|out of memory" $L/mix-$v.log | cut -c1-260
  step $v-done
done
step pack; tar czf $L/all.tgz -C $L $(cd $L && ls -d commit mix-* gpu-mem-* servers-* progress.txt)
step done
