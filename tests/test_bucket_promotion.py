"""Several proxies, one truth, with a bucket: `--data s3://...` on machines that share no
disk. Each proxy here has its own local directory and its own fake vLLM (one machine
each); the promotion state and the adapters reach the others through moto's S3 server."""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

from overnight.cli.main import main
from overnight.config import ProxyConfig
from overnight.proxy import create_app
from overnight.proxy.alias.bucket_state import BucketState
from overnight.proxy.alias.promotions import rollback_on_disk
from overnight.proxy.replicas.lora_client import AdapterError
from overnight.proxy.state import ADAPTERS
from overnight.storage import attach
from overnight.storage.bucket.adapter_sync import CACHE, key_of, manifest_of, publish
from overnight.storage.location import segment_store
from overnight.testing.fake_upstream import RECEIVED, SETTINGS, create_fake_upstream

from .helpers import await_until, rows
from .test_object_storage import BUCKET, objects, s3  # noqa: F401 (the fixture)

CHAT = {"model": "policy", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}


def weights(tmp_path: Path, name: str, payload: bytes) -> Path:
    """A directory that passes for a peft adapter, with "weights" to check copies by."""
    path = tmp_path / "runs" / name
    path.mkdir(parents=True)
    (path / "adapter_config.json").write_text(json.dumps({"r": 8}))
    (path / "adapter_model.safetensors").write_bytes(payload * 1000)
    return path


def same_files(copy: Path, original: Path) -> bool:
    def files(d: Path) -> dict:
        return {p.relative_to(d).as_posix(): p.read_bytes() for p in d.rglob("*") if p.is_file()}

    return files(copy) == files(original)


@pytest.fixture
def machines(aiohttp_client, aiohttp_server, tmp_path, s3):  # noqa: F811
    """`a, b = await machines(prefix, n=2, **config)`: proxies on one bucket, each with
    its own local directory (tmp_path/m0, m1, ...) and its own fake vLLM (`.fake`)."""

    async def start(prefix: str, n: int = 2, **overrides):
        proxies = []
        for i in range(n):
            fake = await aiohttp_server(create_fake_upstream())
            config = ProxyConfig(
                upstream=str(fake.make_url("")),
                data_dir=f"s3://{BUCKET}/{prefix}",
                local_dir=tmp_path / f"m{i}",
                commit_interval=0.0,
                **{"state_poll_interval": 0.05, **overrides},
            )
            proxy = await aiohttp_client(create_app(config))
            proxy.fake, proxy.local = fake, tmp_path / f"m{i}"
            proxies.append(proxy)
        return proxies

    return start


async def promote(proxy, path: Path, status: int = 200) -> dict:
    r = await proxy.post("/admin/adapters/promote", json={"path": str(path)})
    body = await r.json()
    assert r.status == status, body
    return body


async def serves(proxy) -> str | None:
    current = (await (await proxy.get("/admin/adapters")).json())["current"]
    return current["name"] if current else None


async def test_one_promotion_reaches_a_proxy_on_another_machine(machines, s3, tmp_path):  # noqa: F811
    _, client = s3
    a, b = await machines("follow")
    original = weights(tmp_path, "night-1", b"\x01\x02")
    name = (await promote(a, original))["promoted"]
    await await_until(lambda: serves(b), what="the second proxy follows")
    assert await serves(b) == name

    # Each machine's vLLM loaded the adapter from its own local copy, whole.
    key = key_of({**manifest_of(original), "policy": "policy"})  # its manifest names the alias
    for proxy in (a, b):
        loaded = proxy.fake.app[SETTINGS]["loras"]
        assert loaded == {name: str(proxy.local / CACHE / key)}
        assert same_files(Path(loaded[name]), original)
    # The bucket holds the state, the upload and its manifest; each machine a copy of the state.
    stored = objects(client, "follow")
    assert {"adapters.json", f"adapters/{key}.json"} <= set(stored)
    assert f"adapters/{key}/adapter_model.safetensors" in stored
    state = json.loads(client.get_object(Bucket=BUCKET, Key="follow/adapters.json")["Body"].read())
    assert state["version"] == 1 and state["stack"] == [name]
    assert json.loads((b.local / "adapters.json").read_text())["version"] == 1

    # Records from both machines are in one table.
    for proxy in (a, b):
        assert (await proxy.post("/v1/chat/completions", json=CHAT)).status == 200
    await a.close()
    await b.close()  # each uploads its segments
    found = rows(attach(f"s3://{BUCKET}/follow", tmp_path / "reader"),
                 "SELECT model_served, proxy_id FROM completions")  # fmt: skip
    assert [r["model_served"] for r in found] == [name, name]
    assert len({r["proxy_id"] for r in found}) == 2


async def test_two_promotions_racing_through_two_proxies_take_two_versions(
    machines,
    tmp_path,
):
    a, b = await machines("race")
    one, two = weights(tmp_path, "one", b"1"), weights(tmp_path, "two", b"2")
    first, second = await asyncio.gather(promote(a, one), promote(b, two))
    names = {first["promoted"], second["promoted"]}
    state = BucketState(segment_store(a.local), a.local / "adapters.json").read()
    assert state["version"] == 2
    assert {x["name"] for x in state["adapters"]} == names
    assert sorted(x["version"] for x in state["adapters"]) == [1, 2]
    assert set(state["stack"]) == names  # the later one on top, the other below it
    for proxy in (a, b):
        await await_until(lambda p=proxy: _is(serves(p), state["stack"][-1]), what="both follow")


def test_a_write_based_on_an_old_state_is_refused(s3, tmp_path):  # noqa: F811
    """The compare-and-swap under the lease: two writers that read the same version."""
    url = f"s3://{BUCKET}/cas"
    first = BucketState(
        segment_store(attach(url, tmp_path / "a")), tmp_path / "a" / "adapters.json"
    )
    second = BucketState(
        segment_store(attach(url, tmp_path / "b")), tmp_path / "b" / "adapters.json"
    )
    assert first.read() == {} and second.read() == {}
    assert first.write({"stack": ["x"]})["version"] == 1
    with pytest.raises(AdapterError, match="changed the promotion state") as refused:
        second.write({"stack": ["y"]})
    assert refused.value.status == 409
    assert second.read()["stack"] == ["x"]  # read again: now it may write version 2
    assert second.write({"stack": ["y"]})["version"] == 2
    with pytest.raises(AdapterError):
        first.write({"stack": ["z"]})
    assert first.read() == {"stack": ["y"], "version": 2}


async def test_a_lease_left_by_a_dead_proxy_expires(machines, s3, tmp_path):  # noqa: F811
    _, client = s3
    (a,) = await machines("lease", n=1)
    dead = {"owner": "gone", "host": "elsewhere", "pid": 1, "until": 0}
    client.put_object(Bucket=BUCKET, Key="lease/adapters.json.lock", Body=json.dumps(dead))
    await promote(a, weights(tmp_path, "n1", b"n"))
    assert "adapters.json.lock" not in objects(client, "lease")  # given back after


async def test_a_bucket_that_is_down_during_a_follow_does_not_break_serving(
    machines,
    s3,  # noqa: F811
    tmp_path,
):
    server, _ = s3
    a, b = await machines("down")
    name = (await promote(a, weights(tmp_path, "n1", b"a")))["promoted"]
    await await_until(lambda: serves(b), what="the second proxy follows")
    registry = b.app[ADAPTERS]
    server.stop()
    try:
        await await_until(lambda: registry._unreachable, what="a follow meets the outage")
        for proxy in (a, b):  # still served, by the promoted adapter
            r = await proxy.post("/v1/chat/completions", json=CHAT)
            assert r.status == 200
            assert proxy.fake.app[RECEIVED][-1]["body"]["model"] == name
            assert (await proxy.get("/admin/adapters")).status == 200
        refused = await promote(a, weights(tmp_path, "n2", b"b"), status=503)
        assert f"s3://{BUCKET}/down" in refused["error"]["message"]
        assert await serves(a) == await serves(b) == name
    finally:
        server.start()
    await await_until(lambda: not registry._unreachable, what="following again")
    newer = (await promote(a, weights(tmp_path, "n3", b"c")))["promoted"]
    await await_until(lambda: _is(serves(b), newer), what="the promotion after")


async def _is(value, expected) -> bool:
    return await value == expected


async def test_a_half_uploaded_adapter_is_never_loaded(machines, s3, tmp_path):  # noqa: F811
    """A state naming an upload without its manifest (the uploader died), or with a file
    that does not match it: the follower keeps serving what it served, loads nothing,
    and keeps no partial copy; once the upload is whole it follows."""
    _, client = s3
    a, b = await machines("half", state_poll_interval=0)  # b follows when told, below
    first = (await promote(a, weights(tmp_path, "n1", b"a")))["promoted"]
    registry = b.app[ADAPTERS]
    assert await registry.follow() and await serves(b) == first

    unfinished = weights(tmp_path, "n2", b"b")
    manifest = manifest_of(unfinished)
    key = key_of(manifest)
    for f in manifest["files"]:  # the files, not the manifest
        body = (unfinished / f["name"]).read_bytes()
        client.put_object(Bucket=BUCKET, Key=f"half/adapters/{key}/{f['name']}", Body=body)
    state = BucketState(segment_store(a.local), a.local / "adapters.json")
    current = state.read()
    later = {**current["adapters"][0], "name": "policy-v2-half", "version": 2}
    later.update(path=str(unfinished), source=f"s3://{BUCKET}/half/adapters/{key}")
    state.write({**current, "stack": [*current["stack"], later["name"]],
                 "adapters": [*current["adapters"], later]})  # fmt: skip

    assert not await registry.follow()
    assert await serves(b) == first
    assert list(b.fake.app[SETTINGS]["loras"]) == [first]
    # The manifest arrives, but a file in the bucket is not what it says.
    client.put_object(Bucket=BUCKET, Key=f"half/adapters/{key}.json", Body=json.dumps(manifest))
    client.put_object(
        Bucket=BUCKET, Key=f"half/adapters/{key}/adapter_model.safetensors", Body=b"torn"
    )
    assert not await registry.follow()
    assert list(b.fake.app[SETTINGS]["loras"]) == [first]
    assert [p.name for p in (b.local / CACHE).iterdir()] == [first_key(a)]
    # The upload is whole now: followed, loaded from the checked copy.
    body = (unfinished / "adapter_model.safetensors").read_bytes()
    client.put_object(
        Bucket=BUCKET, Key=f"half/adapters/{key}/adapter_model.safetensors", Body=body
    )
    assert await registry.follow() and await serves(b) == "policy-v2-half"
    loaded = b.fake.app[SETTINGS]["loras"]["policy-v2-half"]
    assert loaded == str(b.local / CACHE / key) and same_files(Path(loaded), unfinished)


def first_key(proxy) -> str:
    (only,) = [p.name for p in (proxy.local / CACHE).iterdir()]
    return only


async def test_an_offline_rollback_on_a_bucket_reaches_the_proxies(machines, tmp_path):
    a, b = await machines("offline")
    one = (await promote(a, weights(tmp_path, "n1", b"a")))["promoted"]
    await promote(a, weights(tmp_path, "n2", b"b"))
    args = ["rollback", "--offline", "--data", f"s3://{BUCKET}/offline",
            "--local-dir", str(tmp_path / "ops"), "--reason", "worse"]  # fmt: skip
    result = await asyncio.to_thread(CliRunner().invoke, main, args)
    assert result.exit_code == 0, result.output
    # Both follow: the first adapter again, loaded on each machine from its local copy.
    for proxy in (a, b):
        await await_until(lambda p=proxy: _is(serves(p), one), what="rolled back")
        assert one in proxy.fake.app[SETTINGS]["loras"]
    # `overnight runs` on a machine that never ran a proxy reads the reason from the bucket.
    args = ["runs", "--data", f"s3://{BUCKET}/offline", "--local-dir", str(tmp_path / "laptop")]
    shown = await asyncio.to_thread(CliRunner().invoke, main, args)
    assert shown.exit_code == 0 and "worse" in shown.output, shown.output


async def test_a_rollback_followed_while_its_adapter_is_being_unloaded_loads_it_again(
    machines, tmp_path
):
    """The drain of a replaced adapter checks that the alias no longer serves it, then
    unloads it. A follower adopting an older state meanwhile (an offline rollback) loads
    that same name again where a replica lacks it. Were the check and the unload apart
    from the follower's check, load and switch, the unload could land after the follower
    found the adapter still loaded: the alias would route to a name its replica lacks
    (seen once in the test above, in a loaded full run)."""
    (a,) = await machines("unloading", n=1, state_poll_interval=0)  # follows when told
    registry = a.app[ADAPTERS]
    one = (await promote(a, weights(tmp_path, "n1", b"a")))["promoted"]
    gate, unloading = asyncio.Event(), asyncio.Event()
    unload = registry.lora.unload_on

    async def held(replica, name):  # the unload of `one` waits here, its check passed
        unloading.set()
        await gate.wait()
        await unload(replica, name)

    registry.lora.unload_on = held
    two = (await promote(a, weights(tmp_path, "n2", b"b")))["promoted"]
    await asyncio.wait_for(unloading.wait(), 10)
    data_dir = attach(f"s3://{BUCKET}/unloading", tmp_path / "ops")
    now = await asyncio.to_thread(rollback_on_disk, data_dir / "adapters.json", "worse")
    assert now is not None and now.name == one
    following = asyncio.create_task(registry.follow())
    await asyncio.wait({following}, timeout=1.0)  # done at once, or waiting for the unload
    gate.set()
    assert await following
    await asyncio.gather(*registry._drains)  # the unload of `one`, then of `two`
    assert await serves(a) == one
    assert list(a.fake.app[SETTINGS]["loras"]) == [one], f"serves {one}, replaced {two}"


async def test_an_adapter_uploaded_where_it_was_trained_is_promoted_by_its_url(machines, tmp_path):
    """A trainer on another machine uploads its adapter and promotes it by URL: no proxy
    needs the trainer's disk."""
    a, b = await machines("by-url")
    trained = weights(tmp_path, "gpu-node", b"g")
    trainer_dir = attach(f"s3://{BUCKET}/by-url", tmp_path / "gpu")
    source, copy = await asyncio.to_thread(publish, segment_store(trainer_dir), trained)
    assert source == f"s3://{BUCKET}/by-url/adapters/{copy.name}"
    shutil.rmtree(trained)
    name = (await promote(a, source))["promoted"]
    await await_until(lambda: _is(serves(b), name), what="the second proxy follows")
    for proxy in (a, b):
        loaded = proxy.fake.app[SETTINGS]["loras"][name]
        assert loaded == str(proxy.local / CACHE / copy.name) and same_files(Path(loaded), copy)
    # Not an upload: a clear error, nothing changes.
    missing = f"s3://{BUCKET}/by-url/adapters/{'0' * 24}"
    refused = await promote(a, missing, status=503)
    assert "no manifest" in refused["error"]["message"] and await serves(a) == name
    # Nothing outside this store's uploads is read, whatever the admin API is given.
    for elsewhere in (f"s3://{BUCKET}/other/adapters/{copy.name}", f"s3://{BUCKET}/by-url/x"):
        refused = await promote(a, elsewhere, status=503)
        assert "not an adapter uploaded to" in refused["error"]["message"], refused
    assert await serves(a) == name


async def test_a_proxy_restarted_while_the_bucket_is_down_serves_the_promoted_adapter(
    machines,
    aiohttp_client,
    aiohttp_server,
    s3,  # noqa: F811
    tmp_path,
):
    """Its machine keeps a copy of the state and of the adapter: a restarted vLLM gets the
    adapter again from there, under its name (no new version can be written down now)."""
    server, _ = s3
    (a,) = await machines("restart", n=1)
    name = (await promote(a, weights(tmp_path, "n1", b"a")))["promoted"]
    await a.close()
    server.stop()
    try:
        fresh = await aiohttp_server(create_fake_upstream())  # vLLM restarted too: empty
        config = ProxyConfig(
            upstream=str(fresh.make_url("")),
            data_dir=f"s3://{BUCKET}/restart",
            local_dir=a.local,
            commit_interval=0.0,
        )
        again = await aiohttp_client(create_app(config))
        assert list(fresh.app[SETTINGS]["loras"]) == [name]
        assert (await again.post("/v1/chat/completions", json=CHAT)).status == 200
        assert fresh.app[RECEIVED][-1]["body"]["model"] == name
    finally:
        server.start()


async def test_a_trainer_that_shares_no_disk_with_the_proxies_promotes_and_resumes(
    machines, tmp_path
):
    """`overnight train` on a GPU node: what it trained reaches the proxies through the
    bucket (never by its own path), a resumed run finds it served, and the next night,
    on another node, starts from a checked copy of the served adapter."""
    from overnight.trainer.serving.proxy_client import local_adapter, served_adapter, serving_state
    from overnight.trainer.train import _promote_once, shared_adapter

    a, b = await machines("trainer")
    url = str(a.make_url(""))
    node = attach(f"s3://{BUCKET}/trainer", tmp_path / "gpu")
    trained = weights(node, "night-1", b"n")
    shared = await asyncio.to_thread(shared_adapter, node, trained)
    assert shared.startswith(f"s3://{BUCKET}/trainer/adapters/")
    said: list[str] = []
    state = await asyncio.to_thread(serving_state, url, None)
    name = await asyncio.to_thread(_promote_once, url, None, shared, said.append, None, state)
    await await_until(lambda: _is(serves(b), name), what="the second proxy follows")
    for proxy in (a, b):
        assert same_files(Path(proxy.fake.app[SETTINGS]["loras"][name]), trained)
    state = await asyncio.to_thread(serving_state, url, None)  # the night's, after training
    again = await asyncio.to_thread(_promote_once, url, None, shared, said.append, None, state)
    assert again == name and said[-1] == f"the proxy already serves it as {name}"

    served = served_adapter(await asyncio.to_thread(serving_state, url, None))
    assert served == shared
    next_node = attach(f"s3://{BUCKET}/trainer", tmp_path / "gpu2")
    start = await asyncio.to_thread(local_adapter, next_node, served)
    assert Path(start).is_relative_to(tmp_path / "gpu2") and same_files(Path(start), trained)
    # Without a bucket nothing is uploaded: the proxies are told the path.
    local = tmp_path / "plain"
    assert shared_adapter(local, trained) == str(trained.resolve())
    assert local_adapter(local, str(trained)) == str(trained)
