#!/usr/bin/env bash
# Lease 5 of session 13 (one call): lease 4's agent part again at this commit, whose floor test walks the
# trie once (lease 4's traces: the floor's fetch spent 3.5 s against 0.27 s without it, in mlx-lm's trie
# search): mlxrt-http as is, the probe's floor 32 and floor 0, both traced, native-engine. Then one burst
# run of this commit, traced.
cd "$(dirname "$0")/../../../.."
L=${L:-/tmp/lease5}; mkdir -p $L
exec > >(tee -a $L/progress.txt) 2>&1
step() { echo "=== $(date +%T) $*"; }
step env; cat .gpu/b/commit; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -m pip install -q --no-index --no-deps --upgrade --target /tmp/site .gpu/b/oai/*.whl 2>&1 | tail -1
step compile; timeout 150 python3 docs/benchmarks/data/probes-s11/steps.py synthetic:qwen2.5-0.5b-4bit 16 0 0 200 > $L/compile.log 2>&1; echo "rc $?"
SITE=$PWD/docs/benchmarks/data/probes-s12/site
export PYTHONPATH=$SITE:$PYTHONPATH
step agents; timeout 260 python3 -m benchmarks --model synthetic:qwen2.5-0.5b-4bit --part agent --agents 8 --turns 6 --reply-tokens 64 --system-words 1500 --agent-rounds 2 --peers none "--agent-mlxrt-args=PROBE_MIN_PREFIX=32 MLXRT_PROBE_TRACE=$L/trace-a32" "--agent-mlxrt-args=PROBE_MIN_PREFIX=0 MLXRT_PROBE_TRACE=$L/trace-a0" --no-plot --json $L/agents.json > $L/agents.log 2>&1; echo "rc $?"; grep -E " aggregate |replies identical" $L/agents.log | cut -c1-200
run() {  # NAME ENV...
  local name=$1; shift
  step "$name"
  env "$@" MLXRT_PROBE_TRACE=$L/trace-$name timeout 100 python3 -m benchmarks --model synthetic:qwen2.5-0.5b-4bit --part concurrency,native,mlxrt-ring,mlxrt-http --workers 1 --streams 16,32 --rounds 2 --no-plot --peers none --json $L/bursts-$name.json > $L/bursts-$name.log 2>&1; echo "rc $?"
  grep -E "^(mlxrt-w1|mlxrt-http|native-batch) " $L/bursts-$name.log | cut -c1-150
}
run all6 X=1
step pack; tar czf $L/all.tgz -C $L $(cd $L && ls -d bursts-* agents.*); tar czf $L/traces.tgz -C $L $(cd $L && ls -d trace-*)
step done
