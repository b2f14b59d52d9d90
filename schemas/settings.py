"""Connection settings every component reads (`QBATCH_*` environment variables).

Flags override them: the CLIs build a `ConnectionSettings` from the
environment and then apply what was given on the command line.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from schemas.keys import RedisKeys
from schemas.redis_conn import address_remap, is_cluster_url
from schemas.replica_ack import DEFAULT_WAIT_TIMEOUT_MS, ReplicaAck
from schemas.routes import RouteTable

INTERACTIVE = "interactive"
BULK = "bulk"


class LaneSpec(BaseModel):
    """One priority lane: its name, its requests topic, and its in-flight bounds in a
    worker. Lanes are listed best first; a worker serves a better lane's records first."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(pattern=r"^[a-z][a-z0-9_-]{0,31}$")
    topic: str = Field(min_length=1, max_length=249)
    max_inflight: int | None = Field(
        None, ge=1, description="At most this many of the lane's records in flight."
    )
    min_inflight: int = Field(
        0,
        ge=0,
        description="The lane keeps fetching up to this many in flight even while a better "
        "lane has work: its guaranteed share.",
    )


class ConnectionSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="QBATCH_", extra="ignore", frozen=True)

    kafka_bootstrap: str = Field(
        "127.0.0.1:9092", description="Kafka bootstrap servers, comma-separated."
    )
    redis_url: str = Field(
        "redis://127.0.0.1:6379/0",
        description="Redis URL; rediss:// for TLS; redis+cluster://host:port[,host:port...] "
        "(or rediss+cluster://) for a Redis Cluster, whose keys then carry hash tags; "
        "redis+sentinel://host:port[,host:port...]/<service>[/<db>] (or rediss+sentinel://) "
        "for the master that Redis Sentinel names.",
    )
    topic: str = Field(
        "qbatch.requests", description="The requests topic (the `interactive` lane)."
    )
    bulk_topic: str = Field(
        "qbatch.requests.bulk",
        description="The `bulk` lane's requests topic: bulk jobs publish here by default.",
    )
    lanes: list[LaneSpec] = Field(
        default_factory=list,
        description='Priority lanes, best first, as JSON (e.g. \'[{"name": "interactive", '
        '"topic": "qbatch.requests"}, ...]\'); empty: interactive (--topic) and bulk '
        "(--bulk-topic).",
    )
    dlq_topic: str = Field(
        "qbatch.requests.dlq", description="Dead-letter topic for records that cannot be run."
    )
    group: str = Field("qbatch-workers", description="The workers' Kafka consumer group.")
    results_topic: str | None = Field(
        None,
        description="Kafka topic the workers also publish every result to (key request_id, "
        "value the result envelope JSON); unset: results go to Redis only.",
    )
    tool_calls_topic: str = Field(
        "qbatch.tool-calls",
        description="Topic of tool-loop turns that ended in tool calls: workers publish to "
        "it, `qbatch tools serve` consumes it.",
    )
    prefix: str = Field(
        default="qbatch", pattern=r"^[A-Za-z0-9_.-]{1,64}$", description="Redis key prefix."
    )
    routes: RouteTable | None = Field(
        None,
        description="Route table, model name/alias -> {topic, bulk_topic}, as JSON "
        "(`schemas.routes`); unset: one pool (topic / bulk_topic / lanes) for every model.",
    )
    loop_key: SecretStr | None = Field(
        None,
        description="The key tool executors sign continuations with and workers check them "
        "by (`schemas.loop_auth`); unset: one kept in Redis, made by the first that needs it.",
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
    redis_address_map: dict[str, str] = Field(
        default_factory=dict,
        description='Where to reach Redis nodes, as JSON {"host:port": "host:port"}: an '
        "address a cluster node announces (or the URL names) -> the one this process "
        "connects to, for nodes behind NAT, a port-forward or a proxy; unset: as announced.",
    )

    redis_wait_replicas: int = Field(
        0,
        ge=0,
        description="Replicas that must acknowledge (Redis WAIT) a result before it counts as "
        "written and the worker commits past its request; 0: do not wait. With Redis "
        "Cluster or Sentinel, 1 or more keeps a master's failover from losing results its "
        "replica had not received yet (replication is asynchronous); a master with fewer "
        "replicas up stops taking results (the worker pauses) until they are back.",
    )
    redis_wait_timeout_ms: int = Field(
        DEFAULT_WAIT_TIMEOUT_MS,
        ge=1,
        description="How long one WAIT for --redis-wait-replicas may take before the write "
        "counts as an outage and is retried.",
    )

    @field_validator("redis_address_map")
    @classmethod
    def _address_map_entries(cls, value: dict[str, str]) -> dict[str, str]:
        address_remap(value)  # raises on an entry that is not host:port
        return value

    @property
    def replica_ack(self) -> ReplicaAck:
        return ReplicaAck(self.redis_wait_replicas, self.redis_wait_timeout_ms)

    @property
    def keys(self) -> RedisKeys:
        return RedisKeys(self.prefix, cluster=is_cluster_url(self.redis_url))

    @model_validator(mode="after")
    def _distinct_lanes(self) -> ConnectionSettings:
        specs = self.lane_specs()
        for what in ("name", "topic"):
            values = [getattr(spec, what) for spec in specs]
            if len(set(values)) != len(values):
                raise ValueError(f"lanes: every lane needs its own {what}, got {values}")
        return self

    def lane_specs(self) -> list[LaneSpec]:
        """The lanes, best first."""
        if self.lanes:
            return list(self.lanes)
        return [
            LaneSpec(name=INTERACTIVE, topic=self.topic),
            LaneSpec(name=BULK, topic=self.bulk_topic),
        ]

    def lane_topic(self, lane: str | None) -> str:
        """The requests topic of `lane` (None: the first, interactive lane)."""
        specs = self.lane_specs()
        if lane is None:
            return specs[0].topic
        for spec in specs:
            if spec.name == lane:
                return spec.topic
        raise ValueError(f"unknown lane {lane!r}; lanes: {', '.join(s.name for s in specs)}")

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
        """Keyword arguments for `schemas.redis_conn.connect(self.redis_url, **kwargs)`."""
        kwargs: dict[str, Any] = {}
        if self.redis_password:
            kwargs["password"] = self.redis_password.get_secret_value()
        if self.redis_username:
            kwargs["username"] = self.redis_username
        if self.redis_address_map:
            kwargs["address_map"] = dict(self.redis_address_map)
        if self.redis_ssl_ca_certs:
            kwargs["ssl_ca_certs"] = self.redis_ssl_ca_certs
        return kwargs
