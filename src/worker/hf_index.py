"""transformers' table of its model classes, kept on disk between worker starts.

`import transformers` builds its lazy import table by reading the ``__all__`` of every file under
``transformers/models`` (about 1,100 files, and twice: once for the package, once for
``transformers.models``): 0.3 s of CPU in every worker start on this machine, with the same answer
each time for one installed release. mlx-lm imports transformers for its tokenizers, so every worker
pays it. `remember_transformers_index()` makes the first process on a machine build the table and
write it under the user's cache directory; later ones read it (a few ms).

The table is keyed by the transformers release and the folder's path and modification time (a model
added to an editable checkout changes it). Anything unexpected (another transformers layout, an
unreadable or unwritable cache) falls back to transformers' own code: the cache can only save time.
MLXRT_TRANSFORMERS_INDEX=0 turns it off. The file is JSON (its sets and frozensets tagged), never
pickle: a cache file is read back as data only.
"""

from __future__ import annotations

import contextlib
import importlib.abc
import importlib.util
import json
import os
import sys
import tempfile
import zlib
from pathlib import Path

_MODULE = "transformers.utils.import_utils"


def cache_dir() -> Path:
    """Where the tables are kept: $XDG_CACHE_HOME/mlxrt/transformers-index (else ~/.cache/...)."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "mlxrt" / "transformers-index"


def remember_transformers_index() -> None:
    """Have the next `import transformers` in this process use (and fill) the on-disk table.

    Call before transformers is imported; a no-op after it, or with MLXRT_TRANSFORMERS_INDEX=0.
    """
    if os.environ.get("MLXRT_TRANSFORMERS_INDEX") == "0" or _MODULE in sys.modules:
        return
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())


class _Finder(importlib.abc.MetaPathFinder):
    """Finds `transformers.utils.import_utils` as usual, and wraps its table builder once it has run."""

    def find_spec(self, name, path, target=None):
        if name != _MODULE:
            return None
        sys.meta_path.remove(self)  # one module, once: out of every later import's way
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        run = spec.loader.exec_module

        def exec_module(module) -> None:
            run(module)
            build = getattr(module, "define_import_structure", None)
            if callable(build):
                module.define_import_structure = _Remembered(build)

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


class _Remembered:
    """`define_import_structure(module_path, prefix=None)` answered from disk when it can.

    Like transformers' own (an lru_cache), one call with the same arguments returns the same object in
    this process: its callers update the table they get in place.
    """

    def __init__(self, build) -> None:
        self._build = build
        self._memo: dict[tuple, object] = {}

    def __call__(self, module_path, prefix=None):
        try:
            key = (str(module_path), prefix, os.stat(module_path).st_mtime_ns)
        except OSError:
            return self._build(module_path, prefix)
        if key in self._memo:
            return self._memo[key]
        file = cache_dir() / f"{_release()}-{zlib.crc32(repr(key[:2]).encode()):08x}.json"
        table = _read(file, key)
        if table is None:
            table = self._build(module_path, prefix)
            _write(file, key, table)
        self._memo[key] = table
        return table


def _release() -> str:
    """The transformers release being imported (its package sets __version__ before this module runs)."""
    return str(getattr(sys.modules.get("transformers"), "__version__", "unknown"))


def _encode(x):
    """transformers' table as JSON values: dicts as key-value pairs, sets and frozensets tagged."""
    if isinstance(x, dict):
        return {"d": [[_encode(k), _encode(v)] for k, v in x.items()]}
    if isinstance(x, (set, frozenset)):
        return {"f" if isinstance(x, frozenset) else "s": sorted(x)}
    if isinstance(x, str):
        return x
    raise TypeError(f"unexpected {type(x).__name__} in transformers' table")


def _decode(x):
    if isinstance(x, str):
        return x
    if "d" in x:
        return {_decode(k): _decode(v) for k, v in x["d"]}
    return frozenset(x["f"]) if "f" in x else set(x["s"])


def _read(file: Path, key: tuple):
    try:
        with open(file, encoding="utf-8") as f:
            stored = json.load(f)
        if stored["key"] != list(key):
            return None
        return _decode(stored["table"])
    except Exception:  # absent, half-written, another layout, unreadable: build it instead
        return None


def _write(file: Path, key: tuple, table) -> None:
    try:
        file.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=file.parent, prefix=file.name, suffix=".tmp")
    except OSError:
        return  # a read-only cache only costs the time it would have saved
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump({"key": list(key), "table": _encode(table)}, f)
        os.replace(tmp, file)  # whole or absent: processes starting at once each write their own copy
    except Exception:  # a full disk, a table of another layout: transformers' answer stands
        with contextlib.suppress(OSError):
            os.unlink(tmp)
