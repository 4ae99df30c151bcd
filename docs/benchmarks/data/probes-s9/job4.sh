#!/usr/bin/env bash
# For the next lease (not run in session 9): the agent part with a budget on CUDA as the code now has it
# (chunks on the grid, short prompts batched), against budget 0 and mlx_lm.server, interleaved; then the
# bursts with a budget. Needs the openai wheels (.gpu/b/oai: openai, httpx2, httpcore2, truststore,
# jiter, pydantic, pydantic_core, annotated-types, typing-inspection, distro, tqdm, typing_extensions).
cd "$(dirname "$0")/../../../.."
L=/tmp/lease1; mkdir -p $L
exec > >(tee -a $L/progress.txt) 2>&1
step() { echo "=== $(date +%T) $*"; }
step env; cat .gpu/b/commit; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -m pip install -q --no-index --no-deps --upgrade --target /tmp/site .gpu/b/oai/*.whl 2>&1 | tail -1
step agents; timeout 560 python3 -m benchmarks --model synthetic:qwen2.5-0.5b-4bit --part agent --agents 8 --turns 6 --reply-tokens 64 --system-words 1500 --agent-rounds 2 --peers mlx_lm.server --agent-mlxrt-args=--prefill-budget-ms=200 --no-plot --json $L/agents.json > $L/agents.log 2>&1; echo "rc $?"; grep -v '"level"' $L/agents.log | cut -c1-300 | tail -40
step bursts; MLXRT_PREFILL_BUDGET_MS=200 timeout 500 python3 -m benchmarks --model synthetic:qwen2.5-0.5b-4bit --part concurrency --streams 16,32 --rounds 2 --peers mlx_lm.server --no-plot --json $L/bursts.json > $L/bursts.log 2>&1; echo "rc $?"; grep -v '"level"' $L/bursts.log | cut -c1-300 | tail -20
step done
