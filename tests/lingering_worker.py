"""The real worker, leaving behind a child that holds every file it had: after the worker dies, its pipes
and ring stay open (as a CUDA worker's do while the driver tears its context down, for 100-350 ms),
here until LINGER_S (default 120 s) or until the test kills the child, whose pid goes to LINGER_PID_FILE.
"""

import os
import time

if os.fork() == 0:  # the child: holds the inherited descriptors and does nothing else
    with open(os.environ["LINGER_PID_FILE"], "a") as f:
        f.write(f"{os.getpid()}\n")
    time.sleep(float(os.environ.get("LINGER_S", "120")))
    os._exit(0)

from mlxrt.worker.main import main  # noqa: E402

if __name__ == "__main__":
    main()
