#!/usr/bin/env bash
# Session 16, lease 2, third call (carry [".gpu/c"]; the first two: `bash .gpu/a/stage.sh`, then with .gpu/b
# `source .gpu/b/install.sh` and vllm-mlx's wheels into /tmp/vsite). With A's longest gap now the longest
# wait between arrivals (2d59727): the long-prompt mix with both peers, then bursts at the issue's sizes
# with both peers. vllm-mlx's site keeps only its own modules: pydantic comes from /tmp/site (.gpu/c/oai).
#   export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1; setsid bash THIS >/dev/null 2>&1 </dev/null &
#   sleep 2; L=/tmp/lease5 bash docs/benchmarks/data/probes-s16/poll.sh 560
cd "$(dirname "$0")/../../../.."
L=${L:-/tmp/lease5}; mkdir -p $L
exec > >(tee -a $L/progress.txt) 2>&1
step() { echo "=== $(date +%T) $*"; }
export MLXRT_COMMIT=$(cat /tmp/commit)
step env; echo "tree $MLXRT_COMMIT"
python3 -m pip install -q --no-index --no-deps --upgrade --target /tmp/site .gpu/c/oai/*.whl 2>&1 | tail -1
rm -rf /tmp/vsite/typing_extensions* /tmp/vsite/typing_inspection* /tmp/vsite/pydantic* /tmp/vsite/annotated_types*
export MLXRT_BENCH_VLLM_MLX_SITE=/tmp/vsite
PYTHONPATH=/tmp/vsite:$PYTHONPATH python3 -c "import vllm_mlx.server; print('vllm-mlx server imports')" 2>&1 | tail -1
step mix; timeout 480 python3 -m benchmarks.interleave --model synthetic:llama3.1-8b-4bit --b-tokens 25000 --rounds 2 --out $L/interleave.json > $L/interleave.log 2>&1; echo "rc $?"
grep -E "^round|^\||skipped" $L/interleave.log | cut -c1-220
step bursts; timeout 420 python3 -m benchmarks --model synthetic:qwen2.5-0.5b-4bit --part concurrency --workers 1 --streams 16,32 --prompt-tokens 512 --gen-tokens 256 --rounds 2 --burst-rounds ${R:-3} --no-plot --peers mlx_lm.server,vllm-mlx --json $L/bursts.json > $L/bursts.log 2>&1; echo "rc $?"
grep -E "^(mlxrt-w1|mlxrt-http|native-batch|mlx_lm|vllm)|quality gate|skipped" $L/bursts.log | cut -c1-220
step pack; tar czf $L/all.tgz -C $L $(cd $L && ls -d interleave.* bursts.* 2>/dev/null)
step done
