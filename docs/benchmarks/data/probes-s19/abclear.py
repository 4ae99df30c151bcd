# Session 19: issue 28's long-prompt mix in-process with three ways of handing MLX's buffers back after a long
# prompt's last chunk in the scheduler on CUDA, three engines in one process, their rounds interleaved as
# benchmarks.interleave interleaves its targets: at once, after its last chunk (the engine's own since
# 5285c58); never (the engine before it); after the step that ends with its first token (deferred). MLX's
# cache is cleared before each run and read after it.
#   python3 docs/benchmarks/data/probes-s19/abclear.py [benchmarks.interleave's arguments]
import sys

import mlx.core as real_mx

sys.path.insert(0, ".")
from mlxrt.worker import prefill  # noqa: E402

from benchmarks import interleave  # noqa: E402

STATE = {"variant": None, "pending": False}


class Mx:
    """mlx.core for prefill.py, but for `clear_cache`, which follows the running engine's variant."""

    def __getattr__(self, name):
        return getattr(real_mx, name)

    def clear_cache(self):
        if STATE["variant"] == "never":
            return
        if STATE["variant"] == "deferred":
            STATE["pending"] = True
            return
        real_mx.clear_cache()


prefill.mx = Mx()


def variant(t, name):
    step, run = t.engine.step, t.run

    def stepped():
        STATE["variant"] = name
        step()
        if STATE["pending"]:
            STATE["pending"] = False
            real_mx.clear_cache()

    def ran(spec):
        real_mx.clear_cache()
        out = run(spec)
        out["mlx_cached_mib"] = real_mx.get_cache_memory() / 2**20
        return out

    t.engine.step, t.run = stepped, ran
    return t


def make_targets(model, model_path, http, peers, skipped, targets):
    for name, v in (("at its last chunk", "now"), ("never", "never"), ("after the step", "deferred")):
        targets.append(variant(interleave.EngineTarget(f"mlxrt engine, clear {name}", model, None), v))


interleave.make_targets = make_targets
sys.exit(interleave.main(sys.argv[1:]))
