"""The tenant a `qbatch serve` request acts for: its `Authorization: Bearer` key looked up
in the app's key ring (`producer.serve.auth.KeyRing`), as a FastAPI dependency every
route but `/healthz` takes."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request

from producer.serve.errors import ApiError


def tenant_of(request: Request) -> str:
    """The tenant of the request's `Authorization: Bearer` key (401 without a good one)."""
    header = request.headers.get("authorization")
    if not header:
        raise ApiError(
            401,
            "You didn't provide an API key: send 'Authorization: Bearer YOUR_KEY'.",
            code="missing_api_key",
        )
    scheme, _, key = header.partition(" ")
    tenant = (
        request.app.state.serve.keyring.tenant_for(key.strip())
        if scheme.lower() == "bearer"
        else None
    )
    if tenant is None:
        raise ApiError(401, "Incorrect API key provided.", code="invalid_api_key")
    return tenant


Tenant = Annotated[str, Depends(tenant_of)]


__all__ = ["Tenant", "tenant_of"]
