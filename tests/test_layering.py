"""The folders are the architecture: what each layer of mlxrt may import (BRIEF, STYLE)."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import mlxrt

SRC = Path(mlxrt.__file__).parent
MLX = ("mlx", "mlx_lm")
#: Per folder (or module) of src/: the modules none of its imports may name, lazy ones included.
RULES = {
    "orchestrator": (*MLX, "mlxrt.worker"),
    "ipc": (*MLX, "mlxrt.worker", "mlxrt.orchestrator", "mlxrt.synthetic"),
    "worker": ("mlxrt.orchestrator",),
    # The orchestrator reads the presets before any worker starts.
    "synthetic/presets.py": (*MLX, "mlxrt.worker", "mlxrt.orchestrator"),
    "synthetic/templates.py": (*MLX, "mlxrt.worker", "mlxrt.orchestrator"),
}

_LOADED = """
import importlib, json, pkgutil, sys
for name in sys.argv[1:]:
    walk = name.endswith(".*")
    mod = importlib.import_module(name.removesuffix(".*"))
    for info in pkgutil.walk_packages(mod.__path__, mod.__name__ + ".") if walk else ():
        if not info.name.endswith("__main__"):
            importlib.import_module(info.name)
print(json.dumps(sorted(sys.modules)))
"""


def imported(source: str, module: str) -> set[str]:
    """The absolute names of every module that `source` (the module `module`) imports, anywhere in it."""
    package = module.rsplit(".", 1)[0]
    names: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
            name = node.module or ""
            target = f"{base}.{name}".rstrip(".") if node.level else name
            names.add(target)
            names.update(f"{target}.{a.name}" for a in node.names)  # `from . import group`
    return names


def forbidden(modules, prefixes: tuple[str, ...]) -> list[str]:
    """The modules that are one of `prefixes` or inside one."""
    return sorted(m for m in modules if any(m == p or m.startswith(p + ".") for p in prefixes))


def breaches() -> dict[str, list[str]]:
    """Per source file of src/: the imports its layer's rule forbids."""
    out = {}
    for path in sorted(SRC.rglob("*.py")):
        rel = path.relative_to(SRC).as_posix()
        rule = RULES.get(rel) or RULES.get(rel.split("/")[0] if "/" in rel else "")
        if rule:
            module = "mlxrt." + rel.removesuffix(".py").replace("/", ".").removesuffix(".__init__")
            if rel.endswith("__init__.py"):
                module += ".__init__"  # its relative imports start from the package itself
            found = forbidden(imported(path.read_text(encoding="utf-8"), module), rule)
            if found:
                out[rel] = found
    return out


def loaded(*names: str) -> list[str]:
    """Every module a fresh interpreter holds after importing `names` ("pkg.*": a package and every
    module under it)."""
    out = subprocess.run([sys.executable, "-c", _LOADED, *names], capture_output=True, text=True,
                         timeout=120, check=True)
    return json.loads(out.stdout)


def test_no_layer_imports_what_its_rule_forbids():
    """No orchestrator or ipc module imports MLX or the worker, not even lazily inside a function; the
    worker imports no orchestrator; the synthetic presets the orchestrator reads import no MLX."""
    assert breaches() == {}


def test_the_import_rules_can_fail():
    """The static check sees a lazy relative import of the worker, and `from .. import worker`."""
    lazy = "def f():\n    from ..worker.engine import Engine\n"
    assert forbidden(imported(lazy, "mlxrt.orchestrator.options"), RULES["orchestrator"]) == [
        "mlxrt.worker.engine", "mlxrt.worker.engine.Engine"]
    assert forbidden(imported("from .. import worker\n", "mlxrt.orchestrator.options"),
                     RULES["orchestrator"]) == ["mlxrt.worker"]
    assert forbidden(imported("import mlx.core as mx\n", "mlxrt.ipc.ring"), RULES["ipc"]) == ["mlx.core"]


def test_orchestrator_loads_neither_mlx_nor_the_worker():
    """Every orchestrator module, the HTTP app, the CLI and the public API load without MLX or the worker."""
    modules = loaded("mlxrt", "mlxrt.cli", "mlxrt.orchestrator.*")
    assert "mlxrt.orchestrator.http.app" in modules
    assert "mlxrt.synthetic.presets" in modules
    assert forbidden(modules, RULES["orchestrator"]) == []


def test_the_loaded_check_sees_mlx_and_the_worker():
    """The run-time check can fail: importing the engine is seen to load MLX and the worker."""
    found = forbidden(loaded("mlxrt.worker.engine"), RULES["orchestrator"])
    assert {"mlx", "mlx_lm", "mlxrt.worker"} <= set(found)
