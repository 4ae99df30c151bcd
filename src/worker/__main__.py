"""``python -m mlxrt.worker``: one MLX worker process, driven over its stdin."""

import sys

# The worker's logs are JSON lines with plain tracebacks (logs.configure(json=True)): rich, which structlog
# imports for its console renderer wherever it is installed, would only cost 50 ms of every start.
sys.modules.setdefault("rich", None)  # type: ignore[arg-type]

from .main import main  # noqa: E402

if __name__ == "__main__":
    main()
