"""Learning on tasks others wrote: N nights on reasoning-gym tasks, held-out scores before and after each.

    flock /tmp/overnight-heavy.lock python bench/learning.py --tasks syllogism --nights 2 \\
        --size 16 --group-size 4 --held-out 16

SmolLM2-135M-Instruct (prepared from its pip package) learns each task through the product's
own path, one `overnight serve --model` per task on a fresh data folder (vLLM's CPU backend).
A task is a reasoning-gym task (bench/task_headroom.CANDIDATES) or a TextArena game
(bench/game_headroom.CANDIDATES: examples/game_agent.py plays --size boards, each game one
multi-turn rollout rewarded with its outcome; a move has no verifier of its own, so a
game's nights are gated on forgetting alone):

  before:  the held-out score of the model served as `policy` (the base model)
  day d:   examples/reasoning_gym_agent.py, unchanged, as a user runs it (a subprocess with
           OPENAI_BASE_URL at the proxy): --size questions x --group-size attempts at the
           traffic's --temperature, questions of seed --day-seed + d; it posts the task's
           own `score_answer` as each attempt's reward
  night d: `overnight train --preset smollm2-cpu --settle 0 --no-watch --reward-source agent`,
           gated: the gate samples the candidate and the served adapter on held-out prompts
           (the latest held-out measurement's questions) and scores the replies with
           examples/reasoning_gym_rewards.py:score_answer (the same verifier, found from the
           question text through the index this bench writes), then forgetting on the
           bundled references; its verdict line is kept
  after:   the held-out score again, through the alias, so it measures whatever the night
           left served (the new adapter if promoted, the old one if refused)

A held-out score is the agent's own `--held-out --summary-json` run: --held-out questions of
another seed (the agent adds HELD_OUT_SEED to --held-out-seed; the same questions before and
after every night), never trained on (marked eval), answered greedily (temperature 0, once)
and sampled at the traffic's temperature (--held-out-samples times each). Greedy is asked
first, so the gate's prompts (the newest distinct conversations) carry the traffic's
temperature.

Progress lines with the time spent and an ETA; a table per task at the end; under
--out (default .cache/bench/learning/<UTC time>/): results.json (the rows) and report.html
(the tables and a chart per task, view/charts.line_chart's inline SVG). The task choice and
its difficulty: bench/task_headroom.py (BENCHMARKS.md, "Learning on tasks others wrote").
"""

from __future__ import annotations

import argparse
import html
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import asdict, dataclass, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.game_headroom import CANDIDATES as GAMES  # noqa: E402
from bench.task_headroom import CANDIDATES  # noqa: E402
from examples.reasoning_gym_agent import HELD_OUT_SEED  # noqa: E402

AGENT = ROOT / "examples" / "reasoning_gym_agent.py"
GAME_AGENT = ROOT / "examples" / "game_agent.py"
# A game's moves: at most this many a game (bench/game_headroom.py's, its games' turn limits
# within it), each up to the agent's 64 tokens.
GAME_MOVES = 10
REWARD = f"{ROOT / 'examples' / 'reasoning_gym_rewards.py'}:score_answer"
# Chosen with bench/task_headroom.py (BENCHMARKS.md): untrained sampled scores in range.
DEFAULT_TASKS = ["syllogism"]
# The forgetting measure's base-model figures (DATA/references/<model>.json and .loglik.json:
# the base model's greedy answers to the bundled references and their likelihoods), the same
# for every data folder on this model: generated once (minutes on two cores), then copied
# into each task's fresh data folder, as a later night on one folder reads its own.
REFERENCES = ROOT / ".cache" / "bench" / "learning" / "references"
PEERS = ("trl",)  # --peer: the same budget of sampled completions by another trainer


@dataclass
class Row:
    """One task's held-out scores after `night` nights (0: untrained), and that night."""

    task: str
    night: int
    sampled: float  # held-out mean score, sampled at the traffic's temperature
    greedy: float  # held-out mean score, temperature 0
    served: str = "-"  # what answered the held-out questions (the alias's adapter)
    train_reward: float | None = None  # the day's traffic, as the agent scored it
    verdict: str = "-"  # promoted / refused / - (no gate: untrained, or nothing trained)
    gate_diff: float | None = None  # the gate's candidate - served on its prompts
    forgetting: float | None = None  # the candidate's nats/token vs the base model
    gate_line: str = "-"
    seconds: float = 0.0  # the day, the night and the evaluation
    side: str = "overnight"  # who trained: overnight, or the peer (trl)
    completions: int = 0  # completions sampled for training so far
    wall: float = 0.0  # seconds spent learning so far: sampling and training, no held-out runs


# -- the gate's line ---------------------------------------------------------------------

_VERDICT = re.compile(r"^gate \(([\w-]+)\): (\w+)")
_DIFF = re.compile(r"candidate - served = ([+-]?[\d.]+(?:e[+-]?\d+)?)")
_FORGETTING = re.compile(r"forgetting on \d+ reference answers: candidate ([+-]?[\d.]+) nats")


def parse_gate(line: str) -> tuple[str, float | None, float | None]:
    """(verdict word, candidate - served, candidate's forgetting) from a gate line."""
    verdict = _VERDICT.search(line or "")
    diff = _DIFF.search(line or "")
    forgetting = _FORGETTING.search(line or "")
    return (
        verdict.group(2) if verdict else "-",
        float(diff.group(1)) if diff else None,
        float(forgetting.group(1)) if forgetting else None,
    )


# -- the table and the page --------------------------------------------------------------


def _num(value: float | None, fmt: str = ".3f") -> str:
    return "-" if value is None else format(value, fmt)


HEADER = (f"{'task':20} {'night':>5} {'sampled':>8} {'greedy':>7} {'traffic':>8} "
          f"{'verdict':>9} {'gate diff':>9} {'forgetting':>10}  served by")  # fmt: skip


def table(rows: list[Row]) -> str:
    """Our rows as a text table: one line per task and night."""
    lines = [HEADER]
    for r in rows:
        if r.side != "overnight":
            continue
        lines.append(
            f"{r.task:20} {r.night:5d} {r.sampled:8.3f} {r.greedy:7.3f} "
            f"{_num(r.train_reward):>8} {r.verdict:>9} {_num(r.gate_diff, '+.3f'):>9} "
            f"{_num(r.forgetting, '+.3f'):>10}  {r.served}"
        )
    return "\n".join(lines)


SIDE_BY_SIDE = ["task", "night", "completions", "sampled ours", "sampled TRL", "greedy ours",
                "greedy TRL", "wall s ours", "wall s TRL"]  # fmt: skip


def pairs(rows: list[Row]) -> list[tuple[Row, Row]]:
    """(ours, the peer's) for each task and night both have."""
    peer = {(r.task, r.night): r for r in rows if r.side != "overnight"}
    return [(r, peer[r.task, r.night]) for r in rows
            if r.side == "overnight" and (r.task, r.night) in peer]  # fmt: skip


def side_by_side_cells(ours: Row, theirs: Row) -> list[str]:
    completions = str(ours.completions) if ours.completions == theirs.completions else (
        f"{ours.completions}/{theirs.completions}")  # fmt: skip
    return [ours.task, str(ours.night), completions, f"{ours.sampled:.3f}",
            f"{theirs.sampled:.3f}", f"{ours.greedy:.3f}", f"{theirs.greedy:.3f}",
            f"{ours.wall:.0f}", f"{theirs.wall:.0f}"]  # fmt: skip


def side_by_side(rows: list[Row]) -> str:
    """Ours and the peer's held-out scores and wall time at the same completions sampled."""
    widths = [20, 5, 11, 12, 11, 11, 10, 11, 10]
    lines = [" ".join(h.rjust(w) if i else h.ljust(w)
                      for i, (h, w) in enumerate(zip(SIDE_BY_SIDE, widths, strict=True)))]  # fmt: skip
    for ours, theirs in pairs(rows):
        cells = side_by_side_cells(ours, theirs)
        lines.append(" ".join(c.rjust(w) if i else c.ljust(w)
                              for i, (c, w) in enumerate(zip(cells, widths, strict=True))))  # fmt: skip
    return "\n".join(lines)


def peer_charts(task: str, rows: list[Row]) -> list[str]:
    """Held-out score and wall time against completions sampled, both sides."""
    from overnight.view.charts import line_chart

    ours = [r for r in rows if r.task == task and r.side == "overnight"]
    theirs = [r for r in rows if r.task == task and r.side != "overnight"]
    if not theirs:
        return []
    scores = {
        "ours, sampled": [(r.completions, r.sampled) for r in ours],
        "ours, greedy": [(r.completions, r.greedy) for r in ours],
        "TRL, sampled": [(r.completions, r.sampled) for r in theirs],
        "TRL, greedy": [(r.completions, r.greedy) for r in theirs],
    }
    wall = {"ours": [(r.completions, r.wall) for r in ours],
            "TRL": [(r.completions, r.wall) for r in theirs]}  # fmt: skip
    parts = [line_chart(f"{task}: held-out score, ours and TRL's", scores, "completions sampled"),
             line_chart(f"{task}: seconds spent learning", wall, "completions sampled"),
             "<table><tr>" + "".join(f"<th>{h}</th>" for h in SIDE_BY_SIDE) + "</tr>"]  # fmt: skip
    for pair in pairs(ours + theirs):
        cells = side_by_side_cells(*pair)
        parts.append("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in cells) + "</tr>")
    return [*parts, "</table>"]


def page(rows: list[Row], command: str, settings: dict) -> str:
    """The HTML report: per task, a chart of the held-out scores by night and its table,
    and every gate line."""
    from overnight.view.charts import line_chart

    parts = [
        "<!doctype html><meta charset=utf-8><title>overnight: learning on tasks</title>",
        "<style>body{font-family:sans-serif;margin:2em}td,th{padding:2px 8px;"
        "text-align:right}pre{white-space:pre-wrap}</style>",
        "<h1>Learning on tasks others wrote (bench/learning.py)</h1>",
        f"<p><code>{html.escape(command)}</code></p>",
        f"<p>{html.escape(json.dumps(settings))}</p>",
    ]
    for task in dict.fromkeys(r.task for r in rows):
        mine = [r for r in rows if r.task == task and r.side == "overnight"]
        series = {
            "held-out, sampled": [(r.night, r.sampled) for r in mine],
            "held-out, greedy": [(r.night, r.greedy) for r in mine],
        }
        trained = [(r.night, r.train_reward) for r in mine if r.train_reward is not None]
        if trained:
            series["the day's traffic"] = trained
        parts += [f"<h2>{html.escape(task)}</h2>",
                  line_chart(f"{task}: score by night", series, "nights")]  # fmt: skip
        head = ["night", "sampled", "greedy", "traffic", "verdict", "gate diff",
                "forgetting", "served by"]  # fmt: skip
        parts.append("<table><tr>" + "".join(f"<th>{h}</th>" for h in head) + "</tr>")
        for r in mine:
            cells = [str(r.night), f"{r.sampled:.3f}", f"{r.greedy:.3f}", _num(r.train_reward),
                     r.verdict, _num(r.gate_diff, "+.3f"), _num(r.forgetting, "+.3f"), r.served]  # fmt: skip
            parts.append("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in cells) + "</tr>")
        parts.append("</table>")
        gates = [f"night {r.night}: {r.gate_line}" for r in mine if r.night]
        if gates:
            parts.append(f"<pre>{html.escape(chr(10).join(gates))}</pre>")
        parts += peer_charts(task, rows)
    return "\n".join(parts)


# -- the run -----------------------------------------------------------------------------


def index_specs(task: str, args) -> list[dict]:
    """The datasets the agent asks for `task` (the reward function's index): each day's and
    the held-out one."""
    difficulty = CANDIDATES[task]
    days = [{"task": task, "difficulty": difficulty, "seed": args.day_seed + d, "size": args.size}
            for d in range(1, args.nights + 1)]  # fmt: skip
    held = {"task": task, "difficulty": difficulty, "size": args.held_out,
            "seed": args.held_out_seed + HELD_OUT_SEED}  # fmt: skip
    return [held, *days]


def difficulty_args(task: str) -> list[str]:
    return [f"{k}={json.dumps(list(v) if isinstance(v, tuple) else v)}"
            for k, v in CANDIDATES[task].items()]  # fmt: skip


def run_agent(env: dict, task: str, summary: Path, *args: str) -> dict:
    """The task's agent as a user runs it (examples/reasoning_gym_agent.py, or for a game
    examples/game_agent.py with its settings, a board where a question is: --size boards);
    its --summary-json."""
    if task in GAMES:
        settings = [f"--setting={k}={json.dumps(v)}" for k, v in GAMES[task].items()]
        args = tuple("--games" if a == "--size" else a for a in args)
        command = [sys.executable, str(GAME_AGENT), "--env", task, "--model", "policy",
                   "--max-turns", str(GAME_MOVES), "--summary-json", str(summary), *settings,
                   *args]  # fmt: skip
    else:
        options = difficulty_args(task)
        command = [sys.executable, str(AGENT), "--task", task, "--model", "policy",
                   "--summary-json", str(summary), *args]  # fmt: skip
        command += ["--difficulty", *options] if options else []
    subprocess.run(command, env=env, check=True, stdout=subprocess.DEVNULL)
    return json.loads(summary.read_text())


class Progress:
    """Progress lines with the time spent and an ETA from the mean step so far."""

    def __init__(self, steps: int) -> None:
        self.steps, self.done, self.started = steps, 0, time.monotonic()

    def step(self, what: str) -> None:
        self.done += 1
        spent = time.monotonic() - self.started
        eta = spent / self.done * (self.steps - self.done)
        print(f"[{self.done}/{self.steps}] {what} ({spent:.0f} s spent, ETA {eta:.0f} s)",
              flush=True)  # fmt: skip


def served_by(data: Path, tag: str) -> str:
    """What answered the held-out groups tagged `tag`."""
    from overnight.storage import query_rows

    rows = query_rows(data, "SELECT string_agg(DISTINCT models_served, ',') AS served "
                          f"FROM rollouts WHERE group_id LIKE 'heldout-%-{tag}-%'")  # fmt: skip
    return (rows[0]["served"] if rows else None) or "-"


def evaluate(env: dict, task: str, out: Path, night: int | str, args) -> Row:
    """The held-out score now: greedy once, then sampled --held-out-samples times."""
    tag = f"n{night}{uuid.uuid4().hex[:4]}"
    common = ["--held-out", "--seed", str(args.held_out_seed), "--size", str(args.held_out)]
    greedy = run_agent(env, task, out / f"heldout-greedy-{night}.json", *common,
                       "--temperature", "0", "--group-size", "1", "--run", tag)  # fmt: skip
    sampled = run_agent(env, task, out / f"heldout-sampled-{night}.json", *common,
                        "--temperature", str(args.temperature),
                        "--group-size", str(args.held_out_samples), "--run", tag)  # fmt: skip
    return Row(task, 0, sampled["mean_score"], greedy["mean_score"],
               served=served_by(out / "data", tag))  # fmt: skip


def night(env: dict, task: str, out: Path, url: str, d: int, args, say) -> tuple[dict, str]:
    """Day d's traffic, then night d; the agent's summary of the day and the gate's line."""
    day = run_agent(env, task, out / f"day-{d}.json", "--seed", str(args.day_seed + d),
                    "--size", str(args.size), "--group-size", str(args.group_size),
                    "--temperature", str(args.temperature), "--run", f"d{d}")  # fmt: skip
    say(f"{task} day {d}: {day['attempts']} attempts, mean reward {day['mean_score']:.3f}")
    from overnight.testing.processes import run_overnight

    def progress(line: str) -> None:
        if line.startswith(("step ", "gate (", "nothing to train", "memory:")):
            say(f"{task} night {d}: {line[:300]}")

    # A game's move has no verifier of its own (its reward is the whole game's): its nights
    # are gated on forgetting alone ("not gated: no scorer", then the reference set).
    gate = [] if task in GAMES else ["--gate-reward", REWARD, "--gate-prompts", str(args.held_out)]
    output = run_overnight(
        "train", "--data", str(out / "data"), "--proxy", url, "--preset", "smollm2-cpu",
        "--settle", "0", "--no-watch", "--reward-source", "agent", *gate, *args.train_arg,
        show=progress,
    )  # fmt: skip
    (out / f"night-{d}.log").write_text(output)
    gate = next((line for line in output.splitlines() if line.startswith("gate (")), "-")
    return day, gate


def share_references(source: Path, target: Path) -> None:
    """The forgetting measure's cached base-model figures from `source` to `target`, each
    file where it holds more than the target's copy (the caches only grow)."""
    if not source.is_dir():
        return
    target.mkdir(parents=True, exist_ok=True)
    for path in source.glob("*.json"):
        there = target / path.name
        if not there.exists() or len(json.loads(path.read_text())) > len(
            json.loads(there.read_text())
        ):
            shutil.copyfile(path, there)


def run_task(task: str, model_dir: str, out: Path, args, progress: Progress) -> list[Row]:
    """One task's nights on a fresh proxy and data folder: its rows."""
    from overnight.testing.processes import serve_local_model

    out.mkdir(parents=True, exist_ok=True)
    # The peer first, alone on the machine: its wall time is its own (vLLM not yet started).
    peer = train_peer(task, model_dir, out, args, progress) if args.peer else None
    if task not in GAMES:  # the gate's verifier finds each question through it
        index = out / "index.json"
        index.write_text(json.dumps(index_specs(task, args), indent=1))
        os.environ["REASONING_GYM_INDEX"] = str(index)  # the gate's, in `overnight train`
    share_references(REFERENCES, out / "data" / "references")
    print(f"{task}: starting vLLM (CPU) and the proxy on {out / 'data'}", flush=True)
    server = serve_local_model(out / "data", model_dir, "smollm2", "--max-lora-rank", "8",
                               f"--vllm-arg=--max-model-len={args.max_model_len}")  # fmt: skip
    env = dict(os.environ, OPENAI_BASE_URL=f"{server.url}/v1", OPENAI_API_KEY="unused")
    rows: list[Row] = []
    try:
        t0 = time.monotonic()
        rows.append(evaluate(env, task, out, 0, args))
        rows[-1].seconds = time.monotonic() - t0
        progress.step(f"{task} untrained: held-out sampled {rows[-1].sampled:.3f}, "
                      f"greedy {rows[-1].greedy:.3f}")  # fmt: skip
        completions, wall = 0, 0.0
        for d in range(1, args.nights + 1):
            t0 = time.monotonic()
            day, gate = night(env, task, out, server.url, d, args,
                              lambda line: print(line, flush=True))  # fmt: skip
            completions, wall = completions + day["attempts"], wall + time.monotonic() - t0
            row = evaluate(env, task, out, d, args)
            row.night, row.train_reward, row.gate_line = d, day["mean_score"], gate
            row.verdict, row.gate_diff, row.forgetting = parse_gate(gate)
            row.seconds, row.completions, row.wall = time.monotonic() - t0, completions, wall
            rows.append(row)
            progress.step(f"{task} night {d}: {row.verdict}; held-out sampled {row.sampled:.3f}"
                          f", greedy {row.greedy:.3f}, served by {row.served}")  # fmt: skip
        if peer is not None:
            try:
                rows += measure_peer(env, task, out, args, rows[0], peer, progress)
            except RuntimeError as e:  # ours are kept
                print(f"{task}: measuring TRL's adapters failed: {e}", flush=True)
    finally:
        server.stop()
        share_references(out / "data" / "references", REFERENCES)
    return rows


def train_peer(task: str, model_dir: str, out: Path, args, progress: Progress) -> dict | None:
    """TRL's side of the task (bench/learning_trl.py, a child process); None if it failed
    (said, and ours goes on)."""
    from bench.learning_trl import run_peer, spec_for

    # The difficulty as the agent reads its --difficulty (JSON: tuples become lists).
    difficulty = json.loads(json.dumps(CANDIDATES[task]))
    spec = spec_for(task, difficulty, model_dir, out / "trl", args)
    print(f"{task}: TRL's GRPOTrainer, {spec['budget']}", flush=True)
    try:
        result = run_peer(spec, lambda line: print(f"{task} {line}", flush=True))
    except RuntimeError as e:
        print(f"{task}: TRL's side failed; ours goes on. {e}", flush=True)
        return None
    progress.step(f"{task} TRL: {result['completions']} completions sampled and trained in "
                  f"{result['seconds']:.0f} s")  # fmt: skip
    return result


def measure_peer(env: dict, task: str, out: Path, args, base: Row, peer: dict,
                 progress: Progress) -> list[Row]:  # fmt: skip
    """The held-out score of each of TRL's adapters, as ours: promoted on the same proxy
    (`overnight promote`), then the agent's --held-out runs. Its untrained row is ours (the
    same base model, the same questions)."""
    from overnight.testing.processes import run_overnight

    rows = [replace(base, side="trl", seconds=0.0)]
    for n in peer["nights"]:
        t0 = time.monotonic()
        run_overnight("promote", n["adapter"], "--data", str(out / "data"),
                      "--reason", f"TRL GRPOTrainer, night {n['night']}'s worth")  # fmt: skip
        row = evaluate(env, task, out, f"trl{n['night']}", args)
        row.night, row.side, row.train_reward = n["night"], "trl", n["train_reward"]
        row.completions, row.wall = n["completions"], n["seconds"]
        row.seconds = time.monotonic() - t0
        rows.append(row)
        progress.step(f"{task} TRL night {n['night']}: held-out sampled {row.sampled:.3f}, "
                      f"greedy {row.greedy:.3f}, served by {row.served}")  # fmt: skip
    return rows


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tasks", nargs="*", default=DEFAULT_TASKS,
                        help="reasoning-gym tasks with a difficulty in task_headroom.CANDIDATES, "
                        "TextArena games with settings in game_headroom.CANDIDATES")  # fmt: skip
    parser.add_argument("--nights", type=int, default=2)
    parser.add_argument("--size", type=int, default=16, help="questions a day (groups)")
    parser.add_argument("--group-size", type=int, default=4, help="attempts per question")
    parser.add_argument("--temperature", type=float, default=1.0, help="the traffic's")
    parser.add_argument("--held-out", type=int, default=16, help="held-out questions")
    parser.add_argument("--held-out-samples", type=int, default=4,
                        help="sampled answers per held-out question")  # fmt: skip
    parser.add_argument("--held-out-seed", type=int, default=0,
                        help="the agent's --seed with --held-out (it adds HELD_OUT_SEED)")  # fmt: skip
    parser.add_argument("--day-seed", type=int, default=100,
                        help="day d asks the questions of seed DAY_SEED + d")  # fmt: skip
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--train-arg", action="append", default=[],
                        help="one more `overnight train` argument (repeatable)")  # fmt: skip
    parser.add_argument("--peer", choices=PEERS,
                        help="also TRL's online GRPOTrainer on the same prompts and budget "
                        "(bench/learning_trl.py), its adapters measured as ours")  # fmt: skip
    parser.add_argument("--model-dir", help="a prepared SmolLM2 (default: prepared now)")
    parser.add_argument("--out", type=Path, help="default .cache/bench/learning/<UTC time>/")
    args = parser.parse_args(argv)
    unknown = [t for t in args.tasks if t not in CANDIDATES and t not in GAMES]
    if unknown:
        parser.error(f"no difficulty for {unknown}: add them to bench/task_headroom.CANDIDATES "
                     "(a reasoning-gym task) or bench/game_headroom.CANDIDATES (a game)")  # fmt: skip
    if args.peer and any(t in GAMES for t in args.tasks):
        parser.error("--peer: TRL's side asks single questions; a game is many turns")
    return args


def main(argv: list[str] | None = None) -> list[Row]:
    args = parse_args(argv)
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    out = args.out or ROOT / ".cache" / "bench" / "learning" / stamp
    # Some tasks' questions depend on Python's string hashing (ransom_note and
    # isomorphic_strings iterate over sets of letters): without a fixed hash seed each agent
    # run asks other questions than the index says, and than the run before it. Every
    # process this bench starts (the agent, overnight train and its gate) gets the same one.
    os.environ["PYTHONHASHSEED"] = "0"
    # A SIGTERM stops the servers it started too (the `finally`s), not only this process.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    from overnight.models.smollm2 import prepare_smollm2

    model_dir = args.model_dir or prepare_smollm2(ROOT / ".cache" / "smollm2-135m-instruct")
    # Per task: the untrained score and each night, and with a peer its training and nights.
    progress = Progress(len(args.tasks) * (args.nights + 1) * (2 if args.peer else 1))
    command = "python bench/learning.py " + " ".join(argv if argv is not None else sys.argv[1:])
    settings = {k: v for k, v in vars(args).items() if k not in ("out", "model_dir")}
    rows: list[Row] = []
    for task in args.tasks:
        rows += run_task(task, str(model_dir), out / task, args, progress)
        (out / "results.json").write_text(json.dumps(
            {"command": command, "settings": settings, "rows": [asdict(r) for r in rows]},
            indent=1))  # fmt: skip
        (out / "report.html").write_text(page(rows, command, settings))
    print("\n" + table(rows))
    if any(r.side != "overnight" for r in rows):
        print("\nside by side, at the same completions sampled:\n" + side_by_side(rows))
    for r in rows:
        if r.night:
            print(f"{r.task} night {r.night} {r.gate_line}")
    print(f"\nresults: {out / 'results.json'}; the page: {out / 'report.html'}")
    return rows


if __name__ == "__main__":
    main()
