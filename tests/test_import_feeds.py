"""What imported history feeds (docs/import.md): a day of scripted conversations, logged
as the proxy logs them, exported as each format and imported into a store of its own,
gives the same signals (`overnight signals`) as the captured day; GRPO never trains an
imported answer as if it were sampled (the plan's reason says so); an --sft night
imitates the imported answers the signals rate well."""

from __future__ import annotations

import datetime as dt
import json
from pathlib import Path

import pytest

from overnight.imports.calls import NO_IDS
from overnight.imports.run import import_source
from overnight.judge.implicit import find_signals
from overnight.storage import LogWriter, WriterConfig, now_us, open_db

from .helpers import completion_row

DAY = now_us() - 3 * 3600 * 1_000_000  # three hours ago: settled, inside every window
SYSTEM = {"role": "system", "content": "You are a helpful assistant."}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}]  # fmt: skip
CALL = {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]}  # fmt: skip


def user(text: str) -> dict:
    return {"role": "user", "content": text}


def bot(text: str) -> dict:
    return {"role": "assistant", "content": text}


# Each conversation: its turns, each (the request's messages, the reply); the user's next
# message (in the next turn's request) is what the signals read.
Q1, A1 = user("What is the capital of Australia?"), bot("Sydney.")
Q2, A2 = user("What is 3 plus 4?"), bot("3 plus 4 is 7.")
Q3, A3 = user("Name a prime number above 10."), bot("Eleven is one.")
CONVERSATIONS = [
    [([SYSTEM, Q1], A1),
     ([SYSTEM, Q1, A1, user("No, that's wrong: it is Canberra.")], bot("You are right: Canberra."))],
    [([SYSTEM, Q2], A2), ([SYSTEM, Q2, A2, user("Thanks, that's right!")], bot("Glad to help."))],
    [([SYSTEM, Q3], A3), ([SYSTEM, Q3, A3, user("Name a prime number above 10, please.")],
                          bot("13."))],
    [([SYSTEM, user("Weather in Paris?")], CALL),
     ([SYSTEM, user("Weather in Paris?"), CALL,
       {"role": "tool", "tool_call_id": "call_1", "content": "18C, sunny"}],
      bot("It is 18C and sunny in Paris."))],
    [([SYSTEM, Q1], bot("Canberra."))],  # the first question asked again: a regenerate
]  # fmt: skip


def captured_day(data: Path) -> list[dict]:
    """The conversations as the proxy logs them: one request a turn, two seconds apart."""
    writer = LogWriter(WriterConfig(data, compact_in_process=True, commit_interval=0.0))
    writer.start()
    rows, at = [], DAY
    for c, turns in enumerate(CONVERSATIONS):
        for t, (messages, reply) in enumerate(turns):
            at += 2_000_000
            rid = f"c{c}t{t}"
            request = {"model": "policy", "messages": messages, "temperature": 0.7}
            if any(m.get("tool_calls") for m in [*messages, reply]) or "Weather" in str(messages):
                request["tools"] = TOOLS
            finish = "tool_calls" if reply.get("tool_calls") else "stop"
            response = {
                "id": f"chatcmpl-{rid}", "object": "chat.completion", "created": at // 1_000_000,
                "model": "policy", "choices": [{"index": 0, "message": reply,
                                                "finish_reason": finish}],
                "usage": {"prompt_tokens": 20, "completion_tokens": 5, "total_tokens": 25},
            }  # fmt: skip
            row = completion_row(
                rid, rid, started_at=at, ended_at=at + 500_000, request=request,
                response=response, finish_reason=finish, model_requested="policy",
                model_served="policy", attribution="none", sent_by="client",
            )  # fmt: skip
            writer.append("completions", row)
            rows.append(row)
    writer.close()
    return rows


def _iso(us: int) -> str:
    return dt.datetime.fromtimestamp(us / 1e6, dt.UTC).isoformat().replace("+00:00", "Z")


def _parts(message: dict) -> dict:
    """A chat message as the GenAI conventions' message (role and parts)."""
    parts = []
    if message["role"] == "tool":
        parts.append({"type": "tool_call_response", "id": message["tool_call_id"],
                      "response": message["content"]})  # fmt: skip
    elif message.get("content"):
        parts.append({"type": "text", "content": message["content"]})
    for call in message.get("tool_calls") or ():
        parts.append({"type": "tool_call", "id": call["id"], "name": call["function"]["name"],
                      "arguments": call["function"]["arguments"]})  # fmt: skip
    return {"role": message["role"], "parts": parts}


def _otel_span(row: dict) -> dict:
    request, response = row["request"], row["response"]
    system = [m for m in request["messages"] if m["role"] == "system"]
    attrs = {
        "gen_ai.operation.name": "chat", "gen_ai.request.model": request["model"],
        "gen_ai.response.id": row["record_id"], "gen_ai.response.model": response["model"],
        "gen_ai.system_instructions": json.dumps([{"type": "text", "content": m["content"]}
                                                  for m in system]),
        "gen_ai.input.messages": json.dumps([_parts(m) for m in request["messages"]
                                             if m["role"] != "system"]),
        "gen_ai.output.messages": json.dumps([{**_parts(response["choices"][0]["message"]),
            "finish_reason": response["choices"][0]["finish_reason"]}]),
    }  # fmt: skip
    if "tools" in request:
        attrs["gen_ai.tool.definitions"] = json.dumps(request["tools"])
    return {
        "traceId": f"{abs(hash(row['record_id'])):032x}"[:32], "spanId": "00f067aa0ba902b7",
        "name": "chat policy", "kind": 3,
        "startTimeUnixNano": str(row["started_at"] * 1000),
        "endTimeUnixNano": str(row["ended_at"] * 1000),
        "attributes": [{"key": k, "value": {"stringValue": v}} for k, v in attrs.items()],
        "status": {},
    }  # fmt: skip


def export(rows: list[dict], fmt: str, folder: Path) -> Path:
    """The captured day as `fmt` writes it."""
    folder.mkdir(parents=True)
    lines = []
    for row in rows:
        request, response, rid = row["request"], row["response"], row["record_id"]
        started, ended = row["started_at"], row["ended_at"]
        if fmt == "openai-jsonl":
            lines.append({"id": rid, "request": request, "response": response,
                          "started_at": _iso(started), "ended_at": _iso(ended)})  # fmt: skip
        elif fmt == "openai-batch":
            (folder / "input.jsonl").open("a").write(json.dumps(
                {"custom_id": rid, "method": "POST", "url": "/v1/chat/completions",
                 "body": request}) + "\n")  # fmt: skip
            lines.append({"id": f"batch_req_{rid}", "custom_id": rid, "response": {
                "status_code": 200, "request_id": "req", "body": response}, "error": None})  # fmt: skip
        elif fmt == "litellm":
            parameters = {k: v for k, v in request.items() if k not in ("model", "messages")}
            lines.append({"id": rid, "trace_id": f"trace-{rid}", "session_id": None,
                "call_type": "acompletion", "stream": False, "status": "success",
                "model": "policy", "model_group": "policy", "messages": request["messages"],
                "response": response, "model_parameters": parameters,
                "startTime": started / 1e6, "endTime": ended / 1e6,
                "completionStartTime": ended / 1e6, "prompt_tokens": 20,
                "completion_tokens": 5, "error_str": None, "response_cost": 0.0})  # fmt: skip
        elif fmt == "langfuse":
            lines.append({"id": rid, "traceId": f"trace-{rid}", "type": "GENERATION",
                "name": "chat", "startTime": _iso(started), "endTime": _iso(ended),
                "model": "policy", "modelParameters": {"temperature": "0.7"},
                "input": {k: v for k, v in request.items() if k in ("messages", "tools")},
                "output": response["choices"][0]["message"], "level": "DEFAULT",
                "usageDetails": {"input": 20, "output": 5, "total": 25}})  # fmt: skip
        elif fmt == "otel":
            lines.append({"resourceSpans": [{"resource": {"attributes": []}, "scopeSpans": [
                {"scope": {"name": "opentelemetry.instrumentation.openai_v2"},
                 "spans": [_otel_span(row)]}]}]})  # fmt: skip
    (folder / "export.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    return folder


def _source_id(notes: str) -> str:
    imported = json.loads(notes)
    return imported.get("custom_id") or imported["imported"]["id"]


def signals_by_source(data: Path) -> set[tuple]:
    """Each signal, with the turns it names as the captured day's record ids."""
    con = open_db(data)
    try:
        back = {r: _source_id(n) if n and "imported" in n else r
                for r, n in con.execute("SELECT record_id, notes FROM completions").fetchall()}  # fmt: skip
    finally:
        con.close()
    found = find_signals(data, DAY - 1)
    return {
        (back[s.record_id], s.kind, s.rule, s.value, s.confidence,
         back.get(s.evidence_record) if s.evidence_record else None)
        for s in found.signals
    }  # fmt: skip


@pytest.fixture(scope="module")
def captured(tmp_path_factory) -> tuple[list[dict], set[tuple]]:
    data = tmp_path_factory.mktemp("captured") / "data"
    rows = captured_day(data)
    return rows, signals_by_source(data)


@pytest.mark.parametrize("fmt", ["openai-jsonl", "openai-batch", "litellm", "langfuse", "otel"])
def test_imported_conversations_give_the_captured_days_signals(tmp_path, captured, fmt):
    rows, expected = captured
    kinds = {s[1] for s in expected}
    assert {"corrected", "accepted", "regenerated"} <= kinds, kinds
    source = export(rows, fmt, tmp_path / "export")
    data = tmp_path / "data"
    summary = import_source(data, source, fmt, say=lambda _: None)
    assert summary.written == len(rows) and not summary.bad, summary.lines_out()
    assert signals_by_source(data) == expected


def test_grpo_never_trains_imported_answers_as_sampled(tmp_path, captured):
    from overnight.trainer.grpo.logged_turns import IMPORTED_SKIP, load_samples

    assert NO_IDS == IMPORTED_SKIP
    rows, _ = captured
    data = tmp_path / "data"
    import_source(data, export(rows, "openai-jsonl", tmp_path / "x"), "openai-jsonl",
                  say=lambda _: None)  # fmt: skip
    con = open_db(data)
    try:
        groups = [g for (g,) in con.execute("SELECT DISTINCT group_id FROM completions").fetchall()]
        loaded = load_samples(con, groups, tokenizer=object())  # never asked: skipped first
    finally:
        con.close()
    assert loaded.samples == [] and dict(loaded.skipped) == {IMPORTED_SKIP: len(rows)}


def test_an_sft_night_imitates_imported_answers_the_signals_rate_well(
    tmp_path, captured, tiny_model_dir
):
    pytest.importorskip("torch")
    from transformers import AutoTokenizer

    from overnight.config import TrainConfig
    from overnight.judge.implicit import run_signals
    from overnight.trainer.choose.inputs import Selection
    from overnight.trainer.choose.sft_plan import plan_sft

    rows, _ = captured
    data = tmp_path / "data"
    import_source(data, export(rows, "litellm", tmp_path / "x"), "litellm", say=lambda _: None)
    signals = run_signals(data, rewards=True)
    assert signals.rewards == 3, signals.lines()  # accepted; corrected and regenerated; re-asked
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    config = TrainConfig(sft=True, sft_held_out=0.0, sft_selection="min-reward",
                         sft_min_reward=0.5, reward_sources=("implicit",))  # fmt: skip
    plan = plan_sft(Selection(data, settle_seconds=600, tokenizer=tokenizer), config)
    assert plan.groups == ["trace-c1t0"], (plan.groups, dict(plan.skipped))
    (sample,) = plan.samples
    assert "3 plus 4 is 7." in tokenizer.decode(sample.tokens)


def test_ruler_reads_a_langfuse_session_as_a_group_of_its_traces(tmp_path):
    """Two traces of one Langfuse session answer the same question: one group of two
    rollouts, each with its whole conversation, as the judge loads finished groups."""
    from overnight.judge.run import load_groups
    from overnight.storage import finished_groups

    ask = [SYSTEM, Q1]
    lines = []
    for n, (trace, answer) in enumerate([("t-a", "Sydney."), ("t-b", "Canberra.")]):
        start = _iso(DAY + n * 10_000_000)
        lines.append({"id": f"gen-{trace}", "traceId": trace, "sessionId": "sess-1",
                      "type": "GENERATION", "startTime": start, "endTime": start,
                      "model": "gpt-4o-mini", "input": ask, "output": bot(answer)})  # fmt: skip
    source = tmp_path / "observations.jsonl"
    source.write_text("".join(json.dumps(x) + "\n" for x in lines))
    data = tmp_path / "data"
    summary = import_source(data, source, "langfuse", say=lambda _: None)
    assert summary.grouped == 2
    con = open_db(data)
    try:
        assert finished_groups(con, 600, None) == ["sess-1"]
        (group,) = load_groups(con, ["sess-1"])
    finally:
        con.close()
    assert sorted(r.rollout_id for r in group.trajectories) == ["t-a", "t-b"]
    assert {r.messages[-1]["content"] for r in group.trajectories} == {"Sydney.", "Canberra."}


def test_a_grpo_plan_says_why_it_leaves_imported_groups_out(tmp_path):
    """A session of two imported traces, rewarded apart: a GRPO night would train such a
    group, but its turns were never sampled from the policy: the plan says so."""
    from overnight.config import TrainConfig
    from overnight.trainer.choose.inputs import Selection
    from overnight.trainer.choose.plan import plan_run
    from overnight.trainer.grpo.logged_turns import IMPORTED_SKIP

    lines = []
    for n, (trace, answer) in enumerate([("t-a", "Sydney."), ("t-b", "Canberra.")]):
        start = _iso(DAY + n * 10_000_000)
        lines.append({"id": f"gen-{trace}", "traceId": trace, "sessionId": "sess-1",
                      "type": "GENERATION", "startTime": start, "endTime": start,
                      "model": "policy", "input": [SYSTEM, Q1], "output": bot(answer)})  # fmt: skip
    source = tmp_path / "observations.jsonl"
    source.write_text("".join(json.dumps(x) + "\n" for x in lines))
    data = tmp_path / "data"
    import_source(data, source, "langfuse", say=lambda _: None)
    writer = LogWriter(WriterConfig(data, compact_in_process=True))
    writer.start()
    for rollout, reward in (("t-a", 0.0), ("t-b", 1.0)):
        writer.append("rewards", {"reward_id": f"r-{rollout}", "schema_version": 2,
                                  "rollout_id": rollout, "reward": reward, "source": "agent",
                                  "created_at": now_us()})  # fmt: skip
    writer.close()
    plan = plan_run(Selection(data, settle_seconds=600, tokenizer=object()), TrainConfig())
    assert plan.groups == [] and plan.samples == []
    assert plan.skipped[f"turns skipped: {IMPORTED_SKIP}"] == 2, dict(plan.skipped)
    assert any(IMPORTED_SKIP in line for line in plan.lines()), plan.lines()
