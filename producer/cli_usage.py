"""`qbatch usage`: per-tenant usage (requests and tokens by model and day) from Redis
(`producer.usage`), as a rich table or JSON."""

from __future__ import annotations

from typing import Annotated

import typer
from rich.table import Table

from producer.cli_common import client_for, emit_json, guard, opts, out
from producer.usage import KINDS, UsageRow, UsageStore, last_days


def usage_table(rows: list[UsageRow]) -> Table:
    """Rows (tenant, day, model) with a count column per kind, and a total line. Pure."""
    table = Table(title="qbatch usage")
    for name in ("tenant", "day", "model"):
        table.add_column(name)
    for kind in KINDS:
        table.add_column(kind.replace("_tokens", ""), justify="right")
    totals = dict.fromkeys(KINDS, 0)
    for row in rows:
        table.add_row(row.tenant, row.day, row.model, *(f"{row.counts[k]:,}" for k in KINDS))
        for kind in KINDS:
            totals[kind] += row.counts[kind]
    table.add_row("[bold]total", "", "", *(f"[bold]{totals[k]:,}" for k in KINDS))
    return table


def usage(
    ctx: typer.Context,
    tenant: Annotated[
        list[str] | None, typer.Option("--tenant", help="Only this tenant (repeatable).")
    ] = None,
    days: Annotated[int, typer.Option("--days", help="The last N UTC days.", min=1)] = 7,
    json_out: Annotated[bool, typer.Option("--json", help="Rows as JSON on stdout.")] = False,
) -> None:
    """Requests and prompt/completion/reasoning tokens by tenant, model and day."""
    o = opts(ctx)
    with guard(), client_for(o) as client:
        store = UsageStore(client.redis, client.keys)
        tenants = tenant or store.tenants()
        rows = store.rows(tenants, last_days(days))
    if json_out or o.json:
        emit_json([{"tenant": r.tenant, "day": r.day, "model": r.model, **r.counts} for r in rows])
        return
    out.print(usage_table(rows))


def register(app: typer.Typer) -> None:
    app.command("usage")(usage)


__all__ = ["register", "usage_table"]
