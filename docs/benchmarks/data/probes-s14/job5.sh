#!/usr/bin/env bash
# Ready for session 15's first lease (not run in session 14): the two leads for a burst's TTFT at 16 streams
# in the same paired rounds as mlxrt-w1 (ring), mlxrt-http and native-batch: 32 rows a prefill call
# (--prompt-concurrency 32; ahead of 8 in lease 3's three rounds at 32 streams), and a batched call's
# joining rows handed on as views, not copies (PROBE_ROW_VIEWS=1, probes-s12/site; extract.py).
#   carry [".gpu/b"]: source .gpu/b/install.sh > /tmp/install.log 2>&1; setsid bash THIS >/dev/null 2>&1 </dev/null &
#   sleep 2; L=/tmp/lease5 bash docs/benchmarks/data/probes-s14/poll.sh 560
cd "$(dirname "$0")/../../../.."
L=${L:-/tmp/lease5}; mkdir -p $L
exec > >(tee -a $L/progress.txt) 2>&1
step() { echo "=== $(date +%T) $*"; }
step env; cat .gpu/b/commit; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
step compile; timeout 150 python3 docs/benchmarks/data/probes-s11/steps.py synthetic:qwen2.5-0.5b-4bit 16 0 0 200 > $L/compile.log 2>&1; echo "rc $?"
export PYTHONPATH=$PWD/docs/benchmarks/data/probes-s12/site:$PYTHONPATH
step bursts; timeout ${T:-380} python3 -m benchmarks --model synthetic:qwen2.5-0.5b-4bit --part concurrency,native,mlxrt-ring,mlxrt-http --workers 1 --streams 16,32 --rounds 2 --burst-rounds ${R:-6} --no-plot --peers none "--burst-mlxrt-args=PROBE_ROW_VIEWS=1" "--burst-mlxrt-args=--prompt-concurrency 32" --json $L/bursts-leads.json > $L/bursts-leads.log 2>&1; echo "rc $?"
grep -E "^(mlxrt-w1|mlxrt-http|native-batch)|quality gate" $L/bursts-leads.log | cut -c1-220
step pack; tar czf $L/all.tgz -C $L $(cd $L && ls -d bursts-* compile.log)
step done
