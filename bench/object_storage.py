"""Read paths with the segments in a bucket beside the same history on local disk.

The history is bench/history_scale.py's (production-shaped, the default 5-minute roll,
closed days merged as the writer leaves them); here it is also uploaded to an S3 server
and read through `--data s3://...` (a local directory attached to the URL: no live
logs), side by side with the local directory, each path in a fresh process. The first
read from the bucket fetches the segments into the local directory's copies; it is
shown apart, and the paths after it read the copies (plus a listing of the bucket).

The S3 server is moto's (`ThreadedMotoServer`, in this process, on loopback): it stands
in for the API, not for S3's latency (a real bucket adds ~10-30 ms a request), so the
ratio says how much the requests themselves cost us (listing, footers, column chunks
through fsspec) rather than what a given cloud would.

    python bench/object_storage.py --sizes 10000 100000
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.history_scale import PATHS, generate, measure, merge, stamp_runs  # noqa: E402

BUCKET = "overnight-bench"
MEASURED = ("count_groups", "ls", "plan", "plan_since_yesterday", "ui")


def start_s3() -> object:
    """moto's S3 server on a free loopback port; the AWS variables point every
    measured process at it."""
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    port = server.get_host_and_port()[1]
    os.environ.update(
        AWS_ACCESS_KEY_ID="bench",
        AWS_SECRET_ACCESS_KEY="bench",
        AWS_DEFAULT_REGION="us-east-1",
        AWS_ENDPOINT_URL=f"http://127.0.0.1:{port}",
    )
    import boto3

    boto3.client("s3").create_bucket(Bucket=BUCKET)
    return server


def upload(data: Path, url: str, local: Path) -> int:
    """The tables' segments and manifests of `data` into the bucket at `url`, and
    `local` attached to it; the objects uploaded."""
    import fsspec

    from overnight.storage import attach

    fs = fsspec.filesystem("s3")
    root = url.removeprefix("s3://")
    files = [p for p in data.glob("*/date=*/*.parquet")] + list(data.glob("*/_merged.json"))
    for p in files:
        fs.put_file(str(p), f"{root}/{p.relative_to(data)}")
    attach(url, local)
    return len(files)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[10_000, 100_000])
    parser.add_argument("--work", type=Path, default=Path("/tmp/overnight-object-storage"))
    parser.add_argument("--paths", nargs="+", choices=MEASURED, default=list(MEASURED))
    args = parser.parse_args()
    server = start_s3()
    try:
        for size in args.sizes:
            data = args.work / str(size)
            t = time.perf_counter()
            generate(data, size)
            stamp_runs(data)
            merge(data)
            url, local = f"s3://{BUCKET}/h{size}", args.work / f"{size}-local"
            n = upload(data, url, local)
            print(f"{size} rows: {n} objects, ready in {time.perf_counter() - t:.0f} s")
            # The first read fetches every segment it needs; the paths below find copies.
            print(f"  count_groups, first read: bucket {measure('count_groups', local, None)}")
            for path in args.paths:
                on_disk, in_bucket = measure(path, data, None), measure(path, local, None)
                ratio = ""
                if "seconds" in on_disk and "seconds" in in_bucket:
                    ratio = f"  bucket/disk {in_bucket['seconds'] / on_disk['seconds']:.1f}x"
                print(f"  {path}: disk {on_disk}\n  {' ' * len(path)}  bucket {in_bucket}{ratio}")
    finally:
        server.stop()


if __name__ == "__main__":
    assert set(MEASURED) <= set(PATHS)
    main()
