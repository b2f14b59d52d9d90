"""A real S3-compatible server for tests: moto's server mode (`ThreadedMotoServer`) on a
free loopback port, with one bucket. Shared by the storage contract
(tests/unit/test_serve_storage.py) and the `qbatch serve --storage s3://` end-to-end test
(tests/integration/test_serve_s3.py)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import boto3

BUCKET = "qbatch-test"
CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
}
"""What a client of the server needs in its environment (moto accepts any keys)."""


def client(endpoint: str) -> Any:
    """A boto3 S3 client of the server, with the test credentials."""
    return boto3.client(
        "s3",
        endpoint_url=endpoint,
        region_name=CREDENTIALS["AWS_DEFAULT_REGION"],
        aws_access_key_id=CREDENTIALS["AWS_ACCESS_KEY_ID"],
        aws_secret_access_key=CREDENTIALS["AWS_SECRET_ACCESS_KEY"],
    )


@contextlib.contextmanager
def moto_s3(bucket: str = BUCKET) -> Iterator[str]:
    """Start the server, create `bucket`, yield the endpoint URL; stop it after."""
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        endpoint = f"http://{host}:{port}"
        client(endpoint).create_bucket(Bucket=bucket)
        yield endpoint
    finally:
        server.stop()


def object_keys(endpoint: str, bucket: str = BUCKET, prefix: str = "") -> list[str]:
    """Every object key under `prefix` (read with the test credentials)."""
    pages = client(endpoint).get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
    return sorted(obj["Key"] for page in pages for obj in page.get("Contents", []))
