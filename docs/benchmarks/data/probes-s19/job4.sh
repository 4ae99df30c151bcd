#!/usr/bin/env bash
# Session 19, lease 1, fifth call (the host taken back after job2.sh: staged again first,
# `bash .gpu/a/stage.sh && cp -r .gpu/a/vmx .gpu/a/oai /root/stage/`; carry [".gpu/b"]): issue 28's long-prompt
# mix in-process, MLX's buffers handed back after a long prompt's last chunk at once, never, or after the step
# (abclear.py), 5 rounds.
#   source .gpu/b/install.sh > /tmp/install.log 2>&1; setsid bash THIS >/dev/null 2>&1 </dev/null &
#   sleep 2; L=/tmp/lease4 bash docs/benchmarks/data/probes-s19/poll.sh 540
cd "$(dirname "$0")/../../../.."
L=${L:-/tmp/lease4}; mkdir -p $L
exec > >(tee -a $L/progress.txt) 2>&1
step() { echo "=== $(date +%T) $*"; }
export MLXRT_COMMIT=$(cat .gpu/b/commit) MLX_PTX_CACHE_DIR=/tmp/ptx
echo $MLXRT_COMMIT > $L/commit; step env; echo "tree $MLXRT_COMMIT"; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
P=docs/benchmarks/data/probes-s19
mkdir -p ~/.cache/huggingface/hub
step abclear; timeout 420 python3 $P/abclear.py --model synthetic:llama3.1-8b-4bit --b-tokens 25000 --rounds ${R:-5} --no-http \
  --out $L/abclear.json > $L/abclear.log 2>&1; echo "rc $?"
grep -E "^round|^\|" $L/abclear.log | cut -c1-260
step pack; tar czf $L/all.tgz -C $L $(cd $L && ls -d commit abclear.* 2>/dev/null)
step done
