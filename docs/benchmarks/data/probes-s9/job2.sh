#!/usr/bin/env bash
# Lease 2 of session 9: bursts with prompts prefilled alone on the grid (issue 28), one sequence's decode
# with CUDA's decode-graph warm-up, and a SIGKILLed stream's pause with a spare (issue 29).
cd "$(dirname "$0")/../../../.."
L=/tmp/lease1; mkdir -p $L
exec > >(tee -a $L/progress.txt) 2>&1
step() { echo "=== $(date +%T) $*"; }
step env; cat .gpu/b/commit; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
step bursts; timeout 600 python3 -m benchmarks --model synthetic:qwen2.5-0.5b-4bit --part concurrency --streams 16,32 --rounds 2 --peers mlx_lm.server --no-plot --json $L/bursts.json > $L/bursts.log 2>&1; echo "rc $?"; grep -v '"level"' $L/bursts.log | cut -c1-300 | tail -24
step shapes; timeout 300 python3 -m benchmarks.chunk_shapes synthetic:qwen2.5-0.5b-4bit --parts decode,short,batch --json $L/shapes.json > $L/shapes.log 2>&1; echo "rc $?"; grep -v '"level"' $L/shapes.log | cut -c1-400 | tail -6
step resume; timeout 400 python3 -m benchmarks.resume --model synthetic:qwen2.5-0.5b-4bit --samples 4 --spares 1 --tokens 200 --after 50 --json $L/resume.json > $L/resume.log 2>&1; echo "rc $?"; grep -v '"level"' $L/resume.log | cut -c1-300 | tail -16
step done
