# Session 21, on the CPU: the mix (A decoding, B long, C short) round after round with the prefix cache
# capped so that it evicts (and spills to the disk tier) from round 2 on: does the engine's peak jump then?
# PYTHONPATH=. .venv/bin/python docs/benchmarks/data/probes-s21/evict_mix.py 3000 30  (B tokens, cap MiB)
import sys
import tempfile
import time

import mlx.core as mx
from mlxrt.ipc.protocol import EngineOptions, Generate, SamplingParams
from mlxrt.worker.engine import Engine

from benchmarks.e2e import make_prompt, model_tokenizer


class Count:
    """A listener that counts the requests still running."""

    left = 0

    def started(self, *a):
        pass

    def token(self, *a, **k):
        pass

    def done(self, *a, **k):
        self.left -= 1

    def failed(self, req_id, exc):
        raise exc


def main() -> None:
    path, tok = model_tokenizer("synthetic:small")
    n, cap = int(sys.argv[1]), int(sys.argv[2])
    opts = EngineOptions(prompt_cache_dir=tempfile.mkdtemp(), prompt_cache_bytes=cap << 20)
    eng = Engine(path, options=opts)
    box, ids = Count(), iter(range(10**6))

    def submit(prompt: list[int], tokens: int) -> None:
        box.left += 1
        eng.submit(Generate(id=next(ids), prompt_ids=prompt,
                            params=SamplingParams(max_tokens=tokens, ignore_eos=True)), box)

    def steps(k: int | None = None) -> None:
        while box.left if k is None else k > 0:
            eng.step()
            k = None if k is None else k - 1

    for r in range(7):
        a, b, c, b1 = (make_prompt(tok, t, start=1000 * r + s)[0]
                       for t, s in ((64, 0), (n, 10), (60, 60), (n, 70)))
        base = mx.get_active_memory()
        mx.reset_peak_memory()
        t0 = time.time()
        submit(b1, 8)  # B alone
        steps()
        submit(a, 150)  # the mix: A decoding, then B, then C
        steps(5)
        submit(b, 8)
        steps(2)
        submit(c, 8)
        steps()
        print(f"round {r}: active before {base / 1e6:.0f} MB, peak {mx.get_peak_memory() / 1e6:.0f} MB, "
              f"after {mx.get_active_memory() / 1e6:.0f} MB, entries {len(eng.prefix_cache)}, "
              f"nbytes {eng.prefix_cache.nbytes / 1e6:.0f} MB, {time.time() - t0:.1f}s", flush=True)
    eng.close()


if __name__ == "__main__":
    main()
