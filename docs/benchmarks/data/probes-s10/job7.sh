#!/usr/bin/env bash
# Lease 1 of session 10, third job: the long prompt among streams (8B shape, 25k tokens) with cuDNN's
# attention off, then on, in-process targets only (the environment is the process's).
cd "$(dirname "$0")/../../../.."
L=/tmp/lease1; mkdir -p $L
exec > >(tee -a $L/progress.txt) 2>&1
step() { echo "=== $(date +%T) $*"; }
for v in off on; do
  step interleave-$v
  [ $v = off ] && export MLX_CUDA_USE_CUDNN_SDPA=0
  timeout 290 python3 -m benchmarks.interleave --model synthetic:llama3.1-8b-4bit --b-tokens 25000 --rounds 2 --no-http --out $L/interleave-$v.json > $L/interleave-$v.log 2>&1; echo "rc $?"; grep -v '"level"' $L/interleave-$v.log | cut -c1-250 | tail -16
  unset MLX_CUDA_USE_CUDNN_SDPA
done
step done3
