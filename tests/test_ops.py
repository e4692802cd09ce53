"""Operations: vLLM restarted under the proxy, the proxy's address file, redaction,
pruning old days, the CPU KV cache size, and the nightly batch killed at each stage."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from click.testing import CliRunner

from overnight.cli.main import main
from overnight.proxy.state import ADAPTERS
from overnight.testing.fake_upstream import SETTINGS, create_fake_upstream
from overnight.testing.processes import spawn_fake_upstream, spawn_serve

from .helpers import adapter_dir, await_until, completion_row, rows, wait_for_rows, wait_until

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
CHAT = {"model": "policy", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}


# -- vLLM restarted under a running proxy -----------------------------------------------


async def test_a_restarted_vllm_gets_the_promoted_adapter_again(
    make_proxy, fake, aiohttp_server, tmp_path
):
    proxy = await make_proxy()
    registry = proxy.app[ADAPTERS]
    path = adapter_dir(tmp_path, "a1")
    assert (await proxy.post("/admin/adapters/promote", json={"path": path})).status == 200
    first = registry.current.name
    # vLLM restarts on the same port: it has no adapters any more.
    port = fake.port
    await fake.close()
    restarted = await aiohttp_server(create_fake_upstream(), port=port)
    loras = restarted.app[SETTINGS]["loras"]
    assert loras == {}
    registry.check_interval = 0.05
    registry.notice_missing(first)  # as the relay does on a 404 for the alias
    await await_until(lambda: len(loras) == 1, what="the adapter loaded again")
    (name,) = loras
    assert loras[name] == path and registry.current.name == name != first
    assert registry.current.reason == "restore"
    r = await proxy.post("/v1/chat/completions", json=CHAT)
    assert r.status == 200
    (row,) = await wait_for_rows(tmp_path / "data", 1)
    assert row["model_served"] == name
    # The stack on disk follows, so a proxy restart serves the same adapter.
    state = json.loads((tmp_path / "data" / "adapters.json").read_text())
    assert state["stack"] == [name]
    # Down for a while: the watch keeps trying, and the proxy keeps answering.
    await restarted.close()
    assert not await registry.check_upstream()
    again = await aiohttp_server(create_fake_upstream(), port=port)
    await await_until(
        lambda: len(again.app[SETTINGS]["loras"]) == 1, what="loaded once vLLM is back"
    )


async def test_a_healthy_vllm_is_left_alone(make_proxy, received, tmp_path):
    proxy = await make_proxy()
    registry = proxy.app[ADAPTERS]
    await proxy.post("/admin/adapters/promote", json={"path": adapter_dir(tmp_path, "a1")})
    assert not await registry.check_upstream()
    assert not await registry.check_upstream()
    assert [r["path"] for r in received].count("/v1/load_lora_adapter") == 1


async def test_a_promotion_during_a_replica_check_is_not_taken_for_a_restart(
    make_proxy, fake, tmp_path
):
    # vLLM lists its adapters, then the answer arrives late: a promotion lands meanwhile.
    proxy = await make_proxy()
    registry = proxy.app[ADAPTERS]
    await proxy.post("/admin/adapters/promote", json={"path": adapter_dir(tmp_path, "a1")})
    fake.app[SETTINGS]["models_delay"] = 0.3
    check = asyncio.create_task(registry.check_upstream())
    await asyncio.sleep(0.1)  # the list is made, without the adapter promoted next
    second = adapter_dir(tmp_path, "a2")
    r = await proxy.post("/admin/adapters/promote", json={"path": second})
    assert r.status == 200, await r.text()
    assert not await check  # nothing was missing: no restore
    assert registry.current.version == 2 and registry.current.reason != "restore"
    assert registry.current.path == second


async def test_a_proxy_starts_while_vllm_is_down_and_loads_the_adapter_later(
    make_proxy, fake, aiohttp_server, tmp_path
):
    data = tmp_path / "data"
    first = await make_proxy(data_dir=data)
    await first.post("/admin/adapters/promote", json={"path": adapter_dir(tmp_path, "a1")})
    await first.close()
    port = fake.port
    await fake.close()
    proxy = await make_proxy(upstream=f"http://127.0.0.1:{port}", data_dir=data)  # starts anyway
    registry = proxy.app[ADAPTERS]
    registry.check_interval = 0.05
    back = await aiohttp_server(create_fake_upstream(), port=port)
    registry.notice_missing(registry.current.name)
    await await_until(lambda: len(back.app[SETTINGS]["loras"]) == 1, what="the adapter loaded")


# -- the nightly batch killed at each stage, then run again ---------------------------

REWARD_FILE = """
import os, signal
CALLS = []

def score(rollout):
    CALLS.append(rollout["rollout_id"])
    if os.environ.get("OVERNIGHT_KILL_AT") == "judging" and len(CALLS) == 5:
        os.kill(os.getpid(), signal.SIGKILL)  # killed while judging, some groups scored
    return float(rollout["rollout_id"].rsplit(".", 1)[1])
"""


def _post(url: str, payload: dict, headers: dict | None = None) -> dict:
    request = urllib.request.Request(
        url,
        data=json.dumps(payload).encode(),
        headers={"Content-Type": "application/json", **(headers or {})},
    )
    with urllib.request.urlopen(request, timeout=30) as r:
        return json.loads(r.read())


def _log_groups(proxy_url: str, groups: int = 4, size: int = 3) -> None:
    for g in range(groups):
        for i in range(size):
            rollout = f"g{g}.{i}"
            ids = {"X-Rollout-Group": f"g{g}", "X-Rollout-Id": rollout}
            _post(proxy_url + "/v1/chat/completions", {**CHAT, "max_tokens": 4}, ids)
            _post(f"{proxy_url}/v1/rollouts/{rollout}/finish", {})


def _train(
    data: Path, proxy_url: str, model: Path, reward: Path, kill_at: str | None
) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "OVERNIGHT_KILL_AT"}
    if kill_at:
        env["OVERNIGHT_KILL_AT"] = kill_at
    command = [sys.executable, "-m", "overnight.cli", "train", "--data", str(data)]
    command += ["--proxy", proxy_url, "--base-model", str(model), "--preset", "tiny-cpu"]
    command += ["--epochs", "1", "--groups-per-step", "2", "--settle", "0"]
    # The gate (tests/test_gate.py) would hold out a group for its comparison; here the
    # stages of an ungated night are what is killed.
    command += ["--reward", f"{reward}:score", "--gate", "off"]
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def fake_process():
    """The fake vLLM in its own process, shared: each test starts its own proxy on it."""
    with spawn_fake_upstream() as fake:
        yield fake


# Where the chain kills the night, one stage per start, in the order a night meets them.
STAGES = ("judging", "step-2", "saving", "promoting", "recorded")


@pytest.mark.slow
def test_the_nightly_batch_killed_at_each_stage_in_turn_finishes_on_rerun(
    fake_process, tiny_model_dir, tmp_path
):
    """One night killed (SIGKILL) at each stage in turn, one per start, each start resuming
    what the one before left: scoring (some groups scored), a step computed and not
    checkpointed, the adapter being saved, served and not recorded, recorded and not marked
    finished. Then a start that is not killed: one run recorded, one promotion, one adapter."""
    data = tmp_path / "data"
    reward = tmp_path / "reward.py"
    reward.write_text(REWARD_FILE)
    adapters = data / "adapters"
    with spawn_serve(data, "--upstream", fake_process.url) as proxy:
        _log_groups(proxy.url)
        for stage in STAGES:
            killed = _train(data, proxy.url, tiny_model_dir, reward, stage)
            assert killed.returncode == -signal.SIGKILL, stage + killed.stdout + killed.stderr
            complete = [p for p in adapters.glob("*") if p.is_dir() and "." not in p.name]
            state = _get(proxy.url + "/admin/adapters")
            if stage in ("judging", "step-2", "saving"):
                assert complete == [] and state["current"] is None, stage  # nothing half-written
            else:
                assert len(state["stack"]) == 1, stage  # served once, whoever promoted it
            if stage == "saving":
                assert [p.name.endswith(".partial") for p in adapters.iterdir()] == [True]
            recorded = rows(data, "SELECT * FROM training_runs WHERE status = 'trained'")
            assert len(recorded) == (1 if stage == "recorded" else 0), stage
        again = _train(data, proxy.url, tiny_model_dir, reward, None)
        assert again.returncode == 0, again.stdout + again.stderr
        trained = rows(data, "SELECT * FROM training_runs WHERE status = 'trained'")
        assert len(trained) == 1, trained  # one run, recorded once
        (run,) = trained
        assert sorted(run["groups"]) == ["g0", "g1", "g2", "g3"] and run["steps"] == 2
        state = _get(proxy.url + "/admin/adapters")
        assert len(state["stack"]) == 1  # promoted once, though killed after promoting
        assert state["current"]["path"] == str((adapters / run["run_id"]).resolve())
        assert (adapters / run["run_id"] / "adapter_model.safetensors").exists()
        assert sorted(p.name for p in adapters.iterdir()) == [run["run_id"]]
        assert all((run_dir / "finished").exists() for run_dir in (data / "runs").iterdir())


def _get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=30) as r:
        return json.loads(r.read())


# -- redaction --------------------------------------------------------------------------

EMAIL_CHAT = {
    "model": "fake-base",
    "messages": [{"role": "user", "content": "Mail ann.lee@example.com, cc bob@mail.example.org"}],
    "max_tokens": 2,
}


async def test_the_redaction_hook_masks_emails_before_they_are_written(make_proxy, tmp_path):
    proxy = await make_proxy(redact=f"{EXAMPLES / 'redact_emails.py'}:redact")
    r = await proxy.post("/v1/chat/completions", json=EMAIL_CHAT)
    assert r.status == 200
    assert (await r.json())["choices"][0]["message"]["content"]  # the client is unaffected
    await proxy.post("/v1/chat/completions", json={**CHAT, "model": "fake-base"})
    masked, plain = await wait_for_rows(tmp_path / "data", 2)
    content = json.loads(masked["request"])["messages"][0]["content"]
    assert content == "Mail [email], cc [email]"
    assert masked["prompt_token_ids"] is None and masked["completion_token_ids"] is None
    assert masked["logged"] and masked["error"] is None
    # Nothing to mask: stored whole, token ids included.
    assert json.loads(plain["request"])["messages"][0]["content"] == "Hi"
    assert plain["prompt_token_ids"]
    on_disk = b"".join(p.read_bytes() for p in (tmp_path / "data").rglob("*") if p.is_file())
    assert b"example.com" not in on_disk


async def test_a_failing_redaction_hook_stores_no_body_and_is_counted(make_proxy, tmp_path):
    hook = tmp_path / "hook.py"
    hook.write_text("def redact(record):\n    raise ValueError('boom')\n")
    proxy = await make_proxy(redact=f"{hook}:redact")
    r = await proxy.post("/v1/chat/completions", json=EMAIL_CHAT)
    assert r.status == 200
    (row,) = await wait_for_rows(tmp_path / "data", 1)
    assert row["request"] is None and row["response"] is None and not row["logged"]
    assert row["prompt_token_ids"] is None and row["completion_token_ids"] is None
    assert "redaction failed (ValueError)" in row["error"] and row["http_status"] == 200
    stats = await (await proxy.get("/admin/stats")).json()
    assert stats["redaction_failures"] == 1


def test_a_redaction_hook_that_cannot_be_loaded_stops_the_start(tmp_path):
    from overnight.errors import ConfigError
    from overnight.proxy.capture.redact import Redactor

    with pytest.raises(ConfigError, match="no_such_module"):
        Redactor("no_such_module:redact")


def test_the_example_masks_emails_everywhere_and_only_them():
    from overnight.examples.redact_emails import redact

    record = {
        "request": {"messages": [{"role": "user", "content": ["a@b.co", {"text": "x@y.io!"}]}]},
        "response": {"choices": [{"message": {"content": "no address; @here; a@b"}}]},
        "prompt_token_ids": [1],
        "completion_token_ids": [2],
        "completion_logprobs": None,
    }
    out = redact(record)
    assert out["request"]["messages"][0]["content"] == ["[email]", {"text": "[email]!"}]
    assert out["response"] == record["response"] and out["prompt_token_ids"] is None
    assert record["request"]["messages"][0]["content"][0] == "a@b.co"  # not changed in place
    assert redact({**record, "request": {}}) == {}


# -- the proxy's address in the data directory ----------------------------------------


def test_the_address_file_is_owner_only_and_ignored_once_its_process_is_gone(tmp_path):
    from overnight.proxy.address import find_proxy, remove_address, write_address

    path = write_address(tmp_path, "http://127.0.0.1:8123", admin_token_required=True)
    assert path.stat().st_mode & 0o777 == 0o600
    found = find_proxy(tmp_path)
    assert found["url"] == "http://127.0.0.1:8123" and found["admin_token_required"]
    assert "token" not in json.dumps(
        {k: v for k, v in found.items() if k != "admin_token_required"}
    )
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True
    )
    path.write_text(json.dumps({**found, "pid": int(dead.stdout)}))
    assert find_proxy(tmp_path) is None  # a stale file from a dead pid
    remove_address(tmp_path)
    assert path.exists()  # not this process's: left alone
    write_address(tmp_path, "http://127.0.0.1:8123", admin_token_required=False)
    remove_address(tmp_path)
    assert not path.exists() and find_proxy(tmp_path) is None


@pytest.mark.slow
def test_serve_leaves_its_address_and_rollback_finds_it(fake_process, tmp_path):
    data = tmp_path / "data"
    with spawn_serve(data, "--upstream", fake_process.url, "--admin-token", "s3cret") as proxy:
        record = json.loads((data / "proxy.json").read_text())
        assert record["url"] == proxy.url and record["pid"] == proxy.pid
        assert record["admin_token_required"] is True and "s3cret" not in json.dumps(record)
        assert (data / "proxy.json").stat().st_mode & 0o777 == 0o600
        path = adapter_dir(tmp_path, "a1")
        request = urllib.request.Request(
            proxy.url + "/admin/adapters/promote",
            data=json.dumps({"path": path}).encode(),
            headers={"Content-Type": "application/json", "Authorization": "Bearer s3cret"},
        )
        urllib.request.urlopen(request, timeout=30).close()
        command = [sys.executable, "-m", "overnight.cli", "rollback", "--data", str(data)]
        env = {k: v for k, v in os.environ.items() if k != "OVERNIGHT_PROXY"}
        done = subprocess.run(
            [*command, "--admin-token", "s3cret"], capture_output=True, text=True, env=env
        )
        assert done.returncode == 0, done.stderr
        assert "now serves the base model" in done.stdout and proxy.url in done.stderr
        assert proxy.stop() == 0
    assert not (data / "proxy.json").exists()  # removed on a clean exit


# -- the CPU KV cache -----------------------------------------------------------------


def test_the_cpu_kv_cache_is_sized_from_the_model(monkeypatch):
    from overnight.proxy.launch import vllm_cpu

    qwen7b = {
        "num_hidden_layers": 28,
        "num_attention_heads": 28,
        "num_key_value_heads": 4,
        "hidden_size": 3584,
        "max_position_embeddings": 32768,
        "torch_dtype": "bfloat16",
    }
    big = 512 * 2**30
    # 2 * 28 layers * 4 heads * 128 dims * 2 bytes = 56 KiB a token; 8192 * 8 of them: 3.5 GiB.
    assert vllm_cpu.kv_cache_gib(qwen7b, ["--max-model-len", "8192", "--max-num-seqs=8"], big) == 4
    assert vllm_cpu.kv_cache_gib(qwen7b, [], big) == vllm_cpu.CAP_GIB  # 128 * 32k tokens: capped
    assert vllm_cpu.kv_cache_gib(qwen7b, [], 16 * 2**30) == 4  # a quarter of a small machine
    tiny = {"num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1}
    assert vllm_cpu.kv_cache_gib({**tiny, "head_dim": 64, "hidden_size": 128}, [], big) == 1
    monkeypatch.setattr(vllm_cpu, "vllm_runs_on_cpu", lambda: True)
    assert vllm_cpu.kv_cache_env("/nowhere", [], {}) == {vllm_cpu.KV_CACHE_ENV: "1"}
    assert vllm_cpu.kv_cache_env("/nowhere", [], {vllm_cpu.KV_CACHE_ENV: "7"}) == {}  # the user's
    monkeypatch.setattr(vllm_cpu, "vllm_runs_on_cpu", lambda: False)
    assert vllm_cpu.kv_cache_env("/nowhere", [], {}) == {}  # a GPU: vLLM's own default


def test_on_a_cpu_every_prompt_is_prefilled_in_one_step_unless_the_user_chose(
    monkeypatch, tmp_path
):
    """vllm-cpu 0.32 stops on a seeded request whose prefill is split (vllm_cpu.py):
    the launcher turns chunked prefill off and sizes a step for the longest prompt."""
    from overnight.proxy.launch import launcher, vllm_cpu
    from overnight.proxy.launch.launcher import VLLMConfig, vllm_command

    (tmp_path / "config.json").write_text('{"max_position_embeddings": 8192}')
    model = str(tmp_path)
    whole = vllm_cpu.whole_prefill_args
    assert whole(model, []) == ["--no-enable-chunked-prefill", "--max-num-batched-tokens", "8192"]
    short = ["--max-model-len", "1024"]  # never below vLLM's own default step
    assert whole(model, short) == [
        "--no-enable-chunked-prefill",
        "--max-num-batched-tokens",
        "2048",
    ]
    for mine in (["--enable-chunked-prefill"], ["--max-num-batched-tokens=512"]):
        assert whole(model, mine) == []  # the user's choice stands
    for on_cpu, expected in ((True, True), (False, False)):
        monkeypatch.setattr(launcher, "vllm_runs_on_cpu", lambda on_cpu=on_cpu: on_cpu)
        cmd = vllm_command(VLLMConfig(model=model), 8000)
        assert ("--no-enable-chunked-prefill" in cmd) is expected


# -- pruning old days ---------------------------------------------------------------


def _write_days(data: Path, ages_in_days: list[int]) -> None:
    """A completion and a reward on each of these days ago, compacted to Parquet."""
    from overnight.storage import SCHEMA_VERSION, LogWriter, WriterConfig

    writer = LogWriter(WriterConfig(data, compact_in_process=True))
    writer.start()
    now = time.time_ns() // 1000
    for age in ages_in_days:
        at = now - age * 86_400_000_000
        writer.append("completions", completion_row(f"r{age}", f"g{age}", started_at=at))
        reward = {"reward_id": f"w{age}", "schema_version": SCHEMA_VERSION, "rollout_id": f"r{age}"}
        writer.append("rewards", {**reward, "reward": 1.0, "source": "agent", "created_at": at})
    writer.close()


def test_prune_says_what_it_would_delete_and_deletes_only_with_yes(tmp_path):
    data = tmp_path / "data"
    _write_days(data, [0, 1, 40, 41, 41])
    # A live log of today, never touched.
    from overnight.storage import LogWriter, WriterConfig

    writer = LogWriter(WriterConfig(data, compact_in_process=True))
    writer.start()
    writer.append("completions", completion_row("live", "glive"))
    wait_until(lambda: writer.committed >= 1, what="the live row committed")
    runner = CliRunner()
    shown = runner.invoke(main, ["prune", "--data", str(data), "--older-than", "30d"])
    assert shown.exit_code == 0, shown.output
    assert "completions     2 day(s)      2 file(s)            3 row(s)" in shown.output
    assert "rewards         2 day(s)" in shown.output and "run again with --yes" in shown.output
    assert len(rows(data, "SELECT * FROM completions")) == 6  # nothing deleted
    done = runner.invoke(main, ["prune", "--data", str(data), "--older-than", "30d", "--yes"])
    assert done.exit_code == 0 and "deleted 4 day partition(s)" in done.output, done.output
    left = rows(data, "SELECT rollout_id FROM completions ORDER BY rollout_id")
    assert [r["rollout_id"] for r in left] == ["live", "r0", "r1"]
    assert [r["rollout_id"] for r in rows(data, "SELECT rollout_id FROM rewards ORDER BY 1")] == [
        "r0",
        "r1",
    ]
    # Even 0 days never takes today's partition, nor the live log.
    runner.invoke(main, ["prune", "--data", str(data), "--older-than", "0d", "--yes"])
    left = rows(data, "SELECT rollout_id FROM completions ORDER BY rollout_id")
    assert [r["rollout_id"] for r in left] == ["live", "r0"]
    writer.close()
    assert not list(data.rglob(".pruning-*"))
    bad = runner.invoke(main, ["prune", "--data", str(data), "--older-than", "soon"])
    assert bad.exit_code != 0 and "expected a number and a unit" in bad.output


def test_a_pruned_day_leaves_the_readers_view_in_one_step(tmp_path):
    from overnight.cli.prune import parse_age, plan_prune

    data = tmp_path / "data"
    _write_days(data, [40])
    plan = plan_prune(data, parse_age("30d"))
    (day,) = plan.tables["completions"].days
    # The step readers could observe: after the rename, before the files are gone.
    doomed = day.with_name(".pruning-" + day.name)
    day.rename(doomed)
    assert rows(data, "SELECT * FROM completions") == []
    assert doomed.exists()


async def test_a_404_for_the_promoted_adapter_makes_the_proxy_check_at_once(
    make_proxy, fake, aiohttp_server, tmp_path
):
    proxy = await make_proxy()
    registry = proxy.app[ADAPTERS]
    await proxy.post("/admin/adapters/promote", json={"path": adapter_dir(tmp_path, "a1")})
    port = fake.port
    await fake.close()
    restarted = await aiohttp_server(create_fake_upstream(), port=port)
    # vLLM answers 404 for a model it does not serve (the fake is told to, by header).
    r = await proxy.post("/v1/chat/completions", json=CHAT, headers={"X-Fake": "status-404"})
    assert r.status == 404
    await await_until(lambda: len(restarted.app[SETTINGS]["loras"]) == 1, what="reloaded")
    assert registry.check_interval == 10.0  # not the periodic check: the 404 woke it
