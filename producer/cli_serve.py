"""`qbatch serve`: the OpenAI-compatible HTTP front (`producer.serve`), as a command.

FastAPI and uvicorn are the `serve` extra: they are imported inside the command, so the
bare `pip install qbatch` keeps working and says what to install when they are missing.
Every option is also a `QBATCH_SERVE_*` variable; API keys come only from
`QBATCH_API_KEYS` or `--keys-file` (never a flag: a flag shows in `ps`).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Annotated

import redis
import typer

from producer.cli_common import EXIT_UNAVAILABLE, EXIT_USAGE, client_for, err, opts
from schemas.result_size import DEFAULT_MAX_RESULT_BYTES


def _env(name: str) -> str:
    return f"QBATCH_SERVE_{name}"


def serve(
    ctx: typer.Context,
    host: Annotated[str, typer.Option(envvar=_env("HOST"), help="Address to listen on.")] = (
        "127.0.0.1"
    ),
    port: Annotated[int, typer.Option(envvar=_env("PORT"), help="Port.", min=0)] = 8000,
    storage: Annotated[
        str,
        typer.Option(
            "--storage",
            "--storage-dir",
            envvar=[_env("STORAGE"), _env("STORAGE_DIR")],
            help="Where uploaded and output files' bytes live: a directory (a path or "
            "file:///path), s3://bucket/prefix, gs://bucket/prefix or az://container/prefix "
            "(credentials and region: each cloud's standard variables, AWS_* for S3). Their "
            "records live in Redis.",
        ),
    ] = "qbatch-files",
    s3_endpoint_url: Annotated[
        str | None,
        typer.Option(
            envvar="QBATCH_S3_ENDPOINT_URL",
            help="Endpoint of an S3-compatible server (MinIO, Ceph, ...) for s3:// storage; "
            "none: AWS (or AWS_ENDPOINT_URL_S3).",
        ),
    ] = None,
    keys_file: Annotated[
        Path | None,
        typer.Option(
            envvar=_env("KEYS_FILE"),
            help="JSON/YAML file of sha256 key digests -> tenants, and per-tenant limits "
            "(deploy/README.md, 'qbatch serve'); QBATCH_API_KEYS='key:tenant,...' adds keys.",
        ),
    ] = None,
    max_upload_bytes: Annotated[
        int, typer.Option(envvar=_env("MAX_UPLOAD_BYTES"), help="Largest upload.", min=1)
    ] = 200 * 1024 * 1024,
    max_concurrent_batches: Annotated[
        int,
        typer.Option(
            envvar=_env("MAX_CONCURRENT_BATCHES"), help="Batches in progress per tenant.", min=1
        ),
    ] = 16,
    max_storage_bytes: Annotated[
        int,
        typer.Option(
            envvar=_env("MAX_STORAGE_BYTES"),
            help="Bytes one tenant's stored files (uploads and batch outputs) may hold; an "
            "upload past it: 413, a batch of a tenant at it: 403 (0: no limit).",
            min=0,
        ),
    ] = 0,
    sync_timeout: Annotated[
        float,
        typer.Option(
            envvar=_env("SYNC_TIMEOUT_S"),
            help="Deadline (s) of a chat/completions request whose client sends no "
            "X-Stainless-Timeout.",
            min=1,
        ),
    ] = 600.0,
    forwarded_allow_ips: Annotated[
        str,
        typer.Option(
            envvar=_env("FORWARDED_ALLOW_IPS"),
            help="Proxies whose X-Forwarded-Proto/-For are believed (comma-separated, or *): "
            "behind a TLS-ending Ingress, so the sign-in cookie is Secure.",
        ),
    ] = "127.0.0.1",
    max_sync_inflight: Annotated[
        int,
        typer.Option(
            envvar=_env("MAX_SYNC_INFLIGHT"),
            help="chat/completions requests waiting for their answer at once (each holds a "
            "Redis connection, no thread); past it: 429.",
            min=1,
        ),
    ] = 4096,
    max_sync_inflight_per_tenant: Annotated[
        int,
        typer.Option(
            envvar=_env("MAX_SYNC_INFLIGHT_PER_TENANT"),
            help="One tenant's share of --max-sync-inflight (0: all of it); past it: 429.",
            min=0,
        ),
    ] = 0,
    max_result_bytes: Annotated[
        int,
        typer.Option(
            envvar=_env("MAX_RESULT_BYTES"),
            help="A request (sync or a batch line) whose result could be larger (choices x "
            "max_tokens x bytes a token, logprobs counted) is refused as it is posted.",
            min=65_536,
        ),
    ] = DEFAULT_MAX_RESULT_BYTES,
    max_batch_lines: Annotated[
        int,
        typer.Option(
            envvar=_env("MAX_BATCH_LINES"),
            help="Request lines one batch's input may hold (OpenAI's limit: 50,000).",
            min=1,
        ),
    ] = 50_000,
    reindex: Annotated[
        bool,
        typer.Option(
            "--reindex",
            envvar=_env("REINDEX"),
            help="Import the metadata of a store written by a release before 2026-12-07 "
            "again at start (after replicas of such a release wrote files); otherwise "
            "once per Redis prefix.",
        ),
    ] = False,
    lease_ttl: Annotated[
        float,
        typer.Option(
            envvar=_env("LEASE_TTL"),
            min=1.0,
            help="Seconds the server's lease on its Redis prefix lasts unrenewed (renewed "
            "every third of it): a server killed outright blocks its successor this long.",
        ),
    ] = 30.0,
    lease_wait: Annotated[
        float,
        typer.Option(
            envvar=_env("LEASE_WAIT"),
            min=0.0,
            help="Seconds to wait at start while another server holds the prefix's lease "
            "(a rolling deploy), before refusing to start.",
        ),
    ] = 45.0,
    models: Annotated[
        str,
        typer.Option(
            envvar=_env("MODELS"),
            help="Comma-separated names /v1/models lists (a route table's models instead, "
            "when one is given; neither: an empty list).",
        ),
    ] = "",
    ssl_certfile: Annotated[
        Path | None, typer.Option(envvar=_env("SSL_CERTFILE"), help="TLS certificate (PEM).")
    ] = None,
    ssl_keyfile: Annotated[
        Path | None, typer.Option(envvar=_env("SSL_KEYFILE"), help="TLS private key (PEM).")
    ] = None,
    log_level: Annotated[str, typer.Option(envvar=_env("LOG_LEVEL"))] = "info",
) -> None:
    """Serve the OpenAI Files/Batches/Chat Completions API in front of the queue."""
    try:
        import uvicorn

        from producer.serve.app import ServeConfig, build_state, create_app
        from producer.serve.auth import KeysError, load_keyring
        from producer.serve.lease import Lease, LeaseHeld
        from producer.serve.storage_url import StorageError, open_storage, parse_storage_url
    except ModuleNotFoundError as exc:
        err.print(
            f"[red]error:[/] qbatch serve needs the serve extra ({exc.name} is missing): "
            "pip install 'qbatch[serve]'"
        )
        raise typer.Exit(EXIT_USAGE) from None
    if (ssl_certfile is None) != (ssl_keyfile is None):
        err.print("[red]error:[/] give both --ssl-certfile and --ssl-keyfile, or neither")
        raise typer.Exit(EXIT_USAGE)
    try:
        keyring = load_keyring(os.environ.get("QBATCH_API_KEYS"), keys_file)
    except (KeysError, OSError) as exc:
        err.print(f"[red]error:[/] API keys: {exc}")
        raise typer.Exit(EXIT_USAGE) from None
    try:
        parse_storage_url(storage)  # a bad setting is refused before anything waits
    except StorageError as exc:
        err.print(f"[red]error:[/] storage: {exc}")
        raise typer.Exit(EXIT_USAGE) from None
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(message)s")
    client = client_for(opts(ctx))
    try:
        lease = Lease.acquire(client.redis, client.keys, ttl_s=lease_ttl, wait_s=lease_wait)
    except LeaseHeld as exc:
        err.print(f"[red]error:[/] {exc}")
        raise typer.Exit(EXIT_UNAVAILABLE) from None
    except redis.exceptions.RedisError as exc:
        err.print(f"[red]error:[/] Redis: {exc}")
        raise typer.Exit(EXIT_UNAVAILABLE) from None
    try:
        store = open_storage(storage, lease, s3_endpoint_url=s3_endpoint_url or None)
    except StorageError as exc:
        lease.release()
        err.print(f"[red]error:[/] storage: {exc}")
        raise typer.Exit(EXIT_USAGE) from None
    config = ServeConfig(
        max_upload_bytes=max_upload_bytes,
        max_concurrent_batches=max_concurrent_batches,
        max_storage_bytes=max_storage_bytes or None,
        sync_timeout_s=sync_timeout,
        max_sync_inflight=max_sync_inflight,
        max_sync_inflight_per_tenant=max_sync_inflight_per_tenant or None,
        max_result_bytes=max_result_bytes,
        max_batch_lines=max_batch_lines,
        reindex=reindex,
        metrics_token=os.environ.get("QBATCH_SERVE_METRICS_TOKEN") or None,
        models=tuple(m.strip() for m in models.split(",") if m.strip()),
    )
    state = build_state(config, keyring, store, client, lease)
    uvicorn.run(
        create_app(state),
        host=host,
        port=port,
        log_level=log_level,
        ssl_certfile=str(ssl_certfile) if ssl_certfile else None,
        ssl_keyfile=str(ssl_keyfile) if ssl_keyfile else None,
        proxy_headers=True,
        forwarded_allow_ips=forwarded_allow_ips,
    )


def register(app: typer.Typer) -> None:
    """Add `serve` to the `qbatch` app."""
    app.command("serve")(serve)


__all__ = ["register"]
