#!/usr/bin/env bash
cd "$(dirname "$0")/../.."
python3 -m pip install -q --no-index --no-deps --target /tmp/site /root/stage/vlm/*.whl 2>&1 | tail -1
python3 -c "from mlxrt.synthetic.build import ensure_model; ensure_model('qwen2.5-vl-3b-4bit')" 2>&1 | grep -v transformers | tail -1
timeout 200 python3 .gpu/b/vlm_bisect.py qwen2.5-vl-3b-4bit lm text image vision-f32 2>&1 | cut -c1-250
