#!/usr/bin/env bash
# Session 16, lease 1, second call (warm; carry [".gpu/c"]: the openai client's wheels, which do not fit beside
# .gpu/b): once job1.sh is done, the agent part on mlxrt serve, mlx_lm.server, vllm-mlx and the in-process engine.
#   export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1; setsid bash THIS >/dev/null 2>&1 </dev/null &
#   sleep 2; L=/tmp/lease1 bash docs/benchmarks/data/probes-s15/poll.sh 540
cd "$(dirname "$0")/../../../.."
L=${L:-/tmp/lease2}; mkdir -p $L
exec > >(tee -a $L/progress.txt) 2>&1
step() { echo "=== $(date +%T) $*"; }
export MLXRT_COMMIT=$(cat /tmp/lease1/commit)
step wait for job1; while ! grep -q "=== .* done$" /tmp/lease1/progress.txt 2>/dev/null; do sleep 3; done
python3 -m pip install -q --no-index --no-deps --upgrade --target /tmp/site .gpu/c/oai/*.whl 2>&1 | tail -1
export MLXRT_BENCH_VLLM_MLX_SITE=/tmp/vsite MLXRT_BENCH_PEER_START_S=300
step agents; timeout 500 python3 -m benchmarks --model synthetic:qwen2.5-0.5b-4bit --part agent --agents 8 --turns 6 --reply-tokens 64 --system-words 1500 --agent-rounds ${R:-2} --peers mlx_lm.server,vllm-mlx --no-plot --json $L/agents.json > $L/agents.log 2>&1; echo "rc $?"
grep -E " aggregate |replies identical|same replies|agents: not run|skipped" $L/agents.log | cut -c1-220
step pack; tar czf $L/all.tgz -C $L $(cd $L && ls -d agents.*)
step done
