"""`overnight import --format openai-jsonl|openai-batch` (docs/import.md): lines shaped as
OpenAI's SDK and APIs write them (a chat.completion, its stream's chunks, fine-tuning
lines, Batch API input and output lines), stored as imported rows: no token ids, stable
ids (a second import adds nothing), bad lines counted and named, gzip and directories,
images to the image store, --redact."""

from __future__ import annotations

import base64
import gzip
import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from overnight.cli.main import main
from overnight.imports.calls import NO_IDS
from overnight.imports.run import import_source
from overnight.storage import open_db

CREATED = 1_733_000_000  # 2024-11-30 UTC

REQUEST = {
    "model": "gpt-4o-mini",
    "messages": [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "What is 2 + 3?"},
    ],
    "temperature": 0.7,
    "response_format": {"type": "text"},
}
COMPLETION = {  # openai.types.chat.ChatCompletion, as model_dump() writes it
    "id": "chatcmpl-AaBbCc1",
    "object": "chat.completion",
    "created": CREATED,
    "model": "gpt-4o-mini-2024-07-18",
    "system_fingerprint": "fp_0ba0d124f1",
    "choices": [
        {
            "index": 0,
            "message": {"role": "assistant", "content": "5", "refusal": None},
            "logprobs": None,
            "finish_reason": "stop",
        }
    ],
    "usage": {"prompt_tokens": 21, "completion_tokens": 1, "total_tokens": 22},
}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}]  # fmt: skip


def _chunk(delta: dict, finish: str | None = None, usage: dict | None = None) -> dict:
    """openai.types.chat.ChatCompletionChunk, as a stream sends it."""
    return {
        "id": "chatcmpl-Stream9", "object": "chat.completion.chunk", "created": CREATED + 60,
        "model": "gpt-4o-mini-2024-07-18",
        "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}],
        "usage": usage,
    }  # fmt: skip


STREAMED_TOOL_CALL = [
    _chunk({"role": "assistant", "content": None, "tool_calls": [{"index": 0, "id": "call_1",
           "type": "function", "function": {"name": "get_weather", "arguments": ""}}]}),
    _chunk({"tool_calls": [{"index": 0, "function": {"arguments": '{"city": '}}]}),
    _chunk({"tool_calls": [{"index": 0, "function": {"arguments": '"Paris"}'}}]}),
    _chunk({}, "tool_calls"),
    {**_chunk({}), "choices": [], "usage": {"prompt_tokens": 40, "completion_tokens": 12,
                                            "total_tokens": 52}},
]  # fmt: skip
PNG = base64.b64encode(b"\x89PNG\r\n\x1a\n" + bytes(range(256)) * 2).decode()
IMAGE_REQUEST = {
    "model": "gpt-4o",
    "messages": [{"role": "user", "content": [
        {"type": "text", "text": "What is this?"},
        {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{PNG}"}}]}],
}  # fmt: skip


def _pairs() -> list[str]:
    return [
        json.dumps({"request": REQUEST, "response": COMPLETION}),
        json.dumps(
            {
                "request": {
                    **REQUEST,
                    "tools": TOOLS,
                    "stream": True,
                    "stream_options": {"include_usage": True},
                },
                "response": STREAMED_TOOL_CALL,
                "started_at": "2024-11-30T10:00:00.123456Z",
                "latency_ms": 850,
            }
        ),  # fmt: skip
        json.dumps({"request": IMAGE_REQUEST, "response": {**COMPLETION, "id": "chatcmpl-Img"}}),
        json.dumps(
            {
                "id": "failed-1",
                "request": REQUEST,
                "response": None,
                "status_code": 429,
                "error": {
                    "message": "Rate limit reached",
                    "type": "requests",
                    "code": "rate_limit_exceeded",
                },
                "started_at": CREATED + 5,
            }
        ),  # fmt: skip
        '{"request": {"model": "x"}, "response": {}}',  # no messages
        "{not json",
        json.dumps([1, 2]),
    ]


def _rows(data: Path) -> list[dict]:
    con = open_db(data)
    try:
        cur = con.execute("SELECT * FROM completions ORDER BY started_at, record_id")
        names = [d[0] for d in cur.description]
        return [dict(zip(names, r, strict=True)) for r in cur.fetchall()]
    finally:
        con.close()


def test_openai_jsonl_pairs_stream_tools_images_errors_and_bad_lines(tmp_path: Path) -> None:
    source = tmp_path / "calls.jsonl"
    source.write_text("\n".join(_pairs()) + "\n")
    data = tmp_path / "data"
    summary = import_source(data, source, "openai-jsonl", say=lambda _: None)
    assert (summary.lines, summary.calls, summary.written, summary.already) == (7, 4, 4, 0)
    assert summary.bad.total() == 3
    assert [n.split(":")[:2] for n in summary.bad_named] == [
        ["calls.jsonl", "5"], ["calls.jsonl", "6"], ["calls.jsonl", "7"]]  # fmt: skip
    rows = {json.loads(r["notes"])["imported"]["id"]: r for r in _rows(data)}
    whole = rows["chatcmpl-AaBbCc1"]
    assert str(whole["started_at"].date()) == "2024-11-30" and whole["date"].isoformat() == (
        "2024-11-30"
    )
    assert whole["prompt_token_ids"] is None and whole["completion_token_ids"] is None
    assert whole["completion_logprobs"] is None
    notes = json.loads(whole["notes"])
    assert notes["completion_token_ids"] == NO_IDS and notes["upstream"] == "imported:openai-jsonl"
    assert notes["imported"] == {"format": "openai-jsonl", "id": "chatcmpl-AaBbCc1",
                                 "file": "calls.jsonl", "line": 1}  # fmt: skip
    assert json.loads(whole["request"]) == REQUEST
    answer = json.loads(whole["response"])
    assert answer["choices"][0]["message"]["content"] == "5"
    assert answer["model"] == "gpt-4o-mini-2024-07-18" == whole["model_served"]
    assert (whole["finish_reason"], whole["prompt_tokens"], whole["completion_tokens"]) == (
        "stop", 21, 1)  # fmt: skip
    assert whole["sent_by"] == "client" and whole["endpoint"] == "chat.completions"
    assert whole["record_id"].startswith("imp-") and whole["http_status"] == 200

    streamed = rows["chatcmpl-Stream9"]
    assert streamed["stream"] is True and streamed["finish_reason"] == "tool_calls"
    call = json.loads(streamed["response"])["choices"][0]["message"]["tool_calls"][0]
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    assert json.loads(streamed["request"])["tools"] == TOOLS
    assert streamed["completion_tokens"] == 12 and streamed["latency_ms"] == 850
    assert streamed["started_at"].isoformat() == "2024-11-30T10:00:00.123456+00:00"

    image = rows["chatcmpl-Img"]
    url = json.loads(image["request"])["messages"][0]["content"][1]["image_url"]["url"]
    assert url.startswith("overnight-image:image/png;sha256:") and summary.images_stored == 1
    assert list((data / "images").rglob("*.png"))

    failed = rows["failed-1"]
    assert failed["http_status"] == 429 and "Rate limit reached" in failed["error"]
    assert failed["response"] is None

    again = import_source(data, source, "openai-jsonl", say=lambda _: None)
    assert (again.written, again.already) == (0, 4)
    assert len(_rows(data)) == 4


def test_fine_tuning_lines_are_conversations_gzip_and_directories(tmp_path: Path) -> None:
    conversation = {
        "messages": [
            {"role": "system", "content": "You help with weather."},
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "tool_calls": [{"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "18C, sunny"},
            {"role": "assistant", "content": "18C and sunny.", "weight": 1},
        ],
        "tools": TOOLS,
        "parallel_tool_calls": False,
    }  # fmt: skip
    folder = tmp_path / "exports"
    (folder / "sub").mkdir(parents=True)
    with gzip.open(folder / "sub" / "train.jsonl.gz", "wt") as f:
        f.write(json.dumps(conversation) + "\n")
    (folder / "more.jsonl").write_text(json.dumps({"request": REQUEST, "response": COMPLETION}))
    (folder / "README.txt").write_text("not read")
    data = tmp_path / "data"
    summary = import_source(data, folder, "openai-jsonl", say=lambda _: None)
    assert (summary.lines, summary.calls, summary.written, summary.bad.total()) == (2, 3, 3, 0)
    rows = [r for r in _rows(data) if json.loads(r["notes"])["imported"]["file"].startswith("sub")]
    assert len(rows) == 2 and len({r["rollout_id"] for r in rows}) == 1
    first, second = sorted(rows, key=lambda r: r["turn_index"])
    assert (first["turn_index"], second["turn_index"]) == (0, 1)
    assert (
        first["finish_reason"] == "tool_calls"
        and len(json.loads(first["request"])["messages"]) == 2
    )
    assert json.loads(second["request"])["tools"] == TOOLS
    assert "weight" not in json.loads(second["response"])["choices"][0]["message"]
    assert import_source(data, folder, "openai-jsonl", say=lambda _: None).written == 0


def test_openai_batch_output_joined_with_its_input(tmp_path: Path) -> None:
    folder = tmp_path / "batch"
    folder.mkdir()
    inputs = [
        {"custom_id": f"request-{i}", "method": "POST", "url": "/v1/chat/completions",
         "body": {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": f"Q{i}"}],
                  "max_tokens": 100}}
        for i in (1, 2, 3)
    ]  # fmt: skip
    outputs = [
        {"id": "batch_req_1", "custom_id": "request-1", "response": {"status_code": 200,
         "request_id": "req_a", "body": {**COMPLETION, "id": "chatcmpl-B1"}}, "error": None},
        {"id": "batch_req_2", "custom_id": "request-2", "response": {"status_code": 400,
         "request_id": "req_b", "body": {"error": {"message": "Invalid 'max_tokens'",
         "type": "invalid_request_error", "code": None}}}, "error": None},
        {"id": "batch_req_3", "custom_id": "request-3", "response": None,
         "error": {"code": "batch_expired", "message": "This request could not be executed"}},
        {"id": "batch_req_4", "custom_id": "request-9", "response": {"status_code": 200,
         "request_id": "req_d", "body": COMPLETION}, "error": None},
    ]  # fmt: skip
    (folder / "batch_input.jsonl").write_text("\n".join(json.dumps(i) for i in inputs))
    (folder / "batch_output.jsonl").write_text("\n".join(json.dumps(o) for o in outputs) + "\nx\n")
    data = tmp_path / "data"
    result = CliRunner().invoke(
        main, ["import", "--data", str(data), str(folder), "--format", "openai-batch"]
    )
    assert result.exit_code == 0, result.output
    assert "4 new written" in result.output and "1 bad line(s)" in result.output
    assert "batch_output.jsonl:5" in result.output and "off-policy" in result.output
    rows = {json.loads(r["notes"])["custom_id"]: r for r in _rows(data)}
    assert json.loads(rows["request-1"]["request"])["messages"][0]["content"] == "Q1"
    assert rows["request-1"]["finish_reason"] == "stop"
    assert rows["request-2"]["http_status"] == 400 and "max_tokens" in rows["request-2"]["error"]
    assert "batch_expired" in rows["request-3"]["error"]
    assert rows["request-9"]["request"] is None
    again = CliRunner().invoke(
        main, ["import", "--data", str(data), str(folder), "--format", "openai-batch"]
    )
    assert "0 new written, 4 already stored" in again.output


def test_dry_run_writes_nothing_and_redact_applies(tmp_path: Path) -> None:
    source = tmp_path / "calls.jsonl"
    source.write_text(json.dumps({"request": REQUEST, "response": COMPLETION}) + "\n")
    hook = tmp_path / "hook.py"
    hook.write_text(
        "def redact(r):\n"
        "    q = dict(r['request']); q['messages'] = [{'role': 'user', 'content': '[x]'}]\n"
        "    return {'request': q}\n"
    )
    data = tmp_path / "data"
    dry = import_source(data, source, "openai-jsonl", dry_run=True, say=lambda _: None)
    assert dry.written == 1 and not (data / "completions").exists()
    assert any("would be written" in line for line in dry.lines_out())
    import_source(data, source, "openai-jsonl", redact=f"{hook}:redact", say=lambda _: None)
    (row,) = _rows(data)
    assert json.loads(row["request"])["messages"] == [{"role": "user", "content": "[x]"}]


@pytest.mark.parametrize("fmt", ["openai-jsonl", "openai-batch"])
def test_an_empty_or_missing_source_is_said(tmp_path: Path, fmt: str) -> None:
    result = CliRunner().invoke(
        main, ["import", "--data", str(tmp_path / "d"), str(tmp_path / "nope"), "--format", fmt]
    )
    assert result.exit_code != 0 and "nope" in result.output


def test_a_call_with_n_choices_is_a_row_each_its_request_stored_once(tmp_path: Path) -> None:
    second = {"index": 1, "message": {"role": "assistant", "content": "five"},
              "logprobs": None, "finish_reason": "stop"}  # fmt: skip
    response = {**COMPLETION, "choices": [*COMPLETION["choices"], second]}
    source = tmp_path / "calls.jsonl"
    source.write_text(json.dumps({"request": {**REQUEST, "n": 2}, "response": response}) + "\n")
    data = tmp_path / "data"
    assert import_source(data, source, "openai-jsonl", say=lambda _: None).written == 2
    rows = sorted(_rows(data), key=lambda r: r["choice_index"])
    assert [json.loads(r["response"])["choices"][0]["message"]["content"] for r in rows] == [
        "5", "five"]  # fmt: skip
    assert rows[0]["rollout_id"].endswith(".0") and rows[1]["rollout_id"].endswith(".1")
    assert rows[0]["group_id"] == rows[1]["group_id"] and all(r["request_shared"] for r in rows)
    assert json.loads(rows[1]["request"])["n"] == 2  # the view gives the request back


def test_a_gzip_cut_short_is_a_bad_line_and_the_next_file_is_read(tmp_path: Path) -> None:
    folder = tmp_path / "logs"
    folder.mkdir()
    lines = "".join(
        json.dumps({"id": f"x{i}", "request": REQUEST, "response": COMPLETION}) + "\n"
        for i in range(200)
    )
    whole = gzip.compress(lines.encode())
    (folder / "a.jsonl.gz").write_bytes(whole[: len(whole) // 2])
    (folder / "b.jsonl").write_text(json.dumps({"id": "y", "request": REQUEST,
                                                "response": COMPLETION}) + "\n")  # fmt: skip
    data = tmp_path / "data"
    summary = import_source(data, folder, "openai-jsonl", say=lambda _: None)
    assert summary.bad.total() == 1 and "cannot be read on" in summary.bad_named[0]
    assert summary.bad_named[0].startswith("a.jsonl.gz:")
    assert 0 < summary.written < 201 and "y" in {
        json.loads(r["notes"])["imported"]["id"] for r in _rows(data)}  # fmt: skip


def test_as_policy_counts_the_calls_as_asked_of_an_alias(tmp_path: Path) -> None:
    source = tmp_path / "calls.jsonl"
    source.write_text(json.dumps({"request": REQUEST, "response": COMPLETION}) + "\n")
    data = tmp_path / "data"
    args = ["import", "--data", str(data), str(source), "--format", "openai-jsonl"]
    result = CliRunner().invoke(main, [*args, "--as-policy", "support"])
    assert result.exit_code == 0, result.output
    (row,) = _rows(data)
    assert row["model_requested"] == "support"
    assert json.loads(row["request"])["model"] == "gpt-4o-mini"


def test_progress_lines_come_as_it_goes(tmp_path: Path, monkeypatch) -> None:
    import overnight.imports.run as run

    monkeypatch.setattr(run, "PROGRESS_SECONDS", 0.0)
    source = tmp_path / "calls.jsonl"
    source.write_text("".join(
        json.dumps({"id": f"p{i}", "request": REQUEST, "response": COMPLETION}) + "\n"
        for i in range(3)))  # fmt: skip
    said: list[str] = []
    import_source(tmp_path / "data", source, "openai-jsonl", say=said.append)
    assert said[-1].startswith("openai-jsonl: 3 line(s), 3 call(s), 3 row(s) read")
    assert "already stored, 0 bad line(s)" in said[-1]


def test_the_doc_shows_each_format() -> None:
    doc = (Path(__file__).parent.parent / "docs" / "import.md").read_text()
    for fmt in ("openai-jsonl", "openai-batch", "litellm", "otel", "langfuse"):
        section = doc.split(f"### {fmt}\n", 1)[1].split("\n### ", 1)[0]
        assert "```json" in section and "Lost" in section, fmt
