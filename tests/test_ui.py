"""The web view at /ui: pages over a data directory with known records.

The records are made the way users make them: conversations through the proxy (in
front of the in-process fake vLLM, which answers with a tool call when asked), rewards
posted to its API; the judge's and the trainer's rows are written as those batch jobs
write them. The fast tests read the HTML; the slow one loads the pages in a real
headless Chromium (Debian's `chromium`) and keeps screenshots under tests/artifacts/.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import time
from pathlib import Path

import aiohttp
import pytest
from aiohttp.test_utils import TestServer

from overnight.config import ProxyConfig
from overnight.proxy import create_app
from overnight.storage import SCHEMA_VERSION, LogWriter, WriterConfig

from .helpers import wait_for_rows

ARTIFACTS = Path(__file__).resolve().parent / "artifacts"
TOOLS = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}]
SYSTEM = {"role": "system", "content": "You are the weather desk."}
QUESTION = {"role": "user", "content": "How warm is it in Lima?"}


async def make_records(proxy, data_dir: Path) -> None:
    """Group weather-7: a two-turn rollout with a tool call, and a one-turn one.
    Group numbers-1: two one-turn rollouts. Rewards posted; one judgment; one run."""
    await converse(proxy)
    await wait_for_rows(data_dir, 5)
    write_batch_rows(data_dir)


async def converse(proxy) -> None:
    """The agents' side, through the proxy: conversations, rewards, finishes."""

    async def chat(group, rollout, messages, fake=""):
        headers = {"X-Rollout-Group": group, "X-Rollout-Id": rollout}
        if fake:
            headers["X-Fake"] = fake
        r = await proxy.post(
            "/v1/chat/completions",
            json={"model": "policy", "messages": messages, "tools": TOOLS, "max_tokens": 8},
            headers=headers,
        )
        assert r.status == 200, await r.text()
        return await r.json()

    first = await chat("weather-7", "weather-7.a", [SYSTEM, QUESTION], fake="tool-call")
    call = first["choices"][0]["message"]
    await chat(
        "weather-7",
        "weather-7.a",
        [SYSTEM, QUESTION, call, {"role": "tool", "tool_call_id": "c0", "content": '{"temp": 19}'}],
    )
    await chat("weather-7", "weather-7.b", [SYSTEM, QUESTION])
    await chat("numbers-1", "numbers-1.a", [{"role": "user", "content": "Pick a number."}])
    await chat("numbers-1", "numbers-1.b", [{"role": "user", "content": "Pick a number."}])
    for rollout, reward in (("numbers-1.a", 1.0), ("numbers-1.b", 0.25)):
        r = await proxy.post(f"/v1/rollouts/{rollout}/reward", json={"reward": reward})
        assert r.status == 200
    for rollout in ("weather-7.a", "weather-7.b", "numbers-1.a", "numbers-1.b"):
        assert (await proxy.post(f"/v1/rollouts/{rollout}/finish")).status == 200


def write_batch_rows(data_dir: Path) -> None:
    """The batch jobs' side, written as they write it: a judgment, its rewards, a run."""
    writer = LogWriter(WriterConfig(data_dir, commit_interval=0.0))
    writer.start()
    now = time.time_ns() // 1000
    scores = [
        ("weather-7.a", 0.9, "Looked up Lima and answered with the tool's value."),
        ("weather-7.b", 0.1, "Answered without calling the tool."),
    ]
    writer.append(
        "judgments",
        {
            "judgment_id": "j1",
            "schema_version": SCHEMA_VERSION,
            "group_id": "weather-7",
            "judge_model": "openai/o3",
            "created_at": now,
            "scores": [{"rollout_id": r, "score": s, "explanation": e} for r, s, e in scores],
            "attempts": 1,
        },
    )
    for rollout, score, _ in scores:
        writer.append(
            "rewards",
            {
                "reward_id": f"{rollout}.ruler",
                "schema_version": SCHEMA_VERSION,
                "rollout_id": rollout,
                "reward": score,
                "source": "ruler",
                "created_at": now,
                "judgment_id": "j1",
            },
        )
    steps = [{"step": k, "loss": 0.5 / k, "clipped_fraction": 0.1} for k in (1, 2, 3)]
    writer.append(
        "training_runs",
        {
            "run_id": "20261129-030000-abc123",
            "schema_version": SCHEMA_VERSION,
            "started_at": now,
            "ended_at": now,
            "status": "trained",
            "groups": ["weather-7", "numbers-1"],
            "rollouts": 4,
            "steps": 3,
            "trained_tokens": 64,
            "reward_mean": 0.5625,
            "promoted_as": "policy-v1-0a1b2c",
            "max_logprob_gap": 2.4e-6,
            "metrics": json.dumps({"steps": steps}),
        },
    )
    writer.close()


@pytest.fixture
async def ui(make_proxy, tmp_path):
    proxy = await make_proxy()
    await make_records(proxy, tmp_path / "data")
    return proxy


async def page(client, path: str, status: int = 200) -> str:
    r = await client.get(path)
    text = await r.text()
    assert r.status == status, text
    return text


async def test_groups_page_lists_groups_and_filters_them(ui):
    text = await page(ui, "/ui")
    assert "2 of 2 group(s) shown" in text
    assert '<a href="/ui/groups/weather-7">weather-7</a>' in text
    assert '<a href="/ui/groups/numbers-1">numbers-1</a>' in text
    assert "0.625" in text and "0.500" in text  # mean rewards: (1 + .25)/2, (.9 + .1)/2
    assert "1 of 2 group(s)" in await page(ui, "/ui?q=weather")
    only_high = await page(ui, "/ui?min_reward=0.6")
    assert "numbers-1" in only_high and "groups/weather-7" not in only_high
    assert "0 of 2 group(s)" in await page(ui, "/ui?status=open")
    assert "2 of 2 group(s)" in await page(ui, "/ui?status=finished&adapter=fake-base")


async def test_bad_filters_get_a_clear_error(ui):
    assert "min_reward must be a number" in await page(ui, "/ui?min_reward=lots", 400)
    assert "status must be one of" in await page(ui, "/ui?status=weird", 400)
    assert "no rollout 'nope'" in await page(ui, "/ui/rollouts/nope", 404)


async def test_group_and_rollout_pages_show_the_conversation_and_the_judge(ui):
    group = await page(ui, "/ui/groups/weather-7")
    assert "Looked up Lima and answered with the tool&#x27;s value." in group
    assert group.index("weather-7.a") < group.index("weather-7.b")  # best first
    rollout = await page(ui, "/ui/rollouts/weather-7.a")
    assert "2 turn(s)" in rollout and '<strong id="reward">0.900</strong> (ruler)' in rollout
    assert "judge openai/o3: 0.900" in rollout
    assert "You are the weather desk." in rollout and "How warm is it in Lima?" in rollout
    assert "&rarr; lookup({&quot;query&quot;: &quot;cats&quot;})" in rollout  # the tool call
    assert "{&quot;temp&quot;: 19}" in rollout  # the tool's answer, in turn 1
    assert rollout.count("You are the weather desk.") == 1  # history not repeated


async def test_adapters_and_runs_pages(ui):
    adapters = await page(ui, "/ui/adapters")
    assert '<strong id="current">the base model</strong>' in adapters
    assert '<td>fake-base</td><td class="num">5</td>' in adapters  # every completion so far
    runs = await page(ui, "/ui/runs")
    assert "20261129-030000-abc123" in runs and "policy-v1-0a1b2c" in runs
    assert runs.count("<svg") == 3  # reward per run, reward per adapter, the run's loss
    assert "2.4e-06" in runs


async def test_the_admin_token_guards_the_view_and_a_cookie_remembers_it(make_proxy, tmp_path):
    proxy = await make_proxy(admin_token="s3cret")
    assert "missing or wrong admin token" in await page(proxy, "/ui", 401)
    assert "Groups" in await page(proxy, "/ui?token=s3cret")  # sets the cookie ...
    assert "Training runs" in await page(proxy, "/ui/runs")  # ... which comes back
    proxy.session.cookie_jar.clear()
    await page(proxy, "/ui/runs", 401)
    r = await proxy.get("/ui/adapters", headers={"Authorization": "Bearer s3cret"})
    assert r.status == 200


# -- in a real browser ---------------------------------------------------------------


def chromium() -> str:
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if found is None:
        if os.environ.get("OVERNIGHT_REQUIRE_BROWSER") == "1":
            pytest.fail("chromium is not installed but OVERNIGHT_REQUIRE_BROWSER=1")
        pytest.skip("chromium is not installed (apt-get install chromium)")
    return found


async def browse(url: str, *args: str, tmp_path: Path) -> str:
    """Headless Chromium on `url`; returns what it printed (the DOM for --dump-dom)."""
    browser = await asyncio.create_subprocess_exec(
        chromium(),
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        f"--user-data-dir={tmp_path / 'chromium-profile'}",
        "--window-size=1280,900",
        *args,
        url,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(browser.communicate(), timeout=90)
    assert browser.returncode == 0, err.decode()[-2000:]
    return out.decode()


@pytest.mark.slow
async def test_pages_in_headless_chromium(fake, tmp_path):
    data = tmp_path / "data"
    config = ProxyConfig(upstream=str(fake.make_url("")), data_dir=data, commit_interval=0.0)
    async with TestServer(create_app(config), host="127.0.0.1") as server:
        base = f"http://127.0.0.1:{server.port}"
        async with aiohttp.ClientSession(base_url=base) as client:
            await make_records(client, data)
        dom = await browse(f"{base}/ui?q=weather", "--dump-dom", tmp_path=tmp_path)
        assert '<p class="meta" id="count">1 of 2 group(s) shown</p>' in dom
        assert 'href="/ui/groups/weather-7"' in dom and "numbers-1" not in dom.split("</form>")[1]
        dom = await browse(f"{base}/ui/rollouts/weather-7.a", "--dump-dom", tmp_path=tmp_path)
        assert 'id="judge"' in dom and "Looked up Lima" in dom
        assert "lookup(" in dom and "How warm is it in Lima?" in dom
        ARTIFACTS.mkdir(exist_ok=True)
        for name, path in (
            ("ui-groups", "/ui"),
            ("ui-rollout", "/ui/rollouts/weather-7.a"),
            ("ui-runs", "/ui/runs"),
        ):
            shot = ARTIFACTS / f"{name}.png"
            shot.unlink(missing_ok=True)
            await browse(f"{base}{path}", f"--screenshot={shot}", tmp_path=tmp_path)
            png = shot.read_bytes()
            assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000, len(png)
