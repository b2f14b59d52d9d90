"""What `qbatch serve`'s file storage costs per request, as a tenant's file count grows: a
listing's first page (20 files) and the storage quota's count (`FileStore.usage`, run
twice per upload when a quota is set). Records live in Redis (`--redis-url`, default
`QBATCH_REDIS_URL`), bytes in a local directory and in S3 on moto's server on a loopback
port (an S3 stand-in: real AWS adds tens of ms per request, which is what the request
counts are printed for).

    .venv/bin/python tests/benchmarks/bench_serve_storage.py --files 10000 --s3-files 10000

Each size: the tenant's files are stored once, beside `--others` files of another
tenant, then each operation is timed `--repeat` times (median). Prints a table and a
JSON line (`--json-out FILE`: also there). `--redis fake` runs on fakeredis (the smoke
test's mode; its times say nothing).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve()
sys.path.insert(0, str(HERE.parents[2]))

from producer.serve.lease import Lease, LeaseKeeper  # noqa: E402
from producer.serve.storage import FileStore  # noqa: E402
from producer.serve.storage_url import open_storage  # noqa: E402
from schemas.keys import RedisKeys  # noqa: E402
from tests.s3_fixtures import BUCKET, CREDENTIALS, moto_s3  # noqa: E402

LINE = b'{"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": {}}\n'


class CountedRedis:
    """A Redis client that counts round trips (a pipeline's `execute` is one)."""

    def __init__(self, client: Any, calls: Counter[str]) -> None:
        self._client = client
        self._calls = calls

    def pipeline(self, *args: Any, **kwargs: Any) -> Any:
        pipe = self._client.pipeline(*args, **kwargs)
        real = pipe.execute

        def execute(*a: Any, **kw: Any) -> Any:
            self._calls["redis"] += 1
            return real(*a, **kw)

        pipe.execute = execute
        return pipe

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._client, name)
        if not callable(attr):
            return attr

        def call(*args: Any, **kwargs: Any) -> Any:
            self._calls["redis"] += 1
            return attr(*args, **kwargs)

        return call


def counted(storage: FileStore) -> Counter[str]:
    """Count the store's Redis round trips and object-store requests from now on."""
    calls: Counter[str] = Counter()
    storage.records.redis = CountedRedis(storage.records.redis, calls)
    objects = storage.objects
    for name in ("get", "listing", "put", "delete"):
        real = getattr(objects, name)

        def call(*args: Any, _real: Any = real, _name: str = name, **kwargs: Any) -> Any:
            calls[f"objects.{_name}"] += 1
            return _real(*args, **kwargs)

        setattr(objects, name, call)
    return calls


def fill(storage: FileStore, tenant: str, n: int) -> None:
    for _ in range(n):
        src = storage.tmp / "bench.jsonl"
        src.write_bytes(LINE)
        storage.put(src, tenant=tenant, filename="in.jsonl", purpose="batch")


def median_ms(repeat: int, fn: Callable[[], Any]) -> float:
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return round(statistics.median(times) * 1000, 2)


def measure(storage: FileStore, n: int, others: int, repeat: int) -> dict[str, Any]:
    t = time.perf_counter()
    fill(storage, "bench", n)
    fill(storage, "other", others)
    store_s = time.perf_counter() - t
    calls = counted(storage)
    row: dict[str, Any] = {"files": n, "store_s_per_1000": round(store_s / (n + others) * 1000, 2)}
    row["list_page_ms"] = median_ms(repeat, lambda: storage.list("bench", limit=20))
    row["list_page_calls"] = {k: v // repeat for k, v in calls.items()}
    calls.clear()
    assert storage.usage("bench") == n * len(LINE)
    calls.clear()
    row["usage_ms"] = median_ms(repeat, lambda: storage.usage("bench"))
    row["usage_calls"] = {k: v // repeat for k, v in calls.items()}
    return row


def redis_client(which: str) -> Any:
    if which == "fake":
        import fakeredis

        return fakeredis.FakeRedis()
    import redis

    return redis.Redis.from_url(which)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--files", type=int, nargs="+", default=[1000, 10000])
    ap.add_argument("--s3-files", type=int, nargs="*", default=[1000])
    ap.add_argument("--others", type=int, default=500)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument(
        "--redis", default=os.environ.get("QBATCH_REDIS_URL", "redis://127.0.0.1:6379/0")
    )
    ap.add_argument("--json-out", type=Path)
    args = ap.parse_args()
    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # moto's server: one line a request
    client = redis_client(args.redis)
    prefixes: list[str] = []

    def lease() -> Lease:
        """A prefix's lease, renewed while the benchmark runs (filling takes minutes)."""
        prefixes.append(f"bench-storage-{uuid.uuid4().hex[:8]}")
        held = Lease.acquire(client, RedisKeys(prefixes[-1]), wait_s=0)
        keeper = LeaseKeeper(held, on_lost=lambda: None)
        keeper.start()
        stack.callback(keeper.stop)
        return held

    rows = []
    stack = ExitStack()
    with stack:
        for n in args.files:
            root = Path(stack.enter_context(tempfile.TemporaryDirectory()))
            store = open_storage(str(root), lease())
            rows.append({"backend": "local", **measure(store, n, args.others, args.repeat)})
        if args.s3_files:
            os.environ.update(CREDENTIALS)
            endpoint = stack.enter_context(moto_s3())
            for n in args.s3_files:
                url = f"s3://{BUCKET}/bench-{n}/"
                store = open_storage(url, lease(), s3_endpoint_url=endpoint)
                rows.append({"backend": "s3 (moto)", **measure(store, n, args.others, args.repeat)})
        for prefix in prefixes:
            for key in client.scan_iter(f"{prefix}:*", count=1000):
                client.delete(key)
    print(f"{'backend':10} {'files':>7} {'list page ms':>13} {'usage ms':>9} {'page calls':>40}")
    for r in rows:
        print(
            f"{r['backend']:10} {r['files']:>7} {r['list_page_ms']:>13} {r['usage_ms']:>9} "
            f"{json.dumps(r['list_page_calls']):>40}"
        )
    line = json.dumps({"bench": "serve_storage", "others": args.others, "rows": rows})
    print(line)
    if args.json_out:
        args.json_out.write_text(line + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
