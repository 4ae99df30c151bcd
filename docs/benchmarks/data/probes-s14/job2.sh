#!/usr/bin/env bash
# Lease 1 of session 14, second call (the machine warm): the agent part after 6476b75 (the prefix floor's
# test in one walk), the floor at 32 (as is) against none (PROBE_MIN_PREFIX=0) in the same rounds. Run with
# PYTHONPATH=/tmp/site (the first call's install) and carry [".gpu/c"]: the openai client's wheels, moved out of
# .gpu/b so that .gpu/b and the tree fit one call's 64 MiB.
cd "$(dirname "$0")/../../../.."
L=${L:-/tmp/lease1b}; mkdir -p $L
exec > >(tee -a $L/progress.txt) 2>&1
step() { echo "=== $(date +%T) $*"; }
step env; cat .gpu/b/commit
export PYTHONPATH=$PWD/docs/benchmarks/data/probes-s12/site:$PYTHONPATH
python3 -m pip install -q --no-index --no-deps --upgrade --target /tmp/site .gpu/c/oai/*.whl 2>&1 | tail -1
step agents; timeout ${T:-420} python3 -m benchmarks --model synthetic:qwen2.5-0.5b-4bit --part agent --agents 8 --turns 6 --reply-tokens 64 --system-words 1500 --agent-rounds ${R:-3} --peers none "--agent-mlxrt-args=PROBE_MIN_PREFIX=0" --no-plot --json $L/agents.json > $L/agents.log 2>&1; echo "rc $?"; grep -E " aggregate |replies identical|same replies" $L/agents.log | cut -c1-220
step pack; tar czf $L/all.tgz -C $L $(cd $L && ls -d agents.*)
step done
