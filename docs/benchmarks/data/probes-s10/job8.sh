#!/usr/bin/env bash
# Lease 2 of session 10: the resumed stream's pause with the death noticed from the exited process
# (handle.exit_status), and traces of where a step's time goes: bursts and the long-prompt mix (trace.py).
cd "$(dirname "$0")/../../../.."
L=/tmp/lease2; mkdir -p $L
exec > >(tee -a $L/progress.txt) 2>&1
step() { echo "=== $(date +%T) $*"; }
M=synthetic:qwen2.5-0.5b-4bit
step env; cat .gpu/b/commit; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
step resume
MLXRT_LOG_LEVEL=info timeout 240 python3 -m benchmarks.resume --model $M --samples 6 --spares 1 --tokens 200 --after 50 --json $L/resume.json > $L/resume.log 2> $L/resume.err; echo "rc $?"; grep -v '"level"' $L/resume.log | tail -9 | cut -c1-300
for b in auto 200; do
  step burst-$b
  timeout 150 python3 docs/benchmarks/data/probes-s10/trace.py burst $M 16 1 $b 3 > $L/burst-$b.log 2>&1; echo "rc $?"; grep -v '"level"' $L/burst-$b.log | grep "^round"
done
step mix
timeout 300 python3 docs/benchmarks/data/probes-s10/trace.py mix synthetic:llama3.1-8b-4bit 25000 200 2 > $L/mix.log 2>&1; echo "rc $?"; grep -v '"level"' $L/mix.log | grep -v "^ " | head
step done
