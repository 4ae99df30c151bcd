#!/usr/bin/env bash
# Session 17, lease 1, second call (carry [".gpu/b"], after `bash .gpu/a/stage.sh`): where a burst's TTFT goes at
# issue 28's sizes (512-token prompts, 256 tokens), the workers traced (probes-s12/site), with native-batch
# beside them in the same rounds; show.py prints each burst's calls, decode.py its decode steps.
#   source .gpu/b/install.sh > /tmp/install.log 2>&1; setsid bash THIS >/dev/null 2>&1 </dev/null &
#   sleep 2; L=/tmp/lease1 bash docs/benchmarks/data/probes-s17/poll.sh 540
cd "$(dirname "$0")/../../../.."
L=${L:-/tmp/lease1}; mkdir -p $L
exec > >(tee -a $L/progress.txt) 2>&1
step() { echo "=== $(date +%T) $*"; }
export MLXRT_COMMIT=$(cat .gpu/b/commit) MLX_PTX_CACHE_DIR=/tmp/ptx
echo $MLXRT_COMMIT > $L/commit; step env; echo "tree $MLXRT_COMMIT"; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
P=docs/benchmarks/data
step bursts-traced
PYTHONPATH=$P/probes-s12/site:$PYTHONPATH MLXRT_PROBE_TRACE=$L/trace timeout 420 python3 -m benchmarks \
  --model synthetic:qwen2.5-0.5b-4bit --part concurrency,native,mlxrt-ring,mlxrt-http --workers 1 --streams 16,32 \
  --prompt-tokens 512 --gen-tokens 256 --rounds 2 --burst-rounds ${R:-3} --no-plot --peers none \
  --json $L/bursts.json > $L/bursts.log 2>&1; echo "rc $?"
grep -E "^(mlxrt-w1|mlxrt-http|native-batch)|quality gate|skipped" $L/bursts.log | cut -c1-220
python3 $P/probes-s12/show.py $L/trace 16 > $L/show.log 2>&1; grep "^==" $L/show.log
python3 $P/probes-s13/decode.py $L/trace > $L/decode.log 2>&1; cat $L/decode.log
step pack; tar czf $L/all.tgz -C $L bursts.json bursts.log show.log decode.log; tar czf $L/traces.tgz -C $L trace
step done
