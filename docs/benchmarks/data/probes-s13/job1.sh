#!/usr/bin/env bash
# Lease 1 of session 13 (one call): every prompt ready at its last token joins the batch in one call (this
# commit) against `prompt_concurrency` (8) a call as before (PROBE_JOIN_PROMPTS=1), interleaved twice: the
# harness's bursts over the ring and HTTP, every worker traced.
cd "$(dirname "$0")/../../../.."
L=${L:-/tmp/lease1}; mkdir -p $L
exec > >(tee -a $L/progress.txt) 2>&1
step() { echo "=== $(date +%T) $*"; }
step env; cat .gpu/b/commit; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -m pip install -q --no-index --no-deps --upgrade --target /tmp/site .gpu/b/oai/*.whl 2>&1 | tail -1
step compile; timeout 150 python3 docs/benchmarks/data/probes-s11/steps.py synthetic:qwen2.5-0.5b-4bit 16 0 0 200 > $L/compile.log 2>&1; echo "rc $?"
SITE=$PWD/docs/benchmarks/data/probes-s12/site
export PYTHONPATH=$SITE:$PYTHONPATH
run() {  # NAME ENV...
  local name=$1; shift
  step "$name"
  env "$@" MLXRT_PROBE_TRACE=$L/trace-$name timeout 100 python3 -m benchmarks --model synthetic:qwen2.5-0.5b-4bit --part concurrency,native,mlxrt-ring,mlxrt-http --workers 1 --streams 16,32 --rounds 2 --no-plot --peers none --json $L/bursts-$name.json > $L/bursts-$name.log 2>&1; echo "rc $?"
  grep -E "^(mlxrt-w1|mlxrt-http|native-batch) " $L/bursts-$name.log | cut -c1-150
  python3 docs/benchmarks/data/probes-s12/show.py $L/trace-$name 16 > $L/show-$name.log 2>&1; grep "^==" $L/show-$name.log | cut -c1-160
}
run all1 X=1
run eight1 PROBE_JOIN_PROMPTS=1
run all2 X=1
run eight2 PROBE_JOIN_PROMPTS=1
step pack; tar czf $L/all.tgz -C $L $(cd $L && ls -d show-* bursts-* compile.log)
step done
