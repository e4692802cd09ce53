"""The Node `openai` SDK 6.49, installed with npm into .cache/compat-node (skipped, with
the reason, where npm is absent or the install fails)."""

from __future__ import annotations

import json
import subprocess

import pytest

from .conftest import assert_same_bytes
from .helpers import check_rows

pytestmark = pytest.mark.compat
ROLLOUT = "node-1"


@pytest.fixture(scope="module")
def runs(stack, node_sdk):
    def agent(origin: str, proxied: bool):
        args = ["node", str(node_sdk), origin + "/v1", *([ROLLOUT] if proxied else [])]
        done = subprocess.run(args, capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr[-2000:]
        return json.loads(done.stdout)

    return stack.run_both(agent)


def test_runs_to_the_end(runs):
    assert runs.direct_result == runs.proxied_result
    assert runs.direct_result["calls"] == ["get_weather"]
    assert runs.direct_result["answer"] == "Done after 1 tool result."


def test_same_bytes(runs):
    assert_same_bytes(runs)


def test_responses_bytes(runs):
    """The Responses call alone: passed through untouched."""
    direct = [e for e in runs.direct if e.path == "/v1/responses"]
    proxied = [e for e in runs.proxied if e.path == "/v1/responses"]
    assert len(direct) == 1 and [e.body for e in proxied] == [direct[0].body]


def test_rows(runs, stack):
    rows = stack.rows(ROLLOUT, expect=3)
    check_rows([r for r in rows if r["endpoint"] == "chat.completions"], ROLLOUT, turns=2)
    # The Responses call is recorded too, in the same conversation shape.
    (turn,) = [r for r in rows if r["endpoint"] == "responses"]
    assert json.loads(turn["request"])["messages"] == [{"role": "user", "content": "Say done."}]
    reply = json.loads(turn["response"])["choices"][0]["message"]
    assert reply["content"] == runs.direct_result["responses"]
