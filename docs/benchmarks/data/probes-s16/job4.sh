#!/usr/bin/env bash
# Session 16, lease 1, fourth call (warm; carry [".gpu/c"]): job3.sh with vllm-mlx importing at last: its site
# keeps only its own modules (pydantic from /tmp/site, .gpu/c/oai). The long-prompt mix with both peers, then
# the agent part on mlxrt serve, vllm-mlx and the in-process engine (mlx_lm.server had run in job3.sh); no bursts.
#   export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1; setsid bash THIS >/dev/null 2>&1 </dev/null &
#   sleep 2; then wait for its second "done" line in /tmp/lease4/progress.txt (a failed first try of this call,
#   run from outside the checkout, had written one)
cd "$(dirname "$0")/../../../.."
L=${L:-/tmp/lease4}; mkdir -p $L
exec > >(tee -a $L/progress.txt) 2>&1
step() { echo "=== $(date +%T) $*"; }
export MLXRT_COMMIT=$(cat /tmp/lease1/commit)
step env; echo "tree $MLXRT_COMMIT"
rm -rf /tmp/vsite/typing_extensions* /tmp/vsite/typing_inspection* /tmp/vsite/pydantic* /tmp/vsite/annotated_types*  # the host's and /tmp/site's serve
python3 -m pip install -q --no-index --no-deps --upgrade --target /tmp/site .gpu/c/oai/*.whl 2>&1 | tail -1
export MLXRT_BENCH_VLLM_MLX_SITE=/tmp/vsite
PYTHONPATH=/tmp/vsite:$PYTHONPATH python3 -c "import vllm_mlx.server; print('vllm-mlx server imports')" 2>&1 | tail -1
step mix; timeout 420 python3 -m benchmarks.interleave --model synthetic:llama3.1-8b-4bit --b-tokens 25000 --rounds 2 --out $L/interleave.json > $L/interleave.log 2>&1; echo "rc $?"
grep -E "^round|^\||skipped" $L/interleave.log | cut -c1-220
step agents; timeout 420 python3 -m benchmarks --model synthetic:qwen2.5-0.5b-4bit --part agent --agents 8 --turns 6 --reply-tokens 64 --system-words 1500 --agent-rounds ${R:-2} --peers vllm-mlx --no-plot --json $L/agents.json > $L/agents.log 2>&1; echo "rc $?"
grep -E " aggregate |replies identical|same replies|agents: not run|skipped" $L/agents.log | cut -c1-220
step pack; tar czf $L/all.tgz -C $L $(cd $L && ls -d interleave.* agents.* bursts.* 2>/dev/null)
step done
