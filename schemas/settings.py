"""Connection settings every component reads (`QBATCH_*` environment variables).

Flags override them: the CLIs build a `ConnectionSettings` from the
environment and then apply what was given on the command line.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, SecretStr
from pydantic_settings import BaseSettings, SettingsConfigDict

from schemas.keys import RedisKeys


class ConnectionSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="QBATCH_", extra="ignore", frozen=True)

    kafka_bootstrap: str = Field(
        "127.0.0.1:9092", description="Kafka bootstrap servers, comma-separated."
    )
    redis_url: str = Field("redis://127.0.0.1:6379/0", description="Redis URL; rediss:// for TLS.")
    topic: str = Field("qbatch.requests", description="The requests topic.")
    dlq_topic: str = Field(
        "qbatch.requests.dlq", description="Dead-letter topic for records that cannot be run."
    )
    group: str = Field("qbatch-workers", description="The workers' Kafka consumer group.")
    results_topic: str | None = Field(
        None,
        description="Kafka topic the workers also publish every result to (key request_id, "
        "value the result envelope JSON); unset: results go to Redis only.",
    )
    prefix: str = Field(
        default="qbatch", pattern=r"^[A-Za-z0-9_.-]{1,64}$", description="Redis key prefix."
    )

    kafka_security_protocol: Literal["PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"] = "PLAINTEXT"
    kafka_sasl_mechanism: Literal["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"] | None = None
    kafka_sasl_username: str | None = None
    kafka_sasl_password: SecretStr | None = None
    kafka_ssl_cafile: str | None = None
    kafka_ssl_certfile: str | None = None
    kafka_ssl_keyfile: str | None = None
    redis_ssl_ca_certs: str | None = None
    """CA bundle for `rediss://` URLs; the password goes in the URL or `redis_password`."""
    redis_password: SecretStr | None = None
    redis_username: str | None = None

    @property
    def keys(self) -> RedisKeys:
        return RedisKeys(self.prefix)

    def kafka_kwargs(self) -> dict[str, Any]:
        """Keyword arguments shared by kafka-python's producer, consumer and admin."""
        kwargs: dict[str, Any] = {
            "bootstrap_servers": self.kafka_bootstrap.split(","),
            "security_protocol": self.kafka_security_protocol,
        }
        if self.kafka_sasl_mechanism:
            kwargs["sasl_mechanism"] = self.kafka_sasl_mechanism
            kwargs["sasl_plain_username"] = self.kafka_sasl_username
            kwargs["sasl_plain_password"] = (
                self.kafka_sasl_password.get_secret_value() if self.kafka_sasl_password else None
            )
        for name in ("ssl_cafile", "ssl_certfile", "ssl_keyfile"):
            value = getattr(self, f"kafka_{name}")
            if value:
                kwargs[name] = value
        return kwargs

    def redis_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for `redis.Redis.from_url(self.redis_url, **kwargs)`."""
        kwargs: dict[str, Any] = {}
        if self.redis_password:
            kwargs["password"] = self.redis_password.get_secret_value()
        if self.redis_username:
            kwargs["username"] = self.redis_username
        if self.redis_ssl_ca_certs:
            kwargs["ssl_ca_certs"] = self.redis_ssl_ca_certs
        return kwargs
