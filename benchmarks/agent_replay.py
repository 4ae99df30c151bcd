"""Agent replay: the requests real coding agents sent, replayed by concurrent sessions.

`tests/test_agent_clis.py` drives Claude Code, Codex CLI and OpenCode through a tool round trip
behind a recording proxy; with ``MLXRT_AGENT_CAPTURE_DIR`` set it writes each CLI's requests
(path and body, as the CLI sent them) to a file. Those files, kept in
``benchmarks/data/agent-sessions/``, are the fixtures this benchmark replays: S sessions per CLI
at once, each sending its CLI's requests in order (the next when the last has answered), each
session's task text made its own (`SALT_AT`) so sessions share the agent's system prompt and
tools, as real ones do, and nothing after. Every request is streamed, greedy, its output limit
set to R tokens, against ``mlxrt serve`` (every API the CLIs use) and ``mlx_lm.server``
(chat completions only: OpenCode's sessions; Claude Code's /v1/messages and Codex's
/v1/responses are skipped there, named in the report).

Figures per CLI and server, over rounds: the hit rate (cached prompt tokens over prompt tokens,
as the server reported them, of the requests that continue a conversation of their session:
the same head (`conversation_head`) as an earlier one; OpenCode's title request is its own
conversation beside the agent's, and a session's first request of each is left out), TTFT per request
index (median and spread over sessions and rounds), and aggregate tok/s (every output token of
the round over its wall time). ``python -m benchmarks.agent_replay --help``.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx

from . import env
from .measure import spread

FIXTURES = Path(__file__).with_name("data") / "agent-sessions"
SALT_AT = "list the files here."  # each fixture's task holds it; a session's id goes after it
HTTP_TIMEOUT_S = 600.0
CHAT = "/v1/chat/completions"
DEFAULT_MODEL = "synthetic:tiny-qwen3?context=131072"


@dataclass(kw_only=True)
class Turn:
    """One replayed request as the client saw it (ms, s, tokens)."""

    cli: str
    server: str
    round: int
    session: int
    index: int  # 0-based position in the session
    later: bool  # continues an earlier request of the session (same conversation head)
    status: int
    ttft_ms: float | None
    total_s: float
    prompt_tokens: int | None
    cached_tokens: int | None
    output_tokens: int | None


def load_sessions(root: Path = FIXTURES) -> dict[str, list[dict[str, Any]]]:
    """Fixture name -> its requests (``path``, ``body``) in the order the CLI sent them."""
    out = {}
    for f in sorted(root.glob("*.json")):
        out[f.stem] = [{"path": e["path"], "body": e["body"]} for e in json.loads(f.read_text())
                       if e.get("body") is not None]
    if not out:
        raise SystemExit(f"no agent sessions in {root}: capture them with MLXRT_AGENT_CAPTURE_DIR={root} "
                         "pytest tests/test_agent_clis.py")
    return out


def prepared(body: dict[str, Any], path: str, *, model: str, salt: str, reply_tokens: int,
             mlxrt: bool) -> dict[str, Any]:
    """`body` for one session of the replay: its own task text, the served model's name, greedy,
    `reply_tokens` at most (EOS off on mlxrt, whose API takes ``ignore_eos``)."""
    text = json.dumps(body).replace(SALT_AT, f"{SALT_AT} ({salt})")
    out = {**json.loads(text), "model": model, "temperature": 0.0, "stream": True}
    if path.startswith("/v1/responses"):
        out["max_output_tokens"] = reply_tokens
    else:
        out["max_tokens"] = reply_tokens
    if path == CHAT:
        out["stream_options"] = {"include_usage": True}
    if mlxrt:
        out["ignore_eos"] = True
    return out


def conversation_head(body: dict[str, Any]) -> str:
    """What every request of one conversation begins with (its system text or first item): OpenCode's
    title request is a conversation of its own beside the agent's."""
    first = body.get("system") or (body.get("messages") or body.get("input") or [None])[0]
    return json.dumps(first, sort_keys=True)


def _first_output(event: dict[str, Any]) -> bool:
    """Whether an SSE event of any of the three APIs carries generated text or a call."""
    kind = event.get("type", "")
    if kind == "content_block_delta" or (kind.startswith("response.") and kind.endswith(".delta")):
        return True
    delta = ((event.get("choices") or [{}])[0] or {}).get("delta") or {}
    return any(delta.get(k) for k in ("content", "reasoning_content", "reasoning", "tool_calls"))


def _usage(event: dict[str, Any]) -> tuple[int, int, int] | None:
    """(prompt, cached, output) tokens where `event` reports usage, in any of the three APIs."""
    u = (event.get("response") or event.get("message") or event).get("usage") or {}
    if "cache_read_input_tokens" in u:
        cached = u.get("cache_read_input_tokens") or 0
        return (u.get("input_tokens") or 0) + cached, cached, u.get("output_tokens") or 0
    if "prompt_tokens" in u:
        cached = (u.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
        return u["prompt_tokens"], cached, u.get("completion_tokens") or 0
    if "input_tokens" in u and "output_tokens" in u:
        cached = (u.get("input_tokens_details") or {}).get("cached_tokens") or 0
        return u["input_tokens"], cached, u["output_tokens"]
    return None


def send(client: httpx.Client, base: str, path: str, body: dict[str, Any]) -> tuple[int, float | None, float,
                                                                                   tuple | None]:
    """Stream one request: (status, TTFT ms, total s, (prompt, cached, output) tokens or None)."""
    start = time.perf_counter()
    ttft = usage = None
    with client.stream("POST", base + path, json=body, timeout=HTTP_TIMEOUT_S) as r:
        for line in r.iter_lines():
            if not line.startswith("data:") or line[5:].strip() == "[DONE]":
                continue
            try:
                event = json.loads(line[5:])
            except ValueError:
                continue
            if ttft is None and _first_output(event):
                ttft = (time.perf_counter() - start) * 1000
            usage = _usage(event) or usage
        status = r.status_code
    return status, ttft, time.perf_counter() - start, usage


def replay(base: str, server: str, cli: str, requests: list[dict[str, Any]], *, sessions: int, round_: int,
           model: str, reply_tokens: int) -> tuple[list[Turn], float]:
    """`sessions` copies of one CLI's session at once against `base`; their turns and the wall time (s)."""
    turns: list[Turn] = []
    lock = threading.Lock()

    def session(i: int) -> None:
        seen: set[str] = set()
        with httpx.Client() as client:
            for k, req in enumerate(requests):
                head = conversation_head(req["body"])
                body = prepared(req["body"], req["path"], model=model, salt=f"session {i}, round {round_}",
                                reply_tokens=reply_tokens, mlxrt=server == "mlxrt-http")
                status, ttft, total, usage = send(client, base, req["path"], body)
                prompt, cached, output = usage or (None, None, None)
                with lock:
                    turns.append(Turn(cli=cli, server=server, round=round_, session=i, index=k,
                                      later=head in seen, status=status,
                                      ttft_ms=ttft, total_s=total, prompt_tokens=prompt, cached_tokens=cached,
                                      output_tokens=output))
                seen.add(head)

    start = time.perf_counter()
    threads = [threading.Thread(target=session, args=(i,)) for i in range(sessions)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return turns, time.perf_counter() - start


def figures(turns: list[Turn], walls: list[float]) -> dict[str, Any]:
    """Hit rate of the requests that continue a conversation, TTFT per request index, aggregate tok/s."""
    later = [t for t in turns if t.later and t.prompt_tokens]
    prompt = sum(t.prompt_tokens or 0 for t in later)
    cached = sum(t.cached_tokens or 0 for t in later)
    by_round: dict[int, int] = {}
    for t in turns:
        by_round[t.round] = by_round.get(t.round, 0) + (t.output_tokens or 0)
    rates = [by_round.get(r, 0) / w for r, w in enumerate(walls) if w > 0]
    indices = sorted({t.index for t in turns})
    return {
        "requests": len(turns),
        "non_2xx": sum(not 200 <= t.status < 300 for t in turns),
        "hit_rate_later": cached / prompt if prompt else None,
        "later_indices": sorted({t.index for t in later}),
        "ttft_ms_by_index": {i: spread([t.ttft_ms for t in turns if t.index == i and t.ttft_ms is not None])
                             for i in indices},
        "prompt_tokens_by_index": {i: max(t.prompt_tokens or 0 for t in turns if t.index == i)
                                   for i in indices},
        "tokens_per_s": spread(rates),
    }


def _server(name: str, model_path: str) -> Any:
    from .http_scenario import HttpStream, MlxLmServer

    return HttpStream(model_path) if name == "mlxrt-http" else MlxLmServer(model_path)


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Every CLI's sessions on every server, rounds alternating the servers; the whole document."""
    from mlxrt.worker.engine import resolve_model_path

    sessions = load_sessions(Path(args.fixtures))
    model_path = resolve_model_path(args.model)
    turns: list[Turn] = []
    walls: dict[tuple[str, str], list[float]] = {}
    skipped: dict[str, str] = {}
    live = {}
    for name in args.servers:
        s = _server(name, model_path)
        s.setup()
        live[name] = s
    try:
        for r in range(args.rounds):
            for name, s in live.items():
                base = s.base_url.removesuffix("/v1")
                for cli, requests in sessions.items():
                    if name == "mlx_lm.server" and any(q["path"] != CHAT for q in requests):
                        skipped[f"{cli} on {name}"] = "mlx_lm.server serves chat completions only"
                        continue
                    print(f"agent replay: round {r}, {cli} x{args.sessions} on {name}", file=sys.stderr)
                    got, wall = replay(base, name, cli, requests, sessions=args.sessions, round_=r,
                                       model=s.model, reply_tokens=args.reply_tokens)
                    turns += got
                    walls.setdefault((cli, name), []).append(wall)
    finally:
        for s in live.values():
            s.close()
    results = {f"{cli} on {name}": figures([t for t in turns if (t.cli, t.server) == (cli, name)], w)
               for (cli, name), w in walls.items()}
    return {"benchmark": "agent_replay", "machine": env.describe(), "model": args.model,
            "sessions": args.sessions, "rounds": args.rounds, "reply_tokens": args.reply_tokens,
            "fixtures": {cli: len(q) for cli, q in sessions.items()}, "results": results, "skipped": skipped,
            "turns": [asdict(t) for t in turns]}


def _ms(s: dict[str, float]) -> str:
    return "-" if not s.get("n") else f"{s['median']:.0f} [{s['min']:.0f}-{s['max']:.0f}]"


def table(doc: dict[str, Any]) -> str:
    """The report: one row per CLI and server."""
    rows = ["| CLI on server | requests (non-2xx) | hit rate, later turns | TTFT ms per request (median "
            "[min-max]; * a later turn) | tok/s |", "| --- | --- | --- | --- | --- |"]
    for key, f in doc["results"].items():
        by = f["ttft_ms_by_index"]
        ttfts = ", ".join(("*" if i in f["later_indices"] else "") + _ms(by[i]) for i in sorted(by))
        hit = "-" if f["hit_rate_later"] is None else f"{f['hit_rate_later']:.1%}"
        rows.append(f"| {key} | {f['requests']} ({f['non_2xx']}) | {hit} | {ttfts} "
                    f"| {f['tokens_per_s']['median']:.1f} |")
    rows += [f"skipped: {k}: {why}" for k, why in doc["skipped"].items()]
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.agent_replay", description=__doc__.split("\n")[0])
    p.add_argument("--model", default=DEFAULT_MODEL, help=f"default: {DEFAULT_MODEL}")
    p.add_argument("--fixtures", default=str(FIXTURES), help="directory of captured sessions (*.json)")
    p.add_argument("--sessions", type=int, default=4, help="sessions per CLI at once (default 4)")
    p.add_argument("--rounds", type=int, default=2, help="rounds, each alternating the servers (default 2)")
    p.add_argument("--reply-tokens", type=int, default=16, help="output limit of every request (default 16)")
    p.add_argument("--servers", nargs="+", default=["mlxrt-http", "mlx_lm.server"],
                   choices=["mlxrt-http", "mlx_lm.server"])
    p.add_argument("--out", default=None,
                   help="the JSON document (default bench-results/agent-replay-TIME.json)")
    args = p.parse_args(argv)
    doc = run(args)
    out = Path(args.out or f"bench-results/agent-replay-{time.strftime('%Y%m%d-%H%M%S')}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1))
    print(table(doc))
    print(f"document: {out}")
    summary = {k: {"hit": f["hit_rate_later"], "tok_s": f["tokens_per_s"]["median"],
                   "non_2xx": f["non_2xx"]} for k, f in doc["results"].items()}
    print(json.dumps(summary))
    return 0 if all(f["non_2xx"] == 0 for f in doc["results"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
