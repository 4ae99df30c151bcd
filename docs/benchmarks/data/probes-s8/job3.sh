#!/usr/bin/env bash
# Lease 3 of session 8: the 3B vision figure with the token-identity check (issue 31).
cd "$(dirname "$0")/../.."
L=/tmp/lease1; mkdir -p $L
exec > >(tee -a $L/progress.txt) 2>&1
step() { echo "=== $(date +%T) $*"; }
step env; cat .gpu/b/commit; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -m pip install -q --no-index --no-deps --target /tmp/site /root/stage/vlm/*.whl 2>&1 | tail -2
step vision; timeout 500 python3 -m benchmarks.vision --model synthetic:qwen2.5-vl-3b-4bit --rounds 5 --tokens 64 --json $L/vision.json > $L/vision.log 2>&1; echo "rc $?"; grep -v '"level"' $L/vision.log | cut -c1-300 | tail -14
step done
