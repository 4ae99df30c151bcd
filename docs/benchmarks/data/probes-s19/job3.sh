#!/usr/bin/env bash
# Session 19, lease 1, third call (after job1.sh on the same warm host; on a fresh one, stage again first:
# `bash .gpu/a/stage.sh && cp -r .gpu/a/vmx .gpu/a/oai /root/stage/`; carry [".gpu/b"]): issue 28's long-prompt
# mix in-process, the grid's ladder with midpoints against powers of two only, 7 rounds, with the chunk sizes
# run (abmix.py); then what MLX holds after a long prompt, with 5285c58 (memprobe.py).
#   source .gpu/b/install.sh > /tmp/install.log 2>&1; setsid bash THIS >/dev/null 2>&1 </dev/null &
#   sleep 2; L=/tmp/lease3 bash docs/benchmarks/data/probes-s19/poll.sh 540
cd "$(dirname "$0")/../../../.."
L=${L:-/tmp/lease3}; mkdir -p $L
exec > >(tee -a $L/progress.txt) 2>&1
step() { echo "=== $(date +%T) $*"; }
export MLXRT_COMMIT=$(cat .gpu/b/commit) MLX_PTX_CACHE_DIR=/tmp/ptx
echo $MLXRT_COMMIT > $L/commit; step env; echo "tree $MLXRT_COMMIT"; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
P=docs/benchmarks/data/probes-s19
mkdir -p ~/.cache/huggingface/hub
step abmix; timeout 470 python3 $P/abmix.py --model synthetic:llama3.1-8b-4bit --b-tokens 25000 --rounds ${R:-7} --no-http \
  --out $L/abmix.json > $L/abmix.log 2>&1; echo "rc $?"
grep -E "^round|^\||rung" $L/abmix.log | cut -c1-260
step mem; timeout 120 python3 $P/memprobe.py synthetic:llama3.1-8b-4bit 25000 > $L/mem.log 2>&1; echo "rc $?"; cat $L/mem.log | tail -12
step pack; tar czf $L/all.tgz -C $L $(cd $L && ls -d commit abmix.* mem.* 2>/dev/null)
step done
