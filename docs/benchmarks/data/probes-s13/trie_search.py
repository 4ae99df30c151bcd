# A throwaway probe of session 13: mlx-lm's PromptTrie.search, mlxrt's _Trie.search and _Trie.below_floor,
# each from a prompt's 32nd token into one cached entry of N tokens (the prefix floor's test before and
# after 6476b75), the trie alone.
#   python docs/benchmarks/data/probes-s13/trie_search.py
import time

from mlx_lm.models.cache import PromptTrie
from mlxrt.worker.prefix_cache import _Trie

for n in (669, 2500, 10000, 41000):
    trie, entry = _Trie(), [(i * 7) % 1000 + 5 for i in range(n)]
    trie.add("m", entry, object())
    k, cells = (3 if n > 10000 else 20), []
    head = entry[:32]
    for name, f in (("mlx-lm search", lambda t, h: PromptTrie.search(t, "m", h)),
                    ("_Trie.search", lambda t, h: t.search("m", h)),
                    ("below_floor", lambda t, h: t.below_floor("m", h))):
        t0 = time.perf_counter()
        for _ in range(k):
            f(trie, head)
        cells.append(f"{name} {(time.perf_counter() - t0) / k * 1e3:.2f} ms")
    print(f"{n:6d}-token entry: " + " | ".join(cells))
