"""Attacks on the per-policy admin tokens' limits ("may promote and roll back that policy
only": proxy/alias/ownership.py, routes/admin.py, routes/auth.py), each against the
real app, as an attacker holding `research`'s token (`adm-research`) would try them.

The first test pins what already held (routes, `?policy=` tricks, body fields); the
others are the findings of that review, each failing on the code before its fix: a
failed load named the replicas, a refusal told another policy's runs from none, the same
weights published for two policies were the first one's (and a manifest's policy could
be edited in place), policy names differing only in case shared one state folder on a
case-insensitive disk, and a token's "reason" could bloat the state every proxy reads."""

from __future__ import annotations

import asyncio
import json

import pytest

from overnight.config import ProxyConfig
from overnight.errors import ConfigError
from overnight.proxy.app import create_app
from overnight.proxy.routes.admin import TOKEN_REASON_CHARS
from overnight.storage import attach
from overnight.storage.bucket.adapter_sync import FOLDER, publish
from overnight.storage.location import segment_store
from overnight.testing.fake_upstream import create_fake_upstream

from .helpers import night_adapter
from .test_bucket_promotion import machines, weights  # noqa: F401 (the fixture)
from .test_keys import ADMIN, auth
from .test_object_storage import BUCKET, s3  # noqa: F401 (the fixture)
from .test_policy_tokens import (
    RESEARCH_OPS,
    TOKENS,
    loads,
    promote,
    proxy,  # noqa: F401 (the fixture)
    state_of,
)
from .test_replicas import _refuse_loads

# (method, path) a research token must be refused (403) on: another policy's routes,
# the routes it has none of, and spellings of its own that are not those routes.
REFUSED = [
    ("GET", "/admin/adapters"),  # no ?policy=: the default policy's
    ("GET", "/admin/adapters?policy=policy"),
    ("GET", "/admin/adapters?policy=Research"),
    ("GET", "/admin/adapters?Policy=research"),  # not the parameter: the default's
    ("GET", "/admin/adapters?policy=research&policy=policy"),
    ("GET", "/admin/adapters?policy=research&policy=research"),
    ("GET", "/admin/adapters?policy="),
    ("GET", "/admin/adapters?policy=research%00"),
    ("GET", "/admin/adapters/?policy=research"),
    ("POST", "/admin/adapters/promote?policy=policy"),
    ("POST", "/admin/adapters/rollback?policy=policy"),
    ("POST", "/admin/adapters/promote/?policy=research"),
    ("POST", "/admin//adapters/promote?policy=research"),
    ("POST", "/admin/adapters/prune?policy=research"),
    ("POST", "/admin/maintenance?policy=research"),
    ("GET", "/admin/maintenance?policy=research"),
    ("GET", "/admin/stats?policy=research"),
    ("GET", "/ui?policy=research"),
]


async def test_a_policy_token_reaches_its_own_policys_routes_only(proxy, tmp_path, received):  # noqa: F811
    client = await proxy()
    data = tmp_path / "data"
    own = night_adapter(data, "r-own", "research")
    theirs_before = await state_of(client, "policy")
    for method, path in REFUSED:
        r = await client.request(method, path, json={"path": own}, headers=auth(RESEARCH_OPS))
        assert r.status == 403, (method, path, await r.text())
        assert (await r.json())["error"]["code"] == "admin_forbidden", path
    # A body naming another policy is refused as any unknown field, before anything loads.
    body = {"path": own, "policy": "policy"}
    r = await client.post("/admin/adapters/promote?policy=research", json=body,
                          headers=auth(RESEARCH_OPS))  # fmt: skip
    assert r.status == 400 and loads(received) == []
    # Its own policy, percent-encoded in the query, is its own policy.
    r = await client.post("/admin/adapters/promote?policy=%72esearch", json={"path": own},
                          headers=auth(RESEARCH_OPS))  # fmt: skip
    assert r.status == 200, await r.text()
    assert (await r.json())["alias"] == "research"
    assert await state_of(client, "policy") == theirs_before


async def test_a_policy_tokens_reason_is_bounded(proxy, tmp_path, received):  # noqa: F811
    """Its event goes into the state every proxy reads at each poll (200 events kept): a
    32 MB body's reason, 200 times over, is gigabytes for the proxies of every policy."""
    client = await proxy()
    own = night_adapter(tmp_path / "data", "r1", "research")
    long = "x" * (TOKEN_REASON_CHARS + 1)
    r = await client.post("/admin/adapters/promote?policy=research",
                          json={"path": own, "reason": long}, headers=auth(RESEARCH_OPS))  # fmt: skip
    assert r.status == 400 and "reason" in (await r.json())["error"]["message"]
    assert loads(received) == []
    r = await client.post("/admin/adapters/promote?policy=research",
                          json={"path": own, "reason": long[1:]}, headers=auth(RESEARCH_OPS))  # fmt: skip
    assert r.status == 200
    r = await client.post("/admin/adapters/rollback?policy=research", json={"reason": long},
                          headers=auth(RESEARCH_OPS))  # fmt: skip
    assert r.status == 400 and (await state_of(client))["stack"]
    # The operator's reasons are as long as before.
    assert (await client.post("/admin/adapters/rollback?policy=research", json={"reason": long},
                              headers=auth(ADMIN))).status == 200  # fmt: skip


@pytest.fixture
def two_replicas(aiohttp_server, aiohttp_client, tmp_path):
    """A proxy with both policies' tokens in front of two fake vLLMs, the second refusing
    every load (out of memory); returns the client and the replicas' URLs."""

    async def start():
        good = await aiohttp_server(create_fake_upstream())
        refusing = create_fake_upstream()
        refusing.middlewares.append(_refuse_loads)
        bad = await aiohttp_server(refusing)
        urls = (str(good.make_url("")), str(bad.make_url("")))
        config = ProxyConfig(
            upstreams=urls, data_dir=tmp_path / "data", commit_interval=0.0,
            policies=("research",), keys_toml=TOKENS, admin_token=ADMIN,
        )  # fmt: skip
        return await aiohttp_client(create_app(config)), urls

    return start


async def test_a_failed_load_does_not_tell_a_policy_token_where_the_replicas_are(
    two_replicas, tmp_path
):
    """NIGHT_VIEW leaves the replicas' URLs out; the error of a load one replica refused
    named each (replicas/loading.py). The operator's error still does."""
    client, urls = await two_replicas()
    own = night_adapter(tmp_path / "data", "r1", "research")
    r = await promote(client, RESEARCH_OPS, own)
    assert r.status == 502
    message = (await r.json())["error"]["message"]
    assert "replica 2" in message and "out of memory" in message
    assert not any(url in message for url in urls), message
    r = await promote(client, ADMIN, own)
    assert r.status == 502 and urls[1] in (await r.json())["error"]["message"]


async def test_a_refusal_does_not_tell_another_policys_runs_from_none(proxy, tmp_path):  # noqa: F811
    client = await proxy()
    data = tmp_path / "data"
    theirs = night_adapter(data, "p-theirs", "policy")
    none = str(data / "adapters" / "no-such-run")
    said = []
    for path in (theirs, none):
        r = await promote(client, RESEARCH_OPS, path)
        assert r.status == 403
        said.append((await r.json())["error"]["message"].replace(path, "PATH"))
    assert said[0] == said[1]


async def test_the_same_weights_published_for_two_policies_are_each_ones_own(
    machines,  # noqa: F811
    tmp_path,
):
    """The key hashed the files only: the second policy's publish of the same weights
    found the first's upload and got its URL, whose manifest names the first policy, so
    its own token was refused it; and a manifest's "policy" edited in the bucket still
    hashed to its key. Now the policy is hashed in: two uploads, each its policy's."""
    (client,) = await machines(
        "same", n=1, policies=("research",), admin_token=ADMIN, keys_toml=TOKENS
    )
    store = segment_store(attach(f"s3://{BUCKET}/same", tmp_path / "gpu"))
    same = weights(tmp_path, "w", b"w")
    support, _ = await asyncio.to_thread(publish, store, same, "policy")
    research, _ = await asyncio.to_thread(publish, store, same, "research")
    assert research != support
    r = await promote(client, RESEARCH_OPS, research)
    assert r.status == 200, await r.text()
    # An edited manifest: support's upload, now naming research. It no longer hashes.
    manifest = f"{store.key(FOLDER)}/{support.rsplit('/', 1)[1]}.json"
    forged = {**json.loads(store.fs.cat(manifest)), "policy": "research"}
    store.fs.pipe(manifest, json.dumps(forged).encode())
    r = await promote(client, RESEARCH_OPS, support)
    assert r.status == 403 and "does not hash" in (await r.json())["error"]["message"]


def test_policy_names_that_differ_only_in_case_are_refused(tmp_path):
    """They name folders (DATA/policies/NAME): on macOS one folder, one promotion state,
    and `Research`'s token would promote and roll back `research`."""
    with pytest.raises(ConfigError, match="differ in more than case"):
        ProxyConfig(upstream="http://127.0.0.1:1", data_dir=tmp_path,
                    policies=("research", "Research"))  # fmt: skip
