# A throwaway probe of session 17 (not part of the harness): the prefill scheduler's calls as before session
# 17, for an A/B in one run. Put this folder first on PYTHONPATH; a process started with
#   PROBE_OLD_GRID=1  batches rows on the grid as before (any row count, padded to the longest row only);
#   PROBE_OLD_JOIN=1  merges the rows of the calls that join the batch one by one, as mlx-lm does
#                     (no `CallRow.merge` of whole calls);
#   PROBE_NO_CLEAR=1  the scheduler's prefill calls leave MLX's freed buffers cached (no mx.clear_cache()
#                     after each: run_chunk, run_rows); the engine's own way on CUDA since it landed;
#   PROBE_CLEAR=1     the way before: they hand them back after each call on CUDA too (`release`);
# e.g. `--burst-mlxrt-args=PROBE_OLD_GRID=1` for an mlxrt serve beside the others.
import importlib.abc
import importlib.util
import os
import sys


def patch_prefill(mod):
    if os.environ.get("PROBE_OLD_GRID"):
        batch_rows = mod.batch_rows

        def old_rows(prefills, first, size, room, most, *, grid=False):
            return batch_rows(prefills, first, size, room, most)
        mod.batch_rows = old_rows
        mod.grid_width = lambda tokens, grid=True: tokens
    if os.environ.get("PROBE_OLD_JOIN"):
        mod.whole_calls = lambda caches: None
    if os.environ.get("PROBE_NO_CLEAR"):
        class KeepCache:
            def __getattr__(self, name):
                return getattr(mx, name)

            @staticmethod
            def clear_cache():
                pass
        mx = mod.mx
        mod.mx = KeepCache()
    if os.environ.get("PROBE_CLEAR"):
        mod.release = lambda keep: mod.mx.clear_cache()


PATCHES = {"mlxrt.worker.prefill": patch_prefill} if any(
    os.environ.get(k) for k in ("PROBE_OLD_GRID", "PROBE_OLD_JOIN", "PROBE_NO_CLEAR", "PROBE_CLEAR")) else {}


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name not in PATCHES:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return spec
        loader, exec_module = spec.loader, spec.loader.exec_module

        class _Loader(importlib.abc.Loader):
            def create_module(self, spec):
                return loader.create_module(spec)

            def exec_module(self, module):
                exec_module(module)
                PATCHES[name](module)
        spec.loader = _Loader()
        return spec


if PATCHES:
    sys.meta_path.insert(0, _Finder())
