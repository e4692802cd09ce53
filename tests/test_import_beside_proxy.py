"""An import beside a running proxy (docs/import.md): the same data directory, each with
its own log files; the proxy's completions recorded meanwhile are all there, the
imported rows too, and a second import adds nothing."""

from __future__ import annotations

import asyncio
import json

from overnight.imports.run import import_source

from .helpers import rows, wait_for_rows

LINES = 3000


def _line(i: int) -> str:
    request = {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": f"Q{i}?"}]}
    response = {"id": f"chatcmpl-{i}", "object": "chat.completion", "created": 1_733_000_000 + i,
                "model": "gpt-4o-mini", "choices": [{"index": 0, "finish_reason": "stop",
                "message": {"role": "assistant", "content": f"A{i}."}}]}  # fmt: skip
    return json.dumps({"request": request, "response": response})


async def test_a_proxy_writing_meanwhile_loses_nothing(make_proxy, tmp_path):
    proxy = await make_proxy()
    data = tmp_path / "data"
    source = tmp_path / "calls.jsonl"
    source.write_text("".join(_line(i) + "\n" for i in range(LINES)))
    body = {"model": "policy", "max_tokens": 3, "messages": [{"role": "user", "content": "hi"}]}
    importing = asyncio.create_task(
        asyncio.to_thread(
            import_source, data, source, "openai-jsonl", say=lambda _: None, batch_rows=200
        )  # fmt: skip
    )
    served = 0
    while not importing.done() or served < 20:
        answer = await proxy.post("/v1/chat/completions", json=body)
        assert answer.status == 200
        served += 1
    summary = await importing
    assert summary.written == LINES and summary.lost == 0
    found = await wait_for_rows(data, LINES + served)
    imported = [r for r in found if r["record_id"].startswith("imp-")]
    assert len(imported) == LINES and len(found) - LINES == served
    again = await asyncio.to_thread(import_source, data, source, "openai-jsonl", say=print)
    assert (again.written, again.already) == (0, LINES)
    assert len(rows(data, "SELECT record_id FROM completions")) == LINES + served
