#!/usr/bin/env bash
# Lease 1 of session 12 (one call): kernels compiled first; the harness's bursts with every worker traced
# (probes-s12/site); the same burst in-process, traced; the long-prompt mix over HTTP with B alone
# beside it, at the defaults of this commit.
cd "$(dirname "$0")/../../../.."
L=${L:-/tmp/lease1}; mkdir -p $L
exec > >(tee -a $L/progress.txt) 2>&1
step() { echo "=== $(date +%T) $*"; }
step env; cat .gpu/b/commit; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -m pip install -q --no-index --no-deps --upgrade --target /tmp/site .gpu/b/oai/*.whl 2>&1 | tail -1
step compile; timeout 150 python3 docs/benchmarks/data/probes-s11/steps.py synthetic:qwen2.5-0.5b-4bit 16 0 0 200 > $L/compile.log 2>&1; echo "rc $?"
SITE=$PWD/docs/benchmarks/data/probes-s12/site
step bursts; PYTHONPATH=$SITE:$PYTHONPATH MLXRT_PROBE_TRACE=$L/trace timeout 150 python3 -m benchmarks --model synthetic:qwen2.5-0.5b-4bit --part concurrency,native,mlxrt-ring,mlxrt-http --streams 16,32 --rounds 2 --no-plot --peers none --json $L/bursts.json > $L/bursts.log 2>&1; echo "rc $?"
grep -v "^\[\|^20" $L/bursts.log | grep -E "^(mlx|native)" | cut -c1-150
python3 docs/benchmarks/data/probes-s12/show.py $L/trace 16 > $L/trace-bursts.log 2>&1; grep "^==" $L/trace-bursts.log
step inprocess; PROMPT=128 GEN=128 timeout 60 python3 docs/benchmarks/data/probes-s10/trace.py burst synthetic:qwen2.5-0.5b-4bit 16 0 auto 3 > $L/inprocess.log 2>&1; echo "rc $?"; grep "^round" $L/inprocess.log
step mix; timeout 300 python3 -m benchmarks.interleave --model synthetic:llama3.1-8b-4bit --b-tokens 25000 --rounds 2 --out $L/interleave.json > $L/interleave.log 2>&1; echo "rc $?"; grep -E "^round|^\|" $L/interleave.log | cut -c1-220
step done
