"""Session 20: does a decode step overlap a long prompt's chunk when the two run on separate MLX streams?

A stream A decodes one token a step (a short cache); a long prompt B prefills `--chunk` tokens a step over a
cache `--depth` deep (trimmed back after each step, so every step has the same shape). Each way is timed
for `--steps` steps after `--warm` unmeasured ones, the ways interleaved step by step:
- `chunk`: B's chunk alone; `decode`: A's step alone;
- `serial`: the chunk, evaluated, then A's step on the same stream (the engine as it is);
- `overlap`: the chunk launched on a stream of its own (`mx.async_eval`), A's step on the default stream
  evaluated, then the chunk waited for. `a_ms` is when A's token was in hand.
Usage: python overlap.py MODEL [--depth 20480] [--chunk 1024] [--a-depth 512] [--steps 15]
"""

import argparse
import statistics
import time

import mlx.core as mx
from mlx_lm import load
from mlx_lm.models.cache import make_prompt_cache
from mlxrt.synthetic.build import ensure_model


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--depth", type=int, default=20480)
    ap.add_argument("--chunk", type=int, default=1024)
    ap.add_argument("--a-depth", type=int, default=512)
    ap.add_argument("--steps", type=int, default=15)
    ap.add_argument("--warm", type=int, default=3)
    args = ap.parse_args()
    name = args.model.removeprefix("synthetic:")
    model, _ = load(str(ensure_model(name)) if args.model.startswith("synthetic:") else args.model)
    vocab = model.args.vocab_size
    dev = mx.default_device()
    main_s, side_s = mx.default_stream(dev), mx.new_stream(dev)

    def tokens(n: int, seed: int) -> mx.array:
        return mx.random.randint(0, vocab, (1, n), key=mx.random.key(seed))

    cb, ca = make_prompt_cache(model), make_prompt_cache(model)
    for i in range(0, args.depth, 2048):
        model(tokens(min(2048, args.depth - i), i), cache=cb)
        mx.eval([c.state for c in cb])
    model(tokens(args.a_depth, 7), cache=ca)
    mx.eval([c.state for c in ca])
    xb, xa = tokens(args.chunk, 11), tokens(1, 13)

    def chunk(stream) -> None:
        with mx.stream(stream):
            model(xb, cache=cb)
            return [c.state for c in cb]

    def decode() -> mx.array:
        with mx.stream(main_s):
            return model(xa, cache=ca)[:, -1].argmax(-1)

    def trim(cache, n):
        for c in cache:
            c.trim(n)

    def way_chunk():
        t0 = time.perf_counter()
        mx.eval(chunk(main_s))
        t = time.perf_counter() - t0
        trim(cb, args.chunk)
        return t, None

    def way_decode():
        t0 = time.perf_counter()
        mx.eval(decode())
        t = time.perf_counter() - t0
        trim(ca, 1)
        return t, t

    def way_serial():
        t0 = time.perf_counter()
        mx.eval(chunk(main_s))
        mx.eval(decode())
        t = time.perf_counter() - t0
        trim(cb, args.chunk)
        trim(ca, 1)
        return t, t

    def way_overlap():
        t0 = time.perf_counter()
        states = chunk(side_s)
        mx.async_eval(states)
        mx.eval(decode())
        ta = time.perf_counter() - t0
        mx.eval(states)
        t = time.perf_counter() - t0
        trim(cb, args.chunk)
        trim(ca, 1)
        return t, ta

    ways = {"chunk": way_chunk, "decode": way_decode, "serial": way_serial, "overlap": way_overlap}
    times = {k: [] for k in ways}
    a_times = {k: [] for k in ways}
    for step in range(args.warm + args.steps):
        for k, f in ways.items():
            t, ta = f()
            if step >= args.warm:
                times[k].append(t * 1e3)
                if ta is not None:
                    a_times[k].append(ta * 1e3)
    print(f"model {args.model} device {dev} depth {args.depth} chunk {args.chunk} a-depth {args.a_depth} "
          f"steps {args.steps} mlx {mx.__version__}")
    for k in ways:
        v = times[k]
        a = a_times[k]
        print(f"{k:8s} median {statistics.median(v):8.1f} ms [{min(v):.1f}-{max(v):.1f}]"
              + (f"  A's token at {statistics.median(a):.1f} ms" if a else ""))
    gain = statistics.median(times["serial"]) - statistics.median(times["overlap"])
    print(f"overlap saves {gain:.1f} ms a step of the serial's {statistics.median(times['serial']):.1f}")


if __name__ == "__main__":
    main()
