"""Small helpers shared by the tests."""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import json
import os
import re
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Awaitable, Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import TypeVar

import pytest

from overnight.storage import SCHEMA_VERSION, query_rows

T = TypeVar("T")


def wait_until(condition: Callable[[], T], timeout: float = 10.0, what: str = "the condition") -> T:
    """Poll `condition` until it returns something truthy (returned); fail at the deadline.

    For states another process or thread reaches: a fixed sleep is either too short on a
    slow machine or wasted on a fast one.
    """
    deadline = time.monotonic() + timeout
    while not (value := condition()):
        assert time.monotonic() < deadline, f"{what}: not reached in {timeout:g} s"
        time.sleep(0.02)
    return value


async def await_until(
    condition: Callable[[], T | Awaitable[T]], timeout: float = 10.0, what: str = "the condition"
) -> T:
    """`wait_until` for tests on the event loop; `condition` may be sync or async."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if asyncio.iscoroutine(value) or isinstance(value, asyncio.Future):
            value = await value
        if value:
            return value
        assert time.monotonic() < deadline, f"{what}: not reached in {timeout:g} s"
        await asyncio.sleep(0.02)


@contextlib.contextmanager
def json_server(answer: Callable[[str, str, dict | None], tuple[int, dict]]) -> Iterator[str]:
    """A threaded HTTP server on a free port, its URL yielded: each GET and POST answered
    with `answer(method, path, json body or None)` -> (status, JSON). For code under test
    that calls out from a plain thread (urllib, a subprocess), where an aiohttp test
    server would need the test's event loop to run."""

    class Handler(BaseHTTPRequestHandler):
        def _answer(self, method: str) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            body = json.loads(self.rfile.read(length)) if length else None
            status, reply = answer(method, self.path, body)
            data = json.dumps(reply).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:  # noqa: N802 (http.server's names)
            self._answer("GET")

        def do_POST(self) -> None:  # noqa: N802
            self._answer("POST")

        def log_message(self, *args) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_port}"
    finally:
        server.shutdown()
        server.server_close()


def pid_alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie, exited and not yet reaped, does not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


rows = query_rows  # `query` over a data folder's views: its rows as dicts


async def wait_for_rows(
    data_dir: Path, n: int, table: str = "completions", timeout: float = 10.0
) -> list[dict]:
    """Rows of `table` once at least n are on disk (the log commits asynchronously)."""
    deadline = time.monotonic() + timeout
    while True:
        found = rows(
            data_dir,
            f"SELECT * FROM {table} ORDER BY started_at, choice_index"
            if table == "completions"
            else f"SELECT * FROM {table}",
        )
        if len(found) >= n or time.monotonic() > deadline:
            assert len(found) >= n, f"expected {n} {table} row(s), found {len(found)}"
            return found
        await asyncio.sleep(0.02)


def sse_events(text: str) -> list[dict | str]:
    """Parsed `data:` payloads of an SSE body; [DONE] stays a string."""
    out: list[dict | str] = []
    for block in text.split("\n\n"):
        if block.startswith("data: "):
            data = block[6:]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def without_ids(obj):
    """A response with the fields that differ per call (id, created) removed."""
    if isinstance(obj, dict):
        return {k: without_ids(v) for k, v in obj.items() if k not in ("id", "created")}
    if isinstance(obj, list):
        return [without_ids(v) for v in obj]
    return obj


def version_of(name: str | None) -> str | None:
    """`policy-v3-9f2c1a` -> `policy-v3`: adapter names end in a random tail."""
    return re.sub(r"-[0-9a-f]{6}$", "", name) if name else name


def adapter_dir(tmp_path, name: str) -> str:
    """A directory that passes for a peft adapter (the fake vLLM loads anything)."""
    path = tmp_path / name
    path.mkdir()
    (path / "adapter_config.json").write_text(json.dumps({"r": 8}))
    return str(path)


# A night of the tiny model on real vLLM: two quick steps (tests/test_train.py,
# tests/test_policies_vllm.py).
TINY_NIGHT = dict(learning_rate=1e-3, lora_rank=8, lora_alpha=16, groups_per_step=2,
                  micro_batch_tokens=128, loss="dapo")  # fmt: skip


async def log_digit_group(
    proxy, group: str, messages: list[dict], size: int, model: str = "policy", max_tokens: int = 10
) -> None:
    """`size` rollouts of one task through the proxy, each rewarded with the share of
    digits in its reply (plus a tie-breaker, so every group gives a signal), finished."""
    for i in range(size):
        rollout = f"{group}.{i}"
        r = await proxy.post(
            "/v1/chat/completions",
            headers={"X-Rollout-Group": group, "X-Rollout-Id": rollout},
            json={"model": model, "messages": messages, "max_tokens": max_tokens,
                  "temperature": 1.0},
        )  # fmt: skip
        assert r.status == 200, await r.text()
        text = (await r.json())["choices"][0]["message"]["content"]
        reward = sum(c.isdigit() for c in text) / max(len(text), 1)
        await proxy.post(f"/v1/rollouts/{rollout}/reward", json={"reward": reward + i * 1e-3})
        await proxy.post(f"/v1/rollouts/{rollout}/finish")


def night_adapter(data_dir, run: str, policy: str | None) -> str:
    """A night's adapter as `overnight train` leaves one: DATA/adapters/<run>, and its run
    DATA/runs/<run>/run.json naming the policy it trained (a per-policy admin token
    promotes only its own: proxy/alias/ownership.py)."""
    runs = Path(data_dir) / "runs" / run
    runs.mkdir(parents=True)
    (runs / "run.json").write_text(json.dumps({"groups": [], "start_adapter": None,
                                               "policy": policy}))  # fmt: skip
    path = Path(data_dir) / "adapters" / run
    path.mkdir(parents=True)
    (path / "adapter_config.json").write_text(json.dumps({"r": 8}))
    return str(path)


def lora_calls(received) -> list[tuple[str, str]]:
    """The fake vLLM's load/unload calls, as (endpoint, adapter version)."""
    return [
        (r["path"].rsplit("/", 1)[-1], version_of(r["body"]["lora_name"]))
        for r in received
        if "lora" in r["path"]
    ]


def completion_row(rollout_id: str, group_id: str, **fields) -> dict:
    """A one-turn `completions` row as the proxy writes one, for records written
    directly (tests and benchmarks); `fields` fill in or override."""
    now = time.time_ns() // 1000
    return {
        "record_id": rollout_id,
        "request_id": rollout_id,
        "schema_version": SCHEMA_VERSION,
        "started_at": now,
        "ended_at": now,
        "group_id": group_id,
        "rollout_id": rollout_id,
        "turn_index": 0,
        "choice_index": 0,
        "endpoint": "chat.completions",
        "logged": True,
        "http_status": 200,
        **fields,
    }


def chat_response(text: str) -> dict:
    """A chat completion's body with one assistant message."""
    message = {"role": "assistant", "content": text}
    return {"choices": [{"index": 0, "message": message, "finish_reason": "stop"}]}


def completion(i: int, rollout: str = "r", group: str = "g", **extra) -> dict:
    """Turn `i` of a rollout as a `completions` row, for the writer's own tests."""
    now = time.time_ns() // 1000
    return {
        "record_id": f"rec{i}",
        "request_id": f"req{i}",
        "schema_version": SCHEMA_VERSION,
        "started_at": now,
        "ended_at": now + 10,
        "group_id": group,
        "rollout_id": rollout,
        "turn_index": i,
        "choice_index": 0,
        "request": {"messages": [{"role": "user", "content": str(i)}]},
        "prompt_token_ids": [1, 2],
        "completion_token_ids": [3, 4, 5],
        "completion_logprobs": [-0.5, -0.25, -0.125],
        "prompt_tokens": 2,
        "completion_tokens": 3,
        **extra,
    }


def merge_looking(data_dir: Path, now: float, look: Callable[[], T]) -> tuple[int, list[T]]:
    """`merge_closed_days(data_dir, now)`, calling `look` at each commit just before it
    (the merged file written, not counted yet): what a reader saw meanwhile. Returns the
    merges made and what each look saw."""
    from overnight.storage.upkeep import merge

    commit, seen = merge.write_manifest, []

    def look_then_commit(ref, manifest):
        seen.append(look())
        return commit(ref, manifest)

    merge.write_manifest = look_then_commit
    try:
        return merge.merge_closed_days(data_dir, now=now), seen
    finally:
        merge.write_manifest = commit


# Tests of vLLM's own classes (its tool parsers), not of a server: skipped where vLLM is
# not installed, except in CI (OVERNIGHT_REQUIRE_VLLM=1), where they fail without it.
needs_vllm = pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None and os.environ.get("OVERNIGHT_REQUIRE_VLLM") != "1",
    reason="vLLM is not installed (pip install -e '.[cpu]')",
)


async def served_turn_and_its_sibling(proxy, vllm_url: str, data: Path, request: dict):
    """A chat turn served through `proxy` (logging under `data`) and one sibling of it
    sampled at vLLM as the resampling stage asks (/v1/completions on the logged prompt
    ids), given the served turn's `seed` back: (the turn's row, the sibling's row)."""
    import aiohttp

    from overnight.storage.read.siblings import completion_request, sibling_rows

    assert (await proxy.post("/v1/chat/completions", json=request)).status == 200
    await wait_for_rows(data, 1)
    (turn,) = rows(data, "SELECT * FROM completions")
    body = {**completion_request(turn, 1), "seed": request["seed"]}
    async with (
        aiohttp.ClientSession() as session,
        session.post(f"{vllm_url}/v1/completions", json=body) as r,
    ):
        answer = await r.json()
    (sibling,) = sibling_rows(turn, answer, origin="resample", writer_id="w", started_at=0,
                              ended_at=0, sent=body)  # fmt: skip
    return turn, sibling


def post_status(url: str, body: dict, headers: dict | None = None) -> int:
    """POST `body` as JSON over a new connection (so a proxy's workers each get some) and
    return the status, an error's included: for tests against a real `overnight serve`."""
    request = urllib.request.Request(
        url,
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", **(headers or {})},
    )
    try:
        with urllib.request.urlopen(request, timeout=30) as r:
            r.read()
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
