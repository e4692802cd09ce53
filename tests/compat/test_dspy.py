"""dspy 3.4 (through litellm): native tool calls, then a typed answer.

Tagged with `dspy.LM(extra_headers=...)`. The scripted model follows no text format,
so the agent runs on DSPy's JSON adapter, and litellm is told that the model takes a
JSON schema (as vLLM does): DSPy then sends `response_format` json_schema, else only
`json_object` with the fields described in prose.
"""

import os

import pytest

from .conftest import MODEL, assert_same_bytes, need
from .helpers import GROUP, TASK, check_rows, get_weather

pytestmark = pytest.mark.compat
ROLLOUT = "dspy-1"


def agent(origin: str, proxied: bool):
    need("dspy")
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no fetch at import
    import dspy
    import litellm

    litellm.register_model(
        {
            f"openai/{MODEL}": {"litellm_provider": "openai", "mode": "chat"}
            | {"supports_response_schema": True, "supports_function_calling": True}
        }
    )

    headers = {"X-Rollout-Group": GROUP, "X-Rollout-Id": ROLLOUT} if proxied else None
    lm = dspy.LM(
        f"openai/{MODEL}",
        api_base=origin + "/v1",
        api_key="unused",
        extra_headers=headers,
        cache=False,
        num_retries=0,
    )

    class Plan(dspy.Signature):
        """Call the tools that answer the question."""

        question: str = dspy.InputField()
        tools: list[dspy.Tool] = dspy.InputField()
        outputs: dspy.ToolCalls = dspy.OutputField()

    adapter = dspy.JSONAdapter(use_native_function_calling=True)
    with dspy.context(lm=lm, adapter=adapter):
        tools = [dspy.Tool(get_weather)]
        planned = dspy.Predict(Plan)(question=TASK, tools=tools)
        observed = [call.execute(functions=tools) for call in planned.outputs.tool_calls]
        answer = dspy.Predict("question, observations: list[str] -> city: str, temperature: int")
        result = answer(question=TASK, observations=observed)
    return result.city, result.temperature


@pytest.fixture(scope="module")
def runs(stack):
    return stack.run_both(agent)


def test_runs_to_the_end(runs):
    assert runs.direct_result == runs.proxied_result == ("city 1", 3)


def test_same_bytes(runs):
    assert_same_bytes(runs)


def test_rows(runs, stack):
    check_rows(stack.rows(ROLLOUT, expect=2), ROLLOUT, turns=2)
