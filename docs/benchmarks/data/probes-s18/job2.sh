#!/usr/bin/env bash
# Session 18, lease 2 (job1.sh's host was taken back after its traced mix), second call (carry [".gpu/b"];
# the first: `bash .gpu/a/stage.sh && cp -r .gpu/a/vmx .gpu/a/oai /root/stage/`): issue 28's long-prompt mix
# with both peers over HTTP (where B's TTFT went, in-process, in the engine's targets), then the agent part
# with both peers (this host too was taken back before it ended: job3.sh ran it).
#   source .gpu/b/install.sh > /tmp/install.log 2>&1; setsid bash THIS >/dev/null 2>&1 </dev/null &
#   sleep 2; L=/tmp/lease2 bash docs/benchmarks/data/probes-s18/poll.sh 560
cd "$(dirname "$0")/../../../.."
L=${L:-/tmp/lease2}; mkdir -p $L
exec > >(tee -a $L/progress.txt) 2>&1
step() { echo "=== $(date +%T) $*"; }
export MLXRT_COMMIT=$(cat .gpu/b/commit) MLX_PTX_CACHE_DIR=/tmp/ptx
echo $MLXRT_COMMIT > $L/commit; step env; echo "tree $MLXRT_COMMIT"; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
P=docs/benchmarks/data
# vllm-mlx in a site of its own (its pinned mlx-lm); pydantic and the openai client from /tmp/site.
python3 -m pip install -q --no-index --no-deps --target /tmp/vsite /root/stage/vmx/*.whl 2>&1 | tail -1
python3 -m pip install -q --no-index --no-deps --upgrade --target /tmp/site /root/stage/oai/*.whl 2>&1 | tail -1
export MLXRT_BENCH_VLLM_MLX_SITE=/tmp/vsite MLXRT_BENCH_PEER_START_S=300
PYTHONPATH=/tmp/vsite:$PYTHONPATH python3 -c "import vllm_mlx.server, mlx_lm; print('vllm-mlx server imports; its mlx-lm', mlx_lm.__version__)" 2>&1 | tail -1
mkdir -p ~/.cache/huggingface/hub
step mix; timeout 600 python3 -m benchmarks.interleave --model synthetic:llama3.1-8b-4bit --b-tokens 25000 --rounds 2 \
  --out $L/mix.json > $L/mix.log 2>&1; echo "rc $?"
grep -E "^round|^\||skipped" $L/mix.log | cut -c1-260
step agents; timeout 900 python3 -m benchmarks --model synthetic:qwen2.5-0.5b-4bit --part agent --agents 8 --turns 6 --reply-tokens 64 \
  --system-words 1500 --agent-rounds ${R:-3} --peers mlx_lm.server,vllm-mlx --no-plot --json $L/agents.json > $L/agents.log 2>&1; echo "rc $?"
grep -E " aggregate |replies identical|same replies|agents: not run|skipped" $L/agents.log | cut -c1-220
step done
