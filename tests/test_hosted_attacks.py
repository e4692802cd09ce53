"""Attacks on the hosted-upstream hop (issue 28): where the operator's key, or a client's,
could go somewhere it should not. Each test is a reproduction that failed before its fix
(but one, which pins what `client` auth keeps): against the real app (create_app) and the scripted hosted API
(overnight/testing/hosted_upstream.py), with a second server standing for a host that
must never see a key."""

from __future__ import annotations

import asyncio

import pytest
from aiohttp import web

from overnight.config import ConfigError, ProxyConfig
from overnight.proxy.launch.launcher import detect_kind
from overnight.testing.hosted_upstream import RECEIVED, create_hosted_upstream

UPSTREAM_KEY = "sk-hosted-0123456789abcdef"
MODEL = "hosted-large"
CHAT = {"model": "policy", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8}


def _thief_app() -> web.Application:
    """A host that must never be sent a key: it keeps every request's headers."""
    app = web.Application()
    app[RECEIVED] = []

    async def keep(request: web.Request) -> web.Response:
        request.app[RECEIVED].append(dict(request.headers))
        cards = [{"id": "stolen", "object": "model", "owned_by": "thief"}]
        return web.json_response({"object": "list", "data": cards})

    app.router.add_route("*", "/{tail:.*}", keep)
    return app


@pytest.fixture
async def thief(aiohttp_server):
    return await aiohttp_server(_thief_app())


def _redirecting(thief) -> web.Application:
    """The scripted hosted API, with routes that answer a redirect to the thief (a
    compromised or misconfigured gateway, an http -> https hop to another name)."""
    app = create_hosted_upstream(UPSTREAM_KEY)

    async def away(request: web.Request) -> web.Response:
        raise web.HTTPFound(str(thief.make_url(request.path)))

    app.router.add_post("/v1/embeddings", away)
    return app


def _lower(headers: dict) -> dict:
    return {k.lower(): v for k, v in headers.items()}


# -- redirects: the key never follows one ----------------------------------------------


@pytest.mark.parametrize("kind", ["openai", "anthropic"])
async def test_a_passthrough_redirect_is_relayed_not_followed(
    make_proxy, aiohttp_server, thief, kind
):
    hosted = await aiohttp_server(_redirecting(thief))
    proxy = await make_proxy(
        str(hosted.make_url("")),
        upstream_kind=kind,
        upstream_api_key=UPSTREAM_KEY,
        upstream_model=MODEL,
    )
    body = {"model": MODEL, "input": "hi"}
    r = await proxy.post("/v1/embeddings", json=body, allow_redirects=False)
    # The client gets the redirect, as it would from the upstream directly; the proxy
    # does not carry the operator's key (x-api-key survives aiohttp's own cross-origin
    # strip) to wherever the upstream points.
    assert r.status == 302 and r.headers["Location"] == str(thief.make_url("/v1/embeddings"))
    assert not thief.app[RECEIVED]


def _models_redirecting(thief) -> web.Application:
    """An upstream whose /v1/models answers a redirect to the thief."""
    app = web.Application()

    async def away(request: web.Request) -> web.Response:
        raise web.HTTPFound(str(thief.make_url("/v1/models")))

    app.router.add_get("/v1/models", away)
    return app


async def test_the_model_list_follows_no_redirect_with_the_key(make_proxy, aiohttp_server, thief):
    redirecting = await aiohttp_server(_models_redirecting(thief))
    proxy = await make_proxy(
        str(redirecting.make_url("")),
        upstream_kind="anthropic",
        upstream_api_key=UPSTREAM_KEY,
        upstream_model=MODEL,
    )
    r = await proxy.get("/v1/models", allow_redirects=False)
    assert r.status == 302 and not thief.app[RECEIVED]


async def test_detect_kind_follows_no_redirect_with_the_key(aiohttp_server, thief):
    redirecting = await aiohttp_server(_models_redirecting(thief))
    url = str(redirecting.make_url("")).rstrip("/")
    kind, line = await asyncio.to_thread(detect_kind, url, UPSTREAM_KEY)
    assert not thief.app[RECEIVED]  # neither the key nor the probe went there
    assert kind == "vllm" and "302" in line and UPSTREAM_KEY not in line


# -- headers that carry credit or credentials under other names ----------------------


OTHER_CREDENTIALS = {
    "OpenAI-Organization": "org-someone-else",
    "OpenAI-Project": "proj_someone_else",
    "api-key": "azure-style-client-key",
    "x-goog-api-key": "gemini-style-client-key",
    "Cookie": "overnight_view=session-of-the-proxy",
}


@pytest.mark.parametrize("kind", ["openai", "anthropic"])
async def test_configured_key_goes_alone(make_proxy, aiohttp_server, kind):
    """With `configured`, the operator's key is the only credential upstream gets: a
    client naming another organisation or project would bill the operator's key there,
    and a key of its own under another header name would make two."""
    hosted = await aiohttp_server(create_hosted_upstream(UPSTREAM_KEY))
    proxy = await make_proxy(
        str(hosted.make_url("")),
        upstream_kind=kind,
        upstream_api_key=UPSTREAM_KEY,
        upstream_model=MODEL,
    )
    if kind == "openai":
        r = await proxy.post("/v1/chat/completions", json=CHAT, headers=OTHER_CREDENTIALS)
    else:
        body = {"model": "policy", "max_tokens": 8, "messages": CHAT["messages"]}
        r = await proxy.post("/v1/messages", json=body, headers=OTHER_CREDENTIALS)
    assert r.status == 200, await r.text()
    sent = _lower(hosted.app[RECEIVED][-1]["headers"])
    assert not {name.lower() for name in OTHER_CREDENTIALS} & set(sent)


async def test_client_auth_keeps_the_clients_own_account_headers(make_proxy, aiohttp_server):
    """With `client` the account is the client's: its organisation goes with its key."""
    hosted = await aiohttp_server(create_hosted_upstream(UPSTREAM_KEY))
    proxy = await make_proxy(
        str(hosted.make_url("")),
        upstream_kind="openai",
        upstream_auth="client",
        upstream_model=MODEL,
    )
    headers = {"Authorization": f"Bearer {UPSTREAM_KEY}", "OpenAI-Organization": "org-theirs"}
    r = await proxy.post("/v1/chat/completions", json=CHAT, headers=headers)
    assert r.status == 200, await r.text()
    assert _lower(hosted.app[RECEIVED][-1]["headers"])["openai-organization"] == "org-theirs"


# -- the upstream URL carries no secret -------------------------------------------------


@pytest.mark.parametrize(
    "url",
    [
        "https://user:s3cret-in-url@gateway.example/openai",
        "https://gateway.example/v1beta/openai?key=s3cret-in-url",
    ],
)
def test_an_upstream_url_with_a_secret_is_refused_without_repeating_it(url):
    # The hop never sends a URL's user or query (upstream.py sends the path only), while
    # every "upstream ... unreachable" error, record and log line would carry them.
    with pytest.raises(ConfigError, match="--upstream-api-key") as refused:
        ProxyConfig(upstream=url, upstream_kind="openai")
    assert "s3cret-in-url" not in str(refused.value)


# -- the night: no swap asked of a hosted upstream -------------------------------------


@pytest.fixture
async def hosted_proxy(make_proxy, aiohttp_server):
    """A proxy in front of the scripted hosted API, and that API."""
    hosted = await aiohttp_server(create_hosted_upstream(UPSTREAM_KEY))
    proxy = await make_proxy(
        str(hosted.make_url("")),
        upstream_kind="openai",
        upstream_api_key=UPSTREAM_KEY,
        upstream_model=MODEL,
    )
    return proxy, hosted


@pytest.mark.slow
async def test_a_night_saves_its_adapter_and_asks_a_hosted_proxy_for_no_swap(
    hosted_proxy, tmp_path, tiny_model_dir
):
    """Distilling a hosted model's traffic (--sft) is what its records are for; the
    adapter is for a later local proxy. Before: trained, then promoted into a 409, the
    whole night recorded as failed."""
    from overnight.trainer.train import train

    from .helpers import rows
    from .test_sft import sft, write_teacher_traffic

    pytest.importorskip("peft")
    proxy, hosted = hosted_proxy
    data = tmp_path / "data"
    write_teacher_traffic(data, conversations=4)
    config = sft(base_model=str(tiny_model_dir), learning_rate=1e-2, lora_rank=4,
                 groups_per_step=4, epochs=1)  # fmt: skip
    lines: list[str] = []
    url = str(proxy.make_url(""))
    result = await asyncio.to_thread(train, data, config, proxy_url=url, say=lines.append)
    assert (result.adapter_path / "adapter_config.json").exists()
    assert result.promoted_as is None and result.gate is None
    assert any("fronts a hosted API" in line and "no promotion" in line for line in lines)
    (run,) = rows(data, "SELECT status, error FROM training_runs")
    assert run == {"status": "trained", "error": None}
    assert not hosted.app[RECEIVED]  # nothing reached the hosted API


async def test_a_night_does_not_take_the_hosted_model_for_its_base(
    hosted_proxy, tmp_path, monkeypatch
):
    from overnight.config import TrainConfig
    from overnight.trainer.train import TrainError, train

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # before: a quiet look for "hosted-large"
    proxy, _ = hosted_proxy
    url = str(proxy.make_url(""))
    with pytest.raises(TrainError, match="give --base-model"):
        await asyncio.to_thread(train, tmp_path / "data", TrainConfig(), proxy_url=url)


async def test_resampling_refuses_a_hosted_proxy_before_asking_its_upstream(
    hosted_proxy, tmp_path, monkeypatch
):
    """Before: the hosted API was asked for its models with OVERNIGHT_UPSTREAM_API_KEY
    as a Bearer (an anthropic upstream refuses that: the night failed on a 401 named vLLM's)."""
    from overnight.config import TrainConfig
    from overnight.trainer.choose.inputs import Selection
    from overnight.trainer.choose.resample import ResampleError, resample_turns

    monkeypatch.setenv("OVERNIGHT_UPSTREAM_API_KEY", UPSTREAM_KEY)
    proxy, _ = hosted_proxy
    url = str(proxy.make_url(""))
    with pytest.raises(ResampleError, match="fronts a hosted API .* no token ids"):
        await asyncio.to_thread(
            resample_turns, Selection(tmp_path / "data"), TrainConfig(resample=2), proxy_url=url
        )
