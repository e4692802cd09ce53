"""Prometheus `/metrics`: scraped with prometheus_client's own parser after known traffic,
in-process and from a real `overnight serve --workers 2` (counts summed over workers)."""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import os
import signal
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest
from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client import values as prometheus_values
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.parser import text_string_to_metric_families

from overnight.config import ProxyConfig
from overnight.errors import ConfigError
from overnight.proxy.alias.promotions import Route
from overnight.proxy.capture.captures import Capture
from overnight.proxy.observe.metrics import DURATION_BUCKETS, OWN_TIME_BUCKETS, error_type
from overnight.proxy.observe.tally import Buckets
from overnight.proxy.routes.relay import CLIENT_LEFT
from overnight.storage import SCHEMA_VERSION, LogWriter, WriterConfig
from overnight.testing.processes import spawn_fake_upstream, spawn_serve

from .helpers import adapter_dir, post_status, version_of, wait_until

CHAT = {"model": "policy", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3}
DELAY = 0.05  # the fake upstream's, so that durations have a floor a test can check


def samples(text: str) -> dict[tuple[str, frozenset], float]:
    """Every sample of a scrape: (name, its labels) -> value, parsed by prometheus_client."""
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def value(scraped: dict, name: str, **labels: str) -> float:
    """The sum of `name` over the samples whose labels include `labels` (0 if none)."""
    wanted = set(labels.items())
    return sum(v for (n, ls), v in scraped.items() if n == name and wanted <= ls)


async def scrape(proxy, **headers: str) -> dict:
    r = await proxy.get("/metrics", headers=headers)
    assert r.status == 200, await r.text()
    return samples(await r.text())


async def test_known_traffic_is_counted_with_its_labels_and_durations(
    make_proxy, fake_settings, tmp_path
):
    fake_settings["delay"] = DELAY
    proxy = await make_proxy()
    r = await proxy.post("/v1/chat/completions", json=CHAT)
    whole = await r.json()
    r = await proxy.post(
        "/v1/chat/completions",
        json={**CHAT, "stream": True, "stream_options": {"include_usage": True}},
    )
    streamed = [line for line in (await r.text()).splitlines() if line.startswith("data: {")]
    usage = json.loads(streamed[-1][6:])["usage"]
    r = await proxy.post("/v1/chat/completions", json=CHAT, headers={"X-Fake": "status-404"})
    assert r.status == 404  # vLLM's 4xx, passed through
    r = await proxy.post("/v1/chat/completions", json=CHAT, headers={"X-Fake": "status-500"})
    assert r.status == 500  # an upstream failure
    r = await proxy.post("/v1/chat/completions", data=b"{", headers={"Content-Type": "text/json"})
    assert r.status == 400  # refused by the proxy itself, never forwarded
    r = await proxy.post("/v1/chat/completions", json={**CHAT, "model": "someone's-made-up-name"})
    assert r.status == 200
    r = await proxy.post("/admin/adapters/promote", json={"path": adapter_dir(tmp_path, "a1")})
    promoted = (await r.json())["promoted"]
    r = await proxy.post("/v1/chat/completions", json=CHAT)
    assert r.status == 200
    await asyncio.sleep(0.05)  # the records are built just after each answer

    m = await scrape(proxy)
    base = "fake-base"
    requests = "overnight_requests_total"
    assert value(m, requests) == 7
    assert value(m, requests, requested_model="policy", adapter=base, status="200") == 2
    assert value(m, requests, requested_model="policy", adapter=promoted, status="200") == 1
    assert value(m, requests, requested_model="policy", status="404") == 1
    assert value(m, requests, requested_model="policy", status="500") == 1
    assert value(m, requests, requested_model="other", status="400") == 1
    # A name the proxy does not know is "other", as requested and as served: bounded.
    assert value(m, requests, requested_model="other", adapter="other", status="200") == 1
    assert all(dict(ls).get("model_name") == base for n, ls in m if n == requests)
    failures = "overnight_request_failures_total"
    assert value(m, failures, error_type="upstream_status") == 2
    assert value(m, failures, error_type="invalid_json") == 1
    assert value(m, failures) == 3
    # Durations: the 4 answered ones waited DELAY upstream (the fake fails at once); the
    # proxy's own time is what is left of theirs, so below their durations less DELAY.
    duration = "overnight_request_duration_seconds"
    assert value(m, duration + "_count") == 6  # the refused one never got a clock
    assert value(m, duration + "_count", stream="true") == 1
    assert value(m, duration + "_sum") >= 4 * DELAY
    le = {ls for n, ls in m if n == duration + "_bucket"}
    assert {dict(ls)["le"] for ls in le} == {*(str(b) for b in DURATION_BUCKETS), "+Inf"}
    own = "overnight_proxy_time_seconds"
    assert value(m, own + "_count") == 4
    assert 0 < value(m, own + "_sum") <= value(m, duration + "_sum") - 4 * DELAY
    first = "overnight_time_to_first_chunk_seconds"
    assert value(m, first + "_count") == 1 and value(m, first + "_sum") >= DELAY
    # Tokens by adapter, as the answers' usage says.
    prompt = "overnight_prompt_tokens_total"
    assert (
        value(m, prompt, adapter=base) == whole["usage"]["prompt_tokens"] + usage["prompt_tokens"]
    )
    assert value(m, "overnight_generation_tokens_total", adapter=promoted) == 3
    # The recording pipeline and the alias.
    assert value(m, "overnight_records_appended_total") == 6
    assert value(m, "overnight_recording_degraded") == 0
    info = [dict(ls) for n, ls in m if n == "overnight_adapter_info"]
    assert info == [
        {
            "model_name": base,
            "policy": "policy",
            "alias": "policy",
            "role": "served",
            "adapter": promoted,
            "version": "1",
        }
    ]
    assert version_of(promoted) == "policy-v1"
    # No id of any kind is a label value.
    values = {v for _, ls in m for _, v in ls}
    assert not any(v.startswith(("chatcmpl", "r-", "g-")) for v in values)


async def test_the_token_guards_metrics_and_nothing_else_is_needed(make_proxy):
    open_proxy = await make_proxy(api_keys=("client-key",), admin_token="admin")
    assert (await open_proxy.get("/metrics")).status == 200  # like /health: no key
    guarded = await make_proxy(metrics_token="scrape", admin_token="admin")
    assert (await guarded.get("/metrics")).status == 401
    r = await guarded.get("/metrics", headers={"Authorization": "Bearer wrong"})
    assert r.status == 401 and (await r.json())["error"]["code"] == "invalid_token"
    for token in ("scrape", "admin"):
        r = await guarded.get("/metrics", headers={"Authorization": f"Bearer {token}"})
        assert r.status == 200 and "overnight_requests" in await r.text()
    # The scraper's token opens nothing else.
    r = await guarded.get("/admin/stats", headers={"Authorization": "Bearer scrape"})
    assert r.status == 401
    off = await make_proxy(metrics=False)
    assert (await off.get("/metrics")).status == 404
    assert (await off.post("/v1/chat/completions", json=CHAT)).status == 200
    with pytest.raises(ConfigError):
        ProxyConfig(upstream="http://127.0.0.1:1", metrics_token="")


async def test_an_unreachable_upstream_is_a_failure_of_its_own_type(make_proxy):
    proxy = await make_proxy(upstream="http://127.0.0.1:9")  # nothing listens on port 9
    r = await proxy.post("/v1/chat/completions", json=CHAT)
    assert r.status == 502
    await asyncio.sleep(0.05)
    m = await scrape(proxy)
    assert value(m, "overnight_request_failures_total", error_type="upstream_unavailable") == 1
    assert value(m, "overnight_requests_total", status="502") == 1
    assert value(m, "overnight_proxy_time_seconds_count") == 0  # failures have no own time


@pytest.mark.parametrize("multiprocess", [False, True], ids=["in memory", "--workers files"])
def test_tallied_observations_scrape_as_observe_would_count_them(
    multiprocess, tmp_path, monkeypatch
):
    """The event loop counts a completion's durations in plain numbers and adds them to the
    series at the next sync (`Buckets.add_to`, through prometheus_client's value objects):
    the scrape must be what observing each value would give, bucket edges included (a
    value equal to a bound is in that bound's bucket), in memory and in the files that
    `--workers N` shares. Fails if prometheus_client ever keeps a histogram otherwise."""
    if multiprocess:  # what prometheus_client picks at import when the variable is set
        monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))
        monkeypatch.setattr(prometheus_values, "ValueClass", prometheus_values.MultiProcessValue())
    values = [0.0, 0.00005, *OWN_TIME_BUCKETS, 0.0007, 0.003, 0.003, 7.5, 1e9]
    registry = CollectorRegistry()
    histogram = Histogram("t", "t", ["kind"], buckets=OWN_TIME_BUCKETS, registry=registry)
    tallied = Buckets(OWN_TIME_BUCKETS)
    for v in values:
        histogram.labels("observed").observe(v)
        tallied.observe(v)
    tallied.add_to(histogram.labels("tallied"))
    tallied.add_to(histogram.labels("tallied"))  # adds nothing: the tally starts again at 0
    if multiprocess:
        registry = CollectorRegistry()
        MultiProcessCollector(registry, path=str(tmp_path))
    scraped = {
        (name, labels): v
        for (name, labels), v in samples(generate_latest(registry).decode()).items()
        if not name.endswith("_created")  # the time each series was made: not a count
    }

    def of(kind: str) -> dict:
        label = ("kind", kind)
        return {(n, ls - {label}): v for (n, ls), v in scraped.items() if label in ls}

    observed = of("observed")
    assert observed == of("tallied")
    assert observed[("t_count", frozenset())] == len(values)
    assert observed[("t_bucket", frozenset({("le", "0.0001")}))] == 3  # 0, 5e-5, the bound


def test_error_types_are_a_few_words():
    def capture(status: int, error: str | None) -> str | None:
        c = Capture("chat.completions", False, {}, Route("m", None))
        c.status, c.error = status, error
        return error_type(c)

    assert capture(200, None) is None
    assert capture(200, CLIENT_LEFT) == "client_disconnected"
    assert capture(200, "upstream stream broke: upstream sent nothing for 5 s") == (
        "upstream_disconnected"
    )
    assert capture(504, "upstream sent nothing for 600 s") == "upstream_timeout"
    assert capture(404, "upstream HTTP 404") == "upstream_status"
    assert capture(503, "maintenance: vLLM is asleep") == "maintenance"
    assert capture(500, "internal error: KeyError('x')") == "internal_error"
    assert capture(200, "upstream answered 200 with a body that is not JSON") == (
        "upstream_malformed"
    )


def _runs(data_dir, *runs: tuple) -> None:
    """Rows of `training_runs` as `overnight train` writes them: (status, ended, promoted,
    and optionally the gate's forgetting figures)."""
    writer = LogWriter(WriterConfig(data_dir, compact_in_process=True))
    writer.start()
    for i, (status, ended, promoted, *forgetting) in enumerate(runs):
        at = int(dt.datetime.fromisoformat(ended).timestamp() * 1e6)
        writer.append(
            "training_runs",
            {
                "run_id": f"run-{i}",
                "schema_version": SCHEMA_VERSION,
                "started_at": at - 60_000_000,
                "ended_at": at,
                "status": status,
                "promoted_as": "policy-v1" if promoted else None,
                "groups": [],
                "metrics": json.dumps({"gate": {"forgetting": forgetting[0]}})
                if forgetting
                else None,
            },
        )
    writer.close()


async def test_the_last_nights_come_from_the_data_directory(make_proxy, tmp_path):
    data = tmp_path / "data"
    _runs(
        data,
        ("trained", "2026-11-29T03:00:00+00:00", True),
        ("trained", "2026-11-30T03:00:00+00:00", False),
        ("failed", "2026-12-01T03:00:00+00:00", False),
    )
    proxy = await make_proxy(data_dir=data)
    m = await scrape(proxy)
    assert value(m, "overnight_training_runs", status="trained") == 2
    assert value(m, "overnight_training_runs", status="failed") == 1
    assert [dict(ls) for n, ls in m if n == "overnight_last_training_run_info"] == [
        {"status": "failed", "promoted": "false"}
    ]
    newest = dt.datetime.fromisoformat("2026-12-01T03:00:00+00:00").timestamp()
    trained = dt.datetime.fromisoformat("2026-11-30T03:00:00+00:00").timestamp()
    assert value(m, "overnight_last_training_run_end_timestamp_seconds") == newest
    assert value(m, "overnight_last_successful_training_run_end_timestamp_seconds") == trained


async def test_the_newest_measured_forgetting_is_each_policys_gauge(make_proxy, tmp_path):
    data = tmp_path / "data"
    _runs(
        data,
        ("trained", "2026-11-29T03:00:00+00:00", True, {"served": 0.0, "candidate": 0.03,
                                                         "budget": 0.1}),
        ("trained", "2026-11-30T03:00:00+00:00", False, {"served": 0.03, "candidate": 0.4,
                                                          "budget": 0.1}),
        ("failed", "2026-12-01T03:00:00+00:00", False),  # measured nothing: the last stands
    )  # fmt: skip
    m = await scrape(await make_proxy(data_dir=data))
    name = "overnight_policy_forgetting_nats_per_token"
    assert {dict(ls)["of"]: v for (n, ls), v in m.items() if n == name} == {
        "served": 0.03,
        "candidate": 0.4,
        "budget": 0.1,
    }


def _cycles(data_dir, *cycles: tuple) -> None:
    """Rows of `training_runs` as cycles record them: (status, started, seconds it took,
    promoted, the gate's verdict, its groups' waits to serving, vLLM's sleep); and a run
    from before cycles (no `cycle` in its metrics), which counts as a night only."""
    writer = LogWriter(WriterConfig(data_dir, compact_in_process=True))
    writer.start()
    rows = [(status, start, took, promoted, {"gate": gate} if gate else {}, waits, asleep, True)
            for status, start, took, promoted, gate, waits, asleep in cycles]  # fmt: skip
    rows.append(("trained", "2026-11-01T03:00:00+00:00", 60, True, {}, [5.0], 9.0, False))
    for i, (status, start, took, promoted, gate, waits, asleep, cycle) in enumerate(rows):
        at = int(dt.datetime.fromisoformat(start).timestamp() * 1e6)
        delay = {"median": 0, "max": 0, "groups": len(waits), "waits": waits} if waits else None
        metrics = {**gate, "maintenance": {"seconds": asleep} if asleep else None}
        if cycle:
            metrics["cycle"] = {"by": "overnight learn", "trigger": "t", "to_serving": delay}
        writer.append("training_runs", {
            "run_id": f"run-{i}", "schema_version": SCHEMA_VERSION, "started_at": at,
            "ended_at": at + took * 1_000_000, "status": status, "groups": [],
            "promoted_as": f"policy-v{i}" if promoted else None, "metrics": json.dumps(metrics),
        })  # fmt: skip
    writer.close()


def _ago(minutes: float) -> str:
    return dt.datetime.fromtimestamp(time.time() - minutes * 60, dt.UTC).isoformat()


async def test_cycles_come_from_their_records_in_the_data_directory(make_proxy, tmp_path):
    """`overnight learn` has no port of its own: the proxy says each policy's cycles from
    their records at a scrape, as it says the nights (so a supervisor's restart loses
    nothing, and cron's nights under the lease count too); `overnight runs`, the report and
    /ui's runs page say the last day's in a line."""
    from click.testing import CliRunner

    from overnight.cli.main import main

    data = tmp_path / "data"
    refused = {"promote": False, "reason": "no better"}
    _cycles(
        data,
        ("trained", _ago(240), 100, True, {"promote": True}, [30.0, 200.0], 40.0),
        ("trained", _ago(180), 90, False, refused, [], 35.0),
        ("failed", _ago(120), 20, False, None, [], 0),
        ("trained", _ago(60), 120, True, {"promote": True}, [500.0], 25.0),
    )
    proxy = await make_proxy(data_dir=data)
    m = await scrape(proxy)
    outcomes = {dict(ls)["outcome"]: v for (n, ls), v in m.items()
                if n == "overnight_policy_cycles_total"}  # fmt: skip
    assert outcomes == {"promoted": 2, "refused": 1, "failed": 1, "not_promoted": 0}
    assert all(dict(ls)["policy"] == "policy" for (n, ls) in m if n.startswith("overnight_pol"))
    name = "overnight_policy_cycle_to_serving_seconds"
    assert value(m, f"{name}_count") == 3 and value(m, f"{name}_sum") == 730.0
    assert value(m, f"{name}_bucket", le="60.0") == 1  # 30 s
    assert value(m, f"{name}_bucket", le="300.0") == 2  # 200 s
    assert value(m, f"{name}_bucket", le="600.0") == 3  # 500 s
    assert value(m, "overnight_policy_cycle_asleep_seconds_total") == 100.0
    last = dt.datetime.fromisoformat(_ago(60)).timestamp() + 120
    assert abs(value(m, "overnight_policy_last_cycle_end_timestamp_seconds") - last) < 5
    assert value(m, "overnight_policy_last_cycle_duration_seconds") == 120
    assert value(m, "overnight_training_runs", status="trained") == 4  # the old night too
    # The last day's, in a line: 4 cycles over the 4 hours since the first began.
    line = ("cycles in the last 24 h: 4 (1 per hour): 2 promoted, 1 refused by the gate, "
            "1 failed; serving a median 3.3 min after their data was in (3 groups)")  # fmt: skip
    listing = CliRunner().invoke(main, ["runs", "--data", str(data)])
    assert listing.exit_code == 0 and listing.output.rstrip().endswith(line), listing.output
    page = await (await proxy.get("/ui/runs")).text()
    assert f'<p id="cycles">{line}</p>' in page
    from overnight.view.report import write_report

    assert f'<p id="cycles">{line}</p>' in write_report(data).read_text()


# -- a real `overnight serve --workers 2` --------------------------------------------------


def _scrape(base: str) -> dict:
    with urllib.request.urlopen(base + "/metrics", timeout=10) as r:
        return samples(r.read().decode())


def _pids(metrics_dir) -> set[str]:
    return {p.stem.rsplit("_", 1)[-1] for p in metrics_dir.glob("counter_*.db")}


def _worker_requests(metrics_dir, pid: str) -> float:
    """Completions one worker counted, from its own file alone."""
    merged = MultiProcessCollector.merge([str(metrics_dir / f"counter_{pid}.db")])
    return sum(s.value for m in merged for s in m.samples if s.name == "overnight_requests_total")


@pytest.mark.slow
def test_workers_sum_their_counts_and_a_dead_one_stays_counted(tmp_path):
    metrics_dir = tmp_path / "prometheus"
    metrics_dir.mkdir()
    (metrics_dir / "counter_999999.db").write_bytes(b"an earlier run's")  # wiped at start
    env = dict(os.environ, PROMETHEUS_MULTIPROC_DIR=str(metrics_dir))
    data = tmp_path / "data"
    n = 0
    with (
        spawn_fake_upstream("--delay", "0.02") as upstream,
        spawn_serve(data, "--upstream", upstream.url, "--workers", "2", env=env) as serve,
    ):
        assert "999999" not in _pids(metrics_dir)
        # Waves of 40 until both workers have served some (SO_REUSEPORT spreads new
        # connections, but on a loaded machine the second worker may listen late).
        with ThreadPoolExecutor(8) as pool:
            while True:
                bodies = [{**CHAT, "stream": i % 2 == 1} for i in range(40)]
                statuses = list(
                    pool.map(lambda b: post_status(serve.url + "/v1/chat/completions", b), bodies)
                )
                assert statuses == [200] * 40
                n += 40
                pids = _pids(metrics_dir)
                served = {pid: _worker_requests(metrics_dir, pid) for pid in pids}
                if len(pids) >= 2 and all(served.values()) or n >= 400:
                    break
        assert len(pids) >= 2 and all(served.values()), served  # each counted its own
        assert post_status(serve.url + "/v1/chat/completions", {"model": 1}) == 400
        m = _scrape(serve.url)  # one worker answers, for both
        assert value(m, "overnight_requests_total", status="200") == n
        assert value(m, "overnight_requests_total", status="400") == 1
        assert value(m, "overnight_request_duration_seconds_count") == n
        assert value(m, "overnight_time_to_first_chunk_seconds_count") == n // 2
        # Copied counts reach the scrape within the workers' sync interval.
        wait_until(
            lambda: value(_scrape(serve.url), "overnight_records_committed_total") == n,
            timeout=20,
            what="both workers' committed rows",
        )
        # A worker killed: the supervisor restarts it and marks it dead; what it counted
        # stays counted.
        victim = int(sorted(pids)[0])
        os.kill(victim, signal.SIGKILL)
        wait_until(lambda: len(_pids(metrics_dir)) >= 3, timeout=30, what="a new worker")
        wait_until(lambda: post_status(serve.url + "/v1/chat/completions", CHAT) == 200)
        m = wait_until(
            lambda: (
                (s := _scrape(serve.url))
                and value(s, "overnight_requests_total", status="200") > n
                and s
            )
        )
        assert value(m, "overnight_requests_total", status="200") >= n + 1
        assert value(m, "overnight_recording_degraded") == 0
