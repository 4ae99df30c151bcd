#!/usr/bin/env bash
# Wait up to $1 seconds for $L/progress.txt to say $2 (done); print it; copy what came out to $OUT.
L=${L:-/tmp/lease1}; end=$((SECONDS + ${1:-560})); mark=${2:-done}
while [ $SECONDS -lt $end ]; do grep -q "=== .* $mark\$" $L/progress.txt 2>/dev/null && break; sleep 5; done
cat $L/progress.txt; mkdir -p $OUT; cp $L/*.json $L/*.log $L/*.err $OUT/ 2>/dev/null; true
