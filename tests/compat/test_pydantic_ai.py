"""pydantic-ai 2.38: `openai:` models use the Responses API, `openai-chat:` chat completions.

Pointed at the proxy with nothing but the environment: `OPENAI_BASE_URL` in the
URL-prefix form names the rollout, so the agent's code is unchanged. The chat variant
streams (`run_stream`), and pydantic-ai asks for structured output as a tool it must
call (`tool_choice: "required"`).
"""

from __future__ import annotations

import asyncio
import os

import pytest

from .conftest import MODEL, assert_same_bytes, need
from .helpers import GROUP, TASK, Report, check_rows, get_weather

pytestmark = pytest.mark.compat


def _agent(prefix: str):
    need("pydantic_ai")
    from pydantic_ai import Agent

    def run(origin: str, proxied: bool):
        rollout = f"/rollouts/{GROUP}/pydantic-{prefix}" if proxied else ""
        saved = {k: os.environ.get(k) for k in ("OPENAI_BASE_URL", "OPENAI_API_KEY")}
        os.environ["OPENAI_BASE_URL"] = f"{origin}{rollout}/v1"
        os.environ["OPENAI_API_KEY"] = "unused"
        try:
            agent = Agent(f"{prefix}:{MODEL}", output_type=Report, tools=[get_weather])
            if prefix == "openai":
                return asyncio.run(agent.run(TASK)).output

            async def streamed():
                async with agent.run_stream(TASK) as result:
                    return await result.get_output()

            return asyncio.run(streamed())
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v

    return run


@pytest.fixture(scope="module", params=["openai", "openai-chat"])
def runs(request, stack):
    return request.param, stack.run_both(_agent(request.param))


def test_runs_to_the_end(runs):
    _, r = runs
    assert r.direct_result == r.proxied_result == Report(city="city 1", temperature=3)


def test_same_bytes(runs):
    assert_same_bytes(runs[1])


def test_rows(runs, stack):
    prefix, _ = runs
    rows = stack.rows(f"pydantic-{prefix}", expect=2)
    check_rows(rows, f"pydantic-{prefix}", turns=2, exact=prefix != "openai", extends=True)
    assert {r["attribution"] for r in rows} == {"url"}
