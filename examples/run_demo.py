"""The end-to-end demo on embedded defaults (what `make demo` runs).

Builds the tiny local model, starts `overnight serve --model` (vLLM on CPU behind
the proxy), runs the example agent through it, prints `overnight ls`, and stops the
server cleanly. Later issues extend this with the nightly judge and training.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from overnight.proxy.launcher import wait_healthy

ROOT = Path(__file__).resolve().parent.parent


def say(message: str) -> None:
    print(f"[demo {time.strftime('%H:%M:%S')}] {message}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", default="overnight-data", help="data directory")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--model-dir", default=str(ROOT / ".cache" / "tiny-model"))
    parser.add_argument("--tasks", type=int, default=4)
    parser.add_argument("--group-size", type=int, default=4)
    args = parser.parse_args()

    started = time.monotonic()
    say(f"building the tiny model in {args.model_dir} (reused when present)")
    subprocess.run(
        [sys.executable, "-m", "overnight.cli", "tiny-model", args.model_dir], check=True
    )

    say("starting vLLM (CPU) and the proxy; vLLM's log goes to the data directory")
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE=os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"))
    serve = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "overnight.cli",
            "serve",
            "--model",
            args.model_dir,
            "--port",
            str(args.port),
            "--data",
            args.data,
            "--vllm-arg=--dtype=float32",
            "--vllm-arg=--max-model-len=2048",
            "--max-lora-rank",
            "8",
            "--served-model-name",
            "tiny",
        ],
        env=env,
    )
    base = f"http://127.0.0.1:{args.port}"
    try:
        if not wait_healthy(base + "/health", 900, serve):
            raise SystemExit("overnight serve did not become healthy in 900 s")
        say(f"proxy ready at {base}/v1 after {time.monotonic() - started:.0f} s")

        say(f"running the example agent: {args.tasks} tasks x {args.group_size} attempts")
        agent_env = dict(os.environ, OPENAI_BASE_URL=base + "/v1", OPENAI_API_KEY="unused")
        subprocess.run(
            [
                sys.executable,
                str(ROOT / "examples" / "tool_agent.py"),
                "--tasks",
                str(args.tasks),
                "--group-size",
                str(args.group_size),
            ],
            env=agent_env,
            check=True,
        )
    finally:
        say("stopping the server (it commits and compacts its log first)")
        serve.send_signal(signal.SIGTERM)
        serve.wait(timeout=120)

    say("what was captured (`overnight ls`):")
    subprocess.run(
        [sys.executable, "-m", "overnight.cli", "ls", "--data", args.data, "--limit", "3"],
        check=True,
    )
    say(
        f"done in {time.monotonic() - started:.0f} s. Next: overnight show ROLLOUT_ID --data {args.data}; "
        f'overnight sql "SELECT * FROM groups" --data {args.data}'
    )


if __name__ == "__main__":
    main()
