"""Adapter retention: ten nights of adapters, `--keep-adapters 3`, on local disk and on a
bucket (moto's S3 server). Kept: what the alias serves, the canary, the three previous
of the promotion stack (rollback targets), the gate's best so far, and anything a
replica still serves requests with; everything else is deleted, locally, in the bucket and in adapter-cache/. The
proxy runs in-process in front of the fake vLLM."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

from click.testing import CliRunner

from overnight.cli.main import main
from overnight.config import ProxyConfig
from overnight.proxy import create_app
from overnight.storage import attach
from overnight.storage.bucket.adapter_sync import CACHE
from overnight.testing.fake_upstream import create_fake_upstream

from .test_gate_best import record_nights, verdict_row
from .test_object_storage import BUCKET, objects, s3  # noqa: F401 (the fixture)

CHAT = {"model": "policy", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}


def night_dir(data: Path, night: int) -> Path:
    return data / "adapters" / f"2026120{night // 10}-{night % 10:02d}0000-run{night:02d}"


def night_adapter(data: Path, night: int) -> Path:
    """What a night writes: DATA/adapters/<run>/, a peft-shaped directory."""
    path = night_dir(data, night)
    path.mkdir(parents=True)
    (path / "adapter_config.json").write_text(json.dumps({"r": 8}))
    (path / "adapter_model.safetensors").write_bytes(bytes([night]) * 4096)
    return path


async def prune(proxy, keep: int = 3, dry_run: bool = False) -> dict:
    r = await proxy.post("/admin/adapters/prune", json={"keep": keep, "dry_run": dry_run})
    assert r.status == 200, await r.text()
    return await r.json()


async def drained(proxy) -> None:
    """Nights are hours apart: the adapter a promotion replaced has drained and been
    unloaded by the next night (here, within twice the poll interval)."""
    for _ in range(100):
        state = await (await proxy.get("/admin/adapters")).json()
        if not state["draining_elsewhere"] and set(state["in_flight"]) <= {
            state["current"]["name"]
        }:
            served = await (await proxy.get("/v1/models")).json()
            served = [m for m in served["data"] if m.get("owned_by") != "overnight"]
            if len(served) <= 2:  # the base model and the current adapter (not the alias)
                return
        await asyncio.sleep(0.05)
    raise AssertionError("the replaced adapter was never unloaded")


async def ten_nights(proxy, data: Path) -> list[Path]:
    paths = []
    for night in range(10):
        paths.append(night_adapter(data, night))
        r = await proxy.post("/admin/adapters/promote", json={"path": str(paths[-1])})
        assert r.status == 200, await r.text()
        await drained(proxy)
        await prune(proxy)
    return paths


async def test_ten_nights_on_local_disk_keep_what_serving_and_rollback_need(
    aiohttp_server, aiohttp_client, tmp_path
):
    fake = await aiohttp_server(create_fake_upstream())
    data = tmp_path / "data"
    config = ProxyConfig(upstream=str(fake.make_url("")), data_dir=data, commit_interval=0.0,
                         drain_timeout=30.0, state_poll_interval=0.05)  # fmt: skip
    proxy = await aiohttp_client(create_app(config))
    # The gate's records (storage/read/best_adapter.py): the second night's adapter the
    # policy's best (+0.3 over the base model), each night after it forgiven a small loss.
    names = [str(night_dir(data, n).resolve()) for n in range(10)]
    record_nights(data, [verdict_row(names[0], None, 0.1), verdict_row(names[1], names[0], 0.2)]
                  + [verdict_row(names[n], names[n - 1], -0.01) for n in range(2, 10)])  # fmt: skip
    paths = await ten_nights(proxy, data)
    left = sorted(p.name for p in (data / "adapters").iterdir())
    # The served one and the three before it, and the best so far: a not-worse gate holds
    # each candidate to it, so it stays however many promotions came after it.
    assert left == [paths[1].name] + [p.name for p in paths[-4:]]
    # A refused candidate (never promoted) and a canary.
    refused = night_adapter(data, 10)
    canary = night_adapter(data, 11)
    r = await proxy.post("/admin/adapters/promote", json={"path": str(canary), "canary": 0.1})
    assert r.status == 200
    dry = await prune(proxy, dry_run=True)
    assert dry["deleted"] == [str(refused)] and not dry["done"] and refused.exists()
    assert any(k.startswith(f"{canary}: canary") for k in dry["kept"])
    assert f"{names[1]}: the gate's best so far of policy policy" in dry["kept"], dry["kept"]
    assert any(k.startswith(f"{paths[-1]}: served") for k in dry["kept"])
    # The newest night's own directory is kept for a look, so only the refused one goes
    # once a newer night exists; here the canary is the newest: the refused one goes.
    done = await prune(proxy)
    assert done["deleted"] == [str(refused)] and done["done"] and not refused.exists()
    # A rollback serves a kept adapter, loaded again from its directory.
    r = await proxy.post("/admin/adapters/rollback", json={"reason": "test"})
    assert r.status == 200, await r.text()
    current = (await (await proxy.get("/admin/adapters")).json())["current"]
    assert current["path"] == str(paths[-2]) and Path(current["path"]).is_dir()
    assert (await proxy.post("/v1/chat/completions", json=CHAT)).status == 200


async def test_an_adapter_still_serving_requests_is_never_deleted(
    aiohttp_server, aiohttp_client, tmp_path
):
    """Promoted away while a slow request runs on it: it drains, and stays on disk until
    no replica serves it any more."""
    fake = await aiohttp_server(create_fake_upstream(delay=1.5))
    data = tmp_path / "data"
    config = ProxyConfig(upstream=str(fake.make_url("")), data_dir=data, commit_interval=0.0,
                         drain_timeout=30.0)  # fmt: skip
    proxy = await aiohttp_client(create_app(config))
    old = night_adapter(data, 1)
    assert (await proxy.post("/admin/adapters/promote", json={"path": str(old)})).status == 200
    slow = asyncio.create_task(proxy.post("/v1/chat/completions", json=CHAT))
    await asyncio.sleep(0.3)
    for night in range(2, 6):
        path = night_adapter(data, night)
        assert (await proxy.post("/admin/adapters/promote", json={"path": str(path)})).status == 200
    done = await prune(proxy, keep=1)
    assert old.exists() and any(k.startswith(f"{old}: loaded on a replica") for k in done["kept"])
    assert (await slow).status == 200


async def test_on_a_bucket_uploads_and_cached_copies_go_too(
    aiohttp_server,
    aiohttp_client,
    tmp_path,
    s3,  # noqa: F811
):
    fake = await aiohttp_server(create_fake_upstream())
    local = tmp_path / "local"
    url = f"s3://{BUCKET}/retention"
    config = ProxyConfig(upstream=str(fake.make_url("")), data_dir=url, local_dir=local,
                         commit_interval=0.0, state_poll_interval=0.05)  # fmt: skip
    proxy = await aiohttp_client(create_app(config))
    data = attach(url, local)
    paths = await ten_nights(proxy, data)
    uploads = [k for k in objects(s3[1], "retention/adapters") if "/" not in k]
    assert len(uploads) == 4, uploads  # the served one and three rollback targets
    assert len([p for p in (data / CACHE).iterdir() if not p.name.startswith(".")]) == 4
    assert sorted(p.name for p in (data / "adapters").iterdir()) == [p.name for p in paths[-4:]]
    r = await proxy.post("/admin/adapters/rollback", json={})
    assert r.status == 200, await r.text()
    assert (await proxy.post("/v1/chat/completions", json=CHAT)).status == 200


def served_and_old(data: Path) -> tuple[Path, Path]:
    """Two nights' adapters, the newer promoted (adapters.json, no proxy running)."""
    served, old = night_adapter(data, 1), night_adapter(data, 0)
    data.joinpath("adapters.json").write_text(json.dumps({
        "version": 1, "stack": ["policy-v1"],
        "adapters": [{"name": "policy-v1", "version": 1, "path": str(served),
                      "promoted_at": "2026-12-01T00:00:00+00:00"}],
    }))  # fmt: skip
    return served, old


def test_the_cli_prunes_through_the_proxy_or_offline(tmp_path):
    """Offline (no proxy serving the directory): under the state file's lock; the state
    names the served adapter, which stays."""
    data = tmp_path / "data"
    served, old = served_and_old(data)
    out = CliRunner().invoke(main, ["prune", "--data", str(data), "--adapters", "--proxy", ""])
    assert out.exit_code == 0, out.output
    assert f"would delete {old}" in out.output and old.exists()
    out = CliRunner().invoke(
        main, ["prune", "--data", str(data), "--adapters", "--proxy", "", "--yes"]
    )
    assert out.exit_code == 0 and not old.exists() and served.exists(), out.output
    bare = CliRunner().invoke(main, ["prune", "--data", str(data)])
    assert bare.exit_code != 0 and "--older-than AGE, --adapters" in bare.output


def test_prune_older_than_prunes_adapters_too(tmp_path):
    """`overnight prune --older-than` alone prunes adapters beside the days (the default
    --keep-adapters): an adapter nothing serves or can roll back to goes."""
    data = tmp_path / "data"
    served, old = served_and_old(data)
    args = ["prune", "--data", str(data), "--older-than", "30d", "--proxy", ""]
    out = CliRunner().invoke(main, args)
    assert out.exit_code == 0 and f"would delete {old}" in out.output and old.exists(), out.output
    out = CliRunner().invoke(main, [*args, "--yes"])
    assert out.exit_code == 0 and not old.exists() and served.exists(), out.output


async def test_each_policy_keeps_its_newest_nights_adapter(
    aiohttp_server, aiohttp_client, tmp_path
):
    """A refused candidate of each policy stays for a look until that policy's next
    night; another policy's newer night does not push it out (a night's policy is its
    run's; a night of no run, or naming none, is the default policy's)."""
    fake = await aiohttp_server(create_fake_upstream())
    data = tmp_path / "data"
    config = ProxyConfig(upstream=str(fake.make_url("")), data_dir=data, commit_interval=0.0,
                         policies=("research",))  # fmt: skip
    proxy = await aiohttp_client(create_app(config))
    nights = [night_adapter(data, n) for n in range(5)]
    for night, policy in zip(
        nights, ["research", "research", None, "policy", "policy"], strict=True
    ):
        (data / "runs" / night.name).mkdir(parents=True)
        (data / "runs" / night.name / "run.json").write_text(json.dumps({"policy": policy}))
        (data / "runs" / night.name / "finished").touch()
    unnamed = night_adapter(data, 5)  # no run at all: the default policy's, the newest
    dry = await prune(proxy, keep=0, dry_run=True)
    assert sorted(dry["deleted"]) == [str(n) for n in nights if n != nights[1]]
    assert f"{nights[1]}: the newest night's of policy research" in dry["kept"]
    assert f"{unnamed}: the newest night's of policy policy" in dry["kept"]
