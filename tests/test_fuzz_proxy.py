"""Property: whatever JSON a client puts in the fields the proxy reads, and whatever odd
headers and ids it sends, the proxy itself never fails (no 5xx of its own), the store
stays readable, and a normal request and a reward right after still work.

Hypothesis drives the in-process proxy in front of the fake vLLM (tests/conftest.py).
Bounded: a few dozen examples, about half a minute.
"""

from __future__ import annotations

import asyncio
import json

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from overnight.config import ProxyConfig
from overnight.proxy import create_app
from overnight.storage import open_db
from overnight.testing.fake_upstream import RECEIVED, create_fake_upstream

from .helpers import await_until, rows

CHAT = {"model": "policy", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)
# Every field the proxy reads, or a view renders later.
FIELDS = [
    "model",
    "stream",
    "stream_options",
    "messages",
    "prompt",
    "metadata",
    "n",
    "logprobs",
    "return_token_ids",
    "max_tokens",
    "tools",
    "tool_choice",
]
ids = st.one_of(
    st.text(max_size=12),
    st.text("ab.:-_", max_size=4),
    st.sampled_from([".", "..", "a/b", "%2e%2e", "x" * 300, "ok-1", "\u2603", "a b"]),
)
header_values = st.text(
    st.characters(blacklist_categories=("Cs", "Cc")), max_size=30
)  # a client cannot send CR, LF or NUL in a header


# What a client can put in a header: no control characters (HTTP forbids them).
header_ids = ids.filter(lambda v: v == v.strip() and not any(c < " " or c == "\x7f" for c in v))


@st.composite
def requests(draw) -> dict:
    body = dict(CHAT)
    for name in draw(st.lists(st.sampled_from(FIELDS), max_size=4, unique=True)):
        body[name] = draw(json_values)
    if draw(st.booleans()):
        body["metadata"] = {"rollout_group": draw(json_values), "rollout_id": draw(ids)}
    headers = {}
    if draw(st.booleans()):
        headers["X-Rollout-Id"] = draw(header_ids)
    if draw(st.booleans()):
        headers["X-Rollout-Group"] = draw(header_ids)
    if draw(st.booleans()):
        headers["X-Odd"] = draw(header_values)
    if draw(st.booleans()):
        headers["X-Rollout-Log"] = draw(st.sampled_from(["off", "on", "0", "\u00e9"]))
    path = draw(st.sampled_from(["/v1/chat/completions", "/v1/completions", "prefixed"]))
    if path == "prefixed":
        path = f"/rollouts/{draw(ids)}/{draw(ids)}/v1/chat/completions"
    reward_id = draw(ids)
    reward = draw(json_values | st.floats(allow_nan=False, allow_infinity=False))
    return {"body": body, "headers": headers, "path": path, "reward": (reward_id, reward)}


def _encode_path(path: str) -> str:
    from urllib.parse import quote

    return quote(path, safe="/")


async def _check_one(client, fake_app, case: dict) -> None:
    before = len(fake_app[RECEIVED])
    headers = {**case["headers"], "Content-Type": "application/json"}  # sent as UTF-8
    r = await client.post(
        _encode_path(case["path"]), data=json.dumps(case["body"]), headers=headers
    )
    text = await r.text()
    if r.status >= 500:
        assert len(fake_app[RECEIVED]) > before, (r.status, text, case)  # the upstream's own
    elif r.status >= 400 and r.content_type == "application/json":
        assert set(json.loads(text)["error"]) >= {"message", "type", "code"}, text
    rollout, reward = case["reward"]
    r = await client.post(_encode_path(f"/v1/rollouts/{rollout}/reward"), json={"reward": reward})
    assert r.status < 500, (r.status, await r.text(), case)


async def _still_works(client, data_dir, normal: int) -> None:
    """A normal request right after is recorded (the `normal`-th of its rollout), and a
    reward is answered."""
    r = await client.post("/v1/chat/completions", json=CHAT, headers={"X-Rollout-Id": "normal"})
    assert r.status == 200
    query = "SELECT count(*) AS n FROM completions WHERE rollout_id = 'normal'"
    await await_until(
        lambda: rows(data_dir, query)[0]["n"] == normal, what="the normal request recorded"
    )
    r = await client.post("/v1/rollouts/normal/reward", json={"reward": 1.0})
    assert r.status == 200 and (await r.json())["recorded"] is True


def test_the_proxy_survives_arbitrary_fields_headers_and_ids(tmp_path):
    """One proxy and one fake for all examples (starting them per example cost seconds);
    each batch of odd requests is followed by the checks."""
    from aiohttp.test_utils import TestClient, TestServer

    data_dir = tmp_path / "data"
    loop = asyncio.new_event_loop()
    fake = TestServer(create_fake_upstream(), loop=loop)
    loop.run_until_complete(fake.start_server())
    config = ProxyConfig(upstream=str(fake.make_url("")), data_dir=data_dir, commit_interval=0.0)
    client = TestClient(TestServer(create_app(config), loop=loop), loop=loop)
    loop.run_until_complete(client.start_server())
    normal = iter(range(1, 10**6))

    async def check(batch: list[dict]) -> None:
        for case in batch:
            await _check_one(client, fake.app, case)
        await _still_works(client, data_dir, next(normal))
        con = open_db(data_dir)  # the store stays readable by DuckDB
        try:
            con.execute("SELECT * FROM completions").fetchall()
            con.execute("SELECT * FROM rewards").fetchall()
        finally:
            con.close()

    @settings(
        max_examples=40,
        derandomize=True,  # the same examples every run: a failure here is reproducible
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
        database=None,
    )
    @given(st.lists(requests(), min_size=1, max_size=8))
    def run(batch):
        loop.run_until_complete(check(batch))

    try:
        run()
    finally:
        loop.run_until_complete(client.close())
        loop.run_until_complete(fake.close())
        loop.close()
