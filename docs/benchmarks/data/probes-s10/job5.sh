#!/usr/bin/env bash
# Lease 1 of session 10: does cuDNN's attention (a graph built per new shape) cost the resumed stream's
# pause and the bursts? The same runs with MLX_CUDA_USE_CUDNN_SDPA=0 (MLX's own switch, read once per
# process; workers inherit it) and without, back to back.
cd "$(dirname "$0")/../../../.."
L=/tmp/lease1; mkdir -p $L
exec > >(tee -a $L/progress.txt) 2>&1
step() { echo "=== $(date +%T) $*"; }
M=synthetic:qwen2.5-0.5b-4bit
step env; cat .gpu/b/commit; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -m pip install -q --no-index --no-deps --upgrade --target /tmp/site .gpu/b/oai/*.whl 2>&1 | tail -1
for v in on off; do
  step resume-$v
  [ $v = off ] && export MLX_CUDA_USE_CUDNN_SDPA=0
  MLXRT_LOG_LEVEL=info timeout 200 python3 -m benchmarks.resume --model $M --samples 4 --spares 1 --tokens 200 --after 50 --json $L/resume-$v.json > $L/resume-$v.log 2> $L/resume-$v.err; echo "rc $?"; tail -3 $L/resume-$v.log | cut -c1-300
  unset MLX_CUDA_USE_CUDNN_SDPA
done
for v in off on; do
  step bursts-$v
  [ $v = off ] && export MLX_CUDA_USE_CUDNN_SDPA=0
  timeout 300 python3 -m benchmarks --model $M --part concurrency,native,mlxrt-ring,mlxrt-http --streams 16,32 --rounds 2 --peers none --no-plot --json $L/bursts-$v.json > $L/bursts-$v.log 2>&1; echo "rc $?"; grep -v '"level"' $L/bursts-$v.log | cut -c1-300 | tail -14
  unset MLX_CUDA_USE_CUDNN_SDPA
done
step done
