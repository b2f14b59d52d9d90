"""Prometheus metrics of `qbatch serve` (its `/metrics`), and the usage recorder that
feeds them: every finished request's usage goes to Redis once (`producer.usage`) and,
when it was new there, to these counters. Names follow `worker/metrics.py`
(`qbatch_` prefix, `_total` counters, a registry of their own).
"""

from __future__ import annotations

import logging
from typing import Any

from prometheus_client import CollectorRegistry, Counter

from producer.usage import UsageStore
from schemas import ResultEnvelope

log = logging.getLogger("qbatch.serve")

TOKEN_KINDS = ("prompt", "completion", "reasoning")


class UsageRecorder:
    """Record a tenant's result in Redis (once) and count it in this server's metrics."""

    def __init__(self, store: UsageStore, registry: CollectorRegistry | None = None) -> None:
        self.store = store
        self.registry = registry or CollectorRegistry()
        self.requests = Counter(
            "qbatch_serve_usage_requests",
            "Finished requests by tenant and model (each result once).",
            ["tenant", "model"],
            registry=self.registry,
        )
        self.tokens = Counter(
            "qbatch_serve_usage_tokens",
            "Tokens by tenant, model and kind (prompt, completion, reasoning).",
            ["tenant", "model", "kind"],
            registry=self.registry,
        )

    def __call__(self, tenant: str, result: ResultEnvelope) -> None:
        """Never raises: usage accounting must not fail an answer (a Redis error is logged
        and the next sighting of the result, e.g. a redone finalize, counts it)."""
        try:
            added = self.store.record(tenant, result)
        except Exception as exc:
            log.warning("serve: usage of %s not recorded: %s", result.request_id, exc)
            return
        if added is None:
            return
        model, counts = added
        self.requests.labels(tenant, model).inc(counts["requests"])
        for kind in TOKEN_KINDS:
            self.tokens.labels(tenant, model, kind).inc(counts[f"{kind}_tokens"])

    def exposition(self) -> Any:
        from prometheus_client import generate_latest

        return generate_latest(self.registry)


__all__ = ["TOKEN_KINDS", "UsageRecorder"]
