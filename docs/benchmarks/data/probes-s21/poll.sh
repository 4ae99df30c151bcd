#!/usr/bin/env bash
# Wait up to $1 seconds for $L/progress.txt to say $2 (done); print it; copy $L/all.tgz (or, before it is
# packed, a tarball of what is there) to $OUT: a call brings back a few files only. A host with no
# progress file (the lease was lost and this is a fresh one) is said at once, not waited on.
L=${L:-/tmp/lease1}; end=$((SECONDS + ${1:-560})); mark=${2:-done}
[ -f $L/progress.txt ] || { echo "no $L/progress.txt: a fresh host (the job is gone)"; exit 3; }
while [ $SECONDS -lt $end ]; do grep -q "=== .* $mark\$" $L/progress.txt 2>/dev/null && break; sleep 5; done
cat $L/progress.txt; mkdir -p $OUT
if [ -f $L/all.tgz ]; then cp $L/all.tgz $OUT/; elif [ -f $L/ab.tgz ] && [ "$mark" = ab-done ]; then cp $L/ab.tgz $OUT/; else tar czf $OUT/partial.tgz -C $L . 2>/dev/null; fi; true
