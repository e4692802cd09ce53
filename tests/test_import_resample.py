"""Imported prompts seed --resample (issue 50): an imported turn has no token ids, so its
messages are rendered with the base model's chat template and K siblings are asked by
those ids from the policy's model (the fake vLLM here); the plan trains the siblings of
its per-turn group and names the imported answer as not trained. A captured turn is
still asked exactly as before, by its own ids."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from overnight.config import TINY_CPU_PRESET, TrainConfig
from overnight.imports.run import import_source
from overnight.storage.read.siblings import completion_request, served_member_id, turn_group_id
from overnight.trainer.choose.inputs import Selection
from overnight.trainer.choose.plan import Plan
from overnight.trainer.choose.turn_groups import add_turn_groups
from overnight.trainer.grpo.logged_turns import IMPORTED_SKIP

from .helpers import rows
from .test_import_feeds import DAY, SYSTEM, _iso, bot, user
from .test_resample import served
from .test_turn_groups import append, score

ASKED = {"model": "gpt-4o-mini", "messages": [SYSTEM, user("Name three prime numbers.")],
         "temperature": 0.6, "top_p": 0.9, "max_tokens": 5, "seed": 4,
         "logit_bias": {"1234": -100}}  # fmt: skip


def import_one(data: Path) -> str:
    """One imported single call (OpenAI JSONL); its record id."""
    source = data.parent / "calls.jsonl"
    at = _iso(DAY)
    line = {"id": "call-1", "request": ASKED, "started_at": at, "ended_at": at,
            "response": {"id": "chatcmpl-1", "object": "chat.completion", "created": 1,
                         "model": "gpt-4o-mini", "choices": [{"index": 0, "finish_reason": "stop",
                         "message": bot("2, 3 and 5.")}]}}  # fmt: skip
    source.write_text(json.dumps(line) + "\n")
    assert import_source(data, source, "openai-jsonl", say=lambda _: None).written == 1
    (record,) = rows(data, "SELECT record_id FROM completions WHERE starts_with(record_id, 'imp-')")
    return record["record_id"]


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    pytest.importorskip("transformers")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


async def test_an_imported_turn_gets_siblings_asked_by_its_rendered_ids_and_trains_them(
    fake, tmp_path, tokenizer
):
    from overnight.testing.fake_upstream import RECEIVED
    from overnight.trainer.choose.resample import (
        IMPORTED_PROMPT,
        NO_TOKENIZER,
        render_prompt,
        resample_turns,
    )

    data = tmp_path / "data"
    imported = import_one(data)
    captured = served(model_served="fake-base", started_at=DAY + 1_000_000)
    append(data, "completions", [captured])
    url = str(fake.make_url(""))
    config = TrainConfig(resample=3, resample_upstream=url)

    def stage(tokenizer):
        selection = Selection(data, settle_seconds=0.0, tokenizer=tokenizer)
        return resample_turns(selection, config, say=lambda _: None)

    # Without the base model's tokenizer an imported turn cannot be rendered: said so.
    received = fake.app[RECEIVED]
    received.clear()
    before = await asyncio.to_thread(stage, None)
    assert before.turns == 1 and before.skipped == {NO_TOKENIZER: 1}, before.lines()
    (body,) = [r["body"] for r in received if r["path"] == "/v1/completions"]
    # A captured turn is asked exactly as it always was: its own ids, its own model.
    assert body == completion_request(captured, 3, max_model_len=4096)

    received.clear()
    done = await asyncio.to_thread(stage, tokenizer)
    assert (done.turns, done.siblings, done.failed) == (1, 3, 0), done.lines()
    assert not done.skipped, done.lines()
    (body,) = [r["body"] for r in received if r["path"] == "/v1/completions"]
    rendered = render_prompt(tokenizer, ASKED)
    template = tokenizer.apply_chat_template(ASKED["messages"], add_generation_prompt=True)
    assert rendered == list(template["input_ids"] if hasattr(template, "keys") else template)
    # The policy's model (the one vLLM serves: no proxy state here), the rendered ids, the
    # record's own sampling options; not its seed, nor the bias on another tokenizer's ids.
    assert body["prompt"] == rendered and body["model"] == "fake-base" and body["n"] == 3
    assert (body["temperature"], body["top_p"], body["max_tokens"]) == (0.6, 0.9, 5)
    assert "logit_bias" not in body and "seed" not in body
    siblings = rows(data, "SELECT * FROM siblings WHERE sibling_of = ?", [imported])
    assert len(siblings) == 3
    for row in siblings:
        assert row["group_id"] == turn_group_id(imported) and row["origin"] == "resample"
        assert row["model_served"] == "fake-base" and row["error"] is None
        assert json.loads(row["notes"])[IMPORTED_PROMPT] == rendered
        assert json.loads(row["response"])["choices"][0]["message"]["role"] == "assistant"
    assert (await asyncio.to_thread(stage, tokenizer)).turns == 0, "asked once"

    # The judge scores the whole group, the imported answer with its siblings; the plan
    # trains the siblings only, from the rendered prompt and their own logprobs.
    group = turn_group_id(imported)
    sibling_ids = sorted(r["rollout_id"] for r in siblings)
    score(data, {served_member_id(imported): 1.0, sibling_ids[0]: 0.0, sibling_ids[1]: 1.0,
                 sibling_ids[2]: 0.5})  # fmt: skip
    plan = add_turn_groups(Selection(data), Plan(), TrainConfig(**TINY_CPU_PRESET))
    assert plan.groups == [group], dict(plan.skipped)
    assert sorted(s.rollout_id for s in plan.samples) == sibling_ids
    assert plan.skipped[f"per-turn groups: turns skipped: {IMPORTED_SKIP}"] == 1
    by_id = {r["rollout_id"]: r for r in siblings}
    for sample in plan.samples:
        assert sample.tokens[: len(rendered)] == rendered
        assert sample.trained == [False] * len(rendered) + [True] * sample.trained_tokens
        logprobs = by_id[sample.rollout_id]["completion_logprobs"]
        assert sample.behaviour_logprobs[len(rendered) :] == pytest.approx(logprobs)
    assert abs(sum(s.advantage for s in plan.samples)) < 1e-6  # the siblings' own baseline
    assert any(IMPORTED_SKIP in line for line in plan.lines()), plan.lines()


def test_the_night_loads_the_tokenizer_only_where_imported_turns_wait(tmp_path, tiny_model_dir):
    from overnight.trainer.choose.resample import imported_tokenizer

    data = tmp_path / "data"
    append(data, "completions", [served()])
    assert imported_tokenizer(data, str(tiny_model_dir)) is None  # captured traffic only
    import_one(data)
    assert imported_tokenizer(data, None) is None  # no base model known
    assert imported_tokenizer(data, str(tmp_path / "no-such-model")) is None
    assert imported_tokenizer(data, str(tiny_model_dir)).chat_template
