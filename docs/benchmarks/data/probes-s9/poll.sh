#!/usr/bin/env bash
# Wait up to $1 seconds for /tmp/lease1/progress.txt to say done; print what is new.
L=/tmp/lease1; end=$((SECONDS + ${1:-560}))
while [ $SECONDS -lt $end ]; do grep -q "=== .* done" $L/progress.txt 2>/dev/null && break; sleep 5; done
cat $L/progress.txt; mkdir -p $OUT; cp $L/*.json $L/*.log $OUT/ 2>/dev/null; true
