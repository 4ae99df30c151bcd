#!/usr/bin/env bash
# Session 15, lease 3, second call (warm, compiled; carry [".gpu/c"]: the openai client's wheels, which the
# agent part needs and which do not fit beside .gpu/b in one call): the agent part, the prefix cache's own
# copies (`kvcache.owned`, as it lands) against deep copies (PROBE_NO_OWNED=1, the way before).
#   export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1; setsid bash THIS >/dev/null 2>&1 </dev/null &
#   sleep 2; L=/tmp/lease9 bash docs/benchmarks/data/probes-s15/poll.sh 560
cd "$(dirname "$0")/../../../.."
L=${L:-/tmp/lease9}; mkdir -p $L
exec > >(tee -a $L/progress.txt) 2>&1
step() { echo "=== $(date +%T) $*"; }
step env; cat .gpu/b/commit 2>/dev/null; git log -1 --format=%H 2>/dev/null; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -m pip install -q --no-index --no-deps --upgrade --target /tmp/site .gpu/c/oai/*.whl 2>&1 | tail -1
export PYTHONPATH=$PWD/docs/benchmarks/data/probes-s12/site:$PYTHONPATH
step agents; timeout 240 python3 -m benchmarks --model synthetic:qwen2.5-0.5b-4bit --part agent --agents 8 --turns 6 --reply-tokens 64 --system-words 1500 --agent-rounds ${R:-3} --peers none "--agent-mlxrt-args=PROBE_NO_OWNED=1" --no-plot --json $L/agents-owned.json > $L/agents-owned.log 2>&1; echo "rc $?"
grep -E " aggregate |replies identical|same replies|agents: not run" $L/agents-owned.log | cut -c1-220
step pack; tar czf $L/all.tgz -C $L $(cd $L && ls -d agents-*)
step done
