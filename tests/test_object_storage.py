"""`--data s3://bucket/prefix`: the log on local disk, the Parquet segments in a bucket.

The bucket is moto's S3 server (`moto.server.ThreadedMotoServer`), started here on a
free port: real HTTP, the S3 API, reached through s3fs and botocore exactly as AWS S3,
MinIO or GCS's S3 API would be (the endpoint comes from `AWS_ENDPOINT_URL`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
import urllib.request

import pytest
from click.testing import CliRunner

from overnight.cli.main import main
from overnight.config import TrainConfig
from overnight.storage import LogWriter, WriterConfig, attach, open_db, recover
from overnight.storage import manifest as manifest_module
from overnight.storage.bucket.conditional import BucketError
from overnight.storage.location import CACHE_DIR, MARKER, segment_store
from overnight.storage.manifest import segment_files
from overnight.storage.upkeep import merge as merge_module
from overnight.storage.write.segments import log_files
from overnight.trainer.choose.inputs import Selection
from overnight.trainer.choose.plan import plan_run

from .helpers import completion, merge_looking, rows

pytest.importorskip("s3fs", reason="the s3 extra: pip install -e '.[s3]'")
moto_server = pytest.importorskip("moto.server", reason="the test extra (moto[server])")

BUCKET = "overnight-test"
CHAT = {"model": "policy", "messages": [{"role": "user", "content": "Pick a number."}]}


class Bucket:
    """moto's S3 server on one port, which can go down and come back (its objects kept:
    moto keeps them in this process)."""

    def __init__(self) -> None:
        self.server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        self.server.start()
        self.port = self.server.get_host_and_port()[1]

    def stop(self) -> None:
        self.server.stop()

    def start(self) -> None:
        self.server = moto_server.ThreadedMotoServer(
            ip_address="127.0.0.1", port=self.port, verbose=False
        )
        self.server.start()


@pytest.fixture(scope="module")
def s3():
    """An S3 server for this module: (Bucket, boto3 client). Credentials and endpoint
    as any deployment gives them: the AWS environment variables."""
    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    bucket = Bucket()
    env = {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_ENDPOINT_URL": f"http://127.0.0.1:{bucket.port}",
        # One retry: a bucket that is down (below) fails in milliseconds, not in
        # botocore's default of a dozen seconds of retries.
        "AWS_MAX_ATTEMPTS": "2",
    }
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)  # the compaction child inherits them
    import boto3
    import s3fs

    # fsspec keeps one S3 filesystem per set of arguments, with the endpoint it was made
    # with: another module's server (another port, stopped since) must not answer here.
    s3fs.S3FileSystem.clear_instance_cache()

    client = boto3.client("s3")
    client.create_bucket(Bucket=BUCKET)
    yield bucket, client
    bucket.stop()
    s3fs.S3FileSystem.clear_instance_cache()
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def objects(client, prefix: str) -> list[str]:
    found = client.list_objects_v2(Bucket=BUCKET, Prefix=prefix + "/").get("Contents", [])
    return sorted(o["Key"].removeprefix(prefix + "/") for o in found)


def cli(*args: str) -> str:
    result = CliRunner().invoke(main, list(args))
    assert result.exit_code == 0, result.output
    return result.output


async def converse(proxy, group: str, rewards: dict[str, float | None]) -> None:
    """An agent's group through the proxy: one turn per rollout, a reward (unless None),
    a finish."""
    headers = {"X-Rollout-Group": group}
    for rollout, reward in rewards.items():
        r = await proxy.post(
            "/v1/chat/completions", json=CHAT, headers={**headers, "X-Rollout-Id": rollout}
        )
        assert r.status == 200, await r.text()
        if reward is not None:
            posted = await proxy.post(f"/v1/rollouts/{rollout}/reward", json={"reward": reward})
            assert posted.status == 200
        assert (await proxy.post(f"/v1/rollouts/{rollout}/finish")).status == 200


async def test_a_proxy_on_a_bucket_uploads_segments_that_every_reader_reads(
    s3, make_proxy, tmp_path
):
    _, client = s3
    url, local = f"s3://{BUCKET}/team-a", tmp_path / "local"
    proxy = await make_proxy(data_dir=url, local_dir=local)
    await converse(proxy, "numbers-1", {"numbers-1.a": 1.0, "numbers-1.b": 0.25})
    await converse(proxy, "words-2", {"words-2.a": None, "words-2.b": None})  # for the judge
    await proxy.close()  # the proxy stops: its log is compacted, the segments uploaded

    assert json.loads((local / MARKER).read_text()) == {"segments": url}
    assert log_files(local) == []  # nothing left behind on local disk
    assert not list(local.glob("completions*"))  # no segment folders locally
    uploaded = objects(client, "team-a")
    for table in ("completions", "rewards", "finishes"):
        assert any(k.startswith(f"{table}/date=") and k.endswith(".parquet") for k in uploaded)
    assert all(str(p).startswith(url) for p in segment_files(local, "completions"))

    # The CLI, on this machine and on another (a fresh local directory): the bucket.
    for where in (local, tmp_path / "elsewhere"):
        out = cli("sql", "--data", url, "--local-dir", str(where), "--format", "csv",
                  "SELECT rollout_id, reward FROM rollouts WHERE group_id = 'numbers-1' ORDER BY 1")  # fmt: skip
        assert out.splitlines()[1:] == ["numbers-1.a,1.0", "numbers-1.b,0.25"]
        assert "numbers-1" in cli("ls", "--data", url, "--local-dir", str(where))
    # A proxy on another machine (its own local directory) shows them at /ui.
    other = await make_proxy(data_dir=url, local_dir=tmp_path / "machine-b")
    page = await (await other.get("/ui")).text()
    assert '<a href="/ui/groups/numbers-1">numbers-1</a>' in page
    # The judge reads the groups there and its rewards go there too.
    scorer = tmp_path / "scorer.py"
    scorer.write_text("def score(rollout):\n    return float(len(rollout['messages']))\n")
    judge = ("judge", "--data", url, "--local-dir", str(local), "--reward", f"{scorer}:score")
    out = await asyncio.to_thread(cli, *judge)  # it runs its own event loop
    assert "scored 1 group(s) with the reward function" in out and log_files(local) == []
    out = cli("sql", "--data", url, "--local-dir", str(tmp_path / "elsewhere"), "--format", "csv",
              "SELECT count(*) FROM rewards WHERE source = 'function'")  # fmt: skip
    assert out.splitlines()[1:] == ["2"]
    # The trainer's selection reads the same records from the bucket, token ids included.
    plan = plan_run(Selection(local, settle_seconds=600), TrainConfig())
    assert plan.groups == ["numbers-1"]
    assert sorted(s.rollout_id for s in plan.samples) == ["numbers-1.a", "numbers-1.b"]
    assert all(s.tokens for s in plan.samples)


@pytest.mark.slow
def test_overnight_serve_on_a_bucket_uploads_on_sigterm(s3, tmp_path):
    """The command itself: `overnight serve --data s3://... --local-dir ...` records
    locally, names itself in the local directory, and uploads when it stops."""
    from overnight.testing.processes import spawn_fake_upstream, spawn_serve

    _, client = s3
    url, local = f"s3://{BUCKET}/served", tmp_path / "local"
    with spawn_fake_upstream() as fake:
        serve = spawn_serve(url, "--upstream", fake.url, "--local-dir", str(local),
                            log_path=tmp_path / "serve.log")  # fmt: skip
        with serve:
            for i in range(3):
                body = json.dumps(CHAT).encode()
                request = urllib.request.Request(
                    serve.url + "/v1/chat/completions", body, {"X-Rollout-Id": f"s{i}"}
                )
                with urllib.request.urlopen(request, timeout=30) as r:
                    assert r.status == 200
            assert json.loads((local / "proxy.json").read_text())["url"] == serve.url
            assert serve.stop() == 0  # SIGTERM: finish, compact, upload
    assert log_files(local) == [] and not (local / "proxy.json").exists()
    assert any(k.startswith("completions/date=") for k in objects(client, "served"))
    found = rows(local, "SELECT rollout_id FROM completions ORDER BY 1")
    assert [r["rollout_id"] for r in found] == ["s0", "s1", "s2"]


def write_past_day(local, logs: int, per_log: int, day_ago: int) -> None:
    for n in range(logs):  # one log each: one segment each, all of the same past day
        writer = LogWriter(WriterConfig(local, commit_interval=0.0, compact_in_process=True))
        writer.start()
        for i in range(per_log):
            writer.append("completions", completion(10 * n + i, started_at=day_ago + i))
        writer.close()


def test_a_closed_day_is_merged_in_the_bucket_without_counting_a_row_twice(s3, tmp_path):
    _, client = s3
    local = attach(f"s3://{BUCKET}/merge", tmp_path / "local")
    day_ago = time.time_ns() // 1000 - 2 * 86_400_000_000
    write_past_day(local, logs=3, per_log=4, day_ago=day_ago)
    count = "SELECT count(*) AS n FROM completions"
    assert len(segment_files(local, "completions")) == 3
    assert rows(local, count) == [{"n": 12}]

    later = time.time() + merge_module.MERGE_AFTER + 1
    # Before its commit the merged object exists, not counted yet.
    assert merge_looking(local, later, lambda: rows(local, count)) == (1, [[{"n": 12}]])
    (merged,) = segment_files(local, "completions")
    assert merged.rsplit("/", 1)[1].startswith(manifest_module.MERGED_PREFIX)
    assert rows(local, count) == [{"n": 12}]
    day_objects = [k for k in objects(client, "merge") if k.startswith("completions/date=")]
    records = [k for k in day_objects if k.endswith(".parquet.sha256")]  # one a segment
    assert len(day_objects) == 4 + 3 and len(records) == 3  # replaced: kept for the grace
    assert "completions/_merged.json" in objects(client, "merge")
    merge_module.merge_closed_days(local, now=later + merge_module.GRACE_SECONDS + 1)
    day_objects = [k for k in objects(client, "merge") if k.startswith("completions/date=")]
    assert len(day_objects) == 1 and rows(local, count) == [{"n": 12}]  # records gone too
    # Readers read local copies; those of objects the bucket no longer has are gone.
    copies = list((local / CACHE_DIR / "completions").glob("date=*/*.parquet"))
    assert [p.name for p in copies] == [merged.rsplit("/", 1)[1]]


def test_a_damaged_object_is_set_aside_in_the_bucket_and_never_merged(s3, tmp_path):
    """A truncated object: the merge that reads it verifies it, moves it under
    `quarantine/` (the reason kept on this machine too) and merges the rest."""
    from overnight.storage.integrity import quarantined

    _, client = s3
    local = attach(f"s3://{BUCKET}/damaged", tmp_path / "local")
    write_past_day(local, logs=3, per_log=4, day_ago=time.time_ns() // 1000 - 2 * 86_400_000_000)
    victim = [k for k in objects(client, "damaged") if k.startswith("completions/date=")][0]
    key = f"damaged/{victim}"
    data = client.get_object(Bucket=BUCKET, Key=key)["Body"].read()
    client.put_object(Bucket=BUCKET, Key=key, Body=data[: len(data) // 2])
    later = time.time() + merge_module.MERGE_AFTER + 1
    merge_module.merge_closed_days(local, now=later)
    assert f"quarantine/{victim}" in objects(client, "damaged")
    assert [n["file"] for n in quarantined(local)] == [victim]
    (merged,) = segment_files(local, "completions")
    assert rows(local, "SELECT count(*) AS n FROM completions") == [{"n": 8}]


def test_two_machines_merging_one_day_never_count_a_row_twice(s3, tmp_path, monkeypatch):
    """Mergers on two machines (two local directories: no lock in common) pick the same
    day; B commits while A is between its merged upload and its commit. The bucket
    refuses A's commit (If-Match on the manifest version A chose its sources from), A's
    merged object never counts, and every row is counted once."""
    url = f"s3://{BUCKET}/race"
    machine_a = attach(url, tmp_path / "a")
    machine_b = attach(url, tmp_path / "b")
    day_ago = time.time_ns() // 1000 - 2 * 86_400_000_000
    write_past_day(machine_a, logs=2, per_log=3, day_ago=day_ago)
    later = time.time() + merge_module.MERGE_AFTER + 1
    commit, results = merge_module.write_manifest, []

    def b_first(ref, manifest):
        if ref.store.data_dir == machine_a and not results:
            results.append(merge_module.merge_closed_days(machine_b, now=later))
        return commit(ref, manifest)

    monkeypatch.setattr(merge_module, "write_manifest", b_first)
    assert merge_module.merge_closed_days(machine_a, now=later) == 0  # A lost
    assert results == [1]  # B merged the day
    manifest, _ = manifest_module.read_manifest(segment_store(machine_a), "completions")
    assert len(manifest["merged"]) == 1
    count = "SELECT count(*) AS n FROM completions"
    assert rows(machine_a, count) == [{"n": 6}] and rows(machine_b, count) == [{"n": 6}]
    # A's merged object is in the bucket, never counted, and goes after the grace period.
    store = segment_store(machine_a)
    assert len([f for f in store.list("completions") if "/m-" in f.rel]) == 2
    merge_module.merge_closed_days(machine_a, now=later + merge_module.GRACE_SECONDS + 1)
    assert len(store.list("completions")) == 1 and rows(machine_a, count) == [{"n": 6}]


async def test_a_bucket_that_is_down_loses_no_row(s3, make_proxy, tmp_path):
    """While the bucket is unreachable the agents see nothing: every request is answered
    (200), every reward acknowledged once on local disk. Compaction fails and the log
    stays; readers on this machine get a clear error (the bucket cannot be listed).
    When the bucket is back, the next start uploads the log: every row is there."""
    server, client = s3
    url, local = f"s3://{BUCKET}/outage", tmp_path / "local"
    server.stop()
    try:
        proxy = await make_proxy(data_dir=url, local_dir=local)
        await converse(proxy, "g-down", {"g-down.a": 1.0, "g-down.b": 0.0})
        writer_health = await (await proxy.get("/health")).json()
        await proxy.close()  # compaction fails: the log stays
        assert len(log_files(local)) == 1
        result = CliRunner().invoke(
            main, ["sql", "--data", url, "--local-dir", str(local), "SELECT 1"]
        )
        assert result.exit_code != 0 and "cannot read the records" in result.output
        with pytest.raises(BucketError):
            open_db(local)
    finally:
        server.start()
    assert writer_health["status"] == "ok", writer_health  # recording never degraded
    assert objects(client, "outage") == []
    assert recover(local) == 6  # what the next proxy start does: 2 turns, 2 rewards, 2 finishes
    assert log_files(local) == []
    assert rows(local, "SELECT rollout_id, reward FROM rollouts ORDER BY 1") == [
        {"rollout_id": "g-down.a", "reward": 1.0},
        {"rollout_id": "g-down.b", "reward": 0.0},
    ]


def test_a_local_directory_keeps_its_bucket(tmp_path):
    """`store.json` ties a local directory to one URL; a local --data is used as it is."""
    local = attach("s3://one/prefix", tmp_path / "local")
    assert attach("s3:/one/prefix", local) == local  # how Path() spells the URL
    with pytest.raises(ValueError, match="is the local directory of s3://one/prefix"):
        attach("s3://two/prefix", local)
    assert attach(tmp_path / "plain") == tmp_path / "plain"
    assert not (tmp_path / "plain").exists()
    result = CliRunner().invoke(
        main, ["ls", "--data", "s3://two/prefix", "--local-dir", str(local)]
    )
    assert result.exit_code != 0 and "give another --local-dir" in result.output


def test_prune_deletes_old_days_from_the_bucket(s3, tmp_path):
    _, client = s3
    url = f"s3://{BUCKET}/prune"
    local = attach(url, tmp_path / "local")
    write_past_day(local, logs=1, per_log=2, day_ago=time.time_ns() // 1000 - 40 * 86_400_000_000)
    write_past_day(local, logs=1, per_log=1, day_ago=time.time_ns() // 1000)
    args = ["prune", "--data", url, "--local-dir", str(local), "--older-than", "30d"]
    shown = cli(*args)
    assert (
        f"in {url}:" in shown
        and "completions     1 day(s)      1 file(s)            2 row(s)" in shown
    )
    assert "deleted 1 day partition(s)" in cli(*args, "--yes")
    segments = [k for k in objects(client, "prune") if k.startswith("completions/date=")]
    assert len(segments) == 2  # today's and its record, beside the manifest (the cutoff)
    assert segments[1] == f"{segments[0]}.sha256"
    assert rows(local, "SELECT count(*) AS n FROM completions") == [{"n": 1}]


@pytest.mark.slow
def test_two_overnight_serve_processes_on_one_bucket_share_a_promotion(s3, tmp_path):
    """Two `overnight serve --data s3://...` processes, each with its own local directory
    and its own vLLM (fake, in its own process): a promotion through one is loaded on the
    other's vLLM from that machine's own copy, downloaded from the bucket."""
    from pathlib import Path

    from overnight.storage.bucket.adapter_sync import CACHE
    from overnight.testing.processes import spawn_fake_upstream, spawn_serve

    url = f"s3://{BUCKET}/two-serves"
    adapter = tmp_path / "night-1"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(json.dumps({"r": 8}))
    (adapter / "adapter_model.safetensors").write_bytes(b"\x07" * 4096)

    def get(base: str, path: str, body: dict | None = None) -> dict:
        data = json.dumps(body).encode() if body is not None else None
        request = urllib.request.Request(base + path, data, {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=30) as r:
            return json.loads(r.read())

    def loras(fake) -> dict:
        return {m["id"]: m["root"] for m in get(fake.url, "/v1/models")["data"] if m["parent"]}

    with spawn_fake_upstream() as fake_a, spawn_fake_upstream() as fake_b:
        serves = []
        for name, fake in (("a", fake_a), ("b", fake_b)):
            local = ("--local-dir", str(tmp_path / name), "--state-poll-interval", "0.1")
            log = tmp_path / f"{name}.log"
            serves.append(spawn_serve(url, "--upstream", fake.url, *local, log_path=log))
        with serves[0] as a, serves[1] as b:
            promoted = get(a.url, "/admin/adapters/promote", {"path": str(adapter)})["promoted"]
            deadline = time.monotonic() + 30
            while get(b.url, "/admin/adapters")["stack"] != [promoted]:
                assert time.monotonic() < deadline, "the second proxy did not follow"
                time.sleep(0.1)
            for name, fake in (("a", fake_a), ("b", fake_b)):
                (path,) = loras(fake).values()
                assert list(loras(fake)) == [promoted]
                assert Path(path).parent == tmp_path / name / CACHE
                assert (Path(path) / "adapter_model.safetensors").read_bytes() == b"\x07" * 4096
            assert a.stop() == 0 and b.stop() == 0


async def test_images_go_to_the_bucket_and_read_back_on_another_machine(s3, make_proxy, tmp_path):
    """Issue 40: with --data a bucket, a request's image is put under the prefix's
    images/ (once), not on local disk, and another machine restores it from there."""
    import base64
    import hashlib

    from overnight.storage.images import ImageStore
    from overnight.storage.location import attach
    from overnight.storage.read.images import restore_images

    _, client = s3
    url, local = f"s3://{BUCKET}/team-img", tmp_path / "local"
    shot = b"\x89PNG\r\n\x1a\n" + hashlib.shake_256(b"bucket").digest(5000)
    digest = hashlib.sha256(shot).hexdigest()
    part = {
        "type": "image_url",
        "image_url": {"url": "data:image/png;base64," + base64.b64encode(shot).decode()},
    }
    proxy = await make_proxy(data_dir=url, local_dir=local)
    for turn in range(2):  # the same image twice: one object
        body = {
            "model": "m",
            "messages": [{"role": "user", "content": [part, {"type": "text", "text": str(turn)}]}],
        }
        assert (await proxy.post("/v1/chat/completions", json=body)).status == 200
    await proxy.close()
    assert [k for k in objects(client, "team-img") if k.startswith("images/")] == [
        f"images/{digest[:2]}/{digest}.png"
    ]
    assert not (local / "images").exists()
    other = attach(url, tmp_path / "other-machine")
    found = rows(other, "SELECT request FROM completions")
    assert len(found) == 2 and all("base64" not in r["request"] for r in found)
    restored = restore_images(json.loads(found[0]["request"]), other)
    assert restored["messages"][0]["content"][0] == part
    assert [(i.digest, i.size) for i in ImageStore(other).list()] == [(digest, len(shot))]


def test_check_verifies_the_images_in_the_bucket(s3, tmp_path):
    """`overnight check` on a bucket reads every image object: a damaged one is named by
    its key, a stray object is noted and never read as an image."""
    import hashlib

    from overnight.storage.images import ImageStore
    from overnight.storage.location import attach
    from overnight.storage.upkeep.check import check_store

    _, client = s3
    local = attach(f"s3://{BUCKET}/checked", tmp_path / "local")
    store = ImageStore(local)
    shots = [b"\x89PNG\r\n\x1a\n" + hashlib.shake_256(bytes([k])).digest(2000) for k in range(2)]
    digests = [store.put(shot, "image/png") for shot in shots]
    report = check_store(local)
    assert (report.images, report.damaged, report.findings) == (2, False, [])
    key = f"checked/images/{digests[0][:2]}/{digests[0]}.png"
    client.put_object(Bucket=BUCKET, Key=key, Body=shots[0][:-1] + b"\0")
    client.put_object(Bucket=BUCKET, Key="checked/images/readme.txt", Body=b"not an image")
    report = check_store(local)
    found = [(f.kind, f.where, f.damage) for f in report.findings]
    assert sorted(found) == [
        ("damaged", f"images/{digests[0][:2]}/{digests[0]}.png", True),
        ("stray", "images/readme.txt", False),
    ]
    (damaged,) = [f for f in report.findings if f.damage]
    assert f"{BUCKET}/{key} is damaged" in damaged.detail, damaged.detail  # the object named
    assert report.images == 2
