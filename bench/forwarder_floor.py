"""How much of a proxy's overhead is aiohttp's client: two do-nothing forwarders, side
by side in one run, against the same fake vLLM (its own process, core 1, with wrk).

- bare-aiohttp: aiohttp server + aiohttp client (bench/bare_forwarder.py)
- raw-client:   aiohttp server + the proxy's own client, proxy/forward/upstream.py (bench/raw_client_forwarder.py)

Both pinned to core 0, as in bench/proxy_overhead.py, at concurrency 1 (added p50) and
at concurrency 16 with a 20 ms upstream (throughput vs direct): the two targets of the
capture issue that overnight does not meet.

    python bench/forwarder_floor.py --repeats 2
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import proxy_overhead as po  # noqa: E402

from overnight.proxy.launch.launcher import free_port  # noqa: E402

FORWARDERS = {
    "bare-aiohttp": ROOT / "bench" / "bare_forwarder.py",
    "raw-client": ROOT / "bench" / "raw_client_forwarder.py",
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--duration", type=float, default=4.0)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp())
    body = {"model": "policy", "messages": po.MESSAGES, "max_tokens": 12}
    for delay, connections in ((0.0, 1), (0.02, 16)):
        fport = free_port()
        fake = po.start(
            po.pinned(1, [sys.executable, "-m", "overnight.testing.fake_upstream"])
            + ["--port", str(fport), "--delay", str(delay)],
            f"http://127.0.0.1:{fport}/health",
        )
        running = {}
        try:
            for name, script in FORWARDERS.items():
                port = free_port()
                cmd = [sys.executable, str(script), "--port", str(port)]
                cmd += ["--upstream", f"http://127.0.0.1:{fport}"]
                running[name] = (
                    po.start(po.pinned(0, cmd), f"http://127.0.0.1:{port}/health"),
                    port,
                )
            for _ in range(args.repeats):
                url = f"http://127.0.0.1:{fport}/v1/chat/completions"
                direct = po.wrk(url, body, connections, args.duration, work)
                print(
                    f"c{connections} delay {delay * 1000:.0f} ms  direct        "
                    f"{direct.rps:7.0f} req/s  p50 {direct.p50_ms:7.3f} ms",
                    flush=True,
                )
                for name, (_, port) in running.items():
                    url = f"http://127.0.0.1:{port}/v1/chat/completions"
                    r = po.wrk(url, body, connections, args.duration, work)
                    print(
                        f"c{connections} delay {delay * 1000:.0f} ms  {name:<13} {r.rps:7.0f} req/s  "
                        f"p50 {r.p50_ms:7.3f} ms  added p50 {r.p50_ms - direct.p50_ms:6.3f} ms  "
                        f"vs direct {r.rps / direct.rps:.3f}",
                        flush=True,
                    )
        finally:
            for proc, _ in running.values():
                po.stop(proc)
            po.stop(fake)


if __name__ == "__main__":
    main()
