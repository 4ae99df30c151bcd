#!/usr/bin/env bash
cd "$(dirname "$0")/../.."
L=/tmp/lease4; mkdir -p $L
exec > >(tee -a $L/progress.txt) 2>&1
step() { echo "=== $(date +%T) $*"; }
step env; cat .gpu/b/commit
python3 -m pip install -q --no-index --no-deps --target /tmp/site /root/stage/vlm/*.whl 2>&1 | tail -2
python3 -c "import transformers, PIL, mlx_vlm; print('transformers', transformers.__version__, 'PIL', PIL.__version__)" 2>&1 | tail -3
step vision; timeout 330 python3 -m benchmarks.vision --model synthetic:qwen2.5-vl-3b-4bit --rounds 5 --tokens 64 --json $L/vision.json > $L/vision.log 2>&1; echo "rc $?"; grep -v '"level"' $L/vision.log | cut -c1-300 | tail -30
for d in 0 3; do step resume delay $d; MLXRT_SPARE_DELAY_S=$d python3 -m benchmarks.resume --model synthetic:qwen2.5-0.5b-4bit --samples 3 --spares 1 --tokens 200 --after 50 --json $L/resume-d$d.json 2> $L/resume-d$d.log | tail -2; grep "^sample" $L/resume-d$d.log; done
step done
