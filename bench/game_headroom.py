"""Which TextArena games have headroom for the real model? Untrained play, game by game.

    python bench/game_headroom.py                        # every candidate, 6 seeds x 4 games
    python bench/game_headroom.py --games GuessTheNumber-v0 --seeds 8 --group-size 4

SmolLM2-135M-Instruct (prepared from its pip package) is served by `overnight serve` on
vLLM's CPU backend, and each candidate single-player game, at easy settings (TextArena's
own constructor arguments, passed as the agent's `--setting`), is played through the proxy
by examples/game_agent.py's own loop (`play`: its system prompt ending with the form of a
move, its worked first turn on another board, its 64 tokens a move, its turn limit): `--seeds` boards x `--group-size`
games each at the traffic's temperature, each game one rollout whose reward is the game's
own outcome (most games give partial credit: a share of the way, of the hands won).

Per game the table gives the mean reward, `valid1` (the share of games whose first move the
game accepted), `spread` (the share of seeds whose games did not all score the same: the
groups GRPO learns from), the mean number of moves, and `random`: the mean reward of the same
boards played by a random move of the right form (a number in range, a direction, [hit] or
[stand], ...) through the same loop, no model. A game has headroom where the model's mean
reward lies in [--low, --high] and a quarter of its groups have a spread; the `vs random`
column says whether the model plays above or below the random mover (beyond twice the
standard error of the difference), the line a night's rise is read against.

`--no-move-hint` plays without the move line and the worked turn (the agent's flag), to see
what they change.
Progress lines with an ETA; the table at the end, and --json FILE for the rows.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import signal
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
# The agent's own play loop, so that what is measured here is what its traffic does.
from examples.game_agent import parse_args as agent_args  # noqa: E402
from examples.game_agent import play  # noqa: E402

# Candidate games at easy settings (TextArena 0.7.4's constructor arguments), the multi-turn
# ones short enough to fit the model's 2,048 tokens at 64 tokens a move.
CANDIDATES: dict[str, dict] = {
    "ThreeCardMonte-v0": {"steps": 2},  # one move: which cup
    "GuessTheNumber-v0": {"min_number": 1, "max_number": 10, "max_turns": 4},
    "Secretary-v0": {"N": 3},
    "Blackjack-v0": {"num_hands": 1},
    "FrozenLake-v0": {"size": 3, "num_holes": 1},
    "TowerOfHanoi-v0": {"num_disks": 2, "max_turns": 6},
    "Mastermind-v0": {"code_length": 2, "num_numbers": 4, "max_turns": 6},
    "LightsOut-v0": {"size": 3, "max_turns": 6},
    "Bandit-v0": {"buttons": ["red", "blue"], "num_turns": 3},
}
MULTI_TURN = {g for g in CANDIDATES if g != "ThreeCardMonte-v0"}


def random_move(env: str, settings: dict, rng: random.Random) -> str:
    """A move of the right form for `env`, drawn at random (legal in form, not in play)."""
    game = env.split("-")[0]
    if game == "ThreeCardMonte":
        return f"[{rng.randrange(3)}]"
    if game == "GuessTheNumber":
        return f"[{rng.randint(settings['min_number'], settings['max_number'])}]"
    if game == "Secretary":
        return rng.choice(["[accept]", "[continue]"])
    if game == "Blackjack":
        return rng.choice(["[hit]", "[stand]"])
    if game == "FrozenLake":
        return f"[{rng.choice(['up', 'down', 'left', 'right'])}]"
    if game == "TowerOfHanoi":
        a, b = rng.sample("ABC", 2)
        return f"[{a} {b}]"
    if game == "Mastermind":
        digits = rng.sample(range(1, settings["num_numbers"] + 1), settings["code_length"])
        return f"[{' '.join(map(str, digits))}]"
    if game == "LightsOut":
        return f"[{rng.randrange(settings['size'])} {rng.randrange(settings['size'])}]"
    if game == "Bandit":
        return f"[{rng.choice(settings['buttons'])}]"
    raise ValueError(f"no random mover for {env}")


class RandomClient:
    """Stands in for the OpenAI client in the agent's loop: each reply a random move."""

    def __init__(self, env: str, settings: dict, seed: int) -> None:
        self.rng, self.env, self.settings = random.Random(seed), env, settings
        self.chat = SimpleNamespace(completions=SimpleNamespace(create=self.create))

    async def create(self, **_) -> SimpleNamespace:
        move = random_move(self.env, self.settings, self.rng)
        return SimpleNamespace(choices=[SimpleNamespace(message=SimpleNamespace(content=move))])


async def play_all(client_for, env: str, args) -> list[list[dict]]:
    """`--seeds` groups of `--group-size` games, as many at once as `--concurrency`."""
    settings = CANDIDATES[env]
    argv = ["--env", env, "--max-turns", str(args.max_turns), "--model", "smollm2",
            "--temperature", str(args.temperature)]  # fmt: skip
    argv += [f"--setting={k}={json.dumps(v)}" for k, v in settings.items()]
    argv += ["--no-move-hint"] if args.no_move_hint else []
    agent = agent_args(argv)
    limit = asyncio.Semaphore(args.concurrency)

    async def one(seed: int, k: int) -> dict:
        async with limit:
            try:
                return await play(client_for(seed, k), agent, seed, f"headroom-{env}-{seed}")
            except Exception as e:  # a conversation past the context, a server error: a loss
                reason = f"error: {type(e).__name__}"
                return {"reward": 0.0, "turns": 0, "first_valid": False, "reason": reason}

    seeds = [args.seed + s for s in range(args.seeds)]
    games = await asyncio.gather(*[one(s, k) for s in seeds for k in range(args.group_size)])
    return [games[i : i + args.group_size] for i in range(0, len(games), args.group_size)]


def summary(groups: list[list[dict]]) -> dict:
    games = [g for group in groups for g in group]
    rewards = [g["reward"] for g in games]
    mean = sum(rewards) / len(rewards)
    var = sum((r - mean) ** 2 for r in rewards) / max(len(rewards) - 1, 1)
    return {
        "reward": mean,
        "stderr": (var / len(rewards)) ** 0.5,
        "valid1": sum(g["first_valid"] for g in games) / len(games),
        "spread": sum(max(r) > min(r) for r in ([g["reward"] for g in gr] for gr in groups))
        / len(groups),
        "turns": sum(g["turns"] for g in games) / len(games),
        "errors": sum(g["reason"].startswith("error") for g in games),
    }


async def play_model(env: str, args) -> list[list[dict]]:
    from openai import AsyncOpenAI

    # A client per game, closed in its own loop: each asyncio.run has a loop of its own.
    async with AsyncOpenAI(base_url=args.url, api_key="unused", timeout=300) as client:
        return await play_all(lambda seed, k: client, env, args)


def measure(env: str, args) -> dict:
    model = summary(asyncio.run(play_model(env, args)))
    settings = CANDIDATES[env]
    rand = summary(
        asyncio.run(
            play_all(lambda seed, k: RandomClient(env, settings, seed * 100 + k), env, args)
        )
    )
    gap = model["reward"] - rand["reward"]
    noise = 2 * (model["stderr"] ** 2 + rand["stderr"] ** 2) ** 0.5
    versus = "above" if gap > noise else "below" if gap < -noise else "level"
    return {"game": env, "settings": settings, "multi_turn": env in MULTI_TURN, **model,
            "random": rand["reward"], "random_valid1": rand["valid1"],
            "random_spread": rand["spread"], "vs_random": versus}  # fmt: skip


def headroom(row: dict, low: float, high: float) -> bool:
    return low <= row["reward"] <= high and row["spread"] >= 0.25


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--games", nargs="*", default=list(CANDIDATES))
    parser.add_argument("--seeds", type=int, default=6, help="boards (groups) per game")
    parser.add_argument("--group-size", type=int, default=4, help="games per board")
    parser.add_argument("--max-turns", type=int, default=10, help="moves per game at most")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=1, help="the first board's seed")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--no-move-hint", action="store_true", help="the agent's flag")
    parser.add_argument("--low", type=float, default=0.05)
    parser.add_argument("--high", type=float, default=0.6)
    parser.add_argument("--model-dir", help="a prepared SmolLM2 (default: prepared now)")
    parser.add_argument("--url", help="a running proxy's base URL (…/v1) serving `smollm2`")
    parser.add_argument("--json", type=Path, help="write the rows here")
    args = parser.parse_args()
    unknown = [g for g in args.games if g not in CANDIDATES]
    if unknown:
        parser.error(f"no candidate settings for {unknown}: add them to CANDIDATES")

    server = None
    # A SIGTERM stops the server it started too (the `finally` below), not only this process.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if args.url is None:
        from overnight.models.smollm2 import prepare_smollm2
        from overnight.testing.processes import serve_local_model

        model_dir = args.model_dir or prepare_smollm2(ROOT / ".cache" / "smollm2-135m-instruct")
        data = tempfile.mkdtemp(prefix="game-headroom-")
        print(f"starting vLLM (CPU) on {model_dir} behind the proxy (data {data})", flush=True)
        server = serve_local_model(data, model_dir, "smollm2", "--vllm-arg=--max-model-len=2048")
        args.url = f"{server.url}/v1"
    rows, started = [], time.monotonic()
    try:
        for done, env in enumerate(args.games, 1):
            rows.append(measure(env, args))
            row, spent = rows[-1], time.monotonic() - started
            eta = spent / done * (len(args.games) - done)
            print(f"[{done}/{len(args.games)}] {env}: reward {row['reward']:.3f} valid1 "
                  f"{row['valid1']:.2f} spread {row['spread']:.2f} turns {row['turns']:.1f} "
                  f"random {row['random']:.3f} ({row['vs_random']}; errors {row['errors']}; "
                  f"{spent / done:.0f} s a game, ETA {eta:.0f} s)", flush=True)  # fmt: skip
            if args.json:  # what finished so far, in case the scan is stopped
                args.json.write_text(json.dumps(rows, indent=1, default=str))
    finally:
        if server is not None:
            server.stop()
    print(f"\n{'game':20} {'reward':>7} {'valid1':>7} {'spread':>7} {'turns':>6} {'random':>7} "
          f"{'vs random':>9}  verdict")  # fmt: skip
    for row in sorted(rows, key=lambda r: -r["reward"]):
        verdict = "headroom" if headroom(row, args.low, args.high) else ""
        verdict += " (multi-turn)" if verdict and row["multi_turn"] else ""
        print(f"{row['game']:20} {row['reward']:7.3f} {row['valid1']:7.2f} {row['spread']:7.2f} "
              f"{row['turns']:6.1f} {row['random']:7.3f} {row['vs_random']:>9}  {verdict}")  # fmt: skip
    if args.json:
        for row in rows:
            row["headroom"] = headroom(row, args.low, args.high)
        args.json.write_text(json.dumps(rows, indent=1, default=str))


if __name__ == "__main__":
    main()
