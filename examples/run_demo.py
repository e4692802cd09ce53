"""The end-to-end demo on embedded defaults (what `make demo` runs).

Builds the tiny local model, starts `overnight serve --model` (vLLM on CPU behind the
proxy), and runs a few "days": each day the example agents run through the proxy
unchanged, and each "night" `overnight train` scores the day's groups with the
example reward function, trains the LoRA adapter with GRPO and promotes it. Prints
the mean reward of each day's traffic and the adapter that served it, then the
report's path and what to run next.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from overnight.tiny_model import serve_tiny

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"


def say(message: str) -> None:
    print(f"[demo {time.strftime('%H:%M:%S')}] {message}", flush=True)


def overnight(*args: str, capture: bool = False) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "overnight.cli", *args],
        check=True,
        text=True,
        capture_output=capture,
    )
    return done.stdout if capture else ""


def day_summary(data: str, tag: str) -> tuple[float, str]:
    query = (
        "SELECT avg(r.reward) AS reward, string_agg(DISTINCT c.model_served, ',') AS served "
        "FROM rewards r JOIN completions c USING (rollout_id) "
        f"WHERE r.source = 'function' AND c.group_id LIKE 'numbers-{tag}-%'"
    )
    row = json.loads(overnight("sql", query, "--data", data, "--format", "json", capture=True))
    return row["reward"], row["served"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", default="overnight-data", help="data directory")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--model-dir", default=str(ROOT / ".cache" / "tiny-model"))
    parser.add_argument("--days", type=int, default=4)
    args = parser.parse_args()

    started = time.monotonic()
    say(f"building the tiny model in {args.model_dir} (reused when present)")
    overnight("tiny-model", args.model_dir)
    say("starting vLLM (CPU) and the proxy; vLLM's log goes to the data directory")
    serve = serve_tiny(args.model_dir, args.data, args.port)
    base = f"http://127.0.0.1:{args.port}"
    say(f"proxy ready at {base}/v1 after {time.monotonic() - started:.0f} s")
    agent_env = dict(os.environ, OPENAI_BASE_URL=base + "/v1", OPENAI_API_KEY="unused")
    results = []
    try:
        for day in range(args.days):
            t_day = time.monotonic()
            tag = f"{int(time.time())}d{day}"
            # The verifiable agent (what is trained on) and the multi-turn tool agent.
            subprocess.run(
                [
                    sys.executable,
                    str(EXAMPLES / "number_agent.py"),
                    "--tasks",
                    "8",
                    "--group-size",
                    "8",
                    "--top-k",
                    "50",
                    "--run",
                    tag,
                ],
                env=agent_env,
                check=True,
                stdout=subprocess.DEVNULL,
            )
            subprocess.run(
                [
                    sys.executable,
                    str(EXAMPLES / "tool_agent.py"),
                    "--tasks",
                    "2",
                    "--group-size",
                    "4",
                ],
                env=agent_env,
                check=True,
                stdout=subprocess.DEVNULL,
            )
            t_traffic = time.monotonic() - t_day
            t_night = time.monotonic()
            if day < args.days - 1:
                say(
                    f"night {day + 1}: overnight train --reward examples/rewards.py:numbers_only --preset tiny-cpu"
                )
                overnight(
                    "train",
                    "--data",
                    args.data,
                    "--proxy",
                    base,
                    "--preset",
                    "tiny-cpu",
                    "--settle",
                    "0",
                    "--reward",
                    f"{EXAMPLES / 'rewards.py'}:numbers_only",
                    capture=True,
                )
            else:  # the last day is only scored, to see where the policy ended
                overnight(
                    "judge",
                    "--data",
                    args.data,
                    "--settle",
                    "0",
                    "--reward",
                    f"{EXAMPLES / 'rewards.py'}:numbers_only",
                    capture=True,
                )
            reward, served = day_summary(args.data, tag)
            results.append((day + 1, reward, served, t_traffic, time.monotonic() - t_night))
            say(
                f"day {day + 1}: mean reward {reward:.3f}, served by {served}; traffic {t_traffic:.0f} s, "
                f"night {time.monotonic() - t_night:.0f} s"
            )
    finally:
        say("stopping the server (it commits and compacts its log first)")
        serve.send_signal(signal.SIGTERM)
        serve.wait(timeout=120)

    print("\nday  mean reward  served by                  traffic  night")
    for day, reward, served, t_traffic, t_night in results:
        print(f"{day:>3}  {reward:11.3f}  {served:<25} {t_traffic:6.0f}s {t_night:5.0f}s")
    overnight("ls", "--data", args.data, "--limit", "2")
    report = Path(args.data) / "reports" / "training.html"
    say(f"done in {time.monotonic() - started:.0f} s. The training report: {report}")
    say(
        f"next: overnight runs --data {args.data}; overnight show ROLLOUT_ID --data {args.data}; "
        f'overnight sql "SELECT * FROM groups" --data {args.data}'
    )


if __name__ == "__main__":
    main()
