"""Images on a vision-language model: mlxrt's worker against mlx-vlm's own generate, in-process.

``python -m benchmarks.vision [--model REF] [--rounds N] [--tokens N] [--side PX]``

Each round, interleaved, on the same model (default ``synthetic:tiny-qwen2.5-vl``), greedy, EOS off:

- ``native``: mlx-vlm's ``stream_generate`` in this process, from the PNG's bytes (decoded with Pillow
  inside the timing, as the worker decodes them) to the last token;
- ``mlxrt-cold``: a new image (never seen by the worker) through `Runtime.stream` and a worker process;
- ``mlxrt-repeat``: the same image and prompt again, served from the worker's image cache;
- ``mlxrt-next-turn``: the chat's next turn (the reply, then a new question) with the same image: the
  earlier turn's KV is reused, only the new text prefilled;
- ``mlxrt-next-turn-off``: that next turn on a worker with its prefix cache off (`prompt_cache_bytes=0`);
- ``mlxrt-text+image``: a text request sent while an image request runs (a vision worker serves one
  request at a time): the text request's TTFT is the wait behind the image.

TTFT is measured by the caller (the first streamed token), decode tok/s by the worker's `Stats` (native:
tokens after the first over their time). Each round checks that the worker's reply (cold and repeated)
is mlx-vlm's token ids, and the next turn's the same with the prefix cache on and off. The table goes to
stdout, then the JSON document's path
(``--json``, benchmarks/runner.py) and a short summary line.
"""

from __future__ import annotations

import argparse
import io
import threading
import time
from importlib import metadata

from mlxrt import Runtime
from mlxrt.ipc.protocol import EngineOptions
from mlxrt.worker.engine import resolve_model_path
from mlxrt.worker.vision import load_model

from . import runner

QUESTION = "Describe this picture in detail."
NEXT_QUESTION = "Which colour is there most of, and where?"


def image(side: int, seed: int) -> bytes:
    """A `side` x `side` PNG with a pattern of its own per `seed` (never the same bytes twice)."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    pixels = rng.integers(0, 256, (side, side, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return buf.getvalue()


def messages(png: bytes) -> list[dict]:
    parts = [{"type": "image", "image": png}, {"type": "text", "text": QUESTION}]
    return [{"role": "user", "content": parts}]


def native(model, processor, png: bytes, tokens: int) -> dict:
    """mlx-vlm's own stream_generate from the PNG bytes: TTFT ms and decode tok/s."""
    from mlx_vlm import stream_generate
    from PIL import Image

    t0 = time.perf_counter()
    img = Image.open(io.BytesIO(png)).convert("RGB")
    prompt = processor.tokenizer.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]}],
        tokenize=False, add_generation_prompt=True)
    times = []
    ids = []
    prompt_tokens = 0
    for result in stream_generate(model, processor, prompt, image=[img], max_tokens=tokens, temperature=0.0):
        times.append(time.perf_counter())
        if result.token is not None:
            ids.append(int(result.token))
        prompt_tokens = result.prompt_tokens
    n = len(times)
    return {"ttft_ms": (times[0] - t0) * 1e3,
            "decode_tps": (n - 1) / (times[-1] - times[0]) if n > 1 and times[-1] > times[0] else 0.0,
            "tokens": n, "prompt_tokens": prompt_tokens, "ids": ids[:tokens]}


def through_worker(rt: Runtime, prompt, tokens: int) -> dict:
    """One request through the runtime: the caller's TTFT ms, the worker's decode tok/s and cache use."""
    t0 = time.perf_counter()
    stream = rt.stream(prompt, max_tokens=tokens, ignore_eos=True, temperature=0.0)
    first = None
    text = []
    ids = []
    for chunk in stream:
        first = first or time.perf_counter()
        text.append(chunk.text)
        ids += chunk.tokens
    s = stream.stats
    return {"ttft_ms": ((first or time.perf_counter()) - t0) * 1e3, "decode_tps": s.decode_tps,
            "tokens": s.generation_tokens, "prompt_tokens": s.prompt_tokens, "cached_tokens": s.cached_tokens,
            "text": "".join(text), "ids": ids}


def text_behind_image(rt: Runtime, png: bytes, tokens: int, n: int) -> dict:
    """A text request (new text: `n`) sent just after an image request starts: the text request's figures."""
    worker = threading.Thread(target=through_worker, args=(rt, messages(png), tokens))
    worker.start()
    time.sleep(0.005)  # the image request is sent first
    text = through_worker(rt, [{"role": "user", "content": f"{QUESTION} ({n})"}], tokens)
    worker.join(300)
    return text


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.vision", description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="synthetic:tiny-qwen2.5-vl", help="a vision-language model")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=64, help="tokens generated per request")
    ap.add_argument("--side", type=int, default=448, help="the images' side, pixels")
    ap.add_argument("--transport", default="auto", choices=["auto", "ring", "stdio"])
    runner.add_json_arg(ap, study="vision")
    a = ap.parse_args(argv)
    path = resolve_model_path(a.model)
    model, processor = load_model(path)  # as a worker runs it (on CUDA: the vision tower in float32)
    rt = Runtime(model=path, transport=a.transport)
    off = Runtime(model=path, transport=a.transport, engine=EngineOptions(prompt_cache_bytes=0))
    names = ("native", "mlxrt-cold", "mlxrt-repeat", "mlxrt-next-turn", "mlxrt-next-turn-off",
             "mlxrt-text+image")
    runs: dict[str, list[dict]] = {n: [] for n in names}
    identical: list[bool] = []
    try:
        for r in range(a.rounds + 1):  # round 0 compiles and warms: not kept
            png = image(a.side, r)
            row = {"native": native(model, processor, png, a.tokens),
                   "mlxrt-cold": through_worker(rt, messages(png), a.tokens),
                   "mlxrt-repeat": through_worker(rt, messages(png), a.tokens)}
            turn = messages(png) + [{"role": "assistant", "content": row["mlxrt-cold"]["text"]},
                                    {"role": "user", "content": NEXT_QUESTION}]
            row["mlxrt-next-turn"] = through_worker(rt, turn, a.tokens)
            through_worker(off, messages(png), 1)  # the same history on the other worker, unmeasured
            row["mlxrt-next-turn-off"] = through_worker(off, turn, a.tokens)
            row["mlxrt-text+image"] = text_behind_image(rt, image(a.side, 1000 + r), a.tokens, r)
            same = (row["native"]["ids"] == row["mlxrt-cold"]["ids"] == row["mlxrt-repeat"]["ids"]
                    and row["mlxrt-next-turn"]["ids"] == row["mlxrt-next-turn-off"]["ids"])
            if r:
                identical.append(same)
                for n in names:
                    runs[n].append(row[n])
    finally:
        rt.close()
        off.close()
    ttft = {n: [x["ttft_ms"] for x in runs[n]] for n in names}
    tps = {n: [x["decode_tps"] for x in runs[n]] for n in names}
    prompt_tokens = runs["mlxrt-cold"][0]["prompt_tokens"] if runs["mlxrt-cold"] else 0
    print(f"{a.model} on {runner.environment()['device']}, {a.rounds} rounds, {a.side}x{a.side} PNG, "
          f"{prompt_tokens}-token prompt (image included), {a.tokens} tokens; median [min-max]")
    print(f"{'scenario':20} {'TTFT ms':>24} {'decode tok/s':>24} {'prompt tokens':>14} {'cached tokens':>14}")
    for n in names:
        cached = [x.get("cached_tokens", 0) for x in runs[n]]
        prompt = [x.get("prompt_tokens", 0) for x in runs[n]]
        print(f"{n:20} {runner.span(ttft[n]):>24} {runner.span(tps[n]):>24} {runner.span(prompt, '.0f'):>14} "
              f"{runner.span(cached, '.0f'):>14}")
    print(f"replies identical (native, cold, repeat; the next turn cached and not): "
          f"{sum(identical)}/{len(identical)} rounds")
    env = runner.environment()
    env["versions"]["mlx-vlm"] = metadata.version("mlx-vlm")  # env.describe knows only mlx-lm's family
    result = {"model": a.model, "rounds": a.rounds, "tokens": a.tokens, "side": a.side,
              "prompt_tokens": prompt_tokens, "identical": identical, "runs": runs, "env": env}
    medians = {n: runner.span(ttft[n], rng=False) for n in names}
    runner.finish(result, runner.json_path(a.json, "vision"),
                  {"benchmark": "mlxrt-vision", "model": a.model, "ttft_ms_median": medians,
                   "identical": f"{sum(identical)}/{len(identical)}"})
    return result


if __name__ == "__main__":
    main()
