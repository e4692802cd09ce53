"""An agent for games others wrote: a single-player TextArena game, played turn by turn.

Each game is one rollout: every turn carries the same `X-Rollout-Id`, the conversation
grows by the model's move and the game's answer to it, and the game's own outcome (the
reward TextArena gives when it closes) is posted as the rollout's reward, then the rollout
is finished. `--group-size` games of the same seed (the same board, the same hidden number)
form a GRPO group; `--games` seeds, `--seed` upwards, make that many groups. A game the
agent stops at `--max-turns` before it ended is rewarded 0 (metrics say `finished: false`).
Written with the plain `openai` SDK: it runs unchanged against OpenAI or a plain vLLM,
where the rollout headers are ignored; `--no-rewards` skips the reward and finish posts,
and a server without those routes (404) is noticed once and not asked again.

Games that run offline with TextArena 0.7.4: GuessTheNumber-v0 (the default), FrozenLake-v0,
TowerOfHanoi-v0, Blackjack-v0, Mastermind-v0, Minesweeper-v0, LightsOut-v0, Sudoku-v0,
FifteenPuzzle-v0, Sokoban-v0, RushHour-v0, PegJump-v0, Secretary-v0, Bandit-v0, Set-v0,
LogicPuzzle-v0, Cryptarithm-v0, Countdown-v0, Crosswords-v0, Slitherlink-v0,
ThreeCardMonte-v0. Not offline: Wordle, Hangman, WordLadder and WordSearch load nltk's
`words` corpus (downloaded on first use); GuessWho and TwentyQuestions ask an OpenRouter
model; Klondike and UltimateTexasHoldem do not import on Python 3.11 (syntax errors in
0.7.4). The game is made without TextArena's observation wrappers (its `-raw` id, where
there is one), so each turn's message is only what the game said since the last move;
its action wrapper still puts a bare move in brackets. `--setting KEY=VALUE` (repeatable)
passes TextArena's own constructor arguments, to make a game easier (`--setting max_number=10`).
For the games listed in MOVES the system prompt ends with the form of a move and an example
("Reply with your move only: one number in square brackets, e.g. [7].") and a worked first
turn comes before the game (another board's opening, answered with that example move);
`--no-move-hint` leaves both out. (The line repeated after each message of the game was tried
and dropped: no gain measured, BENCHMARKS.md.) Each game's result counts the moves the game refused (`invalid_moves`,
`first_valid`).

`--held-out` is a measurement, not traffic to train on, as reasoning_gym_agent.py's: the
boards come from another seed (`--seed` + HELD_OUT_SEED), each game is a group of its own
(`heldout-...`), no reward is posted (the rollout is only finished), the
requests carry `X-Rollout-Origin: eval`, and each turn of a seed's k-th game is drawn with
the same seed whatever model plays it (two models' games differ by what they learnt more
than by their draws). The mean outcome is printed, and with `--summary-json PATH` written
as JSON, for bench code (bench/learning.py).

    pip install -e ".[tasks]"
    OPENAI_BASE_URL=http://127.0.0.1:8000/v1 python examples/game_agent.py \\
        --env GuessTheNumber-v0 --games 4 --group-size 4
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import sys
import uuid
from pathlib import Path

import httpx
import openai

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the sibling example's
# The held-out marks and seeds, and the reward and finish routes, as the reasoning-gym agent's.
from reasoning_gym_agent import HELD_OUT_DRAWS, HELD_OUT_SEED, Rewards, eval_headers  # noqa: E402

SYSTEM = (
    "You are playing a text game. Read the game's messages and make one move per turn, "
    "written in square brackets as the game asks, e.g. [5]."
)

# The form of one move, game by game: the 135M model otherwise answers in sentences or
# echoes the rules (the reasoning-gym agent's worked examples fixed the same fault there).
# A game not listed gets SYSTEM alone; `--no-move-hint` turns the line off.
MOVES = {
    "GuessTheNumber": "one number in square brackets, e.g. [{number}]",
    "ThreeCardMonte": "one cup number in square brackets, e.g. [1]",
    "FrozenLake": "one direction in square brackets, e.g. [down]",
    "Blackjack": "[hit] or [stand]",
    "Secretary": "[accept] or [continue]",
    "TowerOfHanoi": "the source and the target tower in square brackets, e.g. [A C]",
    "Mastermind": "the digits of your guess in square brackets, e.g. [{code}]",
    "LightsOut": "a row and a column in square brackets, e.g. [0 1]",
    "Minesweeper": "a row and a column in square brackets, e.g. [2 3]",
    "Bandit": "one button in square brackets, e.g. [{button}]",
}


EXAMPLE_SEED = 2_000_003  # the worked example's board: the same for every --seed


def move_form(env_id: str, settings: dict) -> tuple[str, str] | None:
    """The form of a move in words and the example move in it, for a game listed in MOVES."""
    form = MOVES.get(env_id.split("-")[0])
    if form is None:
        return None
    code = " ".join(str(i + 1) for i in range(int(settings.get("code_length", 4))))
    button = (settings.get("buttons") or ["red"])[0]
    number = min(7, int(settings.get("max_number", 20)))  # within the game's range
    form = form.format(code=code, button=button, number=number)
    return form, form[form.index("[") : form.index("]") + 1]


def system_prompt(env_id: str, settings: dict, hint: bool = True) -> str:
    """SYSTEM, and where the game is listed a line showing the form of a move."""
    form = move_form(env_id, settings)
    if not hint or form is None:
        return SYSTEM
    return f"{SYSTEM} Reply with your move only: {form[0]}."


def worked_example(env_id: str, settings: dict) -> list[dict]:
    """A first turn played before the game: the opening of another board of the same game
    and the example move as the reply (the 135M model copies a reply's form more readily
    than it follows an instruction). Empty for a game not listed in MOVES."""
    form = move_form(env_id, settings)
    if form is None:
        return []
    opening = Game(env_id, EXAMPLE_SEED, settings).observe()
    return [{"role": "user", "content": opening}, {"role": "assistant", "content": form[1]}]


class Game:
    """A TextArena game with a random stream of its own: TextArena draws from Python's
    global `random` (seeded by `reset`), and games played side by side would share it."""

    def __init__(self, env_id: str, seed: int, settings: dict | None = None) -> None:
        import textarena  # the `tasks` extra: pip install -e ".[tasks]"
        from textarena.envs.registration import ENV_REGISTRY
        from textarena.wrappers import ActionFormattingWrapper

        self.state = random.Random(seed).getstate()
        raw = f"{env_id}-raw"
        with self.own_random():
            if raw in ENV_REGISTRY:  # the game's own messages, no history folded in
                self.env = ActionFormattingWrapper(textarena.make(env_id=raw, **settings or {}))
            else:
                self.env = textarena.make(env_id=env_id, **settings or {})
            self.env.reset(num_players=1, seed=seed)
        self.shown = ""  # what a wrapped game's observation already showed
        self.invalid: list[bool] = []  # per move: did the game refuse it

    @contextlib.contextmanager
    def own_random(self):
        outside = random.getstate()
        random.setstate(self.state)
        try:
            yield
        finally:
            self.state = random.getstate()
            random.setstate(outside)

    def observe(self) -> str:
        """What the game said since the player's last move."""
        with self.own_random():
            player, observation = self.env.get_observation()
        if isinstance(observation, str):  # a wrapped game: its whole log every time
            new = observation.removeprefix(self.shown) if self.shown else observation
            self.shown = observation
            return new.strip()
        # Not the player's own move echoed back (a few games, Countdown among them, echo it
        # with the arguments swapped: a number where the text should be).
        said = [m for sender, m, _ in observation if sender != player and isinstance(m, str)]
        return "\n".join(said).strip()

    def step(self, move: str) -> bool:
        with self.own_random():
            done, _ = self.env.step(move)
        # A refused move leaves an error count (reset by the next valid one), or ends the
        # game as an invalid move once the allowance is spent.
        state = getattr(self.env, "state", None)
        info = (getattr(state, "game_info", None) or {}).get(0, {})
        self.invalid.append(getattr(state, "error_count", 0) > 0 or bool(info.get("invalid_move")))
        return done

    def close(self) -> tuple[float, str]:
        """The game's reward (0 where TextArena gives none or no number) and its reason."""
        with self.own_random():
            rewards, info = self.env.close()
        reward = (rewards or {}).get(0)
        reason = str((info or {}).get(0, {}).get("reason", ""))
        if isinstance(reward, bool) or not isinstance(reward, int | float):
            return 0.0, reason or str(reward)
        return float(reward), reason


async def play(client: openai.AsyncOpenAI, args: argparse.Namespace, seed: int, group: str,
               draws: int | None = None) -> dict:  # fmt: skip
    """One game, one rollout: the conversation grows turn by turn. `draws`: each turn's
    sampling seed is draws * 100 + the turn (None: unseeded, as the days' games are)."""
    rollout = f"{group}.{uuid.uuid4().hex[:8]}"
    headers = {"X-Rollout-Group": group, "X-Rollout-Id": rollout}
    headers |= eval_headers() if args.held_out else {}
    settings = dict(args.setting)
    game = Game(args.env, seed, settings)
    hint = not args.no_move_hint
    messages = [{"role": "system", "content": system_prompt(args.env, settings, hint)},
                *(worked_example(args.env, settings) if hint else []),
                {"role": "user", "content": game.observe()}]  # fmt: skip
    done, turns = False, 0
    while not done and turns < args.max_turns:
        reply = await client.chat.completions.create(
            model=args.model,
            messages=messages,
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            extra_headers=headers,
            **({"seed": draws * 100 + turns} if draws is not None else {}),
        )
        move = reply.choices[0].message.content or ""
        messages.append({"role": "assistant", "content": move})
        turns += 1
        done = game.step(move)
        if not done:
            messages.append({"role": "user", "content": game.observe() or "Your move."})
    reward, reason = game.close() if done else (0.0, f"stopped after {turns} turns")
    return {"rollout_id": rollout, "group": group, "seed": seed, "turns": turns,
            "finished": done, "reward": reward, "reason": reason,
            "invalid_moves": sum(game.invalid), "first_valid": bool(game.invalid) and not game.invalid[0]}  # fmt: skip


def setting(text: str) -> tuple[str, object]:
    """KEY=VALUE, the value read as JSON where it is (10, true, ["red","blue"]), else text."""
    key, _, value = text.partition("=")
    try:
        return key, json.loads(value)
    except ValueError:
        return key, value


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--env", default="GuessTheNumber-v0", help="a TextArena game id")
    parser.add_argument("--setting", action="append", default=[], type=setting, metavar="KEY=VALUE",
                        help="a TextArena setting of the game, e.g. max_number=10 (repeatable)")  # fmt: skip
    parser.add_argument("--no-move-hint", action="store_true",
                        help="no line showing the form of a move")  # fmt: skip
    parser.add_argument("--games", type=int, default=4, help="seeds (groups)")
    parser.add_argument("--group-size", type=int, default=4, help="games per seed")
    parser.add_argument("--max-turns", type=int, default=30, help="moves per game at most")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model", default=os.environ.get("OVERNIGHT_MODEL", "policy"))
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=8, help="games at once")
    parser.add_argument("--run", default=uuid.uuid4().hex[:6], help="tag in the group ids")
    parser.add_argument("--no-rewards", action="store_true",
                        help="post no rewards or finishes (plain servers)")  # fmt: skip
    parser.add_argument("--held-out", action="store_true",
                        help="measure on held-out boards: marked eval, no rewards")  # fmt: skip
    parser.add_argument("--summary-json", help="also write the summary here, as JSON")
    return parser.parse_args(argv)


async def run(args: argparse.Namespace) -> list[dict]:
    base_url = os.environ.get("OPENAI_BASE_URL", "http://127.0.0.1:8000/v1")
    api_key = os.environ.get("OPENAI_API_KEY", "unused")
    client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, timeout=300)
    limit = asyncio.Semaphore(args.concurrency)
    async with httpx.AsyncClient(
        base_url=base_url, headers={"Authorization": f"Bearer {api_key}"}, timeout=60
    ) as http:
        rewards = Rewards(http, enabled=not args.no_rewards)

        async def one(i: int, k: int) -> dict:
            # held out: other boards, each game a group of its own, its draws seeded
            seed = args.seed + i + (HELD_OUT_SEED if args.held_out else 0)
            group = (f"heldout-{args.env}-{args.run}-{i}-{k}" if args.held_out
                     else f"game-{args.env}-{args.run}-{i}")  # fmt: skip
            draws = i * HELD_OUT_DRAWS + k if args.held_out else None
            async with limit:
                result = await play(client, args, seed, group, draws)
            metrics = {key: result[key] for key in ("turns", "finished", "reason", "seed")}
            reward = None if args.held_out else result["reward"]  # a measurement: none
            await rewards.post(result["rollout_id"], reward, {"env": args.env, **metrics})
            return result

        results = await asyncio.gather(
            *[one(i, k) for i in range(args.games) for k in range(args.group_size)]
        )
    for r in results:
        print(f"{r['rollout_id']}: {r['turns']} turn(s), reward {r['reward']:.2f} ({r['reason']})")
    summarise(args, results)
    return results


def summarise(args: argparse.Namespace, results: list[dict]) -> dict:
    """The mean outcome, printed, and written to --summary-json where given."""
    n = max(len(results), 1)
    mean = sum(r["reward"] for r in results) / n
    kind = "held-out" if args.held_out else "training"
    print(f"{len(results)} games in {args.games} groups of {args.env} ({kind}), "
          f"mean reward {mean:.3f}")  # fmt: skip
    summary = {"env": args.env, "held_out": args.held_out, "attempts": len(results),
               "boards": args.games, "mean_score": mean,
               "first_valid": sum(r["first_valid"] for r in results) / n,
               "finished": sum(r["finished"] for r in results) / n}  # fmt: skip
    if args.summary_json:
        with open(args.summary_json, "w") as f:
            json.dump(summary, f, indent=1)
    return summary


def main(argv: list[str] | None = None) -> list[dict]:
    return asyncio.run(run(parse_args(argv)))


if __name__ == "__main__":
    main()
