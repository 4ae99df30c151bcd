"""Test-only: ``mlxrt serve`` whose workers are `scripted_worker.py` (replies forced by SCRIPTED_REPLIES).

``python tests/scripted_serve.py serve --model ...`` is the real command line (its flags, logs,
uvicorn and runtime) with one difference: the runtime starts the scripted worker instead of the
production one, so a real client can be driven through a scripted session end to end.
"""

import sys
from pathlib import Path

from mlxrt.cli import main
from mlxrt.orchestrator.runtime import Runtime

SCRIPTED = [sys.executable, str(Path(__file__).with_name("scripted_worker.py"))]
_init = Runtime.__init__


def scripted_init(self, *args, **kwargs):
    kwargs.setdefault("_worker_argv", SCRIPTED)
    _init(self, *args, **kwargs)


Runtime.__init__ = scripted_init

if __name__ == "__main__":
    sys.exit(main())
