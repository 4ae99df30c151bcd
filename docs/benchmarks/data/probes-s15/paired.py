"""Session 15: burst targets compared round by round (the harness's paired, rotating rounds), pooled over
harness JSON files.

    python paired.py FILE.json [...]                    every target over native-batch
    python paired.py --over "B name" "A name" FILE...   target A over target B, in files that ran both
"""

import json
import statistics
import sys


def ratios(files: list[str], a: str, b: str, level: str) -> list[tuple[float, float]]:
    """(throughput, TTFT) of `a` over `b` in each round at `level` streams, every file that ran both."""
    out = []
    for f in files:
        targets = json.load(open(f))["concurrency"]["targets"]
        if a in targets and b in targets:
            for x, y in zip(targets[a][level]["rounds"], targets[b][level]["rounds"], strict=True):
                out.append((x["aggregate_tps"] / y["aggregate_tps"], x["ttft_ms"] / y["ttft_ms"]))
    return out


def line(name: str, level: str, pairs: list[tuple[float, float]]) -> str:
    tps, ttft = [p[0] for p in pairs], [p[1] for p in pairs]
    return (f"{level:>3} {name:60s} n={len(pairs):2d}  tok/s x {statistics.median(tps):.2f} "
            f"[{min(tps):.2f}-{max(tps):.2f}] ahead in {sum(t > 1 for t in tps)}  TTFT x "
            f"{statistics.median(ttft):.2f} [{min(ttft):.2f}-{max(ttft):.2f}] "
            f"lower in {sum(t < 1 for t in ttft)}")


def main(argv: list[str]) -> None:
    if argv[0] == "--over":
        b, a, files = argv[1], argv[2], argv[3:]
        for level in ("16", "32"):
            if pairs := ratios(files, a, b, level):
                print(line(f"{a} / {b}", level, pairs))
        return
    names = sorted({n for f in argv for n in json.load(open(f))["concurrency"]["targets"]} - {"native-batch"})
    for level in ("16", "32"):
        for name in names:
            if pairs := ratios(argv, name, "native-batch", level):
                print(line(name, level, pairs))


if __name__ == "__main__":
    main(sys.argv[1:])
