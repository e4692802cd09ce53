"""Forgetting (issue 39): the measure, its cache, the gate's rule, the operator's own set and
the record, on the tiny model (nothing to lose there: these test the logic; the real
model's figures are bench/forgetting.py's). No vLLM."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from overnight.cli.main import main
from overnight.config import TrainConfig
from overnight.errors import ConfigError
from overnight.trainer.choose.plan import Plan
from overnight.trainer.gate import forgetting
from overnight.trainer.gate.forgetting import (
    Forgetting,
    Reference,
    ReferenceSetError,
    encode,
    judge,
    load_references,
    loglik,
    measure,
)
from overnight.trainer.gate.verdict import Verdict, load_named
from overnight.trainer.run.record import RunResult, record_run
from overnight.view.report import write_report

from .helpers import rows
from .vllm_fixtures import random_lora

pytest.importorskip("peft")


@pytest.fixture(scope="module")
def fresh_adapter(tiny_model_dir, tmp_path_factory) -> Path:
    """A LoRA as a night starts one: B is zero, so the model is exactly the base."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    peft_model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    out = tmp_path_factory.mktemp("adapters") / "fresh"
    peft_model.save_pretrained(out)
    return out


def operator_set(tmp_path: Path, lines: list[dict]) -> Path:
    path = tmp_path / "mine.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


MINE = [
    {"messages": [{"role": "user", "content": "Name a colour."}], "reference": "Blue."},
    {"prompt": "Say hi.", "reference": "Hi there!"},
    {"prompt": "Count to three."},  # no reference: the base model's own answer
]


# -- the reference set ----------------------------------------------------------------------


def test_the_bundled_set_and_the_operators_combine_and_a_bad_line_is_named(tmp_path):
    bundled = load_references("bundled")
    # A hundred-odd general prompts: instructions, knowledge, formats, languages.
    assert 100 <= len(bundled) <= 200 and all(r.answer is None for r in bundled)
    assert len({r.key for r in bundled}) == len(bundled), "each prompt once"
    mine = operator_set(tmp_path, MINE)
    both = load_references(f"bundled,{mine}")
    assert len(both) == len(bundled) + 3
    assert [r.answer for r in both[-3:]] == ["Blue.", "Hi there!", None]
    assert both[-2].messages == [{"role": "user", "content": "Say hi."}]
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"prompt": "fine"}\n{"reference": "no prompt"}\n')
    with pytest.raises(ReferenceSetError, match="line 2"):
        load_references(str(broken))
    with pytest.raises(ReferenceSetError, match="missing.jsonl"):
        load_references(str(tmp_path / "missing.jsonl"))
    with pytest.raises(ConfigError, match="forgetting_budget"):
        TrainConfig(forgetting_budget=-0.1)


def test_auto_is_the_bundled_set_except_on_the_tiny_random_model(tiny_model_dir, tmp_path):
    from overnight.trainer.gate.forgetting import resolve

    assert TrainConfig().reference == "auto"
    # Random weights know nothing: their drift on random answers is noise, not loss.
    assert resolve("auto", str(tiny_model_dir)) is None
    assert resolve("auto", str(tmp_path)) == "bundled"  # any other model
    assert resolve("auto", "HuggingFaceTB/SmolLM2-135M-Instruct") == "bundled"
    assert resolve("bundled", str(tiny_model_dir)) == "bundled", "asked for: measured"
    assert resolve("off", str(tmp_path)) is None


# -- the measure ---------------------------------------------------------------------------


def test_the_batched_measure_is_each_answers_teacher_forced_mean_logprob(tiny_model_dir):
    """Padding and batching change nothing: each reference scored alone, by hand, gives
    the same mean per-token log-likelihood as the right-padded batch."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    refs = [
        Reference([{"role": "user", "content": f"q{i}" * (i + 1)}], None, "t") for i in range(5)
    ]
    encoded = encode(tokenizer, refs, ["a", "a longer answer here", "b c", "", "x " * 20])
    batched = loglik(model, encoded, tokenizer.eos_token_id, "cpu")
    for (ids, begins), got in zip(encoded, batched, strict=True):
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([ids])).logits[0]
        logp = torch.log_softmax(logits[begins - 1 : len(ids) - 1], -1)
        expected = logp.gather(1, torch.tensor(ids[begins:])[:, None]).mean().item()
        assert got == pytest.approx(expected, abs=1e-5)
    assert encoded[3][0][-1] == tokenizer.eos_token_id, "an empty answer still ends"


def test_forgetting_is_zero_for_an_unchanged_model_and_positive_for_a_moved_one(
    tiny_model_dir, fresh_adapter, lora_adapter, tmp_path, monkeypatch
):
    # The base model's own greedy answers: the most likely under it, less under any
    # other model (an operator's text may grow likelier: forgetting is signed).
    prompts = [{"prompt": f"Tell me about {topic}."} for topic in ("cats", "rain", "maps", "tea")]
    config = TrainConfig(
        base_model=str(tiny_model_dir), reference=str(operator_set(tmp_path, prompts))
    )
    data = tmp_path / "data"
    unchanged = measure(config, data, str(tiny_model_dir), fresh_adapter, None)
    assert unchanged.references == 4
    assert unchanged.candidate == pytest.approx(0.0, abs=1e-6) and unchanged.served == 0.0
    assert not unchanged.over
    # The random adapter moves every answer; served by the fresh one (== the base).
    moved = measure(config, data, str(tiny_model_dir), lora_adapter, str(fresh_adapter))
    assert moved.candidate > 0.01 and moved.served == pytest.approx(0.0, abs=1e-6)
    assert moved.base_loglik == pytest.approx(unchanged.base_loglik, abs=1e-6)
    # Deterministic: no sampling; the base's answers come from the cache the first call
    # wrote (generation is never asked again), keyed by the model.
    cached = data / "references" / f"{forgetting.model_identity(str(tiny_model_dir))}.json"
    assert len(json.loads(cached.read_text())) == 4
    # Each model's figures too, the base model's and each adapter's by its weights: the
    # base (4) and the two adapters (4 each) scored once, never again.
    assert len(json.loads(cached.with_suffix(".loglik.json").read_text())) == 12
    monkeypatch.setattr(forgetting, "generate_replies", _no_generation)
    real_loglik = forgetting.loglik
    monkeypatch.setattr(forgetting, "loglik", _no_scoring)
    again = measure(config, data, str(tiny_model_dir), lora_adapter, str(fresh_adapter))
    assert again.candidate == moved.candidate
    # Served and candidate swapped (last night's candidate promoted): the figures follow
    # the adapters, read back by their weights, whatever each is called tonight.
    swapped = measure(config, data, str(tiny_model_dir), fresh_adapter, str(lora_adapter))
    assert swapped.served == pytest.approx(moved.candidate, abs=1e-6)
    assert swapped.candidate == pytest.approx(0.0, abs=1e-6)
    # A new candidate is scored, alone: the served adapter's figures are last night's.
    monkeypatch.setattr(
        forgetting, "loglik", lambda model, *a: _adapter_only(model, real_loglik, *a)
    )
    other = random_lora(tiny_model_dir, 2, tmp_path / "other")
    tonight = measure(config, data, str(tiny_model_dir), other, str(lora_adapter))
    assert tonight.served == pytest.approx(moved.candidate, abs=1e-6)
    assert tonight.candidate > 0.01 and tonight.candidate != pytest.approx(moved.candidate)


def test_the_forgetting_pass_says_its_progress(tiny_model_dir, fresh_adapter, lora_adapter,
                                               tmp_path):  # fmt: skip
    """A line each quarter of the references scored (the base model's pass where it is not
    cached, then the candidate's and the served adapter's) with the counts, and a last
    one; the base model's answers generated first say theirs."""
    prompts = [{"prompt": f"Tell me about {topic}."} for topic in ("cats", "rain", "maps", "tea")]
    config = TrainConfig(
        base_model=str(tiny_model_dir), reference=str(operator_set(tmp_path, prompts))
    )
    lines: list[str] = []
    data = tmp_path / "data"
    measure(config, data, str(tiny_model_dir), lora_adapter, str(fresh_adapter), say=lines.append)
    assert lines[0].startswith("forgetting: generated 4 base answers in "), lines
    assert [line.split(",")[0] for line in lines[1:-1]] == [
        "forgetting: scored 4/12 reference answers",  # the base model's, then the candidate's
        "forgetting: scored 8/12 reference answers",
    ]
    assert all("s left" in line for line in lines[1:-1]), lines
    assert lines[-1].startswith("forgetting: scored 12 reference answers in "), lines
    lines.clear()  # the base model's answers and figures cached, the base model served
    measure(config, data, str(tiny_model_dir), fresh_adapter, None, say=lines.append)
    assert lines == [
        "forgetting: the 4 reference answers' figures read from the cache (every model "
        "scored them before)"
    ]


def _adapter_only(model, real, *args):
    flags = (getattr(m, "disable_adapters", None) for m in model.modules())
    disabled = [flag for flag in flags if isinstance(flag, bool)]  # the LoRA layers'

    assert disabled and not any(disabled), "the base model was scored again"
    return real(model, *args)


def _no_scoring(*_args, **_kwargs):
    raise AssertionError("a model's figures were computed again")


def _no_generation(*_args, **_kwargs):
    raise AssertionError("the base model's answers were generated again")


def test_the_operators_references_are_scored_as_given(tiny_model_dir, fresh_adapter, tmp_path):
    """An answer the base model finds unlikely scores low: the operator's text is what
    is scored, not a fresh generation."""
    from overnight.trainer.gate.forgetting import base_answers

    config = TrainConfig(base_model=str(tiny_model_dir))
    model, tokenizer, device = load_named(str(tiny_model_dir), {"candidate": fresh_adapter}, config)
    refs = load_references(str(operator_set(tmp_path, MINE)))
    answers = base_answers(tmp_path, str(tiny_model_dir), model, tokenizer, refs, device)
    assert answers[:2] == ["Blue.", "Hi there!"]
    cached = tmp_path / "references" / f"{forgetting.model_identity(str(tiny_model_dir))}.json"
    assert list(json.loads(cached.read_text()).values()) == [answers[2]], "only the third"


# -- the gate's rule ------------------------------------------------------------------------


def figures(candidate: float, served: float = 0.0, budget: float = 0.1) -> Forgetting:
    result = Forgetting(120, budget, -1.5, served, candidate, 0.0, 0.3, 1.0)
    result.over = candidate > budget and candidate > served
    return result


def test_the_gate_refuses_a_candidate_over_the_budget_whatever_its_task_reward():
    passed = Verdict("not-worse", True, "candidate - served = +0.4 on 32 held-out prompts")
    judge(passed, figures(0.35))
    assert not passed.promote and passed.word == "refused"
    # Both figures in the verdict: the task gate's and the forgetting.
    assert "forgets more than the budget" in passed.reason
    assert "candidate +0.350 nats/token" in passed.reason and "budget 0.1" in passed.reason
    assert "the task gate passed: candidate - served = +0.4" in passed.reason
    assert passed.as_dict()["forgetting"]["candidate"] == 0.35


def test_within_the_budget_or_back_towards_the_base_the_task_gate_decides():
    within = Verdict("not-worse", True, "task fine")
    judge(within, figures(0.05))
    assert within.promote and within.reason.startswith("task fine; forgetting on 120")
    refused = Verdict("not-worse", False, "task worse")
    judge(refused, figures(0.05))
    assert not refused.promote, "forgetting never passes what the task gate refused"
    # Over the budget, but less than what is served now: a step back is not refused.
    back = Verdict("not-worse", True, "task fine")
    judge(back, figures(0.3, served=0.5))
    assert back.promote and "served +0.500" in back.reason
    # --gate off promotes whatever: the figures are recorded, nothing refused.
    off = Verdict("off", True, "the gate is off (--gate off)")
    judge(off, figures(0.9))
    assert off.promote and off.forgetting["candidate"] == 0.9


# -- the record -----------------------------------------------------------------------------


async def test_each_nights_forgetting_is_listed_plotted_and_shown_with_why_one_was_refused(
    tmp_path, make_proxy
):
    data = tmp_path / "data"
    for run_id, candidate, served in (("night-1", 0.02, 0.0), ("night-2", 0.4, 0.02)):
        verdict = Verdict("not-worse", True, "task fine")
        judge(verdict, figures(candidate, served))
        result = RunResult(run_id, Plan(), gate=verdict)
        record_run(data, result, TrainConfig(), "tiny", None, 0, None)
    (run,) = rows(data, "SELECT metrics FROM training_runs WHERE run_id = 'night-2'")
    assert json.loads(run["metrics"])["gate"]["forgetting"]["served"] == 0.02
    # The report's chart across promotions: served, candidate and budget by night.
    report = write_report(data).read_text()
    assert "Forgetting against the base model" in report
    chart = report.split("Forgetting against the base model")[-1].split("</figure>")[0]
    assert chart.count("<polyline") == 3 and chart.count("<circle") == 6
    page = await (await (await make_proxy(data_dir=data)).get("/ui/runs")).text()
    assert "<th>forgetting</th>" in page.replace(' class="num"', "")
    assert "Forgetting against the base model" in page and "0.400" in page
    listing = CliRunner().invoke(main, ["runs", "--data", str(data)])
    assert listing.exit_code == 0, listing.output
    header = listing.output.splitlines()[0]
    assert "forgetting" in header
    assert "0.02" in listing.output and "0.4" in listing.output
    assert "night-2: gate refused: forgets more than the budget" in listing.output
    assert "night-1: gate refused" not in listing.output


# -- the watch ------------------------------------------------------------------------------


def night_measured(data: Path, run_id: str, served: str | None, candidate: str, figures_: tuple):
    """A night's row as the gate records it: forgetting measured for both adapters."""
    measured = figures(figures_[1], served=figures_[0])
    measured.served_path, measured.candidate_path = served, candidate
    verdict = Verdict("not-worse", True, "task fine")
    judge(verdict, measured)
    record_run(data, RunResult(run_id, Plan(), gate=verdict), TrainConfig(), "tiny", None, 0, None)


async def test_the_watch_rolls_back_an_adapter_served_over_the_budget(
    make_proxy, tmp_path, lora_adapter
):
    import asyncio
    import shutil

    from overnight.trainer.live.watch import watch

    proxy = await make_proxy()
    url, data = str(proxy.make_url("")), tmp_path / "data"
    first, second = tmp_path / "first", tmp_path / "second"
    shutil.copytree(lora_adapter, first)
    shutil.copytree(lora_adapter, second)
    for adapter in (first, second):
        await proxy.post("/admin/adapters/promote", json={"path": str(adapter)})
    # The first measured at 0.02 (its night), the second at 0.08 (promoted under the
    # budget of its night, 0.1); then the operator lowers the budget to 0.05.
    night_measured(data, "night-1", None, str(first), (0.0, 0.02))
    night_measured(data, "night-2", str(first), str(second), (0.02, 0.08))
    lines: list[str] = []
    kept = await asyncio.to_thread(watch, data, url, None, TrainConfig(), lines.append)
    assert not kept.worse and "keeps serving" in lines[-1], lines
    lowered = TrainConfig(forgetting_budget=0.05)
    verdict = await asyncio.to_thread(watch, data, url, None, lowered, lines.append)
    assert verdict.worse and verdict.forgets, verdict.reason
    assert "forgets +0.080 nats/token" in verdict.reason and "(" + str(first) in verdict.reason
    after = await (await proxy.get("/admin/adapters")).json()
    assert after["current"]["path"] == str(first), "the predecessor serves again"
    (event,) = [e for e in after["events"] if e["action"] == "rollback"]
    assert "worse on the reference set" in event["reason"]
    # The first is within the lowered budget: it stays.
    again = await asyncio.to_thread(watch, data, url, None, lowered, lines.append)
    assert not again.worse
    # Off: forgetting decides nothing.
    assert not (await asyncio.to_thread(
        watch, data, url, None, TrainConfig(forgetting_budget=0.0, reference="off"), lines.append
    )).worse  # fmt: skip
