#!/usr/bin/env bash
# Lease 3 of session 12 (one call): the prefix cache's floor (MIN_PREFIX_TOKENS 32, this commit) against
# the old behaviour (any prefix served, PROBE_MIN_PREFIX=0), interleaved twice: the harness's bursts over
# the ring and HTTP, every worker traced.
cd "$(dirname "$0")/../../../.."
L=${L:-/tmp/lease3}; mkdir -p $L
exec > >(tee -a $L/progress.txt) 2>&1
step() { echo "=== $(date +%T) $*"; }
step env; cat .gpu/b/commit; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -m pip install -q --no-index --no-deps --upgrade --target /tmp/site .gpu/b/oai/*.whl 2>&1 | tail -1
step compile; timeout 150 python3 docs/benchmarks/data/probes-s11/steps.py synthetic:qwen2.5-0.5b-4bit 16 0 0 200 > $L/compile.log 2>&1; echo "rc $?"
SITE=$PWD/docs/benchmarks/data/probes-s12/site
run() {  # NAME ENV...
  local name=$1; shift
  step "$name"
  env "$@" PYTHONPATH=$SITE:$PYTHONPATH MLXRT_PROBE_TRACE=$L/trace-$name timeout 100 python3 -m benchmarks --model synthetic:qwen2.5-0.5b-4bit --part concurrency,native,mlxrt-ring,mlxrt-http --workers 1 --streams 16,32 --rounds 2 --no-plot --peers none --json $L/bursts-$name.json > $L/bursts-$name.log 2>&1; echo "rc $?"
  grep -E "^(mlxrt-w1|mlxrt-http|native-batch) " $L/bursts-$name.log | cut -c1-150
  python3 docs/benchmarks/data/probes-s12/show.py $L/trace-$name 16 > $L/show-$name.log 2>&1; grep "^==" $L/show-$name.log
}
run floor1 X=1
run any1 PROBE_MIN_PREFIX=0
run floor2 X=1
run any2 PROBE_MIN_PREFIX=0
step pack; tar czf $L/all.tgz -C $L $(cd $L && ls -d trace-* bursts-* show-* compile.log)
step done
