"""A worker that starts loading only while GATE_FILE holds "open"; tests close the gate to make sure
that no new worker can become ready (a request answered meanwhile did not wait for a load)."""

import os
import sys
import time

GATE_WAIT_S = 120.0

gate = os.environ["GATE_FILE"]
deadline = time.monotonic() + GATE_WAIT_S
while open(gate).read().strip() != "open":
    if time.monotonic() > deadline:
        sys.exit(f"gated worker: {gate} did not open within {GATE_WAIT_S:g} s")
    time.sleep(0.02)
os.execv(sys.executable, [sys.executable, "-m", "mlxrt.worker"])
