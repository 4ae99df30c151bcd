#!/usr/bin/env bash
# Session 19: the agent part with both MLX peers, their servers' logs kept (MLXRT_BENCH_SERVER_LOGS: session 18's
# vllm-mlx answered a 500 and its log was not kept), 3 rounds. A fresh host: staged first as for job5.sh.
#   source .gpu/b/install.sh > /tmp/install.log 2>&1; setsid bash THIS >/dev/null 2>&1 </dev/null &
#   sleep 2; L=/tmp/lease6 bash docs/benchmarks/data/probes-s19/poll.sh 540
cd "$(dirname "$0")/../../../.."
L=${L:-/tmp/lease6}; mkdir -p $L
exec > >(tee -a $L/progress.txt) 2>&1
step() { echo "=== $(date +%T) $*"; }
export MLXRT_COMMIT=$(cat .gpu/b/commit) MLX_PTX_CACHE_DIR=/tmp/ptx
echo $MLXRT_COMMIT > $L/commit; step env; echo "tree $MLXRT_COMMIT"; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -m pip install -q --no-index --no-deps --target /tmp/vsite /root/stage/vmx/*.whl 2>&1 | tail -1
python3 -m pip install -q --no-index --no-deps --upgrade --target /tmp/site /root/stage/oai/*.whl 2>&1 | tail -1
export MLXRT_BENCH_VLLM_MLX_SITE=/tmp/vsite MLXRT_BENCH_PEER_START_S=300 MLXRT_BENCH_SERVER_LOGS=$L/servers
mkdir -p ~/.cache/huggingface/hub $L/servers
step agents; timeout 520 python3 -m benchmarks --model synthetic:qwen2.5-0.5b-4bit --part agent --agents 8 --turns 6 --reply-tokens 64 \
  --system-words 1500 --agent-rounds ${R:-3} --peers mlx_lm.server,vllm-mlx --no-plot --json $L/agents.json > $L/agents.log 2>&1; echo "rc $?"
grep -E " aggregate |replies identical|same replies|agents: not run|skipped" $L/agents.log | cut -c1-220
grep -l -E " 500 |Traceback" $L/servers/* 2>/dev/null | head; for f in $(grep -l -E "Traceback" $L/servers/* 2>/dev/null | head -2); do echo "--- $f"; grep -B2 -A25 Traceback $f | head -60; done
step pack; tar czf $L/all.tgz -C $L $(cd $L && ls -d commit agents.* servers 2>/dev/null)
step done
