"""A worker that loads normally while FLAKY_STATE holds "ok", and crashes at start-up otherwise.

Each start appends a line to FLAKY_STATE + ".starts", so tests can count restarts.
"""

import os
import sys

state = os.environ["FLAKY_STATE"]
with open(state + ".starts", "a") as f:
    f.write("start\n")
with open(state) as f:
    mode = f.read().strip()
if mode != "ok":
    print("flaky worker: crashing at start-up on purpose", file=sys.stderr)
    sys.exit(1)
os.execv(sys.executable, [sys.executable, "-m", "mlxrt.worker"])
