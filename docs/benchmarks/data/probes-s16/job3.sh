#!/usr/bin/env bash
# Session 16, lease 1, third call (warm; carry [".gpu/c"]): vllm-mlx did not start in job1.sh (the pydantic
# in its site needs typing-inspection, which this host lacks), so typing-inspection 0.4.2 and typing-extensions
# 4.15.0 (.gpu/c/vmx2) went into its site, and the long-prompt mix ran again with both peers, then the agent
# part, then the bursts. vllm-mlx still did not start (that typing-extensions lacks what the host's modules
# import), so all three ran without it: job4.sh is the run with it.
#   export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1; setsid bash THIS >/dev/null 2>&1 </dev/null &
#   sleep 2; L=/tmp/lease3 bash docs/benchmarks/data/probes-s16/poll.sh 540
cd "$(dirname "$0")/../../../.."
L=${L:-/tmp/lease3}; mkdir -p $L
exec > >(tee -a $L/progress.txt) 2>&1
step() { echo "=== $(date +%T) $*"; }
export MLXRT_COMMIT=$(cat /tmp/lease1/commit)
step env; echo "tree $MLXRT_COMMIT"
python3 -m pip install -q --no-index --no-deps --target /tmp/vsite --upgrade .gpu/c/vmx2/*.whl 2>&1 | tail -1
python3 -m pip install -q --no-index --no-deps --upgrade --target /tmp/site .gpu/c/oai/*.whl 2>&1 | tail -1
export MLXRT_BENCH_VLLM_MLX_SITE=/tmp/vsite
PYTHONPATH=/tmp/vsite:$PYTHONPATH python3 -c "import vllm_mlx.server; print('vllm-mlx server imports')" 2>&1 | tail -1
step mix; timeout 420 python3 -m benchmarks.interleave --model synthetic:llama3.1-8b-4bit --b-tokens 25000 --rounds 2 --out $L/interleave.json > $L/interleave.log 2>&1; echo "rc $?"
grep -E "^round|^\||skipped" $L/interleave.log | cut -c1-220
step agents; timeout 420 python3 -m benchmarks --model synthetic:qwen2.5-0.5b-4bit --part agent --agents 8 --turns 6 --reply-tokens 64 --system-words 1500 --agent-rounds ${R:-2} --peers mlx_lm.server,vllm-mlx --no-plot --json $L/agents.json > $L/agents.log 2>&1; echo "rc $?"
grep -E " aggregate |replies identical|same replies|agents: not run|skipped" $L/agents.log | cut -c1-220
step bursts; timeout 360 python3 -m benchmarks --model synthetic:qwen2.5-0.5b-4bit --part concurrency --workers 1 --streams 16,32 --prompt-tokens 512 --gen-tokens 256 --rounds 2 --burst-rounds 3 --no-plot --peers vllm-mlx --json $L/bursts.json > $L/bursts.log 2>&1; echo "rc $?"
grep -E "^(mlxrt-w1|mlxrt-http|native-batch|vllm)|quality gate|skipped" $L/bursts.log | cut -c1-220
step pack; tar czf $L/all.tgz -C $L $(cd $L && ls -d interleave.* agents.* bursts.* 2>/dev/null)
step done
