# Session 20: issue 28's long-prompt mix in-process, a long prompt's chunks beside the batch's decode step
# (`PrefillScheduler._overlaps`, this tree's engine) against each chunk before it (the engine before), two
# engines in one process, their rounds interleaved as benchmarks.interleave interleaves its targets.
#   python3 docs/benchmarks/data/probes-s20/abover.py [benchmarks.interleave's arguments]
import sys
import types

sys.path.insert(0, ".")
from benchmarks import interleave  # noqa: E402

KEPT = []


def never(self, p, size, spent):
    return False


def make_targets(model, model_path, http, peers, skipped, targets):
    targets.append(interleave.EngineTarget("mlxrt engine", model, None))
    old = interleave.EngineTarget("mlxrt engine, chunks before the decode", model, None)
    old.engine._overlaps = types.MethodType(never, old.engine)
    targets.append(old)
    KEPT.extend(targets)


interleave.make_targets = make_targets
rc = interleave.main(sys.argv[1:])
for t in KEPT:
    e = t.engine
    print(f"{t.name}: scheduler calls {e.prefill_calls}, beside the decode {e.prefill_overlapped}, "
          f"rate {e.sizer.rate}, rung {e.sizer.rung}", flush=True)
sys.exit(rc)
