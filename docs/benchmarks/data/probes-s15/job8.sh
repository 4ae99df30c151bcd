#!/usr/bin/env bash
# Session 15, lease 3, first call: the engine as it lands (prompt_concurrency on auto: the decode batch's;
# joining rows as views; the prefix cache's own copies) against 8 rows a call (the old default) and against
# the engine before (8 rows, every row copied: PROBE_ROW_COPIES=1), in the same paired rounds as native-batch.
#   carry [".gpu/b"]: source .gpu/b/install.sh > /tmp/install.log 2>&1; setsid bash THIS >/dev/null 2>&1 </dev/null &
#   sleep 2; L=/tmp/lease8 bash docs/benchmarks/data/probes-s15/poll.sh 560
cd "$(dirname "$0")/../../../.."
L=${L:-/tmp/lease8}; mkdir -p $L
exec > >(tee -a $L/progress.txt) 2>&1
step() { echo "=== $(date +%T) $*"; }
step env; cat .gpu/b/commit; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
step compile; timeout 150 python3 docs/benchmarks/data/probes-s11/steps.py synthetic:qwen2.5-0.5b-4bit 16 0 0 200 > $L/compile.log 2>&1; echo "rc $?"
export PYTHONPATH=$PWD/docs/benchmarks/data/probes-s12/site:$PYTHONPATH
step bursts; timeout 260 python3 -m benchmarks --model synthetic:qwen2.5-0.5b-4bit --part concurrency,native,mlxrt-ring,mlxrt-http --workers 1 --streams 16,32 --rounds 2 --burst-rounds ${R:-10} --no-plot --peers none "--burst-mlxrt-args=--prompt-concurrency 8" "--burst-mlxrt-args=PROBE_ROW_COPIES=1 --prompt-concurrency 8" --json $L/bursts-final.json > $L/bursts-final.log 2>&1; echo "rc $?"
grep -E "^(mlxrt-w1|mlxrt-http|native-batch)|quality gate" $L/bursts-final.log | cut -c1-220
step pack; tar czf $L/all.tgz -C $L $(cd $L && ls -d bursts-* compile.log)
step done
