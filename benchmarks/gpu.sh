#!/usr/bin/env bash
# The GPU report's runs, as committed figures in docs/benchmarks/ were produced.
# On the GPU host, after `source .gpu/b/install.sh` (see ../shared/gpu/README.md):
#   MLXRT_COMMIT=<sha> bash benchmarks/gpu.sh bench qwen2.5-0.5b-4bit [extra benchmark args]
#   MLXRT_COMMIT=<sha> bash benchmarks/gpu.sh soak qwen2.5-0.5b-4bit MINUTES
# Models are made on the host (they are too large to carry); results go to $OUT.
set -euo pipefail
what=$1 preset=$2
shift 2
out=${OUT:-bench-results}
models=${MLXRT_MODELS_DIR:-/tmp/mlxrt-models}
dir="$models/$preset-s0"
mkdir -p "$out"
start=$(date +%s)
python3 -m mlxrt make-model "$preset" --out "$dir" >/dev/null
echo "made $preset in $(( $(date +%s) - start )) s: $(du -sh "$dir" | cut -f1)" >&2
case "$what" in
  bench)
    python3 -m benchmarks --model "$dir" --prompt-tokens 512 --gen-tokens 256 --rounds 5 \
      --no-plot --json "$out/$preset.json" "$@" 2> "$out/$preset.stderr" | tee "$out/$preset.txt" | grep -v '^{'
    ;;
  soak)
    python3 -m mlxrt soak --model "$dir" --minutes "${1:-8}" --out "$out/soak-$preset" \
      2> "$out/soak-$preset.stderr" | tee "$out/soak-$preset.txt"
    ;;
  *)
    echo "usage: gpu.sh bench|soak PRESET [args]" >&2
    exit 2
    ;;
esac
