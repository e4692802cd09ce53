"""Shared fixtures: the proxy in-process against the in-process fake upstream.

Tests that need a real vLLM use the session-wide server in `vllm_server` (see
tests/vllm_fixtures.py), marked `vllm`.
"""

from __future__ import annotations

import dataclasses
import os

import pytest

from overnight.config import ProxyConfig
from overnight.proxy import create_app
from overnight.storage import LogWriter, WriterConfig
from overnight.testing.fake_upstream import RECEIVED, SETTINGS, create_fake_upstream

pytest_plugins = ["tests.vllm_fixtures"]

# A developer's own W&B key or collector must not make every test's night report to W&B
# or every proxy trace (`--report-to auto`, the OTEL_*/LANGFUSE_* switches): the tests
# that exercise them set their own (tests/test_wandb.py, tests/test_tracing.py).
for _name in [n for n in os.environ if n.startswith(("OTEL_", "LANGFUSE_"))] + ["WANDB_API_KEY"]:
    os.environ.pop(_name, None)


def _threads_per_worker() -> int | None:
    """Torch's threads in each pytest-xdist worker and the processes it starts (a night's
    `overnight train`, torchrun's ranks): the cores shared out, so that the workers'
    OpenMP pools do not spin against each other. Measured on two cores: two processes of
    two threads each ran a matmul loop 3.9x slower than one alone; of one thread each,
    1.6x (bench/threads.py; BENCHMARKS.md, "The suite's threads"). None: one worker,
    torch's default."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers <= 1:
        return None
    return max(1, (os.cpu_count() or 1) // workers)


# Before torch is imported here, so that its pool starts at this size; a developer's own
# OMP_NUM_THREADS wins. vLLM's workers set their own (bound to a core of theirs).
if (_threads := _threads_per_worker()) is not None:
    os.environ.setdefault("OMP_NUM_THREADS", str(_threads))


@pytest.hookimpl(tryfirst=True)  # before xdist's own, which reads the marks into node ids
def pytest_collection_modifyitems(config, items):
    """`make test` runs the suite on two pytest-xdist workers with `--dist loadgroup`:
    the tests of one real vLLM server go to one worker, so that each server starts once
    (a minute or more each) rather than once in every worker that meets one of them.
    xdist hands out the largest groups first (its --loadscope-reorder), one to each
    worker, and the single tests after them to whichever worker is free."""
    for item in items:
        fixtures = set(getattr(item, "fixturenames", ()))
        if fixtures & {"smollm2_server", "smollm2_dir"}:
            item.add_marker(pytest.mark.xdist_group("smollm2"))
        elif "vllm_server" in fixtures:
            item.add_marker(pytest.mark.xdist_group("vllm-tiny"))
        elif "vision_server" in fixtures:
            item.add_marker(pytest.mark.xdist_group("vllm-vision"))


@pytest.fixture
async def fake(aiohttp_server):
    """The fake vLLM; `fake.app[RECEIVED]` lists what it was sent."""
    return await aiohttp_server(create_fake_upstream())


@pytest.fixture
def make_proxy(aiohttp_client, fake, tmp_path, monkeypatch):
    """Start a proxy in front of the fake: `client = await make_proxy(**config)`.

    Its log is compacted in this process when it closes. The product compacts in a child
    process (so that building Parquet never holds the proxy's GIL), and a child costs
    about 0.7 s of CPU to start: with a proxy or two in most of the 700 fast tests, that
    was minutes of the suite. The child's path is what the process tests run
    (test_serve_process, test_crash_consistency, test_recorder, test_object_storage)."""
    writer_init = LogWriter.__init__

    def compacting_in_process(self, config: WriterConfig, *args, **kwargs) -> None:
        writer_init(self, dataclasses.replace(config, compact_in_process=True), *args, **kwargs)

    monkeypatch.setattr(LogWriter, "__init__", compacting_in_process)

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
