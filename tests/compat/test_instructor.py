"""instructor 1.17: a structured answer through a named `tool_choice` (its TOOLS mode),
streamed as partial objects the way instructor's users stream them."""

from __future__ import annotations

import pytest

from .conftest import MODEL, assert_same_bytes, need
from .helpers import GROUP, TASK, Report, check_rows

pytestmark = pytest.mark.compat
ROLLOUT = "instructor-1"


def agent(origin: str, proxied: bool):
    need("instructor")
    import instructor
    from openai import OpenAI

    headers = {"X-Rollout-Group": GROUP, "X-Rollout-Id": ROLLOUT} if proxied else {}
    client = instructor.from_openai(
        OpenAI(base_url=origin + "/v1", api_key="unused", default_headers=headers),
        mode=instructor.Mode.TOOLS,
    )
    messages = [{"role": "user", "content": TASK}]
    whole = client.chat.completions.create(model=MODEL, response_model=Report, messages=messages)
    partials = list(
        client.chat.completions.create_partial(
            model=MODEL, response_model=Report, messages=messages
        )
    )
    return whole.model_dump(), partials[-1].model_dump()


@pytest.fixture(scope="module")
def runs(stack):
    return stack.run_both(agent)


def test_runs_to_the_end(runs):
    assert runs.direct_result == runs.proxied_result
    assert runs.direct_result == ({"city": "city 1", "temperature": 3},) * 2


def test_same_bytes(runs):
    assert_same_bytes(runs)


def test_rows(runs, stack):
    check_rows(stack.rows(ROLLOUT, expect=2), ROLLOUT, turns=2, tool="Report")
