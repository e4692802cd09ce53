"""The recorder process (proxy/capture/recorder.py): completion records built and written
by a child of the serving process.

In-process proxies against the in-process fake vLLM, each with a real recorder process
(a child Python); the last tests run `overnight serve` itself and kill it.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import signal
import sys
import time
import urllib.request

import pytest
from click.testing import CliRunner

from overnight.cli.main import main
from overnight.config import ProxyConfig
from overnight.proxy import create_app
from overnight.proxy.alias.promotions import Route
from overnight.proxy.capture import recorder as recorder_module
from overnight.proxy.capture.attribution import attribute
from overnight.proxy.capture.captures import Capture, TurnCounter
from overnight.proxy.capture.chat import CHAT as CHAT_ENDPOINT
from overnight.proxy.capture.recorder import RECORDER, RecorderProcess
from overnight.proxy.capture.records import RecordFacts
from overnight.storage.write.segments import log_files
from overnight.testing.processes import spawn_fake_upstream, spawn_serve

from .helpers import await_until, pid_alive, rows, wait_for_rows, wait_until, without_ids

CHAT = {"model": "policy", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3}

# Every kind of record: whole and streamed chat, n > 1, a text completion, a Responses
# turn, a turn with logging off, an upstream's 500, a broken stream. (headers, path, body)
TRAFFIC = [
    ({"X-Rollout-Group": "g", "X-Rollout-Id": "whole"}, "/v1/chat/completions", CHAT),
    (
        {"X-Rollout-Group": "g", "X-Rollout-Id": "streamed"},
        "/v1/chat/completions",
        {**CHAT, "stream": True},
    ),
    ({"X-Rollout-Id": "n2"}, "/v1/chat/completions", {**CHAT, "n": 2}),
    ({"X-Rollout-Id": "text"}, "/v1/completions", {"model": "policy", "prompt": "Say"}),
    ({"X-Rollout-Id": "resp"}, "/v1/responses", {"model": "policy", "input": "Hi"}),
    ({"X-Rollout-Id": "quiet", "X-Rollout-Log": "off"}, "/v1/chat/completions", CHAT),
    ({"X-Rollout-Id": "failed", "X-Fake": "status-500"}, "/v1/chat/completions", CHAT),
    (
        {"X-Rollout-Id": "broken", "X-Fake": "reset-after-1"},
        "/v1/chat/completions",
        {**CHAT, "stream": True},
    ),
    ({"X-Rollout-Group": "g", "X-Rollout-Id": "whole"}, "/v1/chat/completions", CHAT),  # turn 1
]
# What differs between two runs of the same traffic: ids, clocks, the writer.
PER_RUN = {"record_id", "request_id", "started_at", "ended_at", "latency_ms", "ttft_ms"}


async def send(client, traffic=TRAFFIC) -> list[int]:
    statuses = []
    for headers, path, body in traffic:
        r = await client.post(path, json=body, headers=headers)
        await r.read()
        statuses.append(r.status)
    return statuses


def stored(data_dir) -> list[dict]:
    found = rows(data_dir, "SELECT * FROM completions ORDER BY started_at, choice_index")
    out = []
    for row in found:
        row = {k: v for k, v in row.items() if k not in PER_RUN and v is not None}
        for name in ("request", "response", "notes"):
            if isinstance(row.get(name), str):
                row[name] = without_ids(json.loads(row[name]))
        out.append(row)
    return out


async def test_the_recorder_process_stores_the_rows_the_serving_process_would(
    aiohttp_client, fake, tmp_path
):
    results = {}
    for mode in ("inline", "process"):
        data = tmp_path / mode
        config = ProxyConfig(
            upstream=str(fake.make_url("")), data_dir=data, commit_interval=0.0, recorder=mode
        )
        client = await aiohttp_client(create_app(config))
        assert (RECORDER in client.app) is (mode == "process")
        statuses = await send(client)
        await client.close()  # the recorder's last batch written, its log sealed
        assert statuses == [200, 200, 200, 200, 200, 200, 500, 200, 200]
        assert log_files(data) == []
        results[mode] = stored(data)
    inline, process = results["inline"], results["process"]
    assert len(process) == 10  # n=2 is two rows
    ids = {r["proxy_id"] for r in process}
    assert len(ids) == 1 and str(os.getpid()) not in ids.pop()  # the recorder's own writer
    for row in (*inline, *process):
        row.pop("proxy_id")
    assert process == inline
    whole = [r for r in process if r["rollout_id"] == "whole"]
    assert [r["turn_index"] for r in whole] == [0, 1]  # the recorder counts the turns
    by_id = {r["rollout_id"]: r for r in process}
    assert by_id["quiet"]["logged"] is False
    assert by_id["failed"]["http_status"] == 500 and by_id["broken"]["partial"] is True


async def test_stats_health_and_metrics_count_the_recorders_rows(make_proxy):
    client = await make_proxy(recorder="process")
    assert (await send(client, TRAFFIC[:3])) == [200, 200, 200]
    r = await client.post("/v1/rollouts/whole/reward", json={"reward": 1.0})
    assert r.status == 200  # rewards stay in the serving process's writer

    async def written():
        stats = await (await client.get("/admin/stats")).json()
        return stats if stats["rows_committed"] == 5 else None

    stats = await await_until(written, 10, "4 completion rows and a reward committed")
    assert stats["rows_appended"] == 5 and stats["rows_lost"] == 0
    assert stats["status"] == "ok"
    assert stats["recorder"]["pid"] == client.app[RECORDER].proc.pid
    assert stats["recorder"]["writer_id"] != stats["writer_id"]
    assert (await (await client.get("/health")).json()) == {"status": "ok"}
    metrics = await (await client.get("/metrics")).text()
    assert "overnight_records_committed_total 5.0" in metrics


async def test_the_recorders_images_are_counted_in_admin_stats(make_proxy, tmp_path):
    import base64
    import hashlib

    def url(media_type: str, seed: str) -> str:
        data = base64.b64encode(hashlib.shake_256(seed.encode()).digest(3000)).decode()
        return f"data:{media_type};base64,{data}"

    client = await make_proxy(recorder="process")
    content = [
        {"type": "image_url", "image_url": {"url": url("image/png", "a")}},
        {"type": "image_url", "image_url": {"url": url("image/tiff", "b")}},  # kept inline
    ]
    body = {**CHAT, "messages": [{"role": "user", "content": content}]}
    r = await client.post("/v1/chat/completions", json=body, headers={"X-Rollout-Id": "img"})
    assert r.status == 200

    async def counted():
        stats = await (await client.get("/admin/stats")).json()
        return stats if stats["rows_committed"] == 1 else None

    stats = await await_until(counted, 10, "the recorder's row committed")
    assert (stats["images_stored"], stats["images_kept_inline"]) == (1, 1), stats
    (row,) = await wait_for_rows(tmp_path / "data", 1)
    assert str(os.getpid()) not in row["proxy_id"]  # the recorder stored them, not this process
    assert "overnight-image:image/png;sha256:" in row["request"]
    assert "1 image(s) kept inline" in json.loads(row["notes"])["images"]


async def test_a_recorder_that_dies_is_started_again_and_health_says_so(make_proxy, tmp_path):
    client = await make_proxy(recorder="process")
    recorder = client.app[RECORDER]
    await send(client, TRAFFIC[:1])
    await wait_for_rows(tmp_path / "data", 1)
    first = recorder.proc.pid
    os.kill(first, signal.SIGKILL)

    async def degraded():
        return (await (await client.get("/health")).json())["status"] == "degraded"

    await await_until(degraded, 10, "/health degraded while the recorder is down")
    health = await (await client.get("/health")).json()
    assert "recorder process exited with code -9" in health["reason"]
    # Served meanwhile; recorded once the new recorder runs.
    assert (await send(client, TRAFFIC[:2])) == [200, 200]

    async def back():
        return (await (await client.get("/health")).json())["status"] == "ok"

    await await_until(back, 20, "/health ok again with a new recorder")
    assert recorder.proc.pid != first and recorder.restarts == 1
    found = await wait_for_rows(tmp_path / "data", 3)
    assert sorted(r["rollout_id"] for r in found) == ["streamed", "whole", "whole"]
    # The turns are the serving process's count: a new recorder does not start it again.
    assert [r["turn_index"] for r in found if r["rollout_id"] == "whole"] == [0, 1]
    stats = await (await client.get("/admin/stats")).json()
    assert stats["rows_committed"] == 3 and stats["rows_lost"] == 0  # its rows were all written
    assert stats["rows_appended"] == 3  # nothing counted twice: no row left queued
    metrics = await (await client.get("/metrics")).text()
    assert "overnight_records_queued 0.0" in metrics


async def test_records_wait_for_a_recorder_and_past_the_bound_are_counted_lost(monkeypatch):
    """A recorder that cannot start (here: a command that exits at once): records wait in
    a bounded queue; past the bound they are counted lost, and health says why."""
    monkeypatch.setattr(recorder_module, "MAX_WAITING", 3)
    recorder = RecorderProcess([sys.executable, "-c", "import sys; sys.exit(3)"], TurnCounter())
    await recorder.start()
    capture = _finished_capture()
    who = attribute({}, None, None, capture.request_body)
    for _ in range(5):
        recorder.record(capture, who, RecordFacts(1, 2, True))
    await asyncio.sleep(0.05)
    health = recorder.health()
    assert health.status == "degraded"
    assert health.rows_lost == 2 and len(recorder.waiting) == 3
    assert "exited with code 3" in health.reason or "behind" in health.reason
    await recorder.close()
    assert recorder.health().rows_lost == 5  # the three waiting, lost on the way out too


async def test_a_recorder_that_does_not_finish_in_time_is_stopped(monkeypatch):
    monkeypatch.setattr(recorder_module, "CLOSE_TIMEOUT_S", 0.5)
    stuck = 'import sys, time; print(\'{"status": "ok"}\', flush=True); time.sleep(60)'
    recorder = RecorderProcess([sys.executable, "-c", stuck], TurnCounter())
    await recorder.start()
    proc = recorder.proc
    assert proc is not None and recorder.health().status == "ok"
    started = time.monotonic()
    await recorder.close()
    assert time.monotonic() - started < 10
    assert await asyncio.wait_for(proc.wait(), 10) == -signal.SIGKILL


def _finished_capture():
    capture = Capture(CHAT_ENDPOINT, False, dict(CHAT), Route("policy", None, "policy"))
    capture.status = 200
    capture.done()
    return capture


async def test_a_request_too_deep_to_pickle_is_recorded_in_the_serving_process(
    make_proxy, tmp_path, request
):
    """JSON nested 600 levels is a body the proxy reads (and inline recording stores), but
    deeper than pickle goes: that frame is recorded by the serving process's writer.
    Deeper than pickle goes at Python's default recursion limit: a test run earlier in the
    same worker may have raised it (seen once under xdist), so the default is set here."""
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(1000)
    request.addfinalizer(lambda: sys.setrecursionlimit(limit))
    deep: dict = {}
    for _ in range(600):
        deep = {"x": deep}
    client = await make_proxy(recorder="process")
    traffic = [
        ({"X-Rollout-Id": "deep"}, "/v1/chat/completions", {**CHAT, "vllm_xargs_extra": deep})
    ]
    traffic.append(({"X-Rollout-Id": "plain"}, "/v1/chat/completions", CHAT))
    # 400: deeper than orjson writes (jsonio.py), so it is not sent on; its record is kept.
    assert (await send(client, traffic)) == [400, 200]
    found = await wait_for_rows(tmp_path / "data", 2)
    assert sorted(r["rollout_id"] for r in found) == ["deep", "plain"]
    by_id = {r["rollout_id"]: r for r in found}
    assert by_id["deep"]["request"] is not None
    assert by_id["deep"]["proxy_id"] != by_id["plain"]["proxy_id"]  # written where it was
    stats = await (await client.get("/admin/stats")).json()
    assert stats["rows_lost"] == 0


async def test_the_redact_hook_runs_in_the_recorder(make_proxy, tmp_path):
    hook = tmp_path / "hook.py"
    hook.write_text(
        "def redact(parts):\n"
        "    print('a stray print must not reach the health lines')\n"
        "    if parts['request']['messages'][0]['content'] == 'boom':\n"
        "        raise ValueError('no')\n"
        "    return {'request': {'redacted': True}, 'completion_token_ids': None}\n"
    )
    client = await make_proxy(recorder="process", redact=f"{hook}:redact")
    boom = {**CHAT, "messages": [{"role": "user", "content": "boom"}]}
    traffic = [({"X-Rollout-Id": "a"}, "/v1/chat/completions", CHAT)]
    traffic.append(({"X-Rollout-Id": "b"}, "/v1/chat/completions", boom))
    assert (await send(client, traffic)) == [200, 200]
    found = await wait_for_rows(tmp_path / "data", 2)
    by_id = {r["rollout_id"]: r for r in found}
    assert json.loads(by_id["a"]["request"]) == {"redacted": True}
    assert by_id["a"]["completion_token_ids"] is None
    assert by_id["b"]["logged"] is False and by_id["b"]["request"] is None

    async def counted():
        stats = await (await client.get("/admin/stats")).json()
        return stats["redaction_failures"] == 1 and stats["status"] == "ok"

    await await_until(counted, 10, "the hook's failure counted in /admin/stats")


async def test_shadow_sampling_or_tracing_keep_the_records_in_the_serving_process(
    make_proxy, monkeypatch, tmp_path
):
    shadowed = await make_proxy(recorder="process", shadow_samples=1)
    assert RECORDER not in shadowed.app
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:9")
    traced = await make_proxy(recorder="process", data_dir=tmp_path / "traced")
    assert RECORDER not in traced.app


def test_records_are_built_inline_unless_a_recorder_process_is_asked_for():
    fields = {f.name: f.default for f in dataclasses.fields(ProxyConfig)}
    assert fields["recorder"] == "inline"
    option = CliRunner().invoke(main, ["serve", "--help"]).output.split("--recorder", 1)[1]
    assert " ".join(option.split("--", 1)[0].split()).startswith("[inline|process]")
    assert "[default: inline]" in " ".join(option.split("--", 1)[0].split())


# -- `overnight serve`, killed -------------------------------------------------------------


def _post(url: str, body: dict, headers: dict) -> int:
    request = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json", **headers}
    )
    with urllib.request.urlopen(request, timeout=30) as r:
        r.read()
        return r.status


def _recorder_pid(url: str) -> int:
    with urllib.request.urlopen(url + "/admin/stats", timeout=5) as r:
        return json.loads(r.read())["recorder"]["pid"]


@contextlib.contextmanager
def _serve_answering_six(tmp_path, prefix: str):
    """`overnight serve --recorder process`, six completions answered: (serve, recorder pid)."""
    with (
        spawn_fake_upstream() as fake,
        spawn_serve(tmp_path, "--upstream", fake.url, "--recorder", "process") as serve,
    ):
        child = _recorder_pid(serve.url)
        for i in range(6):
            headers = {"X-Rollout-Id": f"{prefix}{i}"}
            assert _post(serve.url + "/v1/chat/completions", CHAT, headers) == 200
        yield serve, child


def _rollouts(tmp_path) -> list[str]:
    found = rows(tmp_path, "SELECT rollout_id FROM completions ORDER BY rollout_id")
    return [r["rollout_id"] for r in found]


@pytest.mark.slow
def test_serve_killed_with_sigkill_its_recorder_writes_what_it_had(tmp_path):
    with _serve_answering_six(tmp_path, "k") as (serve, child):
        time.sleep(0.05)  # the last batch handed over (every 5 ms)
        os.kill(serve.pid, signal.SIGKILL)
        serve.process.wait()
        wait_until(lambda: not pid_alive(child), 30, "the recorder finished and exited")
    assert _rollouts(tmp_path) == [f"k{i}" for i in range(6)]


@pytest.mark.slow
def test_ctrl_c_to_the_process_group_loses_no_record(tmp_path):
    """A terminal's Ctrl-C reaches the recorder too: it ignores it, and writes everything
    the serving process hands it on the way out."""
    with _serve_answering_six(tmp_path, "c") as (serve, child):
        os.kill(serve.pid, signal.SIGINT)
        os.kill(child, signal.SIGINT)
        assert serve.process.wait(timeout=60) == 0
        assert not pid_alive(child)
    assert log_files(tmp_path) == []  # sealed and compacted on the way out
    assert _rollouts(tmp_path) == [f"c{i}" for i in range(6)]
