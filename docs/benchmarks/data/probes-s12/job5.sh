#!/usr/bin/env bash
# Lease 5 of session 12 (one call): the agent part, this commit against mid-step arrivals off
# (PROBE_NO_INTAKE=1) and against both changes off (PROBE_MIN_PREFIX=0 PROBE_NO_INTAKE=1), 3 rounds: lease 4
# measured this commit at 0.91x the old behaviour in 2 rounds.
cd "$(dirname "$0")/../../../.."
L=${L:-/tmp/lease5}; mkdir -p $L
exec > >(tee -a $L/progress.txt) 2>&1
step() { echo "=== $(date +%T) $*"; }
step env; cat .gpu/b/commit
python3 -m pip install -q --no-index --no-deps --upgrade --target /tmp/site .gpu/b/oai/*.whl 2>&1 | tail -1
step compile; timeout 150 python3 docs/benchmarks/data/probes-s11/steps.py synthetic:qwen2.5-0.5b-4bit 16 0 0 200 > $L/compile.log 2>&1; echo "rc $?"
export PYTHONPATH=$PWD/docs/benchmarks/data/probes-s12/site:$PYTHONPATH
step agents; timeout 200 python3 -m benchmarks --model synthetic:qwen2.5-0.5b-4bit --part agent --agents 8 --turns 6 --reply-tokens 64 --system-words 1500 --agent-rounds 3 --peers none "--agent-mlxrt-args=PROBE_NO_INTAKE=1" "--agent-mlxrt-args=PROBE_MIN_PREFIX=0 PROBE_NO_INTAKE=1" --no-plot --json $L/agents.json > $L/agents.log 2>&1; echo "rc $?"; grep -E " aggregate |replies identical" $L/agents.log | cut -c1-200
step pack; tar czf $L/all.tgz -C $L agents.json agents.log compile.log
step done
