#!/usr/bin/env bash
# Session 16, lease 1, first call (carry [".gpu/b"], after `bash .gpu/a/stage.sh`): issue 28's two shapes with
# both MLX peers, mlx_lm.server and vllm-mlx 0.6.0 (its wheels in .gpu/b/vmx, installed in a site of its own):
#  1. bursts of 16 and 32 streams at the issue's sizes (512-token prompts, 256 tokens), paired rounds;
#  2. the long-prompt mix, Llama 3.1 8B shape, B 25,000 tokens.
#   source .gpu/b/install.sh > /tmp/install.log 2>&1; setsid bash THIS >/dev/null 2>&1 </dev/null &
#   sleep 2; L=/tmp/lease1 bash docs/benchmarks/data/probes-s16/poll.sh 540, then again for the rest
cd "$(dirname "$0")/../../../.."
L=${L:-/tmp/lease1}; mkdir -p $L
exec > >(tee -a $L/progress.txt) 2>&1
step() { echo "=== $(date +%T) $*"; }
export MLXRT_COMMIT=$(cat .gpu/b/commit)
echo $MLXRT_COMMIT > $L/commit; step env; echo "tree $MLXRT_COMMIT"; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -m pip install -q --no-index --no-deps --target /tmp/vsite .gpu/b/vmx/*.whl 2>&1 | tail -2
export MLXRT_BENCH_VLLM_MLX_SITE=/tmp/vsite MLXRT_BENCH_PEER_START_S=300
PYTHONPATH=/tmp/vsite:$PYTHONPATH python3 -c "import vllm_mlx, mlx_lm; print('vllm-mlx', vllm_mlx.__version__, 'its mlx-lm', mlx_lm.__version__)" 2>&1 | tail -1
step compile; timeout 150 python3 docs/benchmarks/data/probes-s11/steps.py synthetic:qwen2.5-0.5b-4bit 16 0 0 200 > $L/compile.log 2>&1; echo "rc $?"
step bursts; timeout 480 python3 -m benchmarks --model synthetic:qwen2.5-0.5b-4bit --part concurrency,native,mlxrt-ring,mlxrt-http --workers 1 --streams 16,32 --prompt-tokens 512 --gen-tokens 256 --rounds 2 --burst-rounds ${R:-5} --no-plot --peers mlx_lm.server,vllm-mlx --json $L/bursts.json > $L/bursts.log 2>&1; echo "rc $?"
grep -E "^(mlxrt-w1|mlxrt-http|native-batch|mlx_lm|vllm)|quality gate|skipped" $L/bursts.log | cut -c1-220
step mix; timeout 600 python3 -m benchmarks.interleave --model synthetic:llama3.1-8b-4bit --b-tokens 25000 --rounds 2 --out $L/interleave.json > $L/interleave.log 2>&1; echo "rc $?"
grep -E "^round|^\||skipped" $L/interleave.log | cut -c1-220
step pack; tar czf $L/all.tgz -C $L $(cd $L && ls -d bursts.* interleave.* compile.log)
step done
