"""`overnight train --sft`: logged conversations rendered with the local chat template,
selected by reward, trained with a cross-entropy on the assistant tokens only.

Records are written as a hosted upstream leaves them (text and tool calls, no token
ids) through the store's own writer, to Parquet; the tiny model's template renders them.
"""

from __future__ import annotations

import json
import time

import pytest
from click.testing import CliRunner

from overnight.cli.main import main
from overnight.config import TrainConfig
from overnight.errors import ConfigError
from overnight.storage import LogWriter, WriterConfig
from overnight.trainer.choose.inputs import Selection
from overnight.trainer.choose.sft_plan import HELD_OUT, held_out, plan_sft, select_rollouts

from .helpers import chat_response, completion_row, rows

torch = pytest.importorskip("torch")

SYSTEM = {"role": "system", "content": "Be brief."}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city.",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]
CALL = {
    "role": "assistant",
    "content": None,
    "tool_calls": [
        {
            "id": "call_1",
            "type": "function",
            # As OpenAI sends them: compact JSON text.
            "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'},
        }
    ],
}
RESULT = {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}
QUESTION = {"role": "user", "content": "Weather in Paris?"}


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


class Records:
    """Rows as the proxy writes them for a hosted upstream, into a real store."""

    def __init__(self, data_dir) -> None:
        self.writer = LogWriter(WriterConfig(data_dir, compact_in_process=True))
        self.writer.start()
        self.now = time.time_ns() // 1000
        self.ticks = 0  # each row a microsecond later: groups are ordered by when they began

    def turn(self, rollout, group, messages, reply, turn=0, tools=None, **fields) -> None:
        request = {"model": "gpt-hosted", "messages": messages, "max_tokens": 12}
        if tools:
            request["tools"] = tools
        response = {"choices": [{"index": 0, "message": reply, "finish_reason": "stop"}]}
        self.ticks += 1
        row = completion_row(
            rollout, group, record_id=f"{rollout}.{turn}", turn_index=turn,
            started_at=self.now + self.ticks, ended_at=self.now + self.ticks,
            request=request, response=response, model_served="gpt-hosted", **fields,
        )  # fmt: skip
        self.writer.append("completions", row)

    def finish(self, rollout, reward=None) -> None:
        finish = {"rollout_id": rollout, "schema_version": 1, "finished_at": self.now}
        self.writer.append("finishes", finish)
        if reward is not None:
            self.writer.append(
                "rewards",
                {"reward_id": f"{rollout}.r", "schema_version": 1, "rollout_id": rollout,
                 "reward": reward, "source": "agent", "created_at": self.now},
            )  # fmt: skip

    def one_turn(self, rollout, group, question, answer, reward=None) -> None:
        self.turn(rollout, group, [SYSTEM, {"role": "user", "content": question}],
                  {"role": "assistant", "content": answer})  # fmt: skip
        self.finish(rollout, reward)

    def close(self) -> None:
        self.writer.close()


def write_tool_rollout(data_dir, rollout="r", group="g") -> None:
    """Two turns: a tool call, then (after its result) the answer."""
    records = Records(data_dir)
    records.turn(rollout, group, [SYSTEM, QUESTION], CALL, tools=TOOLS)
    answer = {"role": "assistant", "content": "Sunny, 21 C."}
    records.turn(rollout, group, [SYSTEM, QUESTION, CALL, RESULT], answer, turn=1, tools=TOOLS)
    records.finish(rollout)
    records.close()


def trained_spans(tokenizer, sample) -> list[str]:
    """The decoded runs of trained tokens, in order."""
    spans, current = [], []
    for token, trained in zip(sample.tokens, sample.trained, strict=True):
        if trained:
            current.append(token)
        elif current:
            spans.append(tokenizer.decode(current))
            current = []
    if current:
        spans.append(tokenizer.decode(current))
    return spans


def sft(**options) -> TrainConfig:
    return TrainConfig(sft=True, sft_held_out=options.pop("sft_held_out", 0.0), **options)


# -- rendering -----------------------------------------------------------------------------


def test_tool_calls_and_results_render_in_the_templates_format_and_only_replies_train(
    tmp_path, tokenizer
):
    write_tool_rollout(tmp_path)
    plan = plan_sft(Selection(tmp_path, settle_seconds=600, tokenizer=tokenizer), sft())
    assert plan.groups == ["g"] and plan.skipped == {}
    (sample,) = plan.samples  # the answer's context renders the call as it was: one sequence
    # The call in the template's own format (its arguments re-serialised by the template,
    # not OpenAI's compact text), each reply through its end-of-turn token, nothing else.
    assert trained_spans(tokenizer, sample) == [
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
        "<|im_end|>",
        "Sunny, 21 C.<|im_end|>",
    ]
    # The whole sequence is the template's rendering of the conversation, tools included
    # (what follows the last end-of-turn, a newline, is never generated).
    answer = {"role": "assistant", "content": "Sunny, 21 C."}
    whole = tokenizer.apply_chat_template(
        [SYSTEM, QUESTION, CALL | {"tool_calls": [_parsed(CALL["tool_calls"][0])]}, RESULT,
         answer], tools=TOOLS, tokenize=True, return_dict=True,
    )["input_ids"]  # fmt: skip
    assert sample.tokens == whole[: len(sample.tokens)]
    assert tokenizer.decode(whole[len(sample.tokens) :]).strip() == ""
    context = tokenizer.decode(
        [t for t, m in zip(sample.tokens, sample.trained, strict=True) if not m]
    )
    assert "# Tools" in context and "<tool_response>\nsunny, 21 C\n</tool_response>" in context
    assert sample.sampling == () and not sample.exact  # plain distribution, no logged logprobs


def _parsed(call: dict) -> dict:
    function = call["function"]
    return {**call, "function": {**function, "arguments": json.loads(function["arguments"])}}


def test_a_template_that_drops_earlier_reasoning_trains_every_reply_once_in_its_context(
    tmp_path, tokenizer
):
    """Qwen3's template renders a reply's reasoning only while it is the last turn: the
    next turn's context then differs from the first turn's sequence, so each reply is a
    sequence of its own, trained with the reasoning it was written with."""
    import copy

    thinking = copy.copy(tokenizer)
    plain = "{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}"
    assert plain in tokenizer.chat_template
    thinking.chat_template = tokenizer.chat_template.replace(
        plain,
        "{%- if loop.last and message.reasoning_content %}{{- '\\n<think>' + "
        "message.reasoning_content + '</think>' }}{%- endif %}" + plain,
    )
    records = Records(tmp_path)
    first = {"role": "assistant", "content": "Paris.", "reasoning": "A capital."}
    records.turn("r", "g", [SYSTEM, {"role": "user", "content": "Capital of France?"}], first)
    follow = [SYSTEM, {"role": "user", "content": "Capital of France?"},
              {"role": "assistant", "content": "Paris."}, {"role": "user", "content": "Italy?"}]  # fmt: skip
    second = {"role": "assistant", "content": "Rome.", "reasoning": "Also a capital."}
    records.turn("r", "g", follow, second, turn=1)
    records.finish("r")
    records.close()
    plan = plan_sft(Selection(tmp_path, settle_seconds=600, tokenizer=thinking), sft())
    spans = [trained_spans(thinking, s) for s in plan.samples]
    assert spans == [
        ["<think>A capital.</think>\nParis.<|im_end|>"],
        ["<think>Also a capital.</think>\nRome.<|im_end|>"],
    ]
    context = thinking.decode(plan.samples[1].tokens)
    assert "assistant\nParis.<|im_end|>" in context and "A capital" not in context


def test_bad_records_are_skipped_with_their_reason_and_stay_trainable(tmp_path, tokenizer):
    import copy

    records = Records(tmp_path)
    records.one_turn("ok", "ok", "Hello?", "Hi.")
    records.turn("none", "none", None, {"role": "assistant", "content": "x"})
    records.finish("none")
    image = [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AA"}}]
    records.turn("image", "image", [SYSTEM, {"role": "user", "content": image}],
                 {"role": "assistant", "content": "A cat."})  # fmt: skip
    records.finish("image")
    records.turn("number", "number", [SYSTEM, {"role": "user", "content": 42}],
                 {"role": "assistant", "content": "42."})  # fmt: skip
    records.finish("number")
    records.turn("tools", "tools", [SYSTEM, QUESTION], CALL, tools=TOOLS)
    records.finish("tools")
    records.close()
    strict = copy.copy(tokenizer)
    strict.chat_template = (
        "{%- if tools %}{{ raise_exception('this template takes no tools') }}{%- endif %}"
        + tokenizer.chat_template
    )
    config = sft(rescan=True)
    plan = plan_sft(Selection(tmp_path, settle_seconds=600, tokenizer=strict), config)
    assert plan.groups == ["ok"]
    assert plan.skipped["turns skipped: a record without messages"] == 1
    text = "turns skipped: a message's content is not text (an image, or not a string)"
    assert plan.skipped[text] == 2
    (template,) = [r for r in plan.skipped if "cannot render" in r]
    assert "TemplateError: this template takes no tools" in template
    assert plan.skipped["nothing of it could be rendered (its turns' reasons above)"] == 4
    # Nothing lost: the records are all still there, and a template that renders tools
    # trains the one group that failed only for its template.
    assert len(rows(tmp_path, "SELECT * FROM completions")) == 5
    again = plan_sft(Selection(tmp_path, settle_seconds=600, tokenizer=tokenizer), config)
    assert "tools" in again.groups


def test_token_ids_another_server_logged_are_not_used(tmp_path, tokenizer):
    """A teacher on another vLLM logs its own tokenizer's ids: the turn is rendered from
    its text with the local template all the same."""
    records = Records(tmp_path)
    messages = [SYSTEM, {"role": "user", "content": "Hello?"}]
    records.turn("r", "g", messages, {"role": "assistant", "content": "Hi."},
                 prompt_token_ids=[90001, 90002], completion_token_ids=[90003],
                 completion_logprobs=[-0.1])  # fmt: skip
    records.finish("r")
    records.close()
    (sample,) = plan_sft(
        Selection(tmp_path, settle_seconds=600, tokenizer=tokenizer), sft()
    ).samples
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)
    assert sample.tokens[: len(prompt["input_ids"])] == prompt["input_ids"]
    assert trained_spans(tokenizer, sample) == ["Hi.<|im_end|>"]


def test_a_reply_cut_off_at_its_token_limit_is_not_imitated(tmp_path, tokenizer):
    records = Records(tmp_path)
    response = chat_response("The answer is")
    response["choices"][0]["finish_reason"] = "length"
    row = completion_row("cut", "cut", request={"messages": [SYSTEM, QUESTION]}, response=response)
    records.writer.append("completions", row)
    records.finish("cut")
    records.close()
    plan = plan_sft(Selection(tmp_path, settle_seconds=600, tokenizer=tokenizer), sft())
    assert plan.groups == [] and plan.skipped == {
        "turns skipped: the reply was cut off at its token limit (finish_reason length)": 1,
        "nothing of it could be rendered (its turns' reasons above)": 1,
    }


# -- selection -----------------------------------------------------------------------------


def test_selection_by_reward_best_of_group_or_all():
    rewards = {"a": 1.0, "b": 0.0, "c": 0.5}
    group = ["a", "b", "c"]
    assert select_rollouts(group, rewards, sft()) == ["a"]  # auto: the best
    assert select_rollouts(group, rewards, sft(sft_min_reward=0.5)) == ["a", "c"]
    assert select_rollouts(group, rewards, sft(sft_selection="all")) == group
    assert select_rollouts(group, {}, sft()) == group  # nobody scored it: all of it
    assert "needs them" in select_rollouts(group, {}, sft(sft_selection="best"))
    assert "no reward yet" in select_rollouts(group, {"a": 1.0}, sft())
    low = sft(sft_selection="best", sft_min_reward=2.0)
    assert select_rollouts(group, rewards, low) == "no rollout's reward reaches --sft-min-reward 2"
    assert select_rollouts(["x", "y"], {"x": 1.0, "y": 1.0}, sft()) == ["x"]  # a tie: the first
    with pytest.raises(ConfigError, match="needs --sft-min-reward"):
        sft(sft_selection="min-reward")
    with pytest.raises(ConfigError, match="sft_selection must be one of"):
        sft(sft_selection="most")
    with pytest.raises(ConfigError, match="cross-entropy"):
        sft(kl_coef=0.1)


def test_the_plan_imitates_the_best_dedups_and_holds_out_the_same_groups(tmp_path, tokenizer):
    records = Records(tmp_path)
    for i, reward in enumerate([0.0, 1.0, 0.5]):
        records.one_turn(f"add.{i}", "add", "Add 2 and 2.", f"It is {3 + i}.", reward)
    records.one_turn("hi.0", "hi", "Hello?", "Hi.")  # two groups, one conversation
    records.one_turn("hello2.0", "hello2", "Hello?", "Hi.")
    for i in range(40):
        records.one_turn(f"q{i}", f"q{i}", f"Question {i}?", f"Answer {i}.")
    records.close()
    config = sft(sft_held_out=0.25, rescan=True)
    plan = plan_sft(Selection(tmp_path, settle_seconds=600, tokenizer=tokenizer), config)
    expected = sorted(g for g in [f"q{i}" for i in range(40)] if held_out(g, 0.25))
    assert not any(held_out(g, 0.25) for g in ("add", "hi", "hello2"))  # (by their hashes)
    assert sorted(plan.sft["held_out"]) == expected and len(expected) == 13
    assert plan.skipped[HELD_OUT] == 13 and not set(plan.groups) & set(expected)
    (best,) = [s for s in plan.samples if s.group_id == "add"]
    assert trained_spans(tokenizer, best) == ["It is 4.<|im_end|>"]  # the reward 1.0
    assert plan.rewards == {"add.1": 1.0} and plan.group_stats["add"]["imitated"] == 1
    # Identical conversations train once; both groups are recorded as trained.
    assert [s.group_id for s in plan.samples if s.group_id in ("hi", "hello2")] == ["hello2"]
    assert plan.sft["duplicates"] == 1 and {"hi", "hello2"} <= set(plan.groups)
    assert len(plan.groups) == 3 + 40 - 13 and plan.sft["selected_rollouts"] == 3 + 40 - 13
    # Another night, more groups: those held out are held out again, whatever is new.
    records = Records(tmp_path)
    for i in range(40, 60):
        records.one_turn(f"q{i}", f"q{i}", f"Question {i}?", f"Answer {i}.")
    records.close()
    later = plan_sft(Selection(tmp_path, settle_seconds=600, tokenizer=tokenizer), config)
    assert set(expected) <= set(later.sft["held_out"])
    assert set(later.sft["held_out"]) - set(expected) == {
        f"q{i}" for i in range(40, 60) if held_out(f"q{i}", 0.25)
    }


# -- the loss ------------------------------------------------------------------------------


def test_the_sft_loss_is_the_hand_computed_cross_entropy_of_the_assistant_tokens(
    tmp_path, tokenizer, tiny_model_dir
):
    from overnight.trainer.grpo.loss import LossConfig, token_weights
    from overnight.trainer.grpo.policy import load_policy
    from overnight.trainer.grpo.step import fresh_adapter, micro_batch_loss

    write_tool_rollout(tmp_path, "r1", "g1")
    records = Records(tmp_path)
    for i in range(3):  # a group sharing its prompt (packed once per row)
        records.one_turn(f"s.{i}", "s", "Say a number.", f"{i} {i + 1} {i + 2}.")
    records.close()
    plan = plan_sft(
        Selection(tmp_path, settle_seconds=600, tokenizer=tokenizer), sft(sft_selection="all")
    )
    assert len(plan.samples) == 4
    config = sft(lora_rank=4)
    model = fresh_adapter(load_policy(tiny_model_dir, trainable=True), config)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:  # non-zero: the adapter changes the logits
                p.copy_(torch.randn(p.shape, generator=generator) * 0.05)
    loss_config = LossConfig.from_train_config(config)
    assert loss_config.objective == "sft"
    weights = token_weights([s.trained_tokens for s in plan.samples], loss_config)
    # Ours: two micro-batches accumulated (the second a group with a common prompt).
    ours = 0.0
    for first, end in ((0, 1), (1, 4)):
        loss, stats, gap = micro_batch_loss(
            model, plan.samples[first:end], weights[first:end], loss_config
        )
        ours += loss.item()
    # By hand: each sequence alone, the full vocabulary's log-softmax, the trained tokens.
    picked = []
    for s in plan.samples:
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([s.tokens])).logits[0].float()
        logp = torch.log_softmax(logits[:-1], dim=-1).gather(1, torch.tensor(s.tokens[1:])[:, None])
        picked += [v for v, t in zip(logp[:, 0].tolist(), s.trained[1:], strict=True) if t]
    hand = -sum(picked) / len(picked)
    assert ours == pytest.approx(hand, rel=1e-5, abs=1e-6)
    assert stats["nll"] > 0 and gap == 0.0


# -- a night end to end --------------------------------------------------------------------


def _mean_nll(model_dir, adapter, samples) -> float:
    from overnight.trainer.grpo.loss import LossConfig, token_weights
    from overnight.trainer.grpo.policy import load_policy
    from overnight.trainer.grpo.step import micro_batch_loss

    loss_config = LossConfig(objective="sft")
    model = load_policy(model_dir, adapter)
    with torch.no_grad():
        weights = token_weights([s.trained_tokens for s in samples], loss_config)
        loss, _, _ = micro_batch_loss(model, samples, weights, loss_config)
    return loss.item()


def write_teacher_traffic(data_dir, conversations: int = 12, answer: str | None = None) -> None:
    """A hosted teacher's one-turn answers (nobody scored them; each `answer`, else a
    count) and a two-turn tool use."""
    records = Records(data_dir)
    for i in range(conversations):
        text = answer or f"{i} {i + 1} {i + 2} {i + 3}."
        records.one_turn(f"c{i}", f"c{i}", f"Count from {i}.", text)
    records.close()
    write_tool_rollout(data_dir, "tool", "tool")


@pytest.mark.slow
def test_an_sft_night_from_the_command_line_lowers_the_loss_and_marks_its_groups(
    tmp_path, tiny_model_dir, tokenizer
):
    pytest.importorskip("peft")
    write_teacher_traffic(tmp_path)
    assert list(tmp_path.glob("completions/date=*/*.parquet")), "real Parquet segments"
    # What the night will train on (planning writes nothing).
    plan = plan_sft(
        Selection(tmp_path, settle_seconds=600, tokenizer=tokenizer), sft(sft_held_out=0.2)
    )
    args = ["train", "--data", str(tmp_path), "--sft", "--base-model", str(tiny_model_dir),
            "--proxy", "", "--preset", "tiny-cpu", "--learning-rate", "1e-2", "--lora-rank", "4",
            "--epochs", "3",
            "--groups-per-step", "4", "--sft-held-out", "0.2"]  # fmt: skip
    dry = CliRunner().invoke(main, [*args, "--dry-run"])
    assert dry.exit_code == 0 and "sft (auto): imitating 10 of 10 rollout(s); 3 group(s)" in (
        dry.output
    ), dry.output
    assert "step 1/" not in dry.output and not rows(tmp_path, "SELECT * FROM training_runs")
    out = CliRunner().invoke(main, args)
    assert out.exit_code == 0, out.output
    assert "sft (auto): imitating" in out.output and "cross-entropy" in out.output
    (run,) = rows(tmp_path, "SELECT * FROM training_runs")
    metrics = json.loads(run["metrics"])
    assert run["status"] == "trained" and metrics["objective"] == "sft"
    everything = [f"c{i}" for i in range(12)] + ["tool"]
    held = metrics["sft"]["held_out"]
    assert sorted(held) == sorted(g for g in everything if held_out(g, 0.2)) == ["c0", "c10", "c4"]
    assert set(run["groups"]) == set(everything) - set(held)
    assert metrics["sft"]["selected_rollouts"] == len(run["groups"])
    assert [s["step"] for s in metrics["steps"]] == list(range(1, len(metrics["steps"]) + 1))
    # The adapter imitates the teacher: its loss on the training conversations dropped.
    assert sorted(plan.groups) == sorted(run["groups"])
    before = _mean_nll(tiny_model_dir, None, plan.samples)
    after = _mean_nll(tiny_model_dir, run["adapter_path"], plan.samples)
    assert after < 0.7 * before, (before, after)
    report = (tmp_path / "reports" / "training.html").read_text()
    listing = CliRunner().invoke(main, ["runs", "--data", str(tmp_path)])
    assert "trained (sft)" in report and "trained (sft)" in listing.output, listing.output
    # Its groups are marked trained: the next night, SFT or GRPO, has nothing of them.
    again = CliRunner().invoke(main, args)
    assert again.exit_code == 0 and "nothing to train on" in again.output, again.output


@pytest.mark.slow
def test_an_interrupted_sft_night_resumes_where_it_stopped(tmp_path, tiny_model_dir):
    from safetensors.torch import load_file

    from overnight.trainer.train import TrainError, train

    write_teacher_traffic(tmp_path / "a", conversations=6)
    write_teacher_traffic(tmp_path / "b", conversations=6)
    config = sft(base_model=str(tiny_model_dir), learning_rate=1e-2, lora_rank=4,
                 groups_per_step=2, epochs=2)  # fmt: skip
    whole = train(tmp_path / "a", config, say=lambda _line: None)
    steps = len(whole.metrics["steps"])
    assert steps == 8  # 7 groups, 2 a step, 2 epochs

    class Killed(Exception):
        pass

    def killed_after_step_3(line: str) -> None:
        if line.startswith("step 3/"):
            raise Killed

    with pytest.raises(Killed):
        train(tmp_path / "b", config, say=killed_after_step_3)
    grpo = TrainConfig(base_model=str(tiny_model_dir))
    with pytest.raises(TrainError, match="was an --sft run: resume it with --sft"):
        train(tmp_path / "b", grpo, say=lambda _line: None)
    lines: list[str] = []
    resumed = train(tmp_path / "b", config, say=lines.append)
    assert any(line.startswith("resuming after step 3") for line in lines)
    a = load_file(whole.adapter_path / "adapter_model.safetensors")
    b = load_file(resumed.adapter_path / "adapter_model.safetensors")
    assert a.keys() == b.keys() and all((a[k] - b[k]).abs().max() < 1e-6 for k in a)


@pytest.mark.slow
async def test_the_gate_compares_the_sft_candidate_with_the_served_model_on_held_out_prompts(
    make_proxy, tmp_path, tiny_model_dir
):
    """Through a proxy (the fake vLLM behind it): the held-out share's prompts are the
    gate's, both adapters answer them, the night's scorer decides, the proxy promotes."""
    import asyncio

    from overnight.judge.scoring import pair_scorer
    from overnight.trainer.train import train

    pytest.importorskip("peft")
    proxy = await make_proxy()
    url, data = str(proxy.make_url("")), tmp_path / "data"
    write_teacher_traffic(data, conversations=30, answer="Sure, done.")
    held = [g for g in [f"c{i}" for i in range(30)] + ["tool"] if held_out(g, 0.3)]
    assert len(held) >= 8  # the gate decides nothing on fewer
    reward = tmp_path / "reward.py"
    reward.write_text(
        "def done(rollout):\n    return float('done' in rollout['messages'][-1]['content'])\n"
    )
    # 1e-2: the tiny preset's 6e-2 is tuned for GRPO's small gradients; a cross-entropy
    # at that rate oscillates (measured: 8.5 -> 2.4 in 30 steps; at 1e-2, -> 0.02).
    config = sft(base_model=str(tiny_model_dir), learning_rate=1e-2, epochs=4, lora_rank=8,
                 groups_per_step=4, sft_held_out=0.3, gate_prompts=len(held))  # fmt: skip
    lines: list[str] = []
    result = await asyncio.to_thread(
        train, data, config, proxy_url=url, scorer=pair_scorer(f"{reward}:done", None),
        say=lines.append,
    )  # fmt: skip
    verdict = result.gate
    assert verdict is not None and verdict.prompts == len(held), lines
    prompts = {e["group_id"] for e in verdict.examples}
    assert prompts <= set(held) and not prompts & set(result.plan.groups)
    assert verdict.candidate_mean > verdict.served_mean, verdict.reason  # it learnt to say it
    assert verdict.promote and result.promoted_as, lines
    (run,) = rows(data, "SELECT metrics FROM training_runs")
    metrics = json.loads(run["metrics"])
    assert metrics["objective"] == "sft" and metrics["gate"]["verdict"] == "promoted"


def _sft_adapter(data, model_dir, launch=()) -> tuple[dict, str]:
    """An --sft night on six teacher conversations under `launch` (one process without):
    its adapter's tensors and what it printed."""
    import subprocess

    from safetensors.torch import load_file

    from .test_train_ddp import train_command

    write_teacher_traffic(data, conversations=6)
    command = [*train_command(data, model_dir, launch), "--sft", "--sft-held-out", "0"]
    done = subprocess.run(command, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (run,) = rows(data, "SELECT adapter_path, steps, metrics FROM training_runs")
    assert run["steps"] == 8 and json.loads(run["metrics"])["objective"] == "sft"
    return load_file(f"{run['adapter_path']}/adapter_model.safetensors"), done.stdout


@pytest.fixture(scope="module")
def one_process_sft(tmp_path_factory, tiny_model_dir) -> dict:
    return _sft_adapter(tmp_path_factory.mktemp("one-sft"), tiny_model_dir)[0]


@pytest.mark.slow
@pytest.mark.parametrize("launcher", ["torchrun", "accelerate-fsdp"])
def test_two_processes_train_the_same_sft_adapter_as_one(
    tmp_path, tiny_model_dir, one_process_sft, launcher
):
    """Under torchrun (gloo, data parallel) and FSDP (accelerate launch --use_fsdp) an
    --sft night's step is the one-process step: the same micro-batches shared out, the
    gradients summed."""
    from .test_train_ddp import TWO_PROCESSES, assert_same_adapter

    two, said = _sft_adapter(tmp_path, tiny_model_dir, TWO_PROCESSES[launcher])
    mode = "FSDP" if launcher == "accelerate-fsdp" else "data parallel"
    assert f"2 processes, {mode} on cpu" in said
    assert_same_adapter(one_process_sft, two, f"sft, {launcher}")
