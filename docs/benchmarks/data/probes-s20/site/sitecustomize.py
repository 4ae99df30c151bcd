# A throwaway probe of session 20 (not part of the harness): with PROBE_NO_OVERLAP=1, every mlxrt engine in a
# process started with this folder first on PYTHONPATH (the harness's own and `mlxrt serve`'s workers, which
# inherit it) runs each chunk before the decode step, as before `c4bae69` (`PrefillScheduler._overlaps`
# always false). For job5.sh's A/B of the out-of-memory seen in job2.sh's 4-round mix.
import importlib.abc
import importlib.util
import os
import sys


def patch_prefill(mod):
    mod.PrefillScheduler._overlaps = lambda self, p, size, spent: False


PATCHES = {"mlxrt.worker.prefill": patch_prefill} if os.environ.get("PROBE_NO_OVERLAP") else {}


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
