"""Imported history gates the first night (issue 50): `--reference imported:...` measures
forgetting on the team's own traffic with the answers its served model gave, and recent
imported first turns are the gate's held-out prompts like captured ones. No model, no vLLM."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from overnight.imports.run import FORMATS, import_source
from overnight.storage import open_db
from overnight.trainer.choose.plan import Plan
from overnight.trainer.gate import forgetting
from overnight.trainer.gate.forgetting import (
    IMPORT_FORMATS,
    Imported,
    ReferenceSetError,
    load_references,
    resolve,
)
from overnight.trainer.gate.prompts import held_out_prompts

from .test_import_feeds import DAY, SYSTEM, _iso, bot, user

QUESTIONS = [f"What is {n} plus {n}?" for n in range(6)]


def openai_line(n: int, question: str, answer: dict, **request) -> dict:
    at = _iso(DAY + n * 2_000_000)
    return {
        "id": f"call-{n}",
        "request": {"model": "gpt-4o-mini", "messages": [SYSTEM, user(question)], **request},
        "response": {"id": f"chatcmpl-{n}", "object": "chat.completion", "created": 1,
                     "model": "gpt-4o-mini", "choices": [{"index": 0, "message": answer,
                                                          "finish_reason": "stop"}]},
        "started_at": at, "ended_at": at,
    }  # fmt: skip


def import_lines(data: Path, lines: list[dict], fmt: str = "openai-jsonl") -> None:
    source = data.parent / f"{fmt}-{len(lines)}.jsonl"
    source.write_text("".join(json.dumps(x) + "\n" for x in lines))
    summary = import_source(data, source, fmt, say=lambda _: None)
    assert summary.written == len(lines) and not summary.bad, summary.lines_out()


@pytest.fixture
def imported(tmp_path) -> Path:
    """Six answered questions (one asked twice), a tool call (no text) and a failed call,
    as OpenAI JSONL; two LiteLLM calls beside them."""
    data = tmp_path / "data"
    lines = [openai_line(n, q, bot(f"{2 * n}.")) for n, q in enumerate(QUESTIONS)]
    lines.append(openai_line(6, QUESTIONS[0], bot("0, again.")))  # the same prompt again
    call = {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function",
            "function": {"name": "add", "arguments": "{}"}}]}  # fmt: skip
    lines.append(openai_line(7, "Add with the tool.", call))
    failed = openai_line(8, "Fail.", bot("never"))
    del failed["response"]
    lines.append({**failed, "error": {"message": "overloaded"}, "status_code": 529})
    import_lines(data, lines)
    litellm = [
        {"id": f"ll-{n}", "trace_id": f"t-{n}", "call_type": "acompletion", "stream": False,
         "status": "success", "model": "gpt-4o-mini", "messages": [user(q)],
         "response": {"id": f"x-{n}", "object": "chat.completion", "created": 1, "model": "m",
                      "choices": [{"index": 0, "finish_reason": "stop", "message": bot(a)}]},
         "startTime": DAY / 1e6 + n, "endTime": DAY / 1e6 + n, "model_parameters": {}}
        for n, (q, a) in enumerate([("Say hi.", "Hi!"), ("Name a colour.", "Blue.")])
    ]  # fmt: skip
    import_lines(data, litellm, "litellm")
    return data


# -- item 1: --reference imported:... -------------------------------------------------------


def test_the_formats_are_the_importers():
    assert IMPORT_FORMATS == FORMATS  # the trainer may not import overnight.imports


def test_imported_references_are_the_prompts_with_the_answers_they_were_given(imported):
    spec = resolve("imported:openai-jsonl", "HuggingFaceTB/SmolLM2-135M-Instruct")
    assert spec == "imported:openai-jsonl"
    refs = load_references(spec, imported)
    # Each prompt once (the question asked twice gives one), text answers only (the tool
    # call has none), no failed call; the answer is the imported one, kept as given.
    assert len(refs) == len(QUESTIONS)
    assert {r.messages[-1]["content"] for r in refs} == set(QUESTIONS)
    assert all(r.messages[0] == SYSTEM and r.source == "imported:openai-jsonl" for r in refs)
    by_question = {r.messages[-1]["content"]: r.answer for r in refs}
    assert {q: by_question[q] for q in QUESTIONS[1:]} == {
        q: f"{2 * n}." for n, q in enumerate(QUESTIONS) if n
    }
    assert by_question[QUESTIONS[0]] in ("0.", "0, again.")
    # all formats; bundled beside them; the base model answers none of these
    everything = load_references("imported:all", imported)
    assert len(everything) == len(QUESTIONS) + 2
    assert {r.source for r in everything} == {"imported:openai-jsonl", "imported:litellm"}
    both = load_references("bundled,imported:litellm", imported)
    assert [r.answer for r in both[-2:]] and all(r.answer for r in both if r.source != "bundled")


def test_the_cap_draws_the_same_references_every_night_by_record_id(imported):
    three = load_references("imported:openai-jsonl:3", imported)
    assert len(three) == 3
    assert [r.key for r in load_references("imported:openai-jsonl:3", imported)] == [
        r.key for r in three
    ]
    # a larger cap begins with the same ones: the order is the record ids' md5
    five = load_references("imported:openai-jsonl:5", imported)
    assert [r.key for r in five[:3]] == [r.key for r in three]
    assert Imported.parse("imported:all") == Imported("all", forgetting.IMPORTED_COUNT)


@pytest.mark.parametrize(
    "spec",
    ["imported:", "imported:langsmith", "imported:all:0", "imported:all:many",
     "imported:litellm:5:6", "bundled,off"],
)  # fmt: skip
def test_a_spec_that_names_nothing_known_fails_loudly(spec, imported):
    with pytest.raises(ReferenceSetError) as caught:
        resolve(spec, "some/model")
    if spec.startswith("imported:"):
        assert "imported:all or imported:FORMAT" in str(caught.value)
        assert "litellm" in str(caught.value)  # the formats it accepts are named
    with pytest.raises(ReferenceSetError):
        load_references(spec, imported)


def test_an_imported_spec_with_nothing_imported_fails_before_training(tmp_path, imported):
    with pytest.raises(ReferenceSetError, match="no imported turn"):
        load_references("imported:otel", imported)
    with pytest.raises(ReferenceSetError, match="no data directory"):
        load_references("imported:all")


# -- item 3: the gate's held-out prompts -------------------------------------------------------


def test_recent_imported_first_turns_are_the_gates_held_out_prompts(imported):
    prompts, plan = held_out_prompts(imported, Plan(), 4)
    assert len(prompts) == 4
    con = open_db(imported)
    try:
        newest = [
            json.loads(r)["messages"]
            for (r,) in con.execute(
                "SELECT request FROM completions WHERE error IS NULL "
                "ORDER BY started_at DESC, record_id"
            ).fetchall()
        ]
    finally:
        con.close()
    # newest first, each conversation once, sampled as the request asked
    distinct = []
    for messages in newest:
        if messages not in distinct:
            distinct.append(messages)
    assert [p.messages for p in prompts] == distinct[:4]
    assert all(p.group_id.startswith("imp-") for p in prompts)
    assert plan.groups == [] and not plan.skipped


def test_forgetting_is_measured_on_the_imported_answers(imported, tiny_model_dir, tmp_path):
    """The measure itself, on the tiny model: the imported answers are the references (the
    base model answers none of them: nothing generated, no answer cache written)."""
    pytest.importorskip("peft")
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    fresh_adapter = tmp_path / "fresh"  # B is zero: exactly the base model
    get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"])).save_pretrained(
        fresh_adapter
    )
    from overnight.config import TrainConfig
    from overnight.trainer.gate.forgetting import measure

    config = TrainConfig(reference="imported:all:4")
    result = measure(config, imported, str(tiny_model_dir), fresh_adapter, None, say=lambda _: None)
    assert result.references == 4
    assert result.candidate == pytest.approx(0.0, abs=1e-4)  # a fresh LoRA is the base model
    answers = list((imported / "references").glob("*.json"))
    assert [p.name for p in answers if not p.name.endswith(".loglik.json")] == []
