#!/usr/bin/env bash
# Lease 3: the resume pause after the replay change; probes; stdio bursts; the real-shape vision preset.
cd "$(dirname "$0")/../.."
L=/tmp/lease3; mkdir -p $L
exec > >(tee -a $L/progress.txt) 2>&1
export NCCL_NVLS_ENABLE=0
mkdir -p ~/.cache/huggingface/hub
step() { echo "=== $(date +%T) $*"; }
step env; cat .gpu/b/commit
if [ -d /root/stage/vlm ]; then python3 -m pip install -q --no-index --no-deps --target /tmp/site /root/stage/vlm/*.whl 2>&1 | tail -2; fi
step vision; python3 -m benchmarks.vision --model synthetic:qwen2.5-vl-3b-4bit --rounds 5 --tokens 64 --json $L/vision.json 2>&1 | grep -v '"level"' | grep -v transformers | tail -25
step resume; python3 -m benchmarks.resume --model synthetic:qwen2.5-0.5b-4bit --samples 4 --spares 1 --tokens 200 --after 50 --json $L/resume.json 2>&1 | grep -v '"level"'
step resume_probe; python3 .gpu/b/resume_probe.py qwen2.5-0.5b-4bit 2>&1 | grep -v '"level"' | grep -v transformers
step burst_probe; python3 .gpu/b/burst_probe.py qwen2.5-0.5b-4bit 512 256 16 2>&1 | grep -v '"level"' | grep -v transformers
step stdio_bursts; python3 -m benchmarks --only concurrency,mlxrt-stdio --streams 16,32 --rounds 2 --peers mlx_lm.server --prompt-tokens 512 --gen-tokens 256 --no-plot --json $L/bursts-stdio.json 2>&1 | grep -v '"level"' | grep -A14 "^concurrency (N"
step done
