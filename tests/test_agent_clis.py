"""The real coding agents against a real ``mlxrt serve``: Claude Code, Codex CLI and OpenCode, each
installed from npm at a pinned version (`agent_clis.py`), run non-interactively and set up as
docs/http.md tells users (#coding-agents), through a recording proxy (`agent_proxy.py`).

The model is ``synthetic:tiny-qwen3?context=131072`` served as ``qwen3`` by ``mlxrt serve`` whose
worker is scripted (`scripted_serve.py`, `scripted_worker.py`): asked to list the files, it calls
the CLI's shell tool in Qwen3's ``<tool_call>`` format; once the listing (a file this test made)
is in its prompt, it answers naming that file. Tokenizing, templating, the reply parser, streaming
and each API's shapes run for real, so each CLI goes through a whole tool round trip. Each test
asserts that every request the CLI sent got a 2xx, that the tool ran and its result reached the
model, that the CLI printed the scripted answer, and that the follow-up request was served
mostly from the prefix cache.

Network beyond 127.0.0.1 is not needed: each CLI's vendor traffic (telemetry, updates, model
lists) is switched off as docs/http.md says, and every CLI run has a timeout naming its knob.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from agent_clis import NpmMissing, ensure
from agent_proxy import Exchange, RecordingProxy

MODEL = "synthetic:tiny-qwen3?context=131072"
SERVED = "qwen3"
CLI_TIMEOUT_S = float(os.environ.get("MLXRT_AGENT_CLI_TIMEOUT_S", 300))
SERVER_START_TIMEOUT_S = float(os.environ.get("MLXRT_AGENT_SERVER_TIMEOUT_S", 180))
# Small system prompts and tool sets, as docs/http.md shows for small models: the CLIs' defaults
# (13k-41k tokens) take minutes to prefill on a shared CPU.
SYSTEM = "You are a coding agent. Use the shell tool to look at files."
# Set: each CLI with its own full prompt and tools instead (13k-41k tokens; for capturing agent-sized
# sessions for benchmarks/agent_replay.py, with a larger MLXRT_AGENT_CLI_TIMEOUT_S).
FULL_PROMPTS = bool(os.environ.get("MLXRT_AGENT_FULL_PROMPTS"))

# Per CLI: the task (the marker of the first turn), the file it will find, the call in its tool's
# shape, and the answer. Answers come first: the follow-up prompt holds the task too.
CASES = {
    "claude": ("Claude, list the files here.", "notes-for-claude.txt",
               {"name": "Bash", "arguments": {"command": "ls", "description": "List the files"}}),
    "codex": ("Codex, list the files here.", "notes-for-codex.txt",
              {"name": "exec_command", "arguments": {"cmd": "ls"}}),
    "opencode": ("OpenCode, list the files here.", "notes-for-opencode.txt",
                 {"name": "bash", "arguments": {"command": "ls", "description": "List the files"}}),
}


def answer(name: str) -> str:
    return f"The directory holds {CASES[name][1]}."


SCRIPT = [
    *([f"{file}\n", f"<think>\nThe listing came back.\n</think>\n\n{answer(name)}"]
      for name, (_, file, _) in CASES.items()),
    # OpenCode asks its small model (here the same one) for a title first.
    ["Generate a title for this conversation", "<think>\n\n</think>\n\nListing files"],
    *([task, f"<think>\nI will list the files.\n</think>\n\n<tool_call>\n{json.dumps(call)}\n</tool_call>"]
      for task, _, call in CASES.values()),
]


@pytest.fixture(scope="module")
def clis() -> dict[str, Path]:
    """The pinned CLIs, installed if missing; skipped only where npm is absent and $CI is not set."""
    try:
        return ensure()
    except NpmMissing as exc:
        if os.environ.get("CI"):
            raise
        pytest.skip(str(exc))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """``mlxrt serve --model qwen3=synthetic:tiny-qwen3?context=131072`` on 127.0.0.1, scripted workers."""
    port = free_port()
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    cmd = [sys.executable, str(Path(__file__).with_name("scripted_serve.py")), "--log-level", "info",
           "serve", "--model", f"{SERVED}={MODEL}", "--host", "127.0.0.1", "--port", str(port)]
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT,
                                env={**os.environ, "SCRIPTED_REPLIES": json.dumps(SCRIPT)})
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + SERVER_START_TIMEOUT_S
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"mlxrt serve exited {proc.returncode}:\n{log.read_text()[-4000:]}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"mlxrt serve not ready within {SERVER_START_TIMEOUT_S:g} s "
                               f"(set MLXRT_AGENT_SERVER_TIMEOUT_S):\n{log.read_text()[-4000:]}")
        time.sleep(0.25)
    yield url, log
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise


@pytest.fixture
def session(server, tmp_path, request):
    """A recording proxy in front of the server, an empty work directory and HOME. With
    $MLXRT_AGENT_CAPTURE_DIR set, the requests and answers are written there as <test>.json."""
    url, _ = server
    work, home = tmp_path / "work", tmp_path / "home"
    work.mkdir()
    home.mkdir()
    with RecordingProxy(url) as proxy:
        yield proxy, work, home
    if os.environ.get("MLXRT_AGENT_CAPTURE_DIR"):
        out = Path(os.environ["MLXRT_AGENT_CAPTURE_DIR"]) / f"{request.node.name}.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps([e.record() for e in proxy.exchanges], indent=1))


def run_cli(cmd: list, *, cwd: Path, env: dict, proxy: RecordingProxy) -> subprocess.CompletedProcess:
    """Run one CLI to its end, within MLXRT_AGENT_CLI_TIMEOUT_S; stdin closed (nothing to ask)."""
    base = {k: v for k, v in os.environ.items() if not k.startswith(("ANTHROPIC_", "OPENAI_", "CODEX_"))}
    env = {**base, "PWD": str(cwd), **env}  # OpenCode takes its directory from $PWD, not the process's
    try:
        return subprocess.run([str(c) for c in cmd], cwd=cwd, env=env, capture_output=True,
                              text=True, timeout=CLI_TIMEOUT_S, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired as exc:
        raise AssertionError(f"{Path(cmd[0]).name} did not finish within {CLI_TIMEOUT_S:g} s (set MLXRT_AGENT"
                             f"_CLI_TIMEOUT_S); requests: {summary(proxy.exchanges)}\nstdout: {exc.stdout}\n"
                             f"stderr: {exc.stderr}") from None


def summary(exchanges: list[Exchange]) -> list:
    """What a failure message shows of each request: path, status, prompt and cached tokens."""
    return [(e.path, e.status, e.usage(), e.error) for e in exchanges]


def check_round_trip(name: str, exchanges: list[Exchange], printed: str) -> None:
    """Every request a 2xx; the task asked, the listing sent back, the answer printed; the follow-up
    read from the prefix cache."""
    task, file, _ = CASES[name]
    statuses = summary(exchanges)
    assert exchanges and all(200 <= e.status < 300 for e in exchanges), statuses
    turns = [e for e in exchanges if e.body and task in json.dumps(e.body) and "tools" in e.body]
    assert len(turns) >= 2, f"expected the task and its follow-up with the tool result, got {statuses}"
    first, follow = turns[0], turns[-1]
    assert file not in json.dumps(first.body) and file in json.dumps(follow.body)
    assert answer(name) in printed
    prompt, _ = first.usage()
    follow_prompt, cached = follow.usage()
    # The follow-up repeats the first prompt, then the call and its result: the first is all cached.
    assert follow_prompt > prompt and cached >= prompt * 0.9, (prompt, follow_prompt, cached)


def test_claude_code_round_trip(clis, session):
    """Claude Code (claude -p, ANTHROPIC_* env, model qwen3) completes a Bash round trip, all 2xx, cached."""
    proxy, work, home = session
    (work / CASES["claude"][1]).write_text("hello\n")
    env = {"HOME": home, "ANTHROPIC_BASE_URL": proxy.url, "ANTHROPIC_AUTH_TOKEN": "local-key",
           "ANTHROPIC_MODEL": SERVED, "ANTHROPIC_DEFAULT_HAIKU_MODEL": SERVED,
           "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1", "API_TIMEOUT_MS": str(int(CLI_TIMEOUT_S * 1000))}
    smaller = [] if FULL_PROMPTS else ["--tools", "Bash", "--system-prompt", SYSTEM]
    done = run_cli([clis["claude"], "-p", CASES["claude"][0], "--output-format", "json",
                    "--allowedTools", "Bash", *smaller],
                   cwd=work, env={k: str(v) for k, v in env.items()}, proxy=proxy)
    assert done.returncode == 0, (done.stdout, done.stderr)
    result = json.loads(done.stdout)
    assert not result["is_error"], result
    check_round_trip("claude", proxy.exchanges, result["result"])
    assert {e.path for e in proxy.exchanges} == {"/v1/messages"}


def test_codex_round_trip(clis, session):
    """Codex CLI (codex exec, a responses provider in config.toml) completes an exec_command round trip."""
    proxy, work, home = session
    (work / CASES["codex"][1]).write_text("hello\n")
    codex_home = home / ".codex"
    codex_home.mkdir()
    (codex_home / "instructions.md").write_text(SYSTEM + "\n")
    (codex_home / "config.toml").write_text(codex_config(f"{proxy.url}/v1", codex_home / "instructions.md"))
    done = run_cli([clis["codex"], "exec", "--skip-git-repo-check", "--json", CASES["codex"][0]],
                   cwd=work, env={"HOME": str(home), "CODEX_HOME": str(codex_home)}, proxy=proxy)
    assert done.returncode == 0, (done.stdout, done.stderr)
    events = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    items = [e["item"] for e in events if e.get("type") == "item.completed"]
    ran = [i for i in items if i.get("type") == "command_execution"]
    assert ran and CASES["codex"][1] in ran[0].get("aggregated_output", ""), items
    said = "".join(i.get("text", "") for i in items if i.get("type") == "agent_message")
    check_round_trip("codex", proxy.exchanges, said)
    assert {e.path for e in proxy.exchanges} == {"/v1/responses"}


def codex_config(base_url: str, instructions: Path) -> str:
    """CODEX_HOME/config.toml as docs/http.md gives it, with its smaller-prompt settings."""
    smaller = "" if FULL_PROMPTS else f"""model_instructions_file = "{instructions}"
web_search = "disabled"

[features]
goals = false
apps = false
plugins = false

[agents]
enabled = false
"""
    return f"""model = "{SERVED}"
model_provider = "mlxrt"
check_for_update_on_startup = false
{smaller}
[analytics]
enabled = false

[model_providers.mlxrt]
name = "mlxrt"
base_url = "{base_url}"
wire_api = "responses"
stream_idle_timeout_ms = {int(CLI_TIMEOUT_S * 1000)}
"""


def test_opencode_round_trip(clis, session):
    """OpenCode (opencode run, an openai-compatible provider) completes a bash round trip, all 2xx, cached."""
    proxy, work, home = session
    (work / CASES["opencode"][1]).write_text("hello\n")
    config = home / "opencode.json"
    config.write_text(json.dumps(opencode_config(f"{proxy.url}/v1"), indent=2))
    env = {"HOME": str(home), "OPENCODE_CONFIG": str(config), "OPENCODE_DISABLE_MODELS_FETCH": "1",
           "OPENCODE_DISABLE_AUTOUPDATE": "1"}
    done = run_cli([clis["opencode"], "run", "--pure", "--format", "json", "--print-logs",
                    CASES["opencode"][0]], cwd=work, env=env, proxy=proxy)
    assert done.returncode == 0, (done.stdout, done.stderr)
    events = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    tools = [e["part"] for e in events if e.get("type") == "tool_use"]
    assert tools and CASES["opencode"][1] in json.dumps(tools[0].get("state", {})), events
    said = "".join(e["part"].get("text", "") for e in events if e.get("type") == "text")
    check_round_trip("opencode", proxy.exchanges, said)
    assert {e.path for e in proxy.exchanges} == {"/v1/chat/completions"}


def opencode_config(base_url: str) -> dict:
    """opencode.json as docs/http.md gives it, with its smaller-prompt agent settings."""
    off = ["edit", "write", "glob", "grep", "read", "task", "todowrite", "webfetch", "skill"]
    build = {"prompt": SYSTEM, "tools": dict.fromkeys(off, False)}
    smaller = {} if FULL_PROMPTS else {"agent": {"build": build}}
    return {
        "$schema": "https://opencode.ai/config.json",
        "provider": {"mlxrt": {"npm": "@ai-sdk/openai-compatible", "name": "mlxrt",
                               "options": {"baseURL": base_url, "apiKey": "local-key"},
                               "models": {SERVED: {"name": SERVED, "tool_call": True}}}},
        "model": f"mlxrt/{SERVED}",
        "small_model": f"mlxrt/{SERVED}",
        "autoupdate": False,
        "share": "disabled",
        **smaller,
    }

