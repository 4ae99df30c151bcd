#!/usr/bin/env bash
# Lease 3 of session 13 (one call): two more pairs of lease 1's A/B, in the order all, eight, eight, all
# (every ready prompt joins in one call, against PROBE_JOIN_PROMPTS=1), traces kept; then the agent part,
# the prefix floor against none (PROBE_MIN_PREFIX=0), two rounds more.
cd "$(dirname "$0")/../../../.."
L=${L:-/tmp/lease3}; mkdir -p $L
exec > >(tee -a $L/progress.txt) 2>&1
step() { echo "=== $(date +%T) $*"; }
step env; cat .gpu/b/commit; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -m pip install -q --no-index --no-deps --upgrade --target /tmp/site .gpu/b/oai/*.whl 2>&1 | tail -1
SITE=$PWD/docs/benchmarks/data/probes-s12/site
export PYTHONPATH=$SITE:$PYTHONPATH
run() {  # NAME ENV...
  local name=$1; shift
  step "$name"
  env "$@" MLXRT_PROBE_TRACE=$L/trace-$name timeout 100 python3 -m benchmarks --model synthetic:qwen2.5-0.5b-4bit --part concurrency,native,mlxrt-ring,mlxrt-http --workers 1 --streams 16,32 --rounds 2 --no-plot --peers none --json $L/bursts-$name.json > $L/bursts-$name.log 2>&1; echo "rc $?"
  grep -E "^(mlxrt-w1|mlxrt-http|native-batch) " $L/bursts-$name.log | cut -c1-150
  python3 docs/benchmarks/data/probes-s12/show.py $L/trace-$name 16 > $L/show-$name.log 2>&1; grep "^==" $L/show-$name.log | cut -c1-160
}
run all3 X=1
run eight3 PROBE_JOIN_PROMPTS=1
run eight4 PROBE_JOIN_PROMPTS=1
run all4 X=1
step agents; timeout 200 python3 -m benchmarks --model synthetic:qwen2.5-0.5b-4bit --part agent --agents 8 --turns 6 --reply-tokens 64 --system-words 1500 --agent-rounds 2 --peers none "--agent-mlxrt-args=PROBE_MIN_PREFIX=0" --no-plot --json $L/agents.json > $L/agents.log 2>&1; echo "rc $?"; grep -E " aggregate |replies identical" $L/agents.log | cut -c1-200
step pack; tar czf $L/all.tgz -C $L $(cd $L && ls -d show-* bursts-* agents.*); tar czf $L/traces.tgz -C $L $(cd $L && ls -d trace-*)
step done
