#!/usr/bin/env bash
# Session 15, lease 2: the engine with a batched call's joining rows as views (`prefill.row_caches`) and the
# prefix cache's own copies (`kvcache.owned`), against the way before (PROBE_ROW_COPIES=1), and with 16 and
# 32 rows a prefill call, in the same paired rounds as ring, HTTP and native-batch; then the agent part,
# the prefix cache's copies against none (PROBE_NO_OWNED=1).
#   carry [".gpu/b"]: source .gpu/b/install.sh > /tmp/install.log 2>&1; setsid bash THIS >/dev/null 2>&1 </dev/null &
#   sleep 2; L=/tmp/lease7 bash docs/benchmarks/data/probes-s15/poll.sh 560
cd "$(dirname "$0")/../../../.."
L=${L:-/tmp/lease7}; mkdir -p $L
exec > >(tee -a $L/progress.txt) 2>&1
step() { echo "=== $(date +%T) $*"; }
step env; cat .gpu/b/commit; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
step compile; timeout 150 python3 docs/benchmarks/data/probes-s11/steps.py synthetic:qwen2.5-0.5b-4bit 16 0 0 200 > $L/compile.log 2>&1; echo "rc $?"
export PYTHONPATH=$PWD/docs/benchmarks/data/probes-s12/site:$PYTHONPATH
step bursts; timeout 230 python3 -m benchmarks --model synthetic:qwen2.5-0.5b-4bit --part concurrency,native,mlxrt-ring,mlxrt-http --workers 1 --streams 16,32 --rounds 2 --burst-rounds ${R:-8} --no-plot --peers none "--burst-mlxrt-args=PROBE_ROW_COPIES=1" "--burst-mlxrt-args=--prompt-concurrency 16" "--burst-mlxrt-args=--prompt-concurrency 32" --json $L/bursts-views.json > $L/bursts-views.log 2>&1; echo "rc $?"
grep -E "^(mlxrt-w1|mlxrt-http|native-batch)|quality gate" $L/bursts-views.log | cut -c1-220
step agents; timeout 200 python3 -m benchmarks --model synthetic:qwen2.5-0.5b-4bit --part agent --agents 8 --turns 6 --reply-tokens 64 --system-words 1500 --agent-rounds 3 --peers none "--agent-mlxrt-args=PROBE_NO_OWNED=1" --no-plot --json $L/agents-owned.json > $L/agents-owned.log 2>&1; echo "rc $?"; grep -E " aggregate |replies identical|same replies" $L/agents-owned.log | cut -c1-220
step pack; tar czf $L/all.tgz -C $L $(cd $L && ls -d bursts-* agents-* compile.log)
step done
