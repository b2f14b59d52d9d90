"""Small kafka-python helper used by deploy/local/stack.sh.

    python kafka_ctl.py wait   --bootstrap HOST:PORT --timeout SECONDS [--brokers N]
    python kafka_ctl.py topics --bootstrap HOST:PORT [--replication-factor R]
                               NAME:PARTITIONS [NAME:PARTITIONS ...]
    python kafka_ctl.py list   --bootstrap HOST:PORT

`wait` returns 0 once the broker answers a metadata request listing at least
`--brokers` brokers (default 1; the cluster mode of stack.sh waits for all 3) and
reports its cluster id, 1 on timeout. `topics` creates the topics that do not exist
yet (idempotent, replication factor `--replication-factor`, default 1) and waits
until every partition has a leader; it warns (and does not alter) a topic that
exists with a different partition count.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import sys
import time


def _admin(bootstrap: str, timeout_s: float):  # type: ignore[no-untyped-def]
    from kafka import KafkaAdminClient

    return KafkaAdminClient(
        bootstrap_servers=bootstrap,
        client_id="qbatch-stack",
        request_timeout_ms=int(max(timeout_s, 2) * 1000),
        bootstrap_timeout_ms=int(max(timeout_s, 2) * 1000),
    )


def cmd_wait(bootstrap: str, timeout_s: float, min_brokers: int = 1) -> int:
    deadline = time.monotonic() + timeout_s
    last: Exception | None = None
    while time.monotonic() < deadline:
        try:
            admin = _admin(bootstrap, min(5.0, max(deadline - time.monotonic(), 1.0)))
            try:
                cluster = admin.describe_cluster()
                admin.list_topics()
            finally:
                admin.close()
            brokers = cluster.get("brokers") or []
            if brokers and len(brokers) >= min_brokers:
                print(f"kafka: cluster {cluster.get('cluster_id')} brokers={len(brokers)}")
                return 0
            last = RuntimeError(f"{len(brokers)} of {min_brokers} brokers in the metadata")
        except Exception as exc:  # broker not up yet
            last = exc
        time.sleep(0.5)
    print(
        f"kafka: no metadata answer from {bootstrap} in {timeout_s:.0f}s: {last!r}", file=sys.stderr
    )
    return 1


def cmd_topics(
    bootstrap: str, specs: list[str], timeout_s: float, replication_factor: int = 1
) -> int:
    from kafka.errors import TopicAlreadyExistsError

    wanted: dict[str, int] = {}
    for spec in specs:
        name, _, parts = spec.partition(":")
        wanted[name] = int(parts or "1")
    admin = _admin(bootstrap, timeout_s)
    try:
        existing = set(admin.list_topics())
        missing = {n: p for n, p in wanted.items() if n not in existing}
        if missing:
            with contextlib.suppress(TopicAlreadyExistsError):  # raced with another creator
                admin.create_topics(
                    {
                        n: {"num_partitions": p, "replication_factor": replication_factor}
                        for n, p in missing.items()
                    },
                    timeout_ms=int(timeout_s * 1000),
                )
        admin.wait_for_topics(list(wanted), timeout_ms=int(timeout_s * 1000))
        for info in admin.describe_topics(list(wanted)):
            name = info.get("name") or info["topic"]
            have = len(info["partitions"])
            state = "created" if name in missing else "exists"
            rf = min((len(p.get("replica_nodes") or ()) for p in info["partitions"]), default=0)
            print(f"kafka: topic {name} partitions={have} replication={rf} ({state})")
            if have != wanted[name]:
                print(
                    f"kafka: WARNING topic {name} has {have} partitions, wanted {wanted[name]} "
                    "(not altered; `stack.sh reset` recreates everything)",
                    file=sys.stderr,
                )
        return 0
    finally:
        admin.close()


def cmd_list(bootstrap: str, timeout_s: float) -> int:
    admin = _admin(bootstrap, timeout_s)
    try:
        for name in sorted(admin.list_topics()):
            print(name)
    finally:
        admin.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.CRITICAL)  # kafka-python is chatty while the broker boots
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("command", choices=["wait", "topics", "list"])
    ap.add_argument("specs", nargs="*")
    ap.add_argument("--bootstrap", required=True)
    ap.add_argument("--timeout", type=float, default=30.0)
    ap.add_argument("--brokers", type=int, default=1, help="wait: brokers the metadata must list")
    ap.add_argument("--replication-factor", type=int, default=1, help="topics: for new topics")
    args = ap.parse_intermixed_args(argv)
    if args.command == "wait":
        return cmd_wait(args.bootstrap, args.timeout, args.brokers)
    if args.command == "topics":
        return cmd_topics(args.bootstrap, args.specs, args.timeout, args.replication_factor)
    return cmd_list(args.bootstrap, args.timeout)


if __name__ == "__main__":
    sys.exit(main())
