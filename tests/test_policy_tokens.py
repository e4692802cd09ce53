"""Per-policy admin tokens promote their policy's own adapters only, and see what their
night reads (issue 27, the security review's finding 11; proxy/alias/ownership.py).

Two policies behind the in-process proxy and fake vLLM: the default `policy` (its token
`adm-ops`) and `research` (`adm-research`). A night's adapter is DATA/adapters/<run>, its
run DATA/runs/<run>/run.json naming the policy it trained, as the nights write them."""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

import pytest

from overnight.config.keys import key_digest
from overnight.proxy.routes.admin import NIGHT_VIEW
from overnight.storage import attach
from overnight.storage.bucket.adapter_sync import publish
from overnight.storage.location import segment_store

from .helpers import adapter_dir, night_adapter
from .test_bucket_promotion import machines, weights  # noqa: F401 (the fixture)
from .test_keys import ADMIN, OPS, auth
from .test_object_storage import BUCKET, s3  # noqa: F401 (the fixture)

RESEARCH_OPS = "adm-research"
TOKENS = f"""
[[admin]]
name = "support-ops"
policy = "policy"
sha256 = "{key_digest(OPS)}"

[[admin]]
name = "research-ops"
policy = "research"
sha256 = "{key_digest(RESEARCH_OPS)}"
"""


@pytest.fixture
def proxy(make_proxy, tmp_path):
    async def start(**overrides):
        overrides = {"admin_token": ADMIN, **overrides}
        return await make_proxy(policies=("research",), keys_toml=TOKENS, **overrides)

    return start


async def promote(proxy, token: str, path: str, policy: str = "research"):
    return await proxy.post(
        f"/admin/adapters/promote?policy={policy}", json={"path": path}, headers=auth(token)
    )


async def state_of(proxy, policy: str = "research") -> dict:
    r = await proxy.get(f"/admin/adapters?policy={policy}", headers=auth(ADMIN))
    assert r.status == 200
    return await r.json()


def loads(received) -> list[str]:
    return [r["body"]["lora_path"] for r in received if r["path"] == "/v1/load_lora_adapter"]


async def test_a_policy_token_promotes_its_own_nights_adapters(proxy, tmp_path, received):
    client = await proxy()
    data = tmp_path / "data"
    own = night_adapter(data, "20261201-research", "research")
    r = await promote(client, RESEARCH_OPS, own)
    assert r.status == 200, await r.text()
    assert (await r.json())["promoted"].startswith("research-v1-")
    assert loads(received) == [str(Path(own).resolve())]
    # A run that names no policy (from before policies) is the default policy's.
    old = night_adapter(data, "20261130-old", None)
    r = await promote(client, OPS, old, policy="policy")
    assert r.status == 200, await r.text()
    assert (await promote(client, RESEARCH_OPS, old)).status == 403


def path_tricks(data: Path, tmp_path: Path) -> dict[str, str]:
    """Paths a research token might try to promote, none of them a research night's."""
    own = night_adapter(data, "r-own", "research")
    theirs = night_adapter(data, "p-theirs", "policy")
    loose = adapter_dir(tmp_path, "loose")  # a peft directory, outside the nights
    (tmp_path / "link-to-theirs").symlink_to(theirs)
    os.symlink(loose, data / "adapters" / "r-link")  # inside the nights, leading out
    (data / "runs" / "r-link").mkdir()
    (data / "runs" / "r-link" / "run.json").write_text(json.dumps({"policy": "research"}))
    no_run = data / "adapters" / "r-no-run"
    no_run.mkdir()
    (no_run / "adapter_config.json").write_text("{}")
    return {
        "another policy's night": theirs,
        "dot-dot into another's": f"{own}/../p-theirs",
        "dot-dot that stays": f"{own}/../r-own",
        "a symlink to another's": str(tmp_path / "link-to-theirs"),
        "a symlink out of the nights": str(data / "adapters" / "r-link"),
        "an absolute path elsewhere": loose,
        "a system directory": "/etc",
        "a relative path": os.path.relpath(own),
        "URL-encoded": f"{data}/adapters/r-own%2F..%2Fp-theirs",
        "URL-encoded dot-dot": f"{data}/adapters/%2e%2e/adapters/p-theirs",
        "a night without its run": str(no_run),
        "the run's own directory": str(data / "runs" / "r-own"),
        "a file URL": f"file://{theirs}",
        "a bucket address without a bucket": "s3://bucket/prefix/adapters/" + "0" * 24,
        "a NUL byte": own + "\x00",
    }


async def test_path_tricks_are_refused_with_403_and_change_nothing(proxy, tmp_path, received):
    client = await proxy()
    data = tmp_path / "data"
    tricks = path_tricks(data, tmp_path)
    before = await state_of(client)
    for what, path in tricks.items():
        for canary in (None, 0.25):
            body = {"path": path, **({"canary": canary} if canary else {})}
            r = await client.post(
                "/admin/adapters/promote?policy=research", json=body, headers=auth(RESEARCH_OPS)
            )
            assert r.status == 403, (what, await r.text())
            error = (await r.json())["error"]
            assert error["code"] == "admin_forbidden", what
            assert error["type"] == "invalid_request_error" and "own adapters" in error["message"]
    assert await state_of(client) == before and loads(received) == []
    # The operator's token keeps its powers: any peft directory, for any policy.
    for path in (tricks["another policy's night"], tricks["an absolute path elsewhere"]):
        r = await promote(client, ADMIN, path)
        assert r.status == 200, await r.text()


async def test_a_path_its_state_names_already_is_its_own(proxy, tmp_path):
    """A rollback target or the canary promoted by the operator from anywhere: the
    token may promote it again (canary.py promotes its canary's path so)."""
    client = await proxy()
    loose = adapter_dir(tmp_path, "operators")
    body = {"path": loose, "canary": 0.5}
    r = await client.post("/admin/adapters/promote?policy=research", json=body, headers=auth(ADMIN))
    assert r.status == 200
    assert (await promote(client, RESEARCH_OPS, loose)).status == 200
    # The default policy's state does not name it: not the default token's.
    assert (await promote(client, OPS, loose, policy="policy")).status == 403


async def test_a_policy_token_sees_what_its_night_reads_only(proxy, tmp_path):
    client = await proxy()
    full = await state_of(client)
    assert {"replicas", "base_model_path", "colocation", "in_flight"} <= set(full)
    r = await client.get("/admin/adapters?policy=research", headers=auth(RESEARCH_OPS))
    seen = await r.json()
    assert set(seen) == set(NIGHT_VIEW) - {k for k in NIGHT_VIEW if k not in full}
    assert seen == {k: full[k] for k in seen}
    assert seen["policies"] == ["policy", "research"] and seen["base_model"] == full["base_model"]
    r = await promote(client, RESEARCH_OPS, night_adapter(tmp_path / "data", "r1", "research"))
    promoted = await r.json()
    assert "replicas" not in promoted and promoted["current"]["name"] == promoted["promoted"]
    r = await client.post("/admin/adapters/rollback?policy=research", headers=auth(RESEARCH_OPS))
    assert r.status == 200 and "replicas" not in await r.json()


async def test_without_an_admin_token_a_policy_token_is_held_to_its_policy_on_loopback(
    proxy, tmp_path
):
    """Loopback needs no token; one that brings a policy's token is that policy's night."""
    client = await proxy(admin_token=None)
    assert "replicas" in await (await client.get("/admin/adapters?policy=research")).json()
    r = await client.get("/admin/adapters?policy=research", headers=auth(RESEARCH_OPS))
    assert r.status == 200 and "replicas" not in await r.json()
    r = await client.get("/admin/adapters?policy=policy", headers=auth(RESEARCH_OPS))
    assert r.status == 403
    assert (await promote(client, RESEARCH_OPS, adapter_dir(tmp_path, "x"))).status == 403


async def test_with_a_bucket_a_token_promotes_uploads_of_its_policy_only(machines, tmp_path):  # noqa: F811
    """A night on a GPU node uploads its adapter, its manifest naming the policy
    (trainer/night/proxy_client.shared_adapter); a token promotes its own uploads only."""
    (client,) = await machines(
        "tokens", n=1, policies=("research",), admin_token=ADMIN, keys_toml=TOKENS
    )
    store = segment_store(attach(f"s3://{BUCKET}/tokens", tmp_path / "gpu"))
    research, _ = await asyncio.to_thread(publish, store, weights(tmp_path, "r", b"r"), "research")
    support, _ = await asyncio.to_thread(publish, store, weights(tmp_path, "p", b"p"), "policy")
    unnamed, _ = await asyncio.to_thread(publish, store, weights(tmp_path, "u", b"u"))
    before = await state_of(client)
    for refused in (
        support,
        unnamed,  # from before policies: the default policy's
        f"s3://{BUCKET}/other/adapters/{research.rsplit('/', 1)[1]}",  # another store's
        f"{research}/../{support.rsplit('/', 1)[1]}",
        research.replace("/adapters/", "/adapters%2F"),
        f"s3://{BUCKET}/tokens/adapters/{'0' * 24}",  # no such upload
    ):
        r = await promote(client, RESEARCH_OPS, refused)
        assert r.status == 403, (refused, await r.text())
        assert (await r.json())["error"]["code"] == "admin_forbidden"
    assert await state_of(client) == before
    r = await promote(client, RESEARCH_OPS, research)
    assert r.status == 200, await r.text()
    assert (await promote(client, OPS, unnamed, policy="policy")).status == 200


async def test_a_policys_night_runs_on_its_token(proxy, tmp_path):
    """What a night of `research` does through the admin API with research's token: its
    scope, the base model's name, its promotion; what is the operator's is said, not fatal."""
    from overnight.storage.read.policy_scope import PolicyScope
    from overnight.trainer.serving.proxy_client import (
        base_model_of,
        promote_adapter,
        prune_adapters,
        serving_state,
    )

    client = await proxy()
    url = str(client.make_url(""))
    state = await asyncio.to_thread(serving_state, url, RESEARCH_OPS, "research")
    scope = PolicyScope.of("research", state)
    assert (scope.default, scope.others, scope.others_trained) == (False, ("policy",), False)
    assert base_model_of(state) == "fake-base"  # the name vLLM serves, not where it lies
    own = night_adapter(tmp_path / "data", "r1", "research")
    name = await asyncio.to_thread(promote_adapter, url, RESEARCH_OPS, own, "research")
    assert name.startswith("research-v1-")
    said: list[str] = []
    pruned = await asyncio.to_thread(prune_adapters, url, RESEARCH_OPS, 1, said.append, "research")
    assert pruned is None and "admin_forbidden" in said[0]
