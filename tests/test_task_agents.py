"""The agents for tasks others wrote (examples/reasoning_gym_agent.py, examples/game_agent.py)
through the in-process proxy, in front of the fake vLLM taught to answer their tasks: right
some of the time, so that a group's rewards differ. What the store then holds: one group per
question or seed, one rollout per attempt or game (a game's turns all one rollout, its
conversation growing), the reward each program posted; and a night's plan counts the games."""

from __future__ import annotations

import asyncio
import json
import re
from collections import Counter, defaultdict

import pytest
from aiohttp import web
from click.testing import CliRunner

from overnight.cli.main import main
from overnight.testing.fake_shapes import whole_response
from overnight.testing.fake_upstream import create_fake_upstream

from .helpers import rows, wait_for_rows

reasoning_gym = pytest.importorskip("reasoning_gym")
pytest.importorskip("textarena")

from examples import game_agent, reasoning_gym_agent  # noqa: E402

END = 98  # the end-of-message token: outside the ids 1..97 that characters get


def ids(text: str) -> list[int]:
    return [1 + ord(c) % 97 for c in text]


def prompt_ids(messages: list[dict]) -> list[int]:
    """A chat template of sorts, one token a character: a later turn's prompt extends
    the earlier prompt and its reply, as a real template's does."""
    out: list[int] = []
    for m in messages:
        out += ids(f"{m['role']}:{m['content']}") + [END]
    return out + ids("assistant:")


def taught(answer) -> web.Application:
    """The fake vLLM, its chat completions answered by `answer(messages)`: the reply's
    characters its tokens, then the end token, finish "stop"."""
    app = create_fake_upstream()

    @web.middleware
    async def chat(request: web.Request, handler):
        if request.path != "/v1/chat/completions":
            return await handler(request)
        body = await request.json()
        text = answer(body["messages"])
        tokens = [(i, c, -0.1) for i, c in zip(ids(text), text, strict=True)] + [(END, "", -0.1)]
        reply = whole_response(body, True, prompt_ids(body["messages"]), [tokens], False)
        reply["choices"][0]["finish_reason"] = "stop"
        return web.json_response(reply)

    app.middlewares.append(chat)
    return app


def arithmetic_answers(size: int, seed: int):
    """Right, right in a sentence (partly scored), or no answer: in turn, per question."""
    dataset = reasoning_gym.create_dataset("basic_arithmetic", size=size, seed=seed)
    expected = {dataset[i]["question"]: dataset[i]["answer"] for i in range(size)}
    asked: Counter = Counter()

    def answer(messages: list[dict]) -> str:
        question = messages[-1]["content"]
        asked[question] += 1
        right = expected[question]
        return [right, f"The answer is {right}.", "I do not know"][(asked[question] - 1) % 3]

    return dataset, answer


def guessing_player():
    """GuessTheNumber: every other game of a board bisects (and wins), the rest guess
    [1] again and again (an invalid repeat, then the game ends on the second)."""
    games: Counter = Counter()

    def answer(messages: list[dict]) -> str:
        if messages[0]["content"] != game_agent.SYSTEM:  # the worked first turn: not this game
            messages = [messages[0], *messages[3:]]
        moves = [m["content"] for m in messages if m["role"] == "assistant"]
        if not moves:
            games[messages[1]["content"]] += 1
            return "[10]" if games[messages[1]["content"]] % 2 else "[1]"
        if moves[0] == "[1]":
            return "[1]"
        low, high = 1, 20
        for move, said in zip(messages[2::2], messages[3::2], strict=False):
            guess = int(re.search(r"\[(\d+)\]", move["content"]).group(1))
            if "higher" in said["content"]:
                low = guess + 1
            elif "lower" in said["content"]:
                high = guess - 1
        return f"[{(low + high) // 2}]"

    return answer


@pytest.fixture
def upstream(aiohttp_server):
    async def start(answer):
        return await aiohttp_server(taught(answer))

    return start


async def test_reasoning_gym_groups_are_scored_by_the_datasets_own_score(
    upstream, make_proxy, tmp_path, monkeypatch
):
    dataset, answer = arithmetic_answers(size=3, seed=5)
    fake = await upstream(answer)
    proxy = await make_proxy(upstream=str(fake.make_url("")))
    monkeypatch.setenv("OPENAI_BASE_URL", str(proxy.make_url("/v1")))
    args = ["--task", "basic_arithmetic", "--size", "3", "--seed", "5", "--group-size", "3",
            "--run", "t", "--concurrency", "4"]  # fmt: skip
    summary = await reasoning_gym_agent.run(reasoning_gym_agent.parse_args(args))
    assert summary["attempts"] == 9 and summary["questions"] == 3

    data = tmp_path / "data"
    await wait_for_rows(data, 9, table="finishes")
    groups = rows(data, "SELECT group_id, rollouts, finished, rewarded FROM groups ORDER BY 1")
    assert [g["group_id"] for g in groups] == [f"rg-basic_arithmetic-t-{i}" for i in range(3)]
    assert all((g["rollouts"], g["finished"], g["rewarded"]) == (3, 3, 3) for g in groups)
    turns = rows(
        data,
        "SELECT c.group_id, c.rollout_id, c.request, c.response, r.reward, r.metrics "
        "FROM completions c JOIN rewards r USING (rollout_id)",
    )
    assert len(turns) == 9
    expected_questions = {dataset[i]["question"] for i in range(3)}
    by_group = defaultdict(list)
    for t in turns:
        i = int(t["group_id"].rsplit("-", 1)[1])
        given = json.loads(t["response"])["choices"][0]["message"]["content"]
        sent = json.loads(t["request"])["messages"]
        assert "seed" not in json.loads(t["request"])  # a day's answers: unseeded, diverse
        assert sent[-1]["content"] == dataset[i]["question"]
        # Two worked examples (the default --shots) of another seed, answered, before it.
        assert [m["role"] for m in sent] == ["system", "user", "assistant", "user", "assistant",
                                             "user"]  # fmt: skip
        assert sent[1:5] == reasoning_gym_agent.worked_examples("basic_arithmetic", {}, 2)
        assert {sent[1]["content"], sent[3]["content"]}.isdisjoint(expected_questions)
        assert t["reward"] == dataset.score_answer(given, dataset[i])
        metrics = json.loads(t["metrics"]) if isinstance(t["metrics"], str) else t["metrics"]
        assert metrics == {"task": "basic_arithmetic", "answer": given,
                           "expected": dataset[i]["answer"]}  # fmt: skip
        by_group[i].append(t["reward"])
    # Right, partly right, wrong: each group has something for GRPO to compare.
    assert all(max(r) == 1.0 and min(r) == 0.0 for r in by_group.values()), by_group
    assert summary["mean_score"] == pytest.approx(sum(t["reward"] for t in turns) / 9)


async def test_reasoning_gym_held_out_is_marked_eval_and_posts_no_reward(
    upstream, make_proxy, tmp_path, monkeypatch
):
    seed = 2 + reasoning_gym_agent.HELD_OUT_SEED  # --held-out asks the other seed's questions
    _, answer = arithmetic_answers(size=2, seed=seed)
    fake = await upstream(answer)
    proxy = await make_proxy(upstream=str(fake.make_url("")))
    monkeypatch.setenv("OPENAI_BASE_URL", str(proxy.make_url("/v1")))
    monkeypatch.delenv("OVERNIGHT_ADMIN_TOKEN", raising=False)  # loopback: the mark counts
    out = tmp_path / "summary.json"
    args = ["--size", "2", "--seed", "2", "--group-size", "2", "--run", "h", "--held-out",
            "--summary-json", str(out)]  # fmt: skip
    summary = await reasoning_gym_agent.run(reasoning_gym_agent.parse_args(args))
    assert json.loads(out.read_text()) == summary and summary["held_out"] is True

    data = tmp_path / "data"
    await wait_for_rows(data, 4, table="finishes")
    turns = rows(data, "SELECT group_id, sent_by, request FROM completions ORDER BY group_id")
    assert [t["group_id"] for t in turns] == [
        f"heldout-basic_arithmetic-h-{i}-{k}" for i in range(2) for k in range(2)
    ]
    assert {t["sent_by"] for t in turns} == {"eval"}
    assert rows(data, "SELECT * FROM rewards") == []
    # Each question's k-th answer drawn with its own seed, the same for any model that
    # answers (common random numbers between the held-out scores of two models).
    seeds = [json.loads(t["request"]).get("seed") for t in turns]
    assert seeds == [i * reasoning_gym_agent.HELD_OUT_DRAWS + k for i in range(2) for k in range(2)]


async def test_the_agents_run_against_a_server_without_reward_routes(upstream, monkeypatch, capsys):
    """A plain vLLM (here the fake, directly): the rollout headers are ignored, and the
    reward route's 404 is noticed once; the programs run to their summaries."""
    _, answer = arithmetic_answers(size=1, seed=0)
    fake = await upstream(answer)
    monkeypatch.setenv("OPENAI_BASE_URL", str(fake.make_url("/v1")))
    args = ["--size", "1", "--group-size", "2", "--concurrency", "1"]
    summary = await reasoning_gym_agent.run(reasoning_gym_agent.parse_args(args))
    assert summary["attempts"] == 2
    assert capsys.readouterr().out.count("the server has no reward route") == 1

    fake = await upstream(guessing_player())
    monkeypatch.setenv("OPENAI_BASE_URL", str(fake.make_url("/v1")))
    results = await game_agent.run(game_agent.parse_args(["--games", "1", "--group-size", "2"]))
    assert sorted(r["reward"] for r in results)[-1] == 1.0
    assert "2 games in 1 groups of GuessTheNumber-v0" in capsys.readouterr().out


async def play_games(upstream, make_proxy, tmp_path, monkeypatch) -> tuple[list[dict], object]:
    fake = await upstream(guessing_player())
    proxy = await make_proxy(upstream=str(fake.make_url("")))
    monkeypatch.setenv("OPENAI_BASE_URL", str(proxy.make_url("/v1")))
    args = ["--env", "GuessTheNumber-v0", "--games", "2", "--group-size", "2", "--seed", "3",
            "--run", "g", "--max-turns", "12"]  # fmt: skip
    results = await game_agent.run(game_agent.parse_args(args))
    await wait_for_rows(tmp_path / "data", 4, table="finishes")
    return results, tmp_path / "data"


async def test_a_game_is_one_multi_turn_rollout_rewarded_with_its_outcome(
    upstream, make_proxy, tmp_path, monkeypatch
):
    results, data = await play_games(upstream, make_proxy, tmp_path, monkeypatch)
    groups = rows(data, "SELECT group_id, rollouts, finished, rewarded FROM groups ORDER BY 1")
    assert [(g["group_id"], g["rollouts"], g["finished"], g["rewarded"]) for g in groups] == [
        (f"game-GuessTheNumber-v0-g-{i}", 2, 2, 2) for i in range(2)
    ]
    turns = rows(
        data,
        "SELECT rollout_id, group_id, turn_index, request, prompt_token_ids FROM completions "
        "ORDER BY rollout_id, turn_index",
    )
    by_rollout = defaultdict(list)
    for t in turns:
        by_rollout[t["rollout_id"]].append(t)
    assert len(by_rollout) == 4
    for rollout, game in by_rollout.items():
        assert len(game) >= 2 and len({t["group_id"] for t in game}) == 1
        assert [t["turn_index"] for t in game] == sorted({t["turn_index"] for t in game})
        conversations = [json.loads(t["request"])["messages"] for t in game]
        for before, after in zip(conversations, conversations[1:], strict=False):
            assert after[: len(before)] == before and len(after) == len(before) + 2
        for before, after in zip(game, game[1:], strict=False):
            assert after["prompt_token_ids"][: len(before["prompt_token_ids"])] == list(
                before["prompt_token_ids"]
            )
        (result,) = [r for r in results if r["rollout_id"] == rollout]
        assert result["turns"] == len(game) and result["finished"]
    rewards = rows(data, "SELECT rollout_id, reward, metrics FROM rewards")
    assert len(rewards) == 4 and {r["rollout_id"] for r in rewards} == set(by_rollout)
    posted = {r["rollout_id"]: r["reward"] for r in rewards}
    assert posted == {r["rollout_id"]: r["reward"] for r in results}
    # Each board: the bisecting games win (1.0), the repeating ones lose on it.
    for i in range(2):
        group = sorted(r["reward"] for r in results if r["group"].endswith(f"-{i}"))
        assert group[-1] == 1.0 and group[0] < 1.0, results


async def test_held_out_games_are_marked_eval_seeded_and_post_no_reward(
    upstream, make_proxy, tmp_path, monkeypatch
):
    """`--held-out`: other boards, each game a group of its own, every turn marked eval and
    drawn from the game's own seeds (the same for any model that plays it), no reward; the
    summary's mean is the games' outcomes (bench/learning.py reads it)."""
    fake = await upstream(guessing_player())
    proxy = await make_proxy(upstream=str(fake.make_url("")))
    monkeypatch.setenv("OPENAI_BASE_URL", str(proxy.make_url("/v1")))
    monkeypatch.delenv("OVERNIGHT_ADMIN_TOKEN", raising=False)  # loopback: the mark counts
    out = tmp_path / "summary.json"
    args = ["--env", "GuessTheNumber-v0", "--games", "2", "--group-size", "2", "--seed", "3",
            "--run", "h", "--max-turns", "12", "--held-out", "--summary-json", str(out)]  # fmt: skip
    results = await game_agent.run(game_agent.parse_args(args))
    summary = json.loads(out.read_text())
    assert summary["held_out"] is True and summary["attempts"] == 4
    assert summary["mean_score"] == pytest.approx(sum(r["reward"] for r in results) / 4)
    assert 0 < summary["mean_score"] < 1  # the bisecting games won, the repeating ones lost
    assert {r["seed"] for r in results} == {3 + game_agent.HELD_OUT_SEED + i for i in range(2)}

    data = tmp_path / "data"
    await wait_for_rows(data, 4, table="finishes")
    turns = rows(data, "SELECT group_id, rollout_id, turn_index, sent_by, request "
                       "FROM completions ORDER BY group_id, turn_index")  # fmt: skip
    assert sorted({t["group_id"] for t in turns}) == [
        f"heldout-GuessTheNumber-v0-h-{i}-{k}" for i in range(2) for k in range(2)
    ]
    assert {t["sent_by"] for t in turns} == {"eval"}
    assert rows(data, "SELECT * FROM rewards") == []
    games = defaultdict(list)
    for t in turns:
        games[t["group_id"]].append(json.loads(t["request"])["seed"])
    for (
        group,
        seeds,
    ) in games.items():  # board i's k-th game, its n-th move: (i * DRAWS + k) * 100 + n
        i, k = map(int, group.split("-")[-2:])
        draws = i * game_agent.HELD_OUT_DRAWS + k
        assert seeds == [draws * 100 + n for n in range(len(seeds))], (group, seeds)


async def test_recorded_games_are_planned_for_a_night(
    upstream, make_proxy, tmp_path, monkeypatch, tiny_model_dir
):
    _, data = await play_games(upstream, make_proxy, tmp_path, monkeypatch)
    args = ["train", "--data", str(data), "--settle", "0", "--base-model", str(tiny_model_dir),
            "--proxy", "", "--dry-run"]  # fmt: skip
    out = await asyncio.to_thread(CliRunner().invoke, main, args)
    assert out.exit_code == 0, out.output
    # Both boards' groups, each game one sequence: its turns merged, as each turn's prompt
    # extends the one before.
    assert "2 group(s), 4 sequence(s)" in out.output, out.output


OFFLINE_GAMES = ["GuessTheNumber-v0", "FrozenLake-v0", "TowerOfHanoi-v0", "Blackjack-v0",
                 "Mastermind-v0", "Sudoku-v0", "Countdown-v0", "Cryptarithm-v0"]  # fmt: skip


async def test_offline_games_play_to_their_end(aiohttp_server, monkeypatch):
    """Games the docstring says run offline (no nltk corpus, no model of TextArena's own)
    run to an outcome against the plain fake's filler replies: invalid moves, a game lost.
    Countdown and Cryptarithm echo the player's move with a number for its text (0.7.4)."""
    fake = await aiohttp_server(create_fake_upstream())
    monkeypatch.setenv("OPENAI_BASE_URL", str(fake.make_url("/v1")))
    for env in OFFLINE_GAMES:
        args = ["--env", env, "--games", "1", "--group-size", "1", "--no-rewards"]
        (result,) = await game_agent.run(game_agent.parse_args(args))
        assert result["finished"] and result["turns"] >= 1, (env, result)


async def test_a_game_shows_the_form_of_a_move_takes_settings_and_counts_refused_moves(
    upstream, monkeypatch
):
    """The system prompt ends with the game's move form and an example ([7] for
    GuessTheNumber, [5] in a range up to 5), and a worked first turn (another board's
    opening, answered with it) comes before the game; `--setting` reaches TextArena's
    constructor (the range said in the game's first message); a reply the game refuses (a
    sentence) is counted, the first move included. `--no-move-hint` sends neither."""
    seen: list[list[dict]] = []

    def answer(messages: list[dict]) -> str:
        seen.append(messages)
        return "I think the number is 3." if len(messages) <= 4 else "[3]"

    fake = await upstream(answer)
    monkeypatch.setenv("OPENAI_BASE_URL", str(fake.make_url("/v1")))
    args = ["--games", "1", "--group-size", "1", "--no-rewards", "--setting", "max_number=5",
            "--setting", "max_turns=3"]  # fmt: skip
    (result,) = await game_agent.run(game_agent.parse_args(args))
    system, example, move, first = (m["content"] for m in seen[0])
    assert system.endswith("Reply with your move only: one number in square brackets, e.g. [5].")
    assert [m["role"] for m in seen[0]] == ["system", "user", "assistant", "user"]
    assert "Guess The Number" in example and move == "[5]"  # in the range set
    assert "between 1 and 5" in first and "within 3 turns" in first, first
    assert result["first_valid"] is False and result["invalid_moves"] >= 1, result
    await game_agent.run(game_agent.parse_args([*args, "--no-move-hint"]))
    assert seen[-1][0]["content"] == game_agent.SYSTEM and seen[-1][1]["role"] == "user"
    assert len(seen[-1]) % 2 == 0  # system, then the game's turns only: no worked example
