# Session 19: issue 28's long-prompt mix in-process, the grid's ladder of rungs (powers of two and the
# midpoints between them, the engine's at 41086ea-e66d40f, taken out after this A/B) against powers of two
# only, two engines in one process, their rounds interleaved as benchmarks.interleave interleaves its
# targets. Powers of two are this file's copy of `ChunkSizer._rung` as at session 18's end (9cbb1c4), which
# is the engine's own again since the A/B: at a later tree both targets run the same rungs.
#   python3 docs/benchmarks/data/probes-s19/abmix.py [benchmarks.interleave's arguments]
import collections
import sys
import types

sys.path.insert(0, ".")
from mlxrt.worker import prefill  # noqa: E402

from benchmarks import interleave  # noqa: E402


def pow2_rung(self, want: int) -> int:
    top = 1 << (self.ceiling.bit_length() - 1)
    low = min(top, max(prefill.GRID_MIN_RUNG, 1 << max(0, (self.floor - 1).bit_length())))
    r = self.rung
    if r is None or r > prefill.RUNG_MARGIN * want or 2 * r <= want:
        r = 1 << max(0, max(1, want).bit_length() - 1)
    self.rung = max(low, min(top, r))
    return self.rung


KEPT = []


def counted(sizer):
    """`sizer.record`, also counting the chunk sizes it is given (rows of one token each)."""
    sizer.sizes = collections.Counter()
    record = sizer.record

    def rec(tokens, seconds, shape=None):
        if shape is not None and shape[0] == 1:
            sizer.sizes[tokens] += 1
        record(tokens, seconds, shape)

    sizer.record = rec


def make_targets(model, model_path, http, peers, skipped, targets):
    targets.append(interleave.EngineTarget("mlxrt engine", model, None))
    old = interleave.EngineTarget("mlxrt engine, powers of two", model, None)
    old.engine.sizer._rung = types.MethodType(pow2_rung, old.engine.sizer)
    targets.append(old)
    for t in targets:
        counted(t.engine.sizer)
    KEPT.extend(targets)


interleave.make_targets = make_targets
rc = interleave.main(sys.argv[1:])
for t in KEPT:  # the rung and the rate each engine ended on
    top = sorted(t.engine.sizer.sizes.items(), key=lambda kv: -kv[1])[:8]
    print(f"{t.name}: one-row chunks by size (the most run): {top}", flush=True)
sys.exit(rc)
