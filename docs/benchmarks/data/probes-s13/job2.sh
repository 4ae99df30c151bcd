#!/usr/bin/env bash
# Lease 2 of session 13 (one call): joinbench.py (the scheduler's prefill call and the join, by rows); one
# harness burst run traced with the GC's pauses and each admission's parts; the same with gc.freeze
# (PROBE_GC_FREEZE=1); then the agent part, the prefix floor (this commit) against none (PROBE_MIN_PREFIX=0).
cd "$(dirname "$0")/../../../.."
L=${L:-/tmp/lease2}; mkdir -p $L
exec > >(tee -a $L/progress.txt) 2>&1
step() { echo "=== $(date +%T) $*"; }
step env; cat .gpu/b/commit; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -m pip install -q --no-index --no-deps --upgrade --target /tmp/site .gpu/b/oai/*.whl 2>&1 | tail -1
step compile; timeout 150 python3 docs/benchmarks/data/probes-s11/steps.py synthetic:qwen2.5-0.5b-4bit 16 0 0 200 > $L/compile.log 2>&1; echo "rc $?"
step joinbench; timeout 90 python3 docs/benchmarks/data/probes-s13/joinbench.py synthetic:qwen2.5-0.5b-4bit 8,8,16,16,32,32,13,13,27,27,32,8,4,4,2,2 2>&1 | tee $L/joinbench.log | grep -v Warn
SITE=$PWD/docs/benchmarks/data/probes-s12/site
export PYTHONPATH=$SITE:$PYTHONPATH
run() {  # NAME ENV...
  local name=$1; shift
  step "$name"
  env "$@" MLXRT_PROBE_TRACE=$L/trace-$name timeout 100 python3 -m benchmarks --model synthetic:qwen2.5-0.5b-4bit --part concurrency,native,mlxrt-ring,mlxrt-http --workers 1 --streams 16,32 --rounds 2 --no-plot --peers none --json $L/bursts-$name.json > $L/bursts-$name.log 2>&1; echo "rc $?"
  grep -E "^(mlxrt-w1|mlxrt-http|native-batch) " $L/bursts-$name.log | cut -c1-150
  python3 docs/benchmarks/data/probes-s12/show.py $L/trace-$name 16 > $L/show-$name.log 2>&1; grep "^==" $L/show-$name.log | cut -c1-160
  grep -E "^==| gc " $L/show-$name.log | grep -B1 " gc " | cut -c1-120 | head -30
}
run gc X=1
run freeze PROBE_GC_FREEZE=1
step agents; timeout 170 python3 -m benchmarks --model synthetic:qwen2.5-0.5b-4bit --part agent --agents 8 --turns 6 --reply-tokens 64 --system-words 1500 --agent-rounds 2 --peers none "--agent-mlxrt-args=PROBE_MIN_PREFIX=0" --no-plot --json $L/agents.json > $L/agents.log 2>&1; echo "rc $?"; grep -E " aggregate |replies identical" $L/agents.log | cut -c1-200
step pack; tar czf $L/all.tgz -C $L $(cd $L && ls -d show-* bursts-* agents.* joinbench.log compile.log)
step done
