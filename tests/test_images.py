"""Issue 40, part 1: a request's images stored once, by their sha256, beside the tables;
the rows keep references; read back verified; served to /ui; pruned when no row needs them."""

from __future__ import annotations

import base64
import datetime as dt
import hashlib
import json
import os
import re
import time

import pytest
from click.testing import CliRunner

from overnight.cli.main import main
from overnight.cli.prune import plan_prune, prune
from overnight.storage.images import ImageDamaged, ImageStore, parse_reference
from overnight.storage.read.images import restore_images
from overnight.storage.upkeep.images import plan_sweep
from overnight.view.display import show_rollout

from .helpers import rows, wait_for_rows

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def image(seed: int, size: int = 30_000) -> bytes:
    """Distinct bytes per seed (a PNG's signature, then noise: the store never decodes)."""
    return PNG_MAGIC + hashlib.shake_256(str(seed).encode()).digest(size)


def data_url(data: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64,{base64.b64encode(data).decode()}"


def chat_part(data: bytes) -> dict:
    return {"type": "image_url", "image_url": {"url": data_url(data)}}


def stray_bits(url: str) -> str:
    """A data URL whose last base64 digit carries bits the bytes do not use: it decodes,
    and encodes back to another text."""
    alphabet = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"
    assert url.endswith("==")
    return url[:-3] + alphabet[alphabet.index(url[-3]) | 1] + "=="


def stored_files(data_dir) -> list:
    return sorted(p for p in (data_dir / "images").rglob("*") if p.is_file())


async def screenshot_conversation(proxy, turns: int, screenshot) -> list[dict]:
    """`turns` chat requests of one rollout, each resending the history, each user turn
    with `screenshot(k)`'s image; the bodies sent."""
    sent, messages = [], []
    for k in range(turns):
        messages = [
            *messages,
            {
                "role": "user",
                "content": [{"type": "text", "text": f"step {k}"}, chat_part(screenshot(k))],
            },
        ]
        body = {"model": "m", "messages": messages}
        r = await proxy.post("/v1/chat/completions", json=body, headers={"X-Rollout-Id": "shots"})
        assert r.status == 200
        reply = (await r.json())["choices"][0]["message"]
        messages = [*messages, {"role": "assistant", "content": reply.get("content") or ""}]
        sent.append(body)
    return sent


@pytest.mark.parametrize("distinct", [False, True], ids=["same-screenshot", "one-new-each-turn"])
async def test_a_20_turn_screenshot_conversation_stores_each_image_once(
    make_proxy, tmp_path, distinct
):
    proxy = await make_proxy()
    data = tmp_path / "data"
    sent = await screenshot_conversation(
        proxy, 20, (lambda k: image(k)) if distinct else (lambda k: image(0))
    )
    found = await wait_for_rows(data, 20)
    files = stored_files(data)
    distinct_images = {image(k) for k in range(20)} if distinct else {image(0)}
    assert len(files) == len(distinct_images) == (20 if distinct else 1)
    assert sum(f.stat().st_size for f in files) == sum(len(b) for b in distinct_images)
    assert {f.read_bytes() for f in files} == distinct_images
    inline = sum(len(json.dumps(b)) for b in sent)  # what the rows held before: 210 images
    stored = sum(len(r["request"]) for r in found)
    assert "base64" not in "".join(r["request"] for r in found)
    assert stored < 70_000 < 5_000_000 < inline  # 210 references of ~100 chars, not 210 x 40 KB
    print(f"request column: {inline:,} chars inline, {stored:,} with references")
    # Read back, every turn is what was sent (the proxy drops nothing else from these).
    by_turn = sorted(found, key=lambda r: r["turn_index"])
    for row, body in zip(by_turn, sent, strict=True):
        assert restore_images(json.loads(row["request"]), data)["messages"] == body["messages"]


async def test_the_same_image_through_chat_responses_and_messages_is_stored_once(
    make_proxy, tmp_path
):
    proxy = await make_proxy()
    data = tmp_path / "data"
    shot = image(7)
    b64 = base64.b64encode(shot).decode()
    chat = {
        "model": "m",
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "what?"}, chat_part(shot)]}
        ],
    }
    responses = {
        "model": "m",
        "input": [
            {
                "role": "user",
                "content": [
                    {"type": "input_text", "text": "what?"},
                    {"type": "input_image", "image_url": data_url(shot)},
                ],
            }
        ],
    }
    messages = {
        "model": "m",
        "max_tokens": 16,
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "what?"},
                    {
                        "type": "image",
                        "source": {"type": "base64", "media_type": "image/png", "data": b64},
                    },
                ],
            }
        ],
    }
    for path, body, rollout in (
        ("/v1/chat/completions", chat, "chat"),
        ("/v1/responses", responses, "responses"),
        ("/v1/messages", messages, "messages"),
    ):
        r = await proxy.post(path, json=body, headers={"X-Rollout-Id": rollout})
        assert r.status == 200, await r.text()
    found = {r["rollout_id"]: r for r in await wait_for_rows(data, 3)}
    assert [f.name for f in stored_files(data)] == [f"{hashlib.sha256(shot).hexdigest()}.png"]
    ref = f"overnight-image:image/png;sha256:{hashlib.sha256(shot).hexdigest()}"
    for rollout, row in found.items():
        assert ref in row["request"] and b64 not in row["request"], rollout
        assert parse_reference(ref) == ("image/png", hashlib.sha256(shot).hexdigest())
    assert (
        restore_images(json.loads(found["chat"]["request"]), data)["messages"] == chat["messages"]
    )
    for rollout in ("responses", "messages"):  # recorded in the chat shape (conversation.py)
        restored = restore_images(json.loads(found[rollout]["request"]), data)
        assert restored["messages"][-1]["content"][-1] == chat_part(shot), rollout


def test_every_shape_reads_back_exactly_as_sent(tmp_path):
    from overnight.storage.write.images import ImageCapture

    shot = image(3)
    b64 = base64.b64encode(shot).decode()
    request = {
        "messages": [
            {
                "role": "user",
                "content": [
                    chat_part(shot),
                    {"type": "image_url", "image_url": data_url(shot, "image/jpeg")},
                ],
            },
            {
                "role": "user",
                "content": [{"type": "input_image", "image_url": data_url(shot, "image/webp")}],
            },
            {
                "role": "user",
                "content": [
                    {
                        "type": "image",
                        "source": {"type": "base64", "media_type": "image/gif", "data": b64},
                    }
                ],
            },
            {
                "role": "user",
                "content": [
                    {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}
                ],
            },
        ]
    }
    before = json.dumps(request)
    capture = ImageCapture(tmp_path)
    stored, kept = capture.externalize(request)
    assert json.dumps(request) == before  # the caller's request is never changed
    assert kept == [] and capture.stored == 4 and b64 not in json.dumps(stored)
    assert "https://example.com/a.png" in json.dumps(stored)  # a URL stays a URL, not fetched
    assert len(stored_files(tmp_path)) == 4  # one per media type: the type is in the name
    assert restore_images(stored, tmp_path) == request
    # A client's text that reads like a reference is its text: only an image's own place
    # is read back (no other request's image reaches this one through its words).
    digest = re.search(r"sha256:([0-9a-f]{64})", json.dumps(stored)).group(1)
    words = {
        "messages": [{"role": "user", "content": f"overnight-image:image/png;sha256:{digest}"}]
    }
    assert restore_images(words, tmp_path) is words


async def test_bad_images_are_kept_inline_noted_and_counted(make_proxy, tmp_path):
    proxy = await make_proxy()
    data = tmp_path / "data"
    bad = {
        "tiff": data_url(image(1), "image/tiff"),
        "not-base64": "data:image/png;base64," + "!@#$" * 40,
        "no-padding": data_url(image(2, 1001)).rstrip("="),
        "stray-bits": stray_bits(data_url(image(2, 1001))),
    }
    good = chat_part(image(9))
    for name, url in bad.items():
        body = {
            "model": "m",
            "messages": [
                {
                    "role": "user",
                    "content": [good, {"type": "image_url", "image_url": {"url": url}}],
                }
            ],
        }
        r = await proxy.post("/v1/chat/completions", json=body, headers={"X-Rollout-Id": name})
        assert r.status == 200
    found = {r["rollout_id"]: r for r in await wait_for_rows(data, 4)}
    for name, url in bad.items():
        row = found[name]
        assert url in row["request"], name  # kept inline, whole
        assert "overnight-image:" in row["request"]  # its good image still stored
        assert "1 image(s) kept inline" in json.loads(row["notes"])["images"], name
    notes = {name: json.loads(found[name]["notes"])["images"] for name in bad}
    assert "image/tiff" in notes["tiff"] and "invalid base64" in notes["not-base64"]
    assert "invalid base64" in notes["no-padding"]
    assert "does not read back" in notes["stray-bits"]  # decodes, but not to the same text
    stats = await (await proxy.get("/admin/stats")).json()
    assert stats["images_kept_inline"] == 4 and stats["images_stored"] == 4
    assert len(stored_files(data)) == 1


async def test_a_full_disk_under_the_image_store_keeps_the_record_and_its_image(
    make_proxy, tmp_path, monkeypatch
):
    import errno

    from overnight.storage import images as images_module

    def full(tmp, path):
        raise OSError(errno.ENOSPC, "No space left on device")

    proxy = await make_proxy()
    data = tmp_path / "data"
    shot = chat_part(image(3))
    body = {"model": "m", "messages": [{"role": "user", "content": [shot]}]}
    with monkeypatch.context() as m:
        m.setattr(images_module, "replace_durably", full)  # written, not renamed in
        r = await proxy.post("/v1/chat/completions", json=body, headers={"X-Rollout-Id": "full"})
        assert r.status == 200
        (row,) = await wait_for_rows(data, 1)
    assert shot["image_url"]["url"] in row["request"]  # inline, whole
    assert "overnight-image:" not in row["request"]
    note = json.loads(row["notes"])["images"]
    assert "1 image(s) kept inline" in note and "No space left on device" in note, note
    stats = await (await proxy.get("/admin/stats")).json()
    assert (stats["images_kept_inline"], stats["images_stored"]) == (1, 0), stats
    assert stored_files(data) == []  # its temporary file removed too
    # Room again: the same image is stored by the next request (nothing remembered it).
    r = await proxy.post("/v1/chat/completions", json=body, headers={"X-Rollout-Id": "room"})
    assert r.status == 200
    later = {r["rollout_id"]: r for r in await wait_for_rows(data, 2)}["room"]
    assert "overnight-image:" in later["request"] and later["notes"] in (None, "", "{}")
    stats = await (await proxy.get("/admin/stats")).json()
    assert (stats["images_kept_inline"], stats["images_stored"]) == (1, 1), stats
    assert len(stored_files(data)) == 1


def test_a_flipped_byte_is_an_error_naming_the_image(tmp_path):
    store = ImageStore(tmp_path)
    shot = image(5)
    digest = store.put(shot, "image/png")
    path = store.path(digest, "image/png")
    damaged = bytearray(path.read_bytes())
    damaged[1000] ^= 0x01
    path.write_bytes(bytes(damaged))
    with pytest.raises(ImageDamaged, match=digest) as e:
        store.read(digest, "image/png")
    assert str(path) in str(e.value)
    request = {
        "messages": [
            {
                "role": "user",
                "content": [
                    {
                        "type": "input_image",
                        "image_url": f"overnight-image:image/png;sha256:{digest}",
                    }
                ],
            }
        ]
    }
    with pytest.raises(ImageDamaged):
        restore_images(request, tmp_path)
    store.put(shot, "image/png")  # present: never written again, not even to mend it
    assert path.read_bytes() == bytes(damaged)


def check_output(data_dir, *args: str) -> tuple[int, str, list[tuple[str, str, str]]]:
    """`overnight check`'s exit code, output and findings (mark, kind, where)."""
    result = CliRunner().invoke(main, ["check", "--data", str(data_dir), *args])
    found = [
        (parts[0], parts[1], parts[2].rstrip(":"))
        for line in result.output.splitlines()[1:-1]
        if len(parts := line.split()) > 3 and parts[0] in ("DAMAGE", "note")
    ]
    return result.exit_code, result.output, found


def test_check_verifies_every_image_and_names_a_damaged_one(tmp_path):
    store = ImageStore(tmp_path)
    pngs = [store.put(image(k), "image/png") for k in range(3)]
    store.put(image(7, 500), "image/jpeg")
    code, output, found = check_output(tmp_path)
    assert code == 0 and found == [] and "no damage found" in output, output
    assert "and 4 image(s), 0.1 MB," in output.splitlines()[0]  # every image read

    victim = store.path(pngs[1], "image/png")
    damaged = bytearray(victim.read_bytes())
    damaged[20_000] ^= 0x80
    victim.write_bytes(bytes(damaged))
    (victim.parent / "notes.txt").write_bytes(b"not an image")
    misplaced = tmp_path / "images" / "zz" / f"{pngs[0]}.png"  # a name, in the wrong folder
    misplaced.parent.mkdir()
    misplaced.write_bytes(image(0))
    (victim.parent / f".{victim.name}.1.2.tmp").write_bytes(b"half")
    code, output, found = check_output(tmp_path)
    rel = f"images/{pngs[1][:2]}/{pngs[1]}.png"
    assert code == 1 and "1 finding(s) of damage" in output, output
    assert sorted(found) == sorted(
        [
            ("DAMAGE", "damaged", rel),
            ("note", "stray", f"images/{pngs[1][:2]}/notes.txt"),
            ("note", "stray", f"images/zz/{pngs[0]}.png"),
            ("note", "leftover", f"images/{pngs[1][:2]}/.{pngs[1]}.png.1.2.tmp"),
        ]
    ), output
    assert str(victim) in output and "hash to sha256" in output  # the file, and why
    assert "and 4 image(s)," in output.splitlines()[0]  # strays are not read as images
    code, output, _ = check_output(tmp_path, "--quarantine")  # reported, never moved
    assert code == 1 and victim.read_bytes() == bytes(damaged)
    victim.write_bytes(image(1))  # restored from a backup
    code, output, found = check_output(tmp_path)
    assert code == 0 and all(mark == "note" for mark, _, _ in found), output


async def test_ui_images_serves_a_stored_image_and_nothing_else(make_proxy, tmp_path):
    proxy = await make_proxy()
    data = tmp_path / "data"
    shot = image(11)
    body = {"model": "m", "messages": [{"role": "user", "content": [chat_part(shot)]}]}
    assert (
        await proxy.post("/v1/chat/completions", json=body, headers={"X-Rollout-Id": "ui"})
    ).status == 200
    await wait_for_rows(data, 1)
    digest = hashlib.sha256(shot).hexdigest()
    r = await proxy.get(f"/ui/images/{digest}")
    assert r.status == 200 and await r.read() == shot
    assert r.headers["Content-Type"] == "image/png"
    assert r.headers["X-Content-Type-Options"] == "nosniff"
    page = await (await proxy.get("/ui/rollouts/ui")).text()
    assert f'src="/ui/images/{digest}"' in page and "base64" not in page
    # A secret beside the store, and a link in the store's place pointing at it.
    (data / "secret.txt").write_text("secret")
    other = "ab" * 32
    (data / "images" / "ab").mkdir()
    os.symlink(data / "secret.txt", data / "images" / "ab" / f"{other}.png")
    for bad in (
        "../secret.txt",
        "..%2Fsecret.txt",
        "..%2F..%2Fimages%2F" + digest[:2],
        digest.upper(),
        digest[:63],
        digest + "0",
        f"{digest}.png",
        "0" * 64,  # well formed, not stored
        other,  # a symbolic link: never followed
    ):
        r = await proxy.get(f"/ui/images/{bad}")
        text = await r.text()
        assert r.status in (400, 404), (bad, r.status)
        assert "secret" not in text and r.headers.get("Content-Type") != "image/png", bad


async def test_show_gives_references_sizes_and_types_not_base64(make_proxy, tmp_path):
    proxy = await make_proxy()
    data = tmp_path / "data"
    shot = image(12)
    body = {
        "model": "m",
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "look"}, chat_part(shot)]}
        ],
    }
    assert (
        await proxy.post("/v1/chat/completions", json=body, headers={"X-Rollout-Id": "s"})
    ).status == 200
    await wait_for_rows(data, 1)
    from overnight.storage import open_db

    con = open_db(data)
    try:
        text = show_rollout(con, "s", data)
    finally:
        con.close()
    digest = hashlib.sha256(shot).hexdigest()
    assert f"<image sha256:{digest[:12]}… image/png {len(shot) / 1000:.1f} KB>" in text
    assert base64.b64encode(shot).decode()[:100] not in text


async def test_prune_deletes_unreferenced_images_and_keeps_referenced_ones(make_proxy, tmp_path):
    proxy = await make_proxy()
    data = tmp_path / "data"
    kept, young = image(20), image(22)
    body = {"model": "m", "messages": [{"role": "user", "content": [chat_part(kept)]}]}
    assert (await proxy.post("/v1/chat/completions", json=body)).status == 200
    await wait_for_rows(data, 1)
    store = ImageStore(data)
    orphan = store.put(image(21), "image/png")  # no row names it (its row was lost, pruned)
    store.put(young, "image/png")  # no row yet: its row may still be on its way
    day_ago = time.time() - 2 * 86_400
    for digest in (hashlib.sha256(kept).hexdigest(), orphan):
        os.utime(store.path(digest, "image/png"), (day_ago, day_ago))
    plan = plan_prune(data, dt.timedelta(days=30))
    assert [i.digest for i in plan.images.unreferenced] == [orphan]
    assert plan.images.bytes == len(image(21)) and plan.images.kept == 2
    assert "1 no longer referenced (30,008 bytes), 2 kept" in "\n".join(plan.lines())
    assert len(stored_files(data)) == 3  # a plan deletes nothing
    prune(plan)
    left = {f.name.split(".")[0] for f in stored_files(data)}
    assert left == {hashlib.sha256(kept).hexdigest(), hashlib.sha256(young).hexdigest()}
    # Once the rows that name it are pruned too (here: all rows before tomorrow), it goes.
    tomorrow = int((time.time() + 86_400) * 1_000_000)
    later = plan_sweep(data, since_us=tomorrow)
    assert [i.digest for i in later.unreferenced] == [hashlib.sha256(kept).hexdigest()]


async def test_a_responses_chain_rebuilt_from_the_store_records_its_images(make_proxy, tmp_path):
    """A chain read back from the store holds references (conversation.py stored_chain):
    the next turn's record keeps them as they are, and they read back as the image."""
    data = tmp_path / "data"
    shot = image(30)
    part = {"type": "input_image", "image_url": data_url(shot)}
    first = {"model": "m", "input": [{"role": "user", "content": [part]}]}
    before = await make_proxy(data_dir=data)
    answer = await (
        await before.post("/v1/responses", json=first, headers={"X-Rollout-Id": "a"})
    ).json()
    await wait_for_rows(data, 1)
    await before.close()
    after = await make_proxy(data_dir=data)  # a new proxy: the chain only in the store
    second = {"model": "m", "previous_response_id": answer["id"], "input": "and now?"}
    r = await after.post("/v1/responses", json=second, headers={"X-Rollout-Id": "b"})
    assert r.status == 200
    await wait_for_rows(data, 2)
    row = rows(data, "SELECT request FROM completions WHERE rollout_id = 'b'")[0]
    request = json.loads(row["request"])
    assert "history_missing" not in request and "base64" not in row["request"]
    restored = restore_images(request, data)
    assert restored["messages"][0]["content"] == [chat_part(shot)]
    assert len(stored_files(data)) == 1


async def test_listed_hosts_image_urls_are_fetched_stored_and_sent_as_data(
    make_proxy, received, aiohttp_server, tmp_path, monkeypatch
):
    """--fetch-images-from: an image URL of a listed host is fetched once, sent to vLLM as
    the bytes fetched (a data URL), and recorded as a stored image with the URL in the
    notes (no credentials, no query); anything else stays the client's URL, with the
    reason: an unlisted host or port, a redirect, not an image, too large, a listed name
    that resolves to no public address. A malformed URL never fails the request."""
    from aiohttp import web

    from overnight.proxy.capture import image_urls

    monkeypatch.setattr(image_urls, "MAX_FETCH_BYTES", 40_000)
    shot, big = image(21), image(22, size=60_000)

    async def serve(request: web.Request) -> web.StreamResponse:
        name = request.match_info["name"]
        if name == "moved":
            raise web.HTTPFound("/shot.png")
        if name == "page":
            return web.Response(text="<html>", content_type="text/html")
        return web.Response(body=shot if name == "shot.png" else big, content_type="image/png")

    images_app = web.Application()
    images_app.router.add_get("/{name}", serve)
    host = await aiohttp_server(images_app)
    base = f"http://127.0.0.1:{host.port}"
    # 127.0.0.1 listed by number, with its port: the operator asked for it; a name that
    # resolves there would not reach it, nor would another port.
    listed = (f"127.0.0.1:{host.port}", f"localhost:{host.port}")
    proxy = await make_proxy(fetch_images_from=listed)
    urls = [f"http://user:secret@127.0.0.1:{host.port}/shot.png?sig=abc", f"{base}/moved",
            f"{base}/page", f"{base}/big.png", f"http://localhost:{host.port}/shot.png",
            "https://example.com/a.png", f"http://127.0.0.1:{host.port + 1}/shot.png",
            "http://[evil/a.png"]  # fmt: skip
    body = {"model": "m", "messages": [{"role": "user", "content": [
        *({"type": "image_url", "image_url": {"url": u}} for u in urls),
        {"type": "image_url", "image_url": {"url": urls[0]}},  # the same picture again
        {"type": "text", "text": "what?"}]}]}  # fmt: skip
    r = await proxy.post("/v1/chat/completions", json=body, headers={"X-Rollout-Id": "u"})
    assert r.status == 200, await r.text()
    sent = received[-1]["body"]["messages"][0]["content"]
    assert sent[0]["image_url"]["url"] == sent[8]["image_url"]["url"] == data_url(shot)
    assert [p["image_url"]["url"] for p in sent[1:8]] == urls[1:]  # the others as sent
    (row,) = await wait_for_rows(tmp_path / "data", 1)
    notes = json.loads(row["notes"])["images_fetched"]
    assert notes[f"{base}/shot.png"] == "fetched"  # named without its credentials or query
    assert "secret" not in row["notes"] and "sig=" not in row["notes"]
    assert "HTTP 302" in notes[urls[1]] and "text/html" in notes[urls[2]]
    assert "more than 40000" in notes[urls[3]]
    assert "no public address" in notes[urls[4]]  # a listed name resolving to loopback
    assert len(notes) == 5  # unlisted hosts and ports, and the malformed URL: never asked
    ref = f"overnight-image:image/png;sha256:{hashlib.sha256(shot).hexdigest()}"
    assert ref in row["request"] and base64.b64encode(shot).decode() not in row["request"]
    assert [f.name for f in stored_files(tmp_path / "data")] == [
        f"{hashlib.sha256(shot).hexdigest()}.png"
    ]
    # A Responses `input_image` keeps its shape; past the request's budget a repeated
    # picture stays a URL (a small request must not grow into a huge one).
    monkeypatch.setattr(proxy.app[image_urls.IMAGE_FETCHER], "budget", 2 * len(data_url(shot)))
    part = {"type": "input_image", "image_url": f"{base}/shot.png"}
    responses = {"model": "m", "input": [{"role": "user", "content": [part] * 3}]}
    r = await proxy.post("/v1/responses", json=responses, headers={"X-Rollout-Id": "r"})
    assert r.status == 200, await r.text()
    shown = received[-1]["body"]["input"][0]["content"]
    assert [p["image_url"] for p in shown] == [data_url(shot)] * 2 + [f"{base}/shot.png"]
    # Without the option, or for a request not logged, nothing is fetched.
    plain = await make_proxy(data_dir=tmp_path / "plain")
    await plain.post("/v1/chat/completions", json=body, headers={"X-Rollout-Id": "p"})
    assert received[-1]["body"]["messages"][0]["content"][0]["image_url"]["url"] == urls[0]
    quiet = {"X-Rollout-Id": "q", "X-Rollout-Log": "off"}
    await proxy.post("/v1/chat/completions", json=body, headers=quiet)
    assert received[-1]["body"]["messages"][0]["content"][0]["image_url"]["url"] == urls[0]


def test_a_fetch_reaches_only_public_addresses():
    """IPv6 addresses that carry an IPv4 one are as public as it is."""
    import ipaddress

    from overnight.proxy.capture.image_urls import HostList, public

    for address in ("127.0.0.1", "10.0.0.5", "169.254.169.254", "::1", "::ffff:127.0.0.1",
                    "64:ff9b::a9fe:a9fe", "2002:7f00:1::", "fe80::1"):  # fmt: skip
        assert not public(ipaddress.ip_address(address)), address
    for address in ("8.8.8.8", "2001:4860:4860::8888", "64:ff9b::808:808"):
        assert public(ipaddress.ip_address(address)), address
    hosts = HostList(("cdn.example.com", "*.pics.example", "10.0.0.5:8080"))
    assert hosts.allows("cdn.example.com", 443, "https") and hosts.allows(
        "a.pics.example", 80, "http"
    )
    assert not hosts.allows("cdn.example.com", 8443, "https")  # another port: not listed
    assert not hosts.allows("evilpics.example", 80, "http")  # not a subdomain
    assert not hosts.allows("attacker.com\x00.pics.example", 80, "http")  # a NUL: never
    assert hosts.allows("10.0.0.5", 8080, "http") and hosts.named_by_number("10.0.0.5")
