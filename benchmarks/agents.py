"""The agent part: N agents, each a growing multi-turn chat over one shared system prompt.

Every agent holds its own conversation: a system prompt shared by all agents
(``system_words`` words of the synthetic corpus, seeded per round), then T
turns of a new user message and the server's reply. Each turn sends the whole
conversation so far as chat messages with the official ``openai`` client, so a
server that reuses prompt prefixes prefills only what is new; one that does
not prefills everything again. All agents run at once, one thread each.

Per turn index the report has TTFT (median and spread over agents and rounds),
the prompt tokens and, where the server reports it,
``usage.prompt_tokens_details.cached_tokens``. The reference is the uncached
TTFT: every agent's final-turn prompt sent alone, one at a time, to a fresh
server of the same kind with its prompt cache off (``mlxrt serve
--prompt-cache-bytes 0``, ``mlx_lm.server --prompt-cache-size 0``, ``vllm-mlx serve
--disable-prefix-cache``). A turn's
TTFT over it says what reuse saved; turn TTFTs also include waiting behind the
other agents' work, which the lone uncached request does not.

``native-engine`` runs the same agents in-process on mlxrt's `Engine` (the
loop the worker runs, with no process, transport or HTTP around it): each
agent's next turn is submitted the moment its reply ends, and TTFT is taken
from submission to the first token. Its gap to ``mlxrt-http`` is what the
process split and the HTTP server cost; its gap to ``mlx_lm.server`` is the
engine's.

``mlxrt-http ARGS`` (``--agent-mlxrt-args ARGS``, once per variant) is one more mlxrt serve
started with ARGS added after the shared flags (a repeated flag is the variant's), in the same
rounds: an A/B of a serve flag on the same workload, such as ``--gather-ms=0`` against the
default. ``NAME=value`` words leading ARGS set the server's environment instead, as a shell's do
(its workers inherit it), e.g. ``MLX_CUDA_USE_CUDNN_SDPA=0``. Its uncached reference is mlxrt-http's (the same
final-turn prompts where the replies are the same).

Each server keeps its own prompt cache cap unless ``prompt_cache_bytes`` gives
one to all (``--prompt-cache-bytes``, the flag of that name on mlxrt serve and
mlx_lm.server; vllm-mlx's ``--cache-memory-mb``, in MiB; mlx_lm.server counts its
running batch's KV against it, mlxrt only what it stores).

Greedy, ``max_tokens`` = R; mlxrt gets ``ignore_eos``; mlx_lm.server runs with
its EOS ids cleared, vllm-mlx with its scheduler's stop tokens emptied
(`benchmarks.http_scenario`). Each reply's token count is
recorded all the same. Rounds alternate the servers, each round starting one
server further along (A B C, B C A, C A B): no server always runs first (on an
H200 the first of each round ran at 0.87x the next, the same engine with a trace
probe loaded: docs/benchmarks/gpu-h200-s13.md). Each
round has its own system prompt so no round is served from an earlier one's cache.
"""

from __future__ import annotations

import json
import random
import shlex
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from functools import partial
from importlib import resources
from typing import Any

from .measure import spread
from .scenarios import Skipped

#: The issue's sizes; the default on a GPU, and with --full.
FULL = {"agents": 8, "turns": 6, "reply_tokens": 64, "system_words": 1500}
#: `make bench` on a CPU (the small preset prefills ~300 tokens/s on 2 cores).
CPU = {"agents": 4, "turns": 4, "reply_tokens": 32, "system_words": 400}
#: --quick.
QUICK = {"agents": 2, "turns": 2, "reply_tokens": 16, "system_words": 150}
USER_WORDS = 24  # words of corpus text in each user message
WARMUP_TOKENS = 4
HTTP_TIMEOUT_S = 600.0
NO_CACHE_ARGS = {"mlxrt-http": ["--prompt-cache-bytes", "0"], "mlx_lm.server": ["--prompt-cache-size", "0"],
                 "vllm-mlx": ["--disable-prefix-cache"]}
SERVERS = ("mlxrt-http", "mlx_lm.server", "vllm-mlx")  # mlxrt serve, then the peers
NATIVE = "native-engine"  # mlxrt's Engine in-process: the agent part's native baseline

Messages = list[dict[str, str]]
Say = Callable[[str], None]


@dataclass(frozen=True, kw_only=True)
class Sizes:
    """How big the agent workload is."""

    agents: int
    turns: int
    reply_tokens: int
    system_words: int
    #: Words of corpus text in each user message (fewer: more turns fit a small model's context).
    user_words: int = USER_WORDS
    rounds: int = 1
    #: Unmeasured rounds on every server before the measured ones (kernel compilation, caches).
    warmup_rounds: int = 0
    #: The prompt cache's byte cap given to every server (``--prompt-cache-bytes`` on mlxrt serve and
    #: mlx_lm.server, the engine's option); None: each server's own default. The budgets differ:
    #: mlxrt's bounds the stored prefixes, mlx_lm.server 0.32 charges its running batch's KV too.
    prompt_cache_bytes: int | None = None


def variant_name(args: list[str]) -> str:
    """The name of mlxrt serve started with `args` added (quoted as a shell would), a variant of the agent
    part's or the bursts'."""
    return shlex.join([SERVERS[0], *args])


def cap_args(sizes: Sizes, server: str = SERVERS[0]) -> list[str]:
    """`server`'s flags for `sizes`' prompt cache cap (none when each keeps its own default): vllm-mlx
    takes its cache's memory in whole MiB (``--cache-memory-mb``, rounded up; a cap of 0 is its cache off),
    the others bytes."""
    n = sizes.prompt_cache_bytes
    if n is None:
        return []
    if server == "vllm-mlx":
        return NO_CACHE_ARGS[server] if n == 0 else ["--cache-memory-mb", str(-(-n // (1 << 20)))]
    return ["--prompt-cache-bytes", str(n)]


@dataclass(kw_only=True)
class Reply:
    """One chat request as the client saw it (times in ms and s, counts in tokens)."""

    agent: int
    turn: int  # 1-based
    round: int
    ttft_ms: float
    total_s: float
    reply_tokens: int
    prompt_tokens: int | None
    cached_tokens: int | None  # None: the server did not report it
    finish_reason: str | None
    text: str = field(repr=False)


# ---------------------------------------------------------------- the workload


def _corpus_words() -> list[str]:
    return resources.files("mlxrt.synthetic").joinpath("corpus.txt").read_text(encoding="utf-8").split()


def _words(n: int, rng: random.Random) -> str:
    """`n` consecutive corpus words from a place `rng` picks, wrapping at the end."""
    words = _corpus_words()
    start = rng.randrange(len(words))
    return " ".join(words[(start + i) % len(words)] for i in range(n))


def system_prompt(words: int, *, seed: int) -> str:
    """The shared system prompt of round `seed`: `words` words of the synthetic corpus.

    The seeded words come first, so two rounds share no more than the chat template's opening tokens.
    """
    return _words(words, random.Random(seed)) + "\n\nYou are one of a team of careful assistants."


def user_message(agent: int, turn: int, *, seed: int, words: int = USER_WORDS) -> str:
    """Agent `agent`'s message at `turn` (0-based) of round `seed`: its own, so conversations part."""
    return f"Agent {agent}, step {turn + 1}: " + _words(words, random.Random(f"{seed}:{agent}:{turn}"))


# ---------------------------------------------------------------- one request


def client_missing() -> str | None:
    """Why the agents cannot be driven here (the ``openai`` client is missing); None when they can."""
    try:
        import openai  # noqa: F401
    except ImportError as exc:
        return f"the openai client is not installed ({exc}); pip install openai"
    return None


def _read_error(response: Any) -> None:
    """Read an error's body before the ``openai`` client closes a streamed response unread: then its
    exception carries what the server said (mlx_lm.server's 404 for any exception in generation)."""
    if response.status_code >= 400:
        response.read()


def _client(base_url: str) -> Any:
    import openai

    http = openai.DefaultHttpxClient(event_hooks={"response": [_read_error]})
    return openai.OpenAI(base_url=base_url, api_key="bench", max_retries=0, timeout=HTTP_TIMEOUT_S,
                         http_client=http)


def chat_turn(client: Any, server: Any, messages: Messages, max_tokens: int, **ids: int) -> Reply:
    """Stream one chat completion; TTFT is the first chunk that carries text, reasoning or token ids.

    The reply kept for the next turn is the answer alone, as chat clients keep it (the Qwen3 templates
    drop an earlier turn's reasoning anyway).
    """
    start = time.perf_counter()
    stream = client.chat.completions.create(
        model=server.model,
        messages=messages,
        max_tokens=max_tokens,
        temperature=0.0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body=server.chat_extra or None,
    )
    first: float | None = None
    text: list[str] = []
    usage, finish, n_ids, n_chunks = None, None, 0, 0
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            piece = (c.delta.content if c.delta else None) or ""
            got = len(getattr(c, "token_ids", None) or [])
            if piece or got or _reasoning(c.delta):  # a thinking model's reply may open with its reasoning
                first = first or time.perf_counter()
                text.append(piece)
                n_ids += got
                n_chunks += 1
            finish = c.finish_reason or finish
    end = time.perf_counter()
    details = getattr(usage, "prompt_tokens_details", None)
    cached = getattr(details, "cached_tokens", None)
    return Reply(
        agent=ids.get("agent", -1),
        turn=ids.get("turn", 0),
        round=ids.get("round", 0),
        ttft_ms=((first or end) - start) * 1e3,
        total_s=end - start,
        reply_tokens=usage.completion_tokens if usage is not None else (n_ids or n_chunks),
        prompt_tokens=usage.prompt_tokens if usage is not None else None,
        cached_tokens=cached if isinstance(cached, int) else None,
        finish_reason=finish,
        text="".join(text),
    )


def _reasoning(delta: Any) -> str:
    """A chunk's reasoning text: mlxrt sends ``reasoning_content`` and ``reasoning``, mlx_lm.server
    ``reasoning``; neither is in the ``openai`` client's schema, so they are read from its extras."""
    extra = getattr(delta, "model_extra", None) or {}
    return str(extra.get("reasoning_content") or extra.get("reasoning") or "")


def warm_up(server: Any) -> None:
    """One short plain completion, so the first agent turn pays no first-call costs.

    Not a chat: a chat would leave the template's opening tokens in a prefix cache.
    """
    with _client(server.base_url) as client:
        client.completions.create(
            model=server.model,
            prompt="Warm-up: say something.",
            max_tokens=WARMUP_TOKENS,
            temperature=0.0,
            extra_body=server.chat_extra or None,
        )


# ---------------------------------------------------------------- the agents


def run_agents(server: Any, sizes: Sizes, *, round_: int) -> tuple[list[Reply], list[Messages], float]:
    """All agents at once on `server`; returns every reply, each agent's final-turn prompt, and wall s."""
    system = system_prompt(sizes.system_words, seed=round_)
    barrier = threading.Barrier(sizes.agents + 1)
    replies: list[list[Reply]] = [[] for _ in range(sizes.agents)]
    finals: list[Messages] = [[] for _ in range(sizes.agents)]
    errors: list[BaseException] = []

    def agent(i: int) -> None:
        messages: Messages = [{"role": "system", "content": system}]
        barrier.wait()
        try:
            for t in range(sizes.turns):
                text = user_message(i, t, seed=round_, words=sizes.user_words)
                messages.append({"role": "user", "content": text})
                finals[i] = list(messages)
                r = chat_turn(client, server, messages, sizes.reply_tokens, agent=i, turn=t + 1, round=round_)
                replies[i].append(r)
                messages.append({"role": "assistant", "content": r.text})
        except BaseException as exc:  # reported after every thread is joined
            errors.append(exc)

    threads = [threading.Thread(target=agent, args=(i,), daemon=True) for i in range(sizes.agents)]
    with _client(server.base_url) as client:
        for th in threads:
            th.start()
        barrier.wait()
        start = time.perf_counter()
        for th in threads:
            th.join()
        wall = time.perf_counter() - start
    if errors:
        raise errors[0]
    return [r for rs in replies for r in rs], finals, wall


def run_uncached(server: Any, prompts: list[Messages]) -> list[Reply]:
    """Each prompt alone, one after another (one token each: only the TTFT is wanted).

    The first prompt goes once more first, unmeasured: this fresh server would
    otherwise time its first long prompt's first-use costs (up to 46 s of
    kernel compilation on a fresh CUDA host).
    """
    with _client(server.base_url) as client:
        chat_turn(client, server, prompts[0], 1)
        return [chat_turn(client, server, p, 1, agent=i, turn=0) for i, p in enumerate(prompts)]


class NativeAgents:
    """The agent workload on an in-process `Engine`, one thread, no HTTP: mlxrt's engine alone."""

    def __init__(self, model_path: str, *, prompt_cache_bytes: int | None = None) -> None:
        self.model_path = model_path
        self.prompt_cache_bytes = prompt_cache_bytes
        self.engine: Any = None

    def setup(self) -> None:
        from mlxrt.worker.engine import Engine, EngineOptions

        options = EngineOptions(prompt_cache_bytes=self.prompt_cache_bytes)
        self.engine = Engine(self.model_path, options=options)
        self.engine.warmup(WARMUP_TOKENS)

    def warm_up(self) -> None:
        """Done by `Engine.warmup` in `setup`."""

    def close(self) -> None:
        self.engine = None

    def describe(self) -> dict[str, Any]:
        o = self.engine.options
        return {"target": NATIVE, "engine": {f: getattr(o, f) for f in o.__struct_fields__},
                "prompt_cache_bytes": self.engine.prompt_cache_bytes}  # the cap in effect (auto resolved)

    def run_agents(self, sizes: Sizes, *, round_: int) -> tuple[list[Reply], list[Messages], float]:
        """Every agent's turns on the engine; a turn is submitted as soon as the agent's last one ends."""
        from mlxrt.ipc.protocol import ChatMessage, Generate, SamplingParams

        system = system_prompt(sizes.system_words, seed=round_)
        params = SamplingParams(max_tokens=sizes.reply_tokens, ignore_eos=True)
        chats: list[Messages] = [[{"role": "system", "content": system}] for _ in range(sizes.agents)]
        replies: list[Reply] = []
        box = _Turns()

        def submit(agent: int) -> None:
            turn = sum(m["role"] == "user" for m in chats[agent])
            text = user_message(agent, turn, seed=round_, words=sizes.user_words)
            chats[agent].append({"role": "user", "content": text})
            req_id = agent * 1000 + turn
            box.open(req_id)
            messages = [ChatMessage(m["role"], m["content"]) for m in chats[agent]]
            self.engine.submit(Generate(id=req_id, messages=messages, params=params), box)

        start = time.perf_counter()
        for i in range(sizes.agents):
            submit(i)
        finals = [list(c) for c in chats]
        while self.engine.busy:
            self.engine.step()
            for req_id, reply in box.take():
                agent, turn = divmod(req_id, 1000)
                replies.append(Reply(agent=agent, turn=turn + 1, round=round_, **reply))
                chats[agent].append({"role": "assistant", "content": reply["text"]})
                if turn + 1 < sizes.turns:
                    submit(agent)
                    finals[agent] = list(chats[agent])
        if box.error is not None:
            raise box.error
        return replies, finals, time.perf_counter() - start


class _Turns:
    """The native agents' listener: each request's submission time, first token, text and stats."""

    def __init__(self) -> None:
        self.t0: dict[int, float] = {}
        self.first: dict[int, float] = {}
        self.text: dict[int, list[str]] = {}
        self.ended: list[tuple[int, dict[str, Any]]] = []
        self.error: BaseException | None = None

    def open(self, req_id: int) -> None:
        self.t0[req_id] = time.perf_counter()
        self.text[req_id] = []

    def started(self, req_id: int) -> None:
        pass

    def token(self, req_id: int, token: int, text: str, reasoning: str = "", calls: Any = None,
              **_: Any) -> None:
        self.first.setdefault(req_id, time.perf_counter())
        self.text[req_id].append(text)  # the answer only, as `chat_turn` keeps it

    def done(self, req_id: int, stats: Any, text: str, reasoning: str = "", calls: Any = None,
             **_: Any) -> None:
        end = time.perf_counter()
        t0 = self.t0.pop(req_id)
        reply = {
            "ttft_ms": (self.first.pop(req_id, end) - t0) * 1e3,
            "total_s": end - t0,
            "reply_tokens": stats.generation_tokens,
            "prompt_tokens": stats.prompt_tokens,
            "cached_tokens": stats.cached_tokens,
            "finish_reason": stats.finish_reason,
            "text": "".join(self.text.pop(req_id)) + text,
        }
        self.ended.append((req_id, reply))

    def failed(self, req_id: int, exc: BaseException) -> None:
        self.error = self.error or exc

    def take(self) -> list[tuple[int, dict[str, Any]]]:
        out, self.ended = self.ended, []
        return out


# ---------------------------------------------------------------- figures


def _turn_figures(replies: list[Reply], turns: int, uncached_ms: float | None) -> list[dict[str, Any]]:
    out = []
    for k in range(1, turns + 1):
        rs = [r for r in replies if r.turn == k]
        ttft = spread([r.ttft_ms for r in rs])
        cached = [r.cached_tokens for r in rs if r.cached_tokens is not None]
        counts = [r.reply_tokens for r in rs]
        out.append(
            {
                "turn": k,
                "n": len(rs),
                "ttft_ms": ttft,
                "prompt_tokens": spread([float(r.prompt_tokens) for r in rs if r.prompt_tokens is not None]),
                "cached_tokens": spread([float(c) for c in cached]) if cached else None,
                "reply_tokens": {"min": min(counts), "max": max(counts)} if counts else None,
                "ttft_vs_uncached": ttft["median"] / uncached_ms if uncached_ms and ttft["n"] else None,
                "finish_reasons": sorted({str(r.finish_reason) for r in rs}),
            }
        )
    return out


def server_figures(
    replies: list[Reply], walls: list[float], sizes: Sizes, uncached: list[Reply] | None
) -> dict[str, Any]:
    """One server's figures: per turn, aggregate throughput per round, the uncached reference."""
    per_round = []
    for r, wall in enumerate(walls):
        tokens = sum(x.reply_tokens for x in replies if x.round == r)
        per_round.append({"round": r, "wall_s": wall, "reply_tokens": tokens, "aggregate_tps": tokens / wall})
    unc = spread([r.ttft_ms for r in uncached]) if uncached else None
    return {
        "aggregate_tps": spread([x["aggregate_tps"] for x in per_round]),
        "wall_s": spread(walls),
        "rounds": per_round,
        "cached_tokens_reported": any(r.cached_tokens is not None for r in replies),
        "turns": _turn_figures(replies, sizes.turns, unc["median"] if unc else None),
        "uncached": None
        if uncached is None
        else {
            "ttft_ms": unc,
            "prompt_tokens": spread(
                [float(r.prompt_tokens) for r in uncached if r.prompt_tokens is not None]
            ),
            "cached_tokens": spread(
                [float(r.cached_tokens) for r in uncached if r.cached_tokens is not None]
            ),
            "how": "each agent's final-turn prompt alone, one at a time, to a fresh cache-off server",
        },
        "requests": [{k: v for k, v in asdict(r).items() if k != "text"} for r in replies],
    }


def same_replies(a: list[Reply], b: list[Reply]) -> float | None:
    """Percent of (round, agent, turn) replies whose text is the same on two servers."""
    ka = {(r.round, r.agent, r.turn): r.text for r in a}
    both = [(ka[(r.round, r.agent, r.turn)], r.text) for r in b if (r.round, r.agent, r.turn) in ka]
    return 100.0 * sum(x == y for x, y in both) / len(both) if both else None


# ---------------------------------------------------------------- the part


def _factories(
    model_path: str, sizes: Sizes, variants: Sequence[list[str]]
) -> dict[str, Callable[[list[str]], Any]]:
    from .http_scenario import HttpStream, MlxLmServer, VllmMlxServer, leading_env

    out: dict[str, Callable[[list[str]], Any]] = {
        "mlxrt-http": lambda extra: HttpStream(model_path, extra_args=extra),
        "mlx_lm.server": lambda extra: MlxLmServer(model_path, extra_args=extra),
        "vllm-mlx": lambda extra: VllmMlxServer(model_path, extra_args=extra),
        NATIVE: lambda extra: NativeAgents(model_path, prompt_cache_bytes=sizes.prompt_cache_bytes),
    }
    for args in variants:
        # the variant's own flags last: where one repeats a shared flag (the cache cap), the variant's wins;
        # its environment words first, as HttpStream reads them
        n = leading_env(args)
        env, flags = args[:n], args[n:]
        out[variant_name(args)] = lambda extra, env=env, flags=flags: HttpStream(
            model_path, extra_args=[*env, *extra, *flags])
    return out


def _no_cache_why(name: str) -> str | None:
    """None when `name` can run with its prompt cache off, else why not."""
    if name == NATIVE:
        return "in-process engine: the uncached reference is mlxrt-http's"
    if name == "mlxrt-http":
        from .http_scenario import serve_accepts

        if not serve_accepts("--prompt-cache-bytes"):
            return "this mlxrt serve has no --prompt-cache-bytes (no way to turn its prompt cache off)"
    return None


def _start(make: Callable[[], Any], name: str, say: Say) -> tuple[Any, str | None]:
    """A started, warmed-up server, or None and why not."""
    say(f"agent: starting {name}")
    s = None
    try:
        s = make()
        s.setup()
        s.warm_up() if hasattr(s, "warm_up") else warm_up(s)
        return s, None
    except Skipped as exc:
        why = str(exc)
    except Exception as exc:  # one server failing must not stop the other
        why = f"{type(exc).__name__}: {exc}"
    if s is not None:
        s.close()
    say(f"agent: skip {name}: {why}")
    return None, why


class _Results:
    """What the rounds produced, per server."""

    def __init__(self, names: list[str]) -> None:
        self.replies: dict[str, list[Reply]] = {n: [] for n in names}
        self.walls: dict[str, list[float]] = {n: [] for n in names}
        self.finals: dict[str, list[Messages]] = {}  # round 0's final-turn prompts


WARMUP_ROUND_SEED = 1_000_000  # warm-up rounds' system prompts share nothing with the measured ones


def failure(exc: BaseException) -> str:
    """What went wrong, with what the server answered where the ``openai`` client's message leaves
    it out (it quotes only an ``{"error": {"message": ...}}``)."""
    why = f"{type(exc).__name__}: {exc}"
    body = getattr(exc, "body", None)
    if body is not None and " - " not in str(exc):
        why += ": " + (body if isinstance(body, str) else json.dumps(body))[:500]
    return why


def _try_round(live: dict[str, Any], name: str, sizes: Sizes, round_: int, what: str, skipped: dict[str, str],
               say: Say) -> tuple[list[Reply], list[Messages], float] | None:
    """One round on one server; a server that fails is closed and skipped, the others go on."""
    server = live[name]
    run = server.run_agents if hasattr(server, "run_agents") else partial(run_agents, server)
    try:
        return run(sizes, round_=round_)
    except Exception as exc:
        skipped[name] = f"failed in {what}: {failure(exc)}"
        say(f"agent: skip {name}: {skipped[name]}")
        live.pop(name).close()
        return None


def _warm_rounds(live: dict[str, Any], sizes: Sizes, skipped: dict[str, str], say: Say) -> None:
    """Unmeasured rounds on every server: MLX's CUDA backend compiles a kernel the first time any
    process meets its shape and caches it on disk, so without them the first server pays for all."""
    for r in range(sizes.warmup_rounds):
        for name in list(live):
            say(f"agent: warm-up round {r + 1}/{sizes.warmup_rounds} on {name} (not measured)")
            _try_round(live, name, sizes, WARMUP_ROUND_SEED + r, f"warm-up round {r + 1}", skipped, say)


def _rounds(live: dict[str, Any], sizes: Sizes, res: _Results, skipped: dict[str, str], say: Say) -> None:
    _warm_rounds(live, sizes, skipped, say)
    for r in range(sizes.rounds):
        for name in turns(list(live), r):
            say(f"agent: round {r + 1}/{sizes.rounds} on {name}: {sizes.agents} agents x {sizes.turns} turns")
            done = _try_round(live, name, sizes, r, f"round {r + 1}", skipped, say)
            if done is None:
                continue
            rs, finals, wall = done
            res.replies[name] += rs
            res.walls[name].append(wall)
            res.finals.setdefault(name, finals)
            say(f"  {sum(x.reply_tokens for x in rs) / wall:.1f} tok/s aggregate over {wall:.1f} s")


def turns(names: list, r: int) -> list:
    """Round `r`'s order of `names`: each round starts one further along (A B C, B C A, C A B, A B C ...)."""
    k = r % len(names) if names else 0
    return names[k:] + names[:k]


def _uncached(
    make: Callable[[list[str]], Any], name: str, prompts: list[Messages], say: Say
) -> tuple[list[Reply] | None, str | None]:
    """The final-turn prompts on a fresh server of the same kind with its prompt cache off."""
    why = _no_cache_why(name)
    if why is not None:
        return None, why
    s, why = _start(lambda: make(NO_CACHE_ARGS[name]), f"{name} (cache off)", say)
    if s is None:
        return None, f"the cache-off server did not start: {why}"
    say(f"agent: uncached reference on {name}: {len(prompts)} final-turn prompts, one at a time")
    try:
        return run_uncached(s, prompts), None
    except Exception as exc:
        return None, failure(exc)
    finally:
        s.close()


def run_part(
    model_path: str,
    sizes: Sizes,
    *,
    servers: list[str],
    say: Say,
    tokenizer: Any = None,
    variants: Sequence[Sequence[str]] = (),
) -> dict[str, Any]:
    """The agent workload on each of `servers` (names in `SERVERS` and `NATIVE`) and on mlxrt serve
    with each of `variants`' flags added, then each one's uncached reference. The variants take their
    turn in the rounds right after mlxrt-http."""
    variants = [list(v) for v in variants]
    variant_names = [variant_name(v) for v in variants]
    at = servers.index(SERVERS[0]) + 1 if SERVERS[0] in servers else 0
    servers = [*servers[:at], *variant_names, *servers[at:]]
    system = system_prompt(sizes.system_words, seed=0)
    out: dict[str, Any] = {
        "sizes": asdict(sizes),
        "system_prompt": {
            "words": sizes.system_words,
            "tokens": len(tokenizer.encode(system)) if tokenizer is not None else None,
        },
        "servers": {},
        "skipped": {},
    }
    missing = client_missing()
    if missing:
        return {**out, "not_run": missing}
    make = _factories(model_path, sizes, variants)
    live: dict[str, Any] = {}
    info: dict[str, Any] = {}
    for name in servers:
        s, why = _start(lambda n=name: make[n](cap_args(sizes, n)), name, say)
        if s is None:
            out["skipped"][name] = why
        else:
            live[name], info[name] = s, s.describe()
    res = _Results(list(live))
    try:
        _rounds(live, sizes, res, out["skipped"], say)
    finally:
        for s in live.values():
            s.close()
    refs: dict[str, tuple[list[Reply] | None, str | None]] = {}
    for name in [n for n in servers if res.walls.get(n)]:
        if name in variant_names:  # the same server with a flag added: mlxrt-http's reference, if it has one
            uncached, why = refs.get(SERVERS[0], (None, f"{SERVERS[0]} did not run"))
            why = why and f"{SERVERS[0]}'s reference: {why}"
        else:
            uncached, why = refs[name] = _uncached(make[name], name, res.finals[name], say)
        doc = server_figures(res.replies[name], res.walls[name], sizes, uncached)
        doc["info"] = info[name]
        if name in variant_names and uncached is not None:
            doc["uncached_from"] = SERVERS[0]
        if uncached is None:
            doc["uncached_skipped"] = why
        out["servers"][name] = doc
    names = list(out["servers"])
    if len(names) > 1:  # same model, greedy, EOS off: the servers should write the same replies
        out["same_replies_vs"] = names[0]
        out["same_replies_pct"] = {n: same_replies(res.replies[names[0]], res.replies[n]) for n in names[1:]}
    return out
