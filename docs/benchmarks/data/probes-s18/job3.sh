#!/usr/bin/env bash
# Session 18, lease 3, second call (carry [".gpu/b"]; the first: `bash .gpu/a/stage.sh && cp -r .gpu/a/vmx
# .gpu/a/oai /root/stage/`): issue 28's agent part with session 17's engine and both peers (job2.sh's lease
# was taken back before its agent part ended).
#   source .gpu/b/install.sh > /tmp/install.log 2>&1; setsid bash THIS >/dev/null 2>&1 </dev/null &
#   sleep 2; L=/tmp/lease3 bash docs/benchmarks/data/probes-s18/poll.sh 540
cd "$(dirname "$0")/../../../.."
L=${L:-/tmp/lease3}; mkdir -p $L
exec > >(tee -a $L/progress.txt) 2>&1
step() { echo "=== $(date +%T) $*"; }
export MLXRT_COMMIT=$(cat .gpu/b/commit) MLX_PTX_CACHE_DIR=/tmp/ptx
echo $MLXRT_COMMIT > $L/commit; step env; echo "tree $MLXRT_COMMIT"; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -m pip install -q --no-index --no-deps --target /tmp/vsite /root/stage/vmx/*.whl 2>&1 | tail -1
python3 -m pip install -q --no-index --no-deps --upgrade --target /tmp/site /root/stage/oai/*.whl 2>&1 | tail -1
export MLXRT_BENCH_VLLM_MLX_SITE=/tmp/vsite MLXRT_BENCH_PEER_START_S=300
mkdir -p ~/.cache/huggingface/hub
step agents; timeout 500 python3 -m benchmarks --model synthetic:qwen2.5-0.5b-4bit --part agent --agents 8 --turns 6 --reply-tokens 64 \
  --system-words 1500 --agent-rounds ${R:-4} --peers mlx_lm.server,vllm-mlx --no-plot --json $L/agents.json > $L/agents.log 2>&1; echo "rc $?"
grep -E " aggregate |replies identical|same replies|agents: not run|skipped" $L/agents.log | cut -c1-220
step pack; tar czf $L/all.tgz -C $L $(cd $L && ls -d commit agents.* 2>/dev/null)
step done
