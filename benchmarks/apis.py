"""``python -m benchmarks.apis``: streaming through Anthropic Messages and OpenAI Responses against chat
completions, on one ``mlxrt serve``.

One server subprocess (one worker, prefix cache off: `http_scenario.HttpStream`) serves the model.
Each round streams the same greedy chat (a system prompt and a user message, ``max_tokens`` tokens)
through /v1/chat/completions, /v1/messages and /v1/responses, in an order that rotates from round to
round, ``--streams`` requests at a time. The client is stdlib ``http.client``, one connection per
request, and treats every API alike: it stamps each event that carries answer text and takes the
token count from the API's own usage. A stream's decode rate is (tokens - 1) / (last text event -
first text event); with several streams, the round's rate is all their tokens after the first over
the window from the first text event to the last. Every round checks that the three APIs returned
the same text and the same token count. After one unmeasured round, medians and spread are reported,
and each API's rate over chat completions' paired by round.

A table goes to stdout, then the path of the JSON document (``--json``, benchmarks/runner.py) and
a short summary line.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import msgspec
from mlxrt.synthetic.build import ensure_model

from . import runner
from .concurrency import run_threads
from .env import default_preset
from .http_scenario import MODEL_NAME, HttpStream, sse_data
from .measure import ratio_spread, spread

SYSTEM = "You are a storyteller."
USER = "Tell me a long story about the sea, the tide and the gulls."
APIS = ("chat", "messages", "responses")


@dataclass
class Stream:
    """One streamed request as the client saw it: text-event times (perf_counter s), text, token count."""

    start: float
    times: list[float]
    text: str
    tokens: int

    @property
    def decode_tps(self) -> float:
        span = self.times[-1] - self.times[0] if len(self.times) > 1 else 0.0
        return (self.tokens - 1) / span if span > 0 else float("nan")


def _events(port: int, path: str, body: dict[str, Any]) -> Iterator[tuple[float, dict]]:
    """POST `body`; yield (arrival time, decoded data) for each SSE ``data:`` line, up to ``[DONE]``."""
    for data in sse_data(port, path, body):
        yield time.perf_counter(), msgspec.json.decode(data)


def chat(port: int, tokens: int) -> Stream:
    body = {"model": MODEL_NAME, "max_tokens": tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True},
            "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": USER}]}
    s = Stream(time.perf_counter(), [], "", 0)
    for t, e in _events(port, "/v1/chat/completions", body):
        if e.get("usage"):
            s.tokens = e["usage"]["completion_tokens"]
        elif e["choices"] and e["choices"][0]["delta"].get("content"):
            s.times.append(t)
            s.text += e["choices"][0]["delta"]["content"]
    return s


def messages(port: int, tokens: int) -> Stream:
    body = {"model": MODEL_NAME, "max_tokens": tokens, "temperature": 0, "stream": True, "system": SYSTEM,
            "messages": [{"role": "user", "content": USER}]}
    s = Stream(time.perf_counter(), [], "", 0)
    for t, e in _events(port, "/v1/messages", body):
        if e["type"] == "content_block_delta" and e["delta"]["type"] == "text_delta":
            s.times.append(t)
            s.text += e["delta"]["text"]
        elif e["type"] == "message_delta":
            s.tokens = e["usage"]["output_tokens"]
        elif e["type"] == "error":
            raise RuntimeError(f"server error mid-stream: {e}")
    return s


def responses(port: int, tokens: int) -> Stream:
    body = {"model": MODEL_NAME, "max_output_tokens": tokens, "temperature": 0, "stream": True,
            "store": False, "instructions": SYSTEM, "input": USER}
    s = Stream(time.perf_counter(), [], "", 0)
    for t, e in _events(port, "/v1/responses", body):
        if e["type"] == "response.output_text.delta":
            s.times.append(t)
            s.text += e["delta"]
        elif e["type"] in ("response.completed", "response.incomplete"):
            s.tokens = e["response"]["usage"]["output_tokens"]
        elif e["type"] == "response.failed":
            raise RuntimeError(f"server error mid-stream: {e}")
    return s


CLIENTS: dict[str, Callable[[int, int], Stream]] = {
    "chat": chat, "messages": messages, "responses": responses}


@dataclass(frozen=True)
class _Client:
    """One API's client as a `run_threads` scenario: each run streams one request."""

    api: str
    port: int

    def run(self, _prompt: None, tokens: int) -> Stream:
        return CLIENTS[self.api](self.port, tokens)


def together(api: str, port: int, tokens: int, streams: int) -> tuple[float, list[Stream]]:
    """`streams` requests through `api` at once: the aggregate decode rate (tokens/s) and the streams."""
    done = run_threads(_Client(api, port), [None] * streams, tokens)
    if streams == 1:
        return done[0].decode_tps, done
    first = min(s.times[0] for s in done)
    last = max(s.times[-1] for s in done)
    return sum(s.tokens - 1 for s in done) / (last - first), done


class _Replay:
    """Stands in for a generation's `AsyncStream`: replays chunks, as the worker would send them."""

    def __init__(self, chunks: list) -> None:
        from mlxrt.ipc.protocol import Stats

        self._it = iter(chunks)
        self.stats = Stats(prompt_tokens=32, generation_tokens=len(chunks), finish_reason="length")
        self.finish_reason = "length"
        self.choice_stats: dict = {}  # per-choice stats of n > 1; one choice here, as AsyncStream's

    def __aiter__(self) -> _Replay:
        return self

    async def __anext__(self):
        try:
            return next(self._it)
        except StopIteration:
            raise StopAsyncIteration from None

    def close(self) -> None:
        pass


def encode_cost(tokens: int, rounds: int) -> dict[str, Any]:
    """Microseconds per token of each API's streaming encoder alone, in-process: its event generator
    over `tokens` one-token chunks (what the server does per token, less the ASGI send)."""
    import asyncio

    from mlxrt.orchestrator.http import anthropic, openai, responses
    from mlxrt.orchestrator.http.anthropic_schemas import Message, Usage
    from mlxrt.orchestrator.http.responses_schemas import ResponsesRequest
    from mlxrt.orchestrator.http.service import Generation
    from mlxrt.orchestrator.runtime import Chunk

    def generation() -> Generation:
        chunks = [Chunk(text=f" word{i % 50}", tokens=[i % 1000]) for i in range(tokens)]
        return Generation(None, "bench", MODEL_NAME, _Replay(chunks), 0.0)  # type: ignore[arg-type]

    def message() -> Message:
        return Message(id="msg_1", model=MODEL_NAME, content=[], usage=Usage(input_tokens=0, output_tokens=0))

    encoders = {
        "chat": lambda g: openai.chat_events(g, "chatcmpl-1", 0, usage=True, token_ids=False),
        "messages": lambda g: anthropic.message_events(g, message(), thinking=True),
        "responses": lambda g: responses.response_events(g, responses.Turn(
            ResponsesRequest(model=MODEL_NAME, input="x", store=False), [], responses.ResponseStore(0))),
    }

    async def drain(events) -> int:
        return sum([len(b) async for b in events])

    us: dict[str, list[float]] = {api: [] for api in APIS}
    size: dict[str, int] = {}
    for r in range(rounds + 1):
        for api in APIS[r % 3:] + APIS[: r % 3]:
            gen = generation()
            t0 = time.perf_counter()
            size[api] = asyncio.run(drain(encoders[api](gen)))
            if r:
                us[api].append((time.perf_counter() - t0) * 1e6 / tokens)
    return {"tokens": tokens, "rounds": rounds, "us_per_token": {a: spread(v) for a, v in us.items()},
            "bytes_per_token": {a: size[a] / tokens for a in APIS}}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.apis", description=__doc__.splitlines()[0])
    p.add_argument("--preset", default=None, help="synthetic preset (default: small on a CPU, the real "
                                                   "0.5B shape on a GPU)")
    p.add_argument("--model", default=None, help="a model directory instead of a preset")
    p.add_argument("--tokens", type=int, default=256, help="max tokens per request (default 256)")
    p.add_argument("--rounds", type=int, default=7, help="measured rounds (default 7)")
    p.add_argument("--streams", type=int, default=1, help="requests at a time per API (default 1)")
    p.add_argument("--encode", action="store_true",
                   help="only the per-token cost of each API's streaming encoder, in-process (no model)")
    runner.add_json_arg(p, study="apis")
    args = p.parse_args(argv)
    if args.encode:
        return print_encode_cost(encode_cost(20_000, args.rounds), args.json)
    preset = args.preset or default_preset()
    path = args.model or str(ensure_model(preset))
    server = HttpStream(path, extra_args=["--prompt-cache-bytes", "0"])
    server.setup()
    rates: dict[str, list[float]] = {api: [] for api in APIS}
    ttft: dict[str, list[float]] = {api: [] for api in APIS}
    identical = []
    try:
        for r in range(args.rounds + 1):
            order = APIS[r % 3:] + APIS[: r % 3]
            got: dict[str, list[Stream]] = {}
            for api in order:
                rate, got[api] = together(api, server.port, args.tokens, args.streams)
                if r:
                    rates[api].append(rate)
                    ttft[api].extend((s.times[0] - s.start) * 1e3 for s in got[api])
            ref = got["chat"][0]
            same = all((s.text, s.tokens) == (ref.text, ref.tokens) for ss in got.values() for s in ss)
            if r:
                identical.append(same)
                print(f"round {r}: " + ", ".join(f"{a} {rates[a][-1]:.1f}" for a in APIS)
                      + f" tok/s; identical: {same}", file=sys.stderr)
    finally:
        server.close()
    out = {"preset": args.model or preset, "tokens": args.tokens, "rounds": args.rounds,
           "streams": args.streams, "env": runner.environment(), "identical_every_round": all(identical),
           "decode_tps": {a: spread(v) for a, v in rates.items()},
           "ttft_ms": {a: spread(v) for a, v in ttft.items()},
           "over_chat": {a: ratio_spread(rates[a], rates["chat"]) for a in ("messages", "responses")},
           "raw_decode_tps": rates}
    print(f"{out['preset']}, {args.streams} stream(s), {args.tokens} tokens, {args.rounds} rounds "
          f"(median [min-max])")
    print("| API | decode tok/s | TTFT ms | rate / chat completions (paired by round) |")
    print("|---|---|---|---|")
    for a in APIS:
        d, t = out["decode_tps"][a], out["ttft_ms"][a]
        ratio = out["over_chat"].get(a)
        rel = runner.span(ratio, ".3f") if ratio else "1"
        print(f"| {a} | {runner.span(d)} | {t['median']:.1f} | {rel} |")
    same = out["identical_every_round"]
    print(f"\nsame text and token count through all three APIs in every round: {same}")
    medians = {a: out["over_chat"][a]["median"] for a in out["over_chat"]}
    runner.finish(out, runner.json_path(args.json, "apis"), {
        "benchmark": "mlxrt-apis", "identical_every_round": same, "over_chat_median": medians})
    return 0 if all(identical) else 1


def print_encode_cost(out: dict[str, Any], json_arg: str | None = None) -> int:
    print(f"streaming encoders, {out['tokens']} one-token chunks, {out['rounds']} rounds (median [min-max])")
    print("| API | us per token | bytes per token |")
    print("|---|---|---|")
    for a in APIS:
        u = out["us_per_token"][a]
        size = out["bytes_per_token"][a]
        print(f"| {a} | {runner.span(u, '.2f')} | {size:.0f} |")
    out["env"] = runner.environment()
    medians = {a: out["us_per_token"][a]["median"] for a in APIS}
    runner.finish(out, runner.json_path(json_arg, "apis-encode"),
                  {"benchmark": "mlxrt-apis-encode", "us_per_token_median": medians})
    return 0


if __name__ == "__main__":
    sys.exit(main())
