"""A worker that completes the handshake, then breaks the channel on purpose.

Used where the real worker cannot misbehave on demand: malformed, truncated
and oversized frames. FAKE_MODE picks the fault.
"""

import os
import struct
import sys
import time

from mlxrt.ipc.protocol import PROTOCOL_VERSION, Generate, Hello, Ready, worker_codec
from mlxrt.ipc.stdio import PipeReceiver, PipeSender


def main() -> None:
    codec = worker_codec()
    rx, tx = PipeReceiver(0), PipeSender(1)
    hello = codec.decode(rx.recv())
    assert isinstance(hello, Hello)
    tx.send(codec.encode(Ready(protocol=PROTOCOL_VERSION, pid=os.getpid(), model=hello.model,
                               context_length=512, vocab_size=100, load_s=0.0, warmup_s=0.0,
                               mlx_version="fake", mlx_lm_version="fake", device="fake")))
    mode = os.environ["FAKE_MODE"]
    if mode == "deaf":  # alive, but never reads its input again
        time.sleep(600)
    while True:
        msg = codec.decode(rx.recv())
        if not isinstance(msg, Generate):
            continue
        if mode == "garbage":
            tx.send(b"\xc1\xff not msgpack")
        elif mode == "wrong_type":
            tx.send(codec.encode(Ready(protocol=1, pid=1, model="x", context_length=1, vocab_size=1,
                                       load_s=0, warmup_s=0, mlx_version="", mlx_lm_version="",
                                       device="")).replace(b"ready", b"bogus"))
        elif mode == "truncated":
            os.write(1, struct.pack("<I", 1000) + b"0123456789")
            os._exit(0)
        elif mode == "silent":
            pass
        elif mode == "huge_length":
            os.write(1, struct.pack("<I", 0xFFFFFFFF))
        sys.stdin.read()  # wait to be stopped


if __name__ == "__main__":
    main()
