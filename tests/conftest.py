"""Shared fixtures: the proxy in-process against the in-process fake upstream.

Tests that need a real vLLM use the session-wide server in `vllm_server` (see
tests/vllm_fixtures.py), marked `vllm`.
"""

from __future__ import annotations

import os

import pytest

from overnight.config import ProxyConfig
from overnight.proxy import create_app
from overnight.testing.fake_upstream import RECEIVED, SETTINGS, create_fake_upstream

pytest_plugins = ["tests.vllm_fixtures"]

# A developer's own W&B key or collector must not make every test's night report to W&B
# or every proxy trace (`--report-to auto`, the OTEL_*/LANGFUSE_* switches): the tests
# that exercise them set their own (tests/test_wandb.py, tests/test_tracing.py).
for _name in [n for n in os.environ if n.startswith(("OTEL_", "LANGFUSE_"))] + ["WANDB_API_KEY"]:
    os.environ.pop(_name, None)


@pytest.fixture
async def fake(aiohttp_server):
    """The fake vLLM; `fake.app[RECEIVED]` lists what it was sent."""
    return await aiohttp_server(create_fake_upstream())


@pytest.fixture
def make_proxy(aiohttp_client, fake, tmp_path):
    """Start a proxy in front of the fake: `client = await make_proxy(**config)`."""

    async def start(upstream: str | None = None, **overrides):
        config = ProxyConfig(
            upstream=upstream or str(fake.make_url("")),
            data_dir=overrides.pop("data_dir", tmp_path / "data"),
            commit_interval=0.0,
            **overrides,
        )
        return await aiohttp_client(create_app(config))

    return start


@pytest.fixture
def received(fake):
    return fake.app[RECEIVED]


@pytest.fixture
def fake_settings(fake):
    return fake.app[SETTINGS]
