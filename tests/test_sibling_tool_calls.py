"""Siblings' tool calls reach the scorer as the served turn's did (issue 15).

A sibling comes back from vLLM's /v1/completions as text; the served turn's tool calls
were parsed by the server's `--tool-call-parser`. The judge reads each sibling with
vLLM's own parser class of that name (judge/tool_calls.py), so that a Llama-style or
pythonic call is a call for the scorer too. Real vLLM parser classes and a real
on-disk store; no vLLM server. The tokenizer llama3_json needs (its `<|python_tag|>`)
is built here: models cannot be downloaded.
"""

from __future__ import annotations

import asyncio
import json
import logging
import sys
from pathlib import Path

import pytest

from overnight.errors import ConfigError
from overnight.judge.rewards import RewardFunction
from overnight.judge.run import run_judge
from overnight.judge.tool_calls import reparsed, sibling_parser
from overnight.storage import LogWriter, WriterConfig, new_id, now_us
from overnight.storage.read.siblings import (
    completion_request,
    hermes_tool_calls,
    served_member_id,
    sibling_rows,
)

from .helpers import completion_row, needs_vllm, rows, served_turn_and_its_sibling

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "lookup",
            "parameters": {"type": "object", "properties": {"q": {"type": "string"}}},
        },
    }
]
REQUEST = {
    "model": "policy",
    "messages": [{"role": "user", "content": "How many cats?"}],
    "tools": TOOLS,
    "temperature": 0.8,
    "max_tokens": 32,
}
CALL = {"name": "lookup", "arguments": '{"q": "cats"}'}
HERMES = '<tool_call>\n{"name": "lookup", "arguments": {"q": "cats"}}\n</tool_call>'
LLAMA = '{"name": "lookup", "parameters": {"q": "cats"}}'
PYTHONIC = '[lookup(q="cats")]'
BROKEN_HERMES = '<tool_call>\n{"name": "lookup", "arguments": {"q": \n</tool_call>'
BROKEN_LLAMA = '{"name": "lookup", "parameters": {"q": '

# What the reward function was given, by rollout: the last message (the reply).
SEEN: dict[str, dict] = {}


def saw(rollout: dict) -> float:
    """A reward function that keeps the reply it was shown: 1 for a call to lookup."""
    reply = rollout["messages"][-1]
    SEEN[rollout["rollout_id"]] = reply
    calls = reply.get("tool_calls") or []
    return float(any(c["function"] == CALL for c in calls))


SAW = f"{__name__}:saw"


def served_turn(request: dict = REQUEST) -> dict:
    """A served chat turn whose reply vLLM's parser read as one call to lookup."""
    record_id = new_id()
    call = {"id": "chatcmpl-tool-9f2", "type": "function", "function": CALL}
    message = {"role": "assistant", "content": None, "tool_calls": [call]}
    response = {"choices": [{"index": 0, "message": message, "finish_reason": "tool_calls"}]}
    return completion_row(record_id, record_id, model_served="tiny", request=request,
                          response=response, prompt_token_ids=[11, 12, 13],
                          completion_token_ids=[21, 22], completion_logprobs=[-1.0, -2.0],
                          finish_reason="tool_calls")  # fmt: skip


def vllm_response(texts: list[str]) -> dict:
    """/v1/completions with n=len(texts), logprobs=0 and return_token_ids, as vLLM
    answers it: text, never parsed tool calls."""
    choices = [
        {
            "index": i,
            "text": text,
            "token_ids": [100 + i, 200 + i],
            "prompt_token_ids": [11, 12, 13],
            "logprobs": {"token_logprobs": [-0.5, -0.5]},
            "finish_reason": "stop",
        }  # fmt: skip
        for i, text in enumerate(texts)
    ]
    return {"object": "text_completion", "choices": choices}


def store_turn(data: Path, texts: list[str], request: dict = REQUEST) -> tuple[dict, list[dict]]:
    """A served turn and its siblings (one per text) in a real store."""
    turn = served_turn(request)
    siblings = sibling_rows(turn, vllm_response(texts), origin="resample", writer_id="w",
                            started_at=now_us(), ended_at=now_us(),
                            sent=completion_request(turn, len(texts)))  # fmt: skip
    writer = LogWriter(WriterConfig(data, compact_in_process=True))
    writer.start()
    writer.append("completions", turn)
    for row in siblings:
        writer.append("siblings", row)
    writer.close()
    return turn, siblings


def scored(data: Path, turn: dict, siblings: list[dict], **options) -> tuple[list, list]:
    """Score the per-turn group with `saw`: (replies the scorer saw, rewards), the served
    reply first, then the siblings in the order of their texts."""
    SEEN.clear()
    summary = asyncio.run(
        run_judge(data, None, RewardFunction(SAW), progress=False, settle_seconds=0, **options)
    )
    assert summary.turn_groups == 1, summary.lines()
    ids = [served_member_id(turn["record_id"])] + [s["rollout_id"] for s in siblings]
    rewards = {r["rollout_id"]: r["reward"] for r in rows(data, "SELECT * FROM rewards")}
    return [SEEN[i] for i in ids], [rewards[i] for i in ids]


def llama_tokenizer(directory: Path) -> str:
    """The tiny model's tokenizer with Llama 3's `<|python_tag|>`, which vLLM's
    llama3_json parser looks up when it is built."""
    from overnight.models.tiny import build_tokenizer

    tokenizer = build_tokenizer(0, 400)
    tokenizer.add_tokens(["<|python_tag|>"], special_tokens=True)
    tokenizer.save_pretrained(directory)
    return str(directory)


# -- through the judge, real parsers ------------------------------------------------------------


@needs_vllm
def test_hermes_siblings_reach_the_scorer_as_tool_calls_and_broken_markup_as_text(tmp_path):
    data = tmp_path / "data"
    turn, siblings = store_turn(data, [HERMES, "There are 3 cats.", BROKEN_HERMES])
    seen, rewards = scored(data, turn, siblings, tool_call_parser="hermes")
    assert rewards == [1.0, 1.0, 0.0, 0.0], seen
    assert seen[0]["tool_calls"][0]["id"] == "chatcmpl-tool-9f2"  # the served reply, as logged
    assert seen[1] == {"role": "assistant", "content": None,
                       "tool_calls": [{"id": "call_0", "type": "function", "function": CALL}]}  # fmt: skip
    assert seen[2] == {"role": "assistant", "content": "There are 3 cats."}
    assert seen[3] == {"role": "assistant", "content": BROKEN_HERMES}  # text, whole


@needs_vllm
def test_llama3_json_siblings_are_calls_with_the_servers_parser_and_text_without(tmp_path):
    data = tmp_path / "data"
    turn, siblings = store_turn(data, [LLAMA, BROKEN_LLAMA, "There are 3 cats."])
    # The old reading (hermes markup only): a Llama call reached the scorer as text.
    seen, rewards = scored(data, turn, siblings, tool_call_parser="hermes")
    assert seen[1] == {"role": "assistant", "content": LLAMA} and rewards[1] == 0.0
    # With the server's parser it is the call the served turn would have been.
    tokenizer = llama_tokenizer(tmp_path / "tokenizer")
    SEEN.clear()
    asyncio.run(run_judge(data, None, RewardFunction(SAW), progress=False, settle_seconds=0,
                          rejudge=True, tool_call_parser="llama3_json",
                          tool_parser_tokenizer=tokenizer))  # fmt: skip
    by_text = {s["response"]["choices"][0]["raw"]["text"]: SEEN[s["rollout_id"]] for s in siblings}
    assert by_text[LLAMA]["tool_calls"][0]["function"] == CALL, by_text[LLAMA]
    assert by_text[LLAMA]["content"] is None
    assert by_text[BROKEN_LLAMA] == {"role": "assistant", "content": BROKEN_LLAMA}
    assert by_text["There are 3 cats."] == {"role": "assistant", "content": "There are 3 cats."}


@needs_vllm
def test_pythonic_siblings_need_no_tokenizer(tmp_path):
    data = tmp_path / "data"
    turn, siblings = store_turn(data, [PYTHONIC, "[lookup(q="])
    seen, rewards = scored(data, turn, siblings, tool_call_parser="pythonic")
    assert rewards == [1.0, 1.0, 0.0], seen
    assert seen[2] == {"role": "assistant", "content": "[lookup(q="}


def test_no_parser_leaves_every_sibling_text_as_the_server_did(tmp_path):
    """A server run without a tool parser answered calls as text: so are siblings,
    though the row stored the hermes reading."""
    data = tmp_path / "data"
    turn, siblings = store_turn(data, [HERMES])
    assert siblings[0]["response"]["choices"][0]["message"]["tool_calls"]  # as stored
    seen, rewards = scored(data, turn, siblings, tool_call_parser="")
    assert seen[1] == {"role": "assistant", "content": HERMES} and rewards[1] == 0.0
    assert seen[0]["tool_calls"]  # the served reply stays as vLLM parsed it


def test_a_turn_without_tools_is_never_parsed(tmp_path):
    data = tmp_path / "data"
    request = {k: v for k, v in REQUEST.items() if k != "tools"}
    turn, siblings = store_turn(data, [HERMES], request=request)
    assert "raw" not in siblings[0]["response"]["choices"][0]
    seen, _ = scored(data, turn, siblings, tool_call_parser="")
    assert seen[1] == {"role": "assistant", "content": HERMES}


@needs_vllm
def test_special_tokens_the_servers_parser_would_skip_are_dropped(tmp_path):
    """Siblings of a tool turn are decoded with their special tokens (a call's markers
    may be special tokens, and hermes and most parsers keep them); the scorer drops them
    where the server's parser would have had them skipped (llama3_json does)."""
    turn = served_turn()
    assert completion_request(turn, 2)["skip_special_tokens"] is False
    [row] = sibling_rows(turn, vllm_response(["3 cats<|python_tag|>"]), origin="resample",
                         writer_id="w", started_at=0, ended_at=0,
                         sent=completion_request(turn, 1))  # fmt: skip
    raw = row["response"]["choices"][0]["raw"]
    assert raw == {"text": "3 cats<|python_tag|>", "finish_reason": "stop",
                   "skip_special_tokens": False}  # fmt: skip
    tokenizer = llama_tokenizer(tmp_path / "tokenizer")
    llama = sibling_parser("llama3_json", tokenizer)
    message = reparsed(row["response"], REQUEST, llama)["choices"][0]["message"]
    assert message == {"role": "assistant", "content": "3 cats"}
    assert llama.decode("3 cats<|python_tag|>", REQUEST, False)[0] == "3 cats<|python_tag|>"
    hermes = sibling_parser("hermes", tokenizer)  # asks the chat endpoint to keep them
    assert hermes.decode("3 cats<|python_tag|>", REQUEST, True)[0] == "3 cats<|python_tag|>"


# -- errors at start -------------------------------------------------------------------------------


@needs_vllm
def test_an_unknown_parser_stops_the_run_before_anything_is_scored(tmp_path):
    data = tmp_path / "data"
    store_turn(data, [HERMES])
    with pytest.raises(ConfigError, match=r"no tool call parser 'hermez'.*hermes.*llama3_json"):
        asyncio.run(run_judge(data, None, RewardFunction(SAW), progress=False,
                              settle_seconds=0, tool_call_parser="hermez"))  # fmt: skip
    assert rows(data, "SELECT * FROM rewards") == []


@needs_vllm
def test_a_parser_that_needs_the_models_vocabulary_says_so_at_start():
    with pytest.raises(ConfigError, match=r"llama3_json .*no tokenizer.*python_tag"):
        sibling_parser("llama3_json", None)


# -- without vLLM ----------------------------------------------------------------------------------


@pytest.fixture
def without_vllm(monkeypatch):
    """vLLM not importable (a batch machine with the `train` extra only)."""
    monkeypatch.setitem(sys.modules, "vllm.tool_parsers", None)  # import raises ImportError
    sibling_parser.cache_clear()
    yield
    sibling_parser.cache_clear()


def test_without_vllm_hermes_is_read_by_our_own_reader_and_says_so(tmp_path, without_vllm, caplog):
    data = tmp_path / "data"
    turn, siblings = store_turn(data, [HERMES, BROKEN_HERMES])
    with caplog.at_level(logging.WARNING, logger="overnight.judge.tool_calls"):
        summary = asyncio.run(run_judge(data, None, RewardFunction(SAW), progress=False,
                                        settle_seconds=0))  # fmt: skip
    assert "vLLM is not importable" in caplog.text
    assert "siblings' tool calls read with overnight's own hermes reader" in "\n".join(
        summary.lines()
    )
    assert SEEN[siblings[0]["rollout_id"]]["tool_calls"][0]["function"] == CALL
    assert SEEN[siblings[1]["rollout_id"]] == {"role": "assistant", "content": BROKEN_HERMES}
    with pytest.raises(ConfigError, match="llama3_json.*needs vLLM"):
        sibling_parser("llama3_json")


@needs_vllm
@pytest.mark.parametrize(
    "text",
    [
        HERMES,
        BROKEN_HERMES,
        "Let me look. " + HERMES,
        HERMES + "\n" + HERMES.replace("cats", "dogs"),
        '<tool_call>{"name": "lookup", "arguments": {"q": "ünïcode"}}',  # cut off: still a call
        '<tool_call>{"name": "lookup"}</tool_call>',  # no arguments: vLLM keeps it text
        '<tool_call>["lookup"]</tool_call>',
        "no call at all",
    ],
)
def test_our_hermes_reader_reads_as_vllms(text):
    vllm_hermes = sibling_parser("hermes")
    assert vllm_hermes.how == "vLLM's hermes parser"
    assert hermes_tool_calls(text) == vllm_hermes.parse(text, REQUEST)


@needs_vllm
def test_what_a_client_or_the_model_can_send_leaves_a_sibling_as_text(caplog):
    # Tools vLLM's request model refuses (a function without its body, named by
    # tool_choice), and a reply nested deeper than JSON parsers go: each reads as text,
    # none stops the judge; the first failure is said at warning.
    odd = {**REQUEST, "tools": [{"type": "function"}],
           "tool_choice": {"type": "function", "function": {"name": "lookup"}}}  # fmt: skip
    with caplog.at_level(logging.WARNING, logger="overnight.judge.tool_calls"):
        assert sibling_parser("hermes").parse(HERMES, odd) is None
    assert "could not read a sibling's reply" in caplog.text
    deep = "<tool_call>" + "[" * 200_000
    assert hermes_tool_calls(deep) is None
    assert sibling_parser("hermes").parse(deep, REQUEST) is None


def test_a_row_written_before_siblings_kept_their_text_is_read_as_stored():
    response = {"object": "overnight.sibling",
                "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"},
                             "finish_reason": "stop"}]}  # fmt: skip
    assert reparsed(response, REQUEST, sibling_parser("")) == response


# -- against the served chat endpoint ------------------------------------------------------------


@pytest.mark.vllm
async def test_a_sibling_reads_as_the_served_chat_turn_did(vllm_server, make_proxy, tmp_path):
    """The chat endpoint under the hermes parser keeps a reply's special tokens; so does
    the sibling's /v1/completions call on the logged prompt ids (given the served turn's
    seed back), and the judge's reading of it is the served message, word for word."""
    proxy = await make_proxy(upstream=vllm_server.url)
    # <|im_start|> (id 1, a special token) now and then.
    request = {**REQUEST, "max_tokens": 24, "seed": 5, "min_tokens": 4, "logit_bias": {"1": 6.0}}
    data = tmp_path / "data"
    turn, sibling = await served_turn_and_its_sibling(proxy, vllm_server.url, data, request)
    assert sibling["completion_token_ids"] == turn["completion_token_ids"]
    served = json.loads(turn["response"])["choices"][0]["message"]
    assert "<|im_start|>" in (served.get("content") or ""), served  # skipped, it would differ
    read = reparsed(sibling["response"], request, sibling_parser("hermes"))
    message = read["choices"][0]["message"]
    assert message["content"] == served["content"]
    assert message.get("tool_calls", []) == served.get("tool_calls", [])
