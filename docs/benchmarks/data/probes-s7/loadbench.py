"""Where a disk-tier load's time goes: mlx-lm's load_prompt_cache against a threaded safetensors reader."""
import json, os, struct, sys, time
from concurrent.futures import ThreadPoolExecutor
import numpy as np
import mlx.core as mx
from mlx_lm.models.cache import KVCache, load_prompt_cache, save_prompt_cache

layers, heads, dim, tokens = (int(x) for x in (sys.argv[1:5] if len(sys.argv) > 4 else (36, 8, 128, 16000)))
path = sys.argv[5] if len(sys.argv) > 5 else "/tmp/kv.safetensors"
cache = []
for i in range(layers):
    c = KVCache()
    k = mx.random.normal((1, heads, tokens, dim)).astype(mx.bfloat16)
    v = mx.random.normal((1, heads, tokens, dim)).astype(mx.bfloat16)
    c.update_and_fetch(k, v)
    cache.append(c)
mx.eval([c.state for c in cache])
t = time.perf_counter(); save_prompt_cache(path, cache, {"x": "y"}); print(f"save {time.perf_counter()-t:.3f} s, {os.path.getsize(path)/1e9:.2f} GB", flush=True)
del cache
mx.clear_cache()

DT = {"BF16": (np.uint16, mx.bfloat16), "F16": (np.float16, mx.float16), "F32": (np.float32, mx.float32),
      "U32": (np.uint32, mx.uint32), "I32": (np.int32, mx.int32), "U8": (np.uint8, mx.uint8)}

def read_threaded(path, threads, chunk=64 << 20):
    fd = os.open(path, os.O_RDONLY)
    try:
        n = struct.unpack("<Q", os.pread(fd, 8, 0))[0]
        header = json.loads(os.pread(fd, n, 8))
        base = 8 + n
        size = os.fstat(fd).st_size - base
        buf = np.empty(size, dtype=np.uint8)
        mv = memoryview(buf)
        def part(off):
            end = min(off + chunk, size)
            got = os.preadv(fd, [mv[off:end]], base + off)
            assert got == end - off
        with ThreadPoolExecutor(threads) as ex:
            list(ex.map(part, range(0, size, chunk)))
    finally:
        os.close(fd)
    return header, buf

def to_mx(header, buf):
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        a, b = info["data_offsets"]
        npdt, mxdt = DT[info["dtype"]]
        arr = buf[a:b].view(npdt).reshape(info["shape"])
        x = mx.array(arr)
        if mxdt == mx.bfloat16:
            x = x.view(mx.bfloat16)
        out[name] = x
    return out

def timed(label, fn, rounds=3):
    ts = []
    for _ in range(rounds):
        mx.clear_cache()
        t = time.perf_counter(); r = fn(); ts.append(time.perf_counter() - t)
        del r
    print(f"{label}: " + " ".join(f"{x:.3f}" for x in ts), flush=True)

def mlxlm():
    c = load_prompt_cache(path)
    mx.eval([x.state for x in c])
    return c

def mxload():
    d = mx.load(path)
    mx.eval(list(d.values()))
    return d

timed("load_prompt_cache+eval", mlxlm)
timed("mx.load+eval", mxload)
for th in (1, 4, 8, 16):
    timed(f"preadv x{th} (numpy only)", lambda: read_threaded(path, th))
    def full(th=th):
        h, b = read_threaded(path, th)
        d = to_mx(h, b)
        mx.eval(list(d.values()))
        return d
    timed(f"preadv x{th} + mx.array + eval", full)
def numpy_to_mx():
    h, b = read_threaded(path, 8)
    t = time.perf_counter(); d = to_mx(h, b); mx.eval(list(d.values())); print(f"   (mx.array part {time.perf_counter()-t:.3f})")
    return d
timed("split", numpy_to_mx, 2)
os.unlink(path)
