"""The coding-agent CLIs the tests drive (Claude Code, Codex CLI, OpenCode), pinned and cached.

`ensure()` installs `PINS` from the npm registry once, into
``~/.cache/mlxrt/agent-clis/<hash of PINS>`` ($MLXRT_AGENT_CLIS_DIR replaces the root), with
``npm install --prefix``: built in a directory beside it and renamed into place, under a lock,
so concurrent test runs share one install and never see half of one. Each CLI's version is
checked after installing. The packages' install scripts run (Claude Code's and OpenCode's copy
their platform's native binary over a placeholder ``bin``). ``make test`` runs this file first
(``python tests/agent_clis.py``), so a fresh clone's tests find the CLIs installed.

Without npm the CLI tests skip, naming why, except where $CI is set: there a missing npm, like
any failed install, is an error.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

#: Package -> version. Bump together: the install directory is named by their hash.
PINS = {"@anthropic-ai/claude-code": "2.1.328", "@openai/codex": "0.169.0", "opencode-ai": "1.18.33"}
#: CLI command -> (package, what ``--version`` prints).
BINS = {"claude": ("@anthropic-ai/claude-code", "2.1.328 (Claude Code)"),
        "codex": ("@openai/codex", "codex-cli 0.169.0"),
        "opencode": ("opencode-ai", "1.18.33")}
DEFAULT_INSTALL_TIMEOUT_S = 900.0  # three packages, about 250 MB from the registry
VERSION_TIMEOUT_S = 60.0


class NpmMissing(RuntimeError):
    """npm is not on PATH: the CLIs cannot be installed here."""


def install_dir() -> Path:
    """Where `PINS` are (or will be) installed."""
    root = os.environ.get("MLXRT_AGENT_CLIS_DIR") or Path.home() / ".cache" / "mlxrt" / "agent-clis"
    digest = hashlib.sha256(json.dumps(PINS, sort_keys=True).encode()).hexdigest()[:16]
    return Path(root).expanduser() / digest


def ensure() -> dict[str, Path]:
    """Each CLI's executable, `PINS` installed first if missing; NpmMissing without npm, RuntimeError
    (naming the command and its output) if the install or a version check fails."""
    out = install_dir()
    bins = {name: out / "node_modules" / ".bin" / name for name in BINS}
    if _installed(out):
        return bins
    npm = shutil.which("npm")
    if npm is None:
        raise NpmMissing("npm is not on PATH: install Node.js 20+ to run the coding-agent CLI tests")
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.parent / f".{out.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # a concurrent run installs; this one waits, then reuses it
        if not _installed(out):
            _install(npm, out)
    return bins


def _installed(out: Path) -> bool:
    try:
        return json.loads((out / "mlxrt-pins.json").read_text()) == PINS
    except (OSError, ValueError):
        return False


def _install(npm: str, out: Path) -> None:
    timeout = float(os.environ.get("MLXRT_NPM_TIMEOUT_S", DEFAULT_INSTALL_TIMEOUT_S))
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent))
    try:
        cmd = [npm, "install", "--prefix", str(tmp), "--no-audit", "--no-fund",
               "--no-save", "--loglevel=error", *(f"{p}@{v}" for p, v in PINS.items())]
        _run(cmd, timeout, "MLXRT_NPM_TIMEOUT_S")
        for name, (_, want) in BINS.items():
            got = _run([str(tmp / "node_modules" / ".bin" / name), "--version"], VERSION_TIMEOUT_S,
                       None, env={**os.environ, "HOME": str(tmp)})
            if want not in got:
                raise RuntimeError(f"{name} --version printed {got.strip()!r}, expected {want!r}")
        (tmp / "mlxrt-pins.json").write_text(json.dumps(PINS))
        shutil.rmtree(out, ignore_errors=True)  # a stale or partial install of the same pins
        tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _run(cmd: list[str], timeout: float, knob: str | None, env: dict | None = None) -> str:
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env,
                              stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"{' '.join(cmd)} did not finish within {timeout:g} s"
                           + (f" (set {knob})" if knob else "")) from None
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {done.returncode}:\n{done.stdout}\n{done.stderr}")
    return done.stdout + done.stderr


def main() -> int:
    """Install for ``make test``: 0 when installed (or npm is absent outside CI), 1 otherwise."""
    try:
        bins = ensure()
    except NpmMissing as exc:
        print(f"agent CLIs: {exc}", file=sys.stderr)
        return 1 if os.environ.get("CI") else 0
    except RuntimeError as exc:
        print(f"agent CLIs: install failed: {exc}", file=sys.stderr)
        return 1
    print(f"agent CLIs: {', '.join(f'{p}@{v}' for p, v in PINS.items())} in {install_dir()}")
    return 0 if all(b.exists() for b in bins.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
