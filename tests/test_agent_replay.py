"""The agent replay benchmark's fixtures and arithmetic (benchmarks/agent_replay.py); its figures come
from running it, not from here."""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # `benchmarks` is a top-level folder of the checkout, not an installed package
    sys.path.insert(0, str(ROOT))

from benchmarks import agent_replay  # noqa: E402
from benchmarks.agent_replay import CHAT, SALT_AT, Turn, conversation_head, figures, prepared  # noqa: E402


def test_fixtures_hold_each_cli_round_trip():
    """Each captured CLI session was all 2xx, on its CLI's API, holds the salt point and continues a turn."""
    raw = {f.stem: json.loads(f.read_text()) for f in sorted(agent_replay.FIXTURES.glob("*.json"))}
    assert sorted(raw) == ["claude-code", "codex", "opencode"]
    paths = {"claude-code": "/v1/messages", "codex": "/v1/responses", "opencode": CHAT}
    for cli, exchanges in raw.items():
        assert all(200 <= e["status"] < 300 for e in exchanges), cli
        requests = agent_replay.load_sessions()[cli]
        assert {q["path"] for q in requests} == {paths[cli]}
        heads = [conversation_head(q["body"]) for q in requests]
        assert len(set(heads)) < len(heads), f"{cli}: no request continues an earlier one"
        assert all(SALT_AT in json.dumps(q["body"]) for q in requests)


def test_prepared_gives_each_session_its_own_task_and_a_bounded_reply():
    """Sessions differ only after the task; model, greedy, output limit set; ignore_eos for mlxrt only."""
    (req, *_), = [agent_replay.load_sessions()["codex"]]
    a = prepared(req["body"], req["path"], model="m", salt="session 0", reply_tokens=7, mlxrt=True)
    b = prepared(req["body"], req["path"], model="m", salt="session 1", reply_tokens=7, mlxrt=False)
    ta, tb = json.dumps(a), json.dumps(b)
    cut = ta.index(SALT_AT) + len(SALT_AT)
    assert ta[:cut] == tb[:cut] and ta != tb
    got = (a["model"], a["max_output_tokens"], a["temperature"], a["stream"], a["ignore_eos"])
    assert got == ("m", 7, 0.0, True, True)
    assert "ignore_eos" not in b
    (chat, *_), = [agent_replay.load_sessions()["opencode"]]
    c = prepared(chat["body"], CHAT, model="m", salt="s", reply_tokens=5, mlxrt=False)
    assert c["max_tokens"] == 5 and c["stream_options"] == {"include_usage": True}


def test_hit_rate_counts_only_continued_conversations():
    """Each conversation's first request is out of the hit rate; tok/s is a round's output over its wall."""
    def turn(index, later, prompt, cached, out=4):
        return Turn(cli="c", server="s", round=0, session=0, index=index, later=later, status=200,
                    ttft_ms=1.0, total_s=1.0, prompt_tokens=prompt, cached_tokens=cached, output_tokens=out)

    f = figures([turn(0, False, 100, 0), turn(1, False, 1000, 10), turn(2, True, 1100, 990)], [2.0])
    assert f["hit_rate_later"] == 990 / 1100 and f["later_indices"] == [2]
    assert f["tokens_per_s"]["median"] == 6.0 and f["non_2xx"] == 0
