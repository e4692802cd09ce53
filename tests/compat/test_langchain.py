"""langchain-openai 1.7: tools bound to the model, a streamed answer, structured output.

Tagged with `extra_body` metadata (the proxy removes it before vLLM sees it). The trap:
`model_kwargs={"metadata": ...}` never reaches the wire.
"""

from __future__ import annotations

import pytest

from .conftest import MODEL, assert_same_bytes, need
from .helpers import GROUP, TASK, Report, check_rows, get_weather

pytestmark = pytest.mark.compat
ROLLOUT = "langchain-1"


def _chat(origin: str, proxied: bool, **kwargs):
    need("langchain_openai")
    from langchain_openai import ChatOpenAI

    metadata = {"rollout_group": GROUP, "rollout_id": ROLLOUT} if proxied else None
    return ChatOpenAI(
        model=MODEL,
        base_url=origin + "/v1",
        api_key="unused",
        extra_body={"metadata": metadata} if metadata else None,
        **kwargs,
    )


def agent(origin: str, proxied: bool):
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_core.tools import tool

    weather = tool(get_weather)
    llm = _chat(origin, proxied)
    messages = [HumanMessage(TASK)]
    reply = llm.bind_tools([weather]).invoke(messages)
    messages.append(reply)
    for call in reply.tool_calls:
        messages.append(ToolMessage(weather.invoke(call["args"]), tool_call_id=call["id"]))
    streamed = "".join(chunk.content for chunk in llm.bind_tools([weather]).stream(messages))
    report = llm.with_structured_output(Report).invoke(messages)
    return streamed, report


@pytest.fixture(scope="module")
def runs(stack):
    return stack.run_both(agent)


def test_runs_to_the_end(runs):
    assert runs.direct_result == runs.proxied_result
    assert runs.direct_result == ("Done after 1 tool result.", Report(city="city 1", temperature=3))


def test_same_bytes(runs):
    assert_same_bytes(runs)


def test_rows(runs, stack):
    check_rows(stack.rows(ROLLOUT, expect=3), ROLLOUT, turns=3)


def test_model_kwargs_metadata_is_never_sent(stack):
    """The trap docs/clients.md warns of: metadata put in model_kwargs does not travel."""
    before = len(stack.received)
    try:
        llm = _chat(stack.direct_tap.url, False, model_kwargs={"metadata": {"rollout_id": "x"}})
        llm.invoke("hi")
    except Exception as exc:  # noqa: BLE001 - what LangChain does with it is the point
        pytest.skip(f"LangChain refused model_kwargs metadata outright: {exc}")
    sent = stack.received[before:]
    assert sent and all("metadata" not in r["body"] for r in sent), sent[-1]["body"]
