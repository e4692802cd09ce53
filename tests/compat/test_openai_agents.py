"""openai-agents 0.24: the Responses API by default, chat completions when told."""

from __future__ import annotations

import asyncio

import pytest

from .conftest import MODEL, assert_same_bytes, need
from .helpers import GROUP, TASK, Report, check_rows, get_weather

pytestmark = pytest.mark.compat


def _agent(api: str):
    need("agents")
    from agents import (
        Agent,
        Runner,
        function_tool,
        set_default_openai_api,
        set_default_openai_client,
        set_tracing_disabled,
    )
    from openai import AsyncOpenAI

    def run(origin: str, proxied: bool):
        # Groups in one process: the rollout's ids as the client's default headers.
        headers = {"X-Rollout-Group": GROUP, "X-Rollout-Id": f"agents-{api}"} if proxied else {}
        client = AsyncOpenAI(base_url=origin + "/v1", api_key="unused", default_headers=headers)
        set_tracing_disabled(True)  # traces would go to OpenAI's servers
        set_default_openai_client(client, use_for_tracing=False)
        set_default_openai_api(api)
        agent = Agent(
            name="weather",
            instructions="Use the tool, then report.",
            model=MODEL,
            tools=[function_tool(get_weather)],
            output_type=Report,
        )
        try:
            return asyncio.run(Runner.run(agent, TASK)).final_output
        finally:
            set_default_openai_api("responses")

    return run


@pytest.fixture(scope="module", params=["responses", "chat_completions"])
def runs(request, stack):
    return request.param, stack.run_both(_agent(request.param))


def test_runs_to_the_end(runs):
    api, r = runs
    assert r.direct_result == r.proxied_result == Report(city="city 1", temperature=3)
    paths = {e.path for e in r.direct}
    assert paths == {"/v1/responses" if api == "responses" else "/v1/chat/completions"}


def test_same_bytes(runs):
    assert_same_bytes(runs[1])


def test_rows(runs, stack):
    api, _ = runs
    rows = stack.rows(f"agents-{api}", expect=2)
    check_rows(rows, f"agents-{api}", turns=2, exact=api != "responses", extends=True)
