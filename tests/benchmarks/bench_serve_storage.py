"""What `qbatch serve`'s storage index costs per request, as a tenant's file count grows:
a listing's first page, the storage quota's count (`FileStore.usage`, run twice per
upload when a quota is set), and that count's first call on a store just upgraded
from a release before size entries (it reads at most MEND_PER_COUNT files' metadata). Both backends: the local
directory, and S3 on moto's server on a loopback port (an S3 stand-in: real AWS adds
tens of ms per request, which is what the request counts are printed for).

    .venv/bin/python tests/benchmarks/bench_serve_storage.py --files 10000 --s3-files 2000

No Kafka or Redis needed. Each size: the tenant's files are stored once, beside
`--others` files of another tenant, then each operation is timed `--repeat` times
(median). Prints a table and a JSON line (`--json-out FILE`: also there).
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve()
sys.path.insert(0, str(HERE.parents[2]))

from producer.serve.file_index import SizeEntry, size_key  # noqa: E402
from producer.serve.storage import MEND_PER_COUNT, FileStore  # noqa: E402
from producer.serve.storage_url import open_storage  # noqa: E402
from tests.s3_fixtures import BUCKET, CREDENTIALS, moto_s3  # noqa: E402

LINE = b'{"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": {}}\n'


class Counted:
    """Counts a store's backend calls (what each is on S3: a LIST page, a GET, a PUT)."""

    def __init__(self, storage: FileStore) -> None:
        self.calls: Counter[str] = Counter()
        for name in ("_marks", "_read_meta", "_mark", "_unmark"):
            setattr(storage, name, self._wrap(name, getattr(storage, name)))

    def _wrap(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        if name == "_marks":

            def marks(folder: str) -> Iterator[str]:
                self.calls["walks"] += 1  # a folder; on S3 one LIST per 1,000 names
                yield from fn(folder)

            return marks

        def call(*args: Any) -> Any:
            self.calls[name.strip("_")] += 1
            return fn(*args)

        return call


def fill(storage: FileStore, tenant: str, n: int) -> list[Any]:
    stored = []
    for _ in range(n):
        src = storage.tmp / "bench.jsonl"
        src.write_bytes(LINE)
        stored.append(storage.put(src, tenant=tenant, filename="in.jsonl", purpose="batch"))
    return stored


def median_ms(repeat: int, fn: Callable[[], Any]) -> float:
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return round(statistics.median(times) * 1000, 2)


def measure(storage: FileStore, n: int, others: int, repeat: int) -> dict[str, Any]:
    t = time.perf_counter()
    files = fill(storage, "bench", n)
    fill(storage, "other", others)
    store_s = time.perf_counter() - t
    counted = Counted(storage)
    row: dict[str, Any] = {"files": n, "store_s_per_1000": round(store_s / (n + others) * 1000, 2)}
    row["list_page_ms"] = median_ms(repeat, lambda: storage.list("bench", limit=20))
    row["list_page_calls"] = {k: v // repeat for k, v in counted.calls.items()}
    assert storage.usage("bench") == n * len(LINE)
    counted.calls.clear()
    row["usage_ms"] = median_ms(repeat, lambda: storage.usage("bench"))
    row["usage_calls"] = {k: v // repeat for k, v in counted.calls.items()}
    for f in files:  # a store written before size entries
        storage._unmark(size_key("bench", SizeEntry(f.id, f.bytes)))
    counted.calls.clear()
    t = time.perf_counter()
    assert storage.usage("bench") == min(n, MEND_PER_COUNT) * len(LINE)  # the rest: later
    row["first_usage_after_upgrade_ms"] = round((time.perf_counter() - t) * 1000, 1)
    row["first_usage_calls"] = dict(counted.calls)
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--files", type=int, nargs="+", default=[1000, 10000])
    ap.add_argument("--s3-files", type=int, nargs="*", default=[1000])
    ap.add_argument("--others", type=int, default=500)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--json-out", type=Path)
    args = ap.parse_args()
    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # moto's server: one line a request
    rows = []
    with ExitStack() as stack:
        for n in args.files:
            root = Path(stack.enter_context(tempfile.TemporaryDirectory()))
            rows.append(
                {
                    "backend": "local",
                    **measure(open_storage(str(root)), n, args.others, args.repeat),
                }
            )
        if args.s3_files:
            import os

            os.environ.update(CREDENTIALS)
            endpoint = stack.enter_context(moto_s3())
            for n in args.s3_files:
                url = f"s3://{BUCKET}/bench-{n}/"
                store = open_storage(url, s3_endpoint_url=endpoint)
                rows.append({"backend": "s3 (moto)", **measure(store, n, args.others, args.repeat)})
    print(
        f"{'backend':10} {'files':>7} {'list page ms':>13} {'usage ms':>9} {'usage calls':>22} "
        f"{'1st after upgrade ms':>21}"
    )
    for r in rows:
        print(
            f"{r['backend']:10} {r['files']:>7} {r['list_page_ms']:>13} {r['usage_ms']:>9} "
            f"{json.dumps(r['usage_calls']):>22} {r['first_usage_after_upgrade_ms']:>21}"
        )
    line = json.dumps({"bench": "serve_storage", "others": args.others, "rows": rows})
    print(line)
    if args.json_out:
        args.json_out.write_text(line + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
