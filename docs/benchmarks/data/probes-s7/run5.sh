#!/usr/bin/env bash
cd "$(dirname "$0")/../.."
L=/tmp/lease5; mkdir -p $L
exec > >(tee -a $L/progress.txt) 2>&1
step() { echo "=== $(date +%T) $*"; }
step env; cat .gpu/b/commit
python3 -m pip install -q --no-index --no-deps --target /tmp/site /root/stage/vlm/*.whl 2>&1 | tail -1
step tiny; timeout 100 python3 -X faulthandler -m benchmarks.vision --model synthetic:tiny-qwen2.5-vl --rounds 1 --tokens 8 --json $L/vision-tiny.json > $L/vision-tiny.log 2>&1; echo "rc $?"; grep -v '"level"' $L/vision-tiny.log | grep -v '^\[transformers\]' | cut -c1-250 | tail -25
step 3b; timeout 160 python3 -X faulthandler -m benchmarks.vision --model synthetic:qwen2.5-vl-3b-4bit --rounds 2 --tokens 32 --json $L/vision-3b.json > $L/vision-3b.log 2>&1; echo "rc $?"; grep -v '"level"' $L/vision-3b.log | grep -v '^\[transformers\]' | cut -c1-250 | tail -25
step done
