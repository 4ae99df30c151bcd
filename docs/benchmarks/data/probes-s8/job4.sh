#!/usr/bin/env bash
# Lease 4 of session 8: the restart with the disk tier's warming (issue 29).
cd "$(dirname "$0")/../.."
L=/tmp/lease1; mkdir -p $L
exec > >(tee -a $L/progress.txt) 2>&1
step() { echo "=== $(date +%T) $*"; }
step env; cat .gpu/b/commit; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
step restart; timeout 560 python3 -m benchmarks.disk_restart --model synthetic:qwen3-8b-4bit --prefix-tokens 16000 --rounds 3 --json $L/restart.json > $L/restart.log 2>&1; echo "rc $?"; grep -v '"level"' $L/restart.log | cut -c1-300 | tail -14
step done
