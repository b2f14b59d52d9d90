"""`QBatchClient`: publish request envelopes to Kafka, read results from Redis.

    with QBatchClient() as qb:                      # settings from QBATCH_* env
        rid = qb.submit({"messages": [{"role": "user", "content": "hi"}]})
        result = qb.wait(rid, timeout=30)           # ResultEnvelope | None
        print(result.response.choices[0].message.content)

Every envelope is validated with `schemas.validate_envelope` before anything is
published, so a `ContractError` (naming the field at fault) is raised at the call,
never discovered later in a worker log.

Waiting: the worker pushes one token onto `{prefix}:done:{request_id}` after it writes
`{prefix}:result:{request_id}`. The result key is the truth; the token is only a
wake-up. `wait` checks GET first, then BLPOPs on the token for at most `poll_s`, then
GETs again, and loops until the deadline: a token consumed by another waiter costs
at most one `poll_s` of latency, and a server where BLPOP fails falls back to
polling GET.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable, Mapping, Sequence
from types import TracebackType
from typing import Any

import redis
from kafka import KafkaProducer
from kafka.errors import KafkaError

from producer.envelopes import Request, build_envelope, now_utc
from producer.placement import PlacementMode, PrefixPlanner, arrange, family_key, placement_mode
from schemas import (
    ConnectionSettings,
    ContractError,
    RedisKeys,
    RequestEnvelope,
    ResultEnvelope,
    encode_request,
    validate_envelope,
)
from schemas.embeddings import EmbeddingList, decode_vector
from schemas.endpoints import EMBEDDINGS
from schemas.kafka_compat import repair_idempotent_reset
from schemas.redis_conn import connect, is_cluster, mget
from schemas.result_size import check_asked
from schemas.routes import RouteTable
from schemas.settings import BULK

DEFAULT_PRODUCER_CONFIG: dict[str, Any] = {
    "acks": "all",
    "enable_idempotence": True,
    "linger_ms": 10,
    "batch_size": 512 * 1024,
    "max_in_flight_requests_per_connection": 5,
    "delivery_timeout_ms": 120_000,
    "request_timeout_ms": 30_000,
    "retry_backoff_ms": 100,
    # kafka-python grows the reconnect backoff to 30 s while a broker is down; cap it so
    # a producer is back within ~2 s of the broker (tests/reliability, Kafka outage).
    "reconnect_backoff_max_ms": 2_000,
}
"""kafka-python producer settings: durable (acks=all, idempotent, retried until the
delivery timeout) and batched for throughput. Override with `producer_config=`."""


class EmbeddingFailed(RuntimeError):
    """`QBatchClient.embed` got a result that is not vectors; `result` says why."""

    def __init__(self, result: ResultEnvelope) -> None:
        error = result.error
        detail = f"{error.code}: {error.message} ({error.param})" if error else "no vectors"
        super().__init__(f"embedding {result.request_id} {result.status}: {detail}")
        self.result = result


def _plain(value: Any) -> Any:
    """Sequences (tuples, numpy-free iterables of ids) as JSON lists."""
    if isinstance(value, str):
        return value
    return [item if isinstance(item, str | int) else list(item) for item in value]


class PublishError(RuntimeError):
    """Kafka did not acknowledge some records; `failed` maps request_id -> the error."""

    def __init__(self, failed: Mapping[str, BaseException]) -> None:
        self.failed = dict(failed)
        first = next(iter(self.failed.items()), None)
        detail = f"; first: {first[0]}: {first[1]!r}" if first else ""
        super().__init__(f"{len(self.failed)} record(s) not acknowledged by Kafka{detail}")


def parse_result(raw: bytes | str | None) -> ResultEnvelope | None:
    if raw is None:
        return None
    return ResultEnvelope.model_validate_json(raw)


class QBatchClient:
    """Submit requests to qbatch and read their results.

    Arguments override `settings` (default: `ConnectionSettings()`, i.e. the
    `QBATCH_*` environment). `producer`/`redis_client` may be injected (tests, or
    sharing one connection); the Kafka producer is created on first publish, so a
    client that only reads results never connects to Kafka.
    """

    def __init__(
        self,
        settings: ConnectionSettings | None = None,
        *,
        bootstrap: str | None = None,
        redis_url: str | None = None,
        topic: str | None = None,
        bulk_topic: str | None = None,
        prefix: str | None = None,
        producer_config: Mapping[str, Any] | None = None,
        producer: Any | None = None,
        redis_client: Any | None = None,
        send_timeout_s: float = 60.0,
        poll_s: float = 1.0,
    ) -> None:
        base = settings or ConnectionSettings()
        updates: dict[str, Any] = {}
        if bootstrap is not None:
            updates["kafka_bootstrap"] = bootstrap
        if redis_url is not None:
            updates["redis_url"] = redis_url
        if topic is not None:
            updates["topic"] = topic
        if bulk_topic is not None:
            updates["bulk_topic"] = bulk_topic
        if prefix is not None:
            updates["prefix"] = prefix
        # Re-validate so that a bad --prefix is refused here, not when a key is built.
        self.settings = (
            ConnectionSettings.model_validate({**base.model_dump(), **updates}) if updates else base
        )
        self.keys: RedisKeys = self.settings.keys
        self.topic = self.settings.topic
        self._producer_config = {**DEFAULT_PRODUCER_CONFIG, **(producer_config or {})}
        self._producer = producer
        self._redis = redis_client
        self.send_timeout_s = send_timeout_s
        self.poll_s = poll_s
        self._closed = False

    # ------------------------------------------------------------ connections

    @property
    def redis(self) -> Any:
        if self._redis is None:
            self._redis = connect(self.settings.redis_url, **self.settings.redis_kwargs())
        return self._redis

    @property
    def producer(self) -> Any:
        if self._producer is None:
            self._producer = repair_idempotent_reset(
                KafkaProducer(**self.settings.kafka_kwargs(), **self._producer_config)
            )
        return self._producer

    # ------------------------------------------------------------ publishing

    @property
    def routes(self) -> RouteTable | None:
        """The route table (model -> topics), None when one pool serves every model."""
        return self.settings.routes

    def topic_for(self, lane: str | None, model: str | None = None) -> str:
        """The requests topic of priority lane `lane` (None: interactive, the first).

        With a route table, the topic is the route of `model` (its `bulk_topic` on the
        `bulk` lane, its `topic` otherwise); a model nobody serves is a ContractError
        naming body.model."""
        topic = self._lane_topic(lane)
        if self.routes is None:
            return topic
        return self.routes.route(model).topic_for(bulk=lane == BULK)

    def _lane_topic(self, lane: str | None) -> str:
        try:
            return self.settings.lane_topic(lane)
        except ValueError as exc:
            raise ContractError(str(exc), param="lane") from None

    def send(
        self, envelope: RequestEnvelope, lane: str | None = None, partition: int | None = None
    ) -> Any:
        """Publish a validated envelope without waiting: returns kafka-python's future.

        `lane`: the priority lane (`interactive`, the default, or `bulk`, ...: see
        `ConnectionSettings.lanes`); bulk jobs publish to `bulk`. `partition`: where
        placement put it (None: Kafka's key partitioner); the key is the request_id always.
        """
        extra = {} if partition is None else {"partition": partition}
        return self.producer.send(
            self.topic_for(lane, envelope.body.model),
            key=envelope.request_id.encode("utf-8"),
            value=encode_request(envelope),
            **extra,
        )

    def partition_count(self, topic: str) -> int | None:
        """`topic`'s partition count from the producer's metadata; None when unknown."""
        try:
            found = self.producer.partitions_for(topic)
        except KafkaError:
            return None
        return len(found) if found else None

    def place(
        self,
        envelopes: Sequence[RequestEnvelope],
        lane: str | None = None,
        planner: PrefixPlanner | None = None,
    ) -> list[tuple[RequestEnvelope, int | None]]:
        """Prefix-aware placement (`producer.placement`): the envelopes in publication
        order, each with its partition (None: Kafka's key partitioner). Lines sharing a
        long prompt prefix go to one partition, together; pass one `planner` for all the
        windows of a job so a big family keeps rotating over the partitions."""
        order = arrange(
            [env.request_id for env in envelopes],
            [family_key(env.body) for env in envelopes],
            [self.topic_for(lane, env.body.model) for env in envelopes],
            self.partition_count,
            planner or PrefixPlanner(),
        )
        return [(envelopes[index], partition) for index, partition in order]

    def flush(self, futures: Iterable[tuple[str, Any]] = (), timeout: float | None = None) -> None:
        """Flush the producer, then raise PublishError if any of `futures` failed."""
        self.producer.flush(timeout=timeout if timeout is not None else self.send_timeout_s)
        failed: dict[str, BaseException] = {}
        for rid, future in futures:
            try:
                future.get(timeout=0 if future.is_done else self.send_timeout_s)
            except (KafkaError, Exception) as exc:
                failed[rid] = exc
        if failed:
            raise PublishError(failed)

    def submit(
        self,
        body: Mapping[str, Any],
        *,
        request_id: str | None = None,
        endpoint: str | None = None,
        lane: str | None = None,
        flush: bool = True,
        max_result_bytes: int | None = None,
        **options: Any,
    ) -> str:
        """Validate and publish one request; returns its request_id.

        `options`: any of `schemas.RequestOptions` (job_id, custom_id, priority, deadline,
        result_ttl_s, metadata). `lane`: the priority lane (default interactive). With
        `flush=True` (default) this returns once Kafka has acknowledged the record
        (acks=all) and raises `PublishError` otherwise. `max_result_bytes`: see
        `schemas.result_size.check_asked`."""
        envelope = build_envelope(body, request_id=request_id, endpoint=endpoint, **options)
        if max_result_bytes is not None:
            check_asked(envelope, max_result_bytes)
        future = self.send(envelope, lane)
        if flush:
            self.flush([(envelope.request_id, future)])
        return envelope.request_id

    def submit_envelope(
        self, envelope: RequestEnvelope | Mapping[str, Any], lane: str | None = None
    ) -> str:
        """Publish a ready-made envelope (validated again) and wait for the ack."""
        env = (
            validate_envelope(envelope.model_dump(mode="json", exclude_none=True))
            if isinstance(envelope, RequestEnvelope)
            else validate_envelope(dict(envelope))
        )
        if env.submitted_at is None:
            env = env.model_copy(update={"submitted_at": now_utc()})
        self.flush([(env.request_id, self.send(env, lane))])
        return env.request_id

    def submit_many(
        self,
        requests: Iterable[Request | Mapping[str, Any]],
        lane: str | None = None,
        placement: str | PlacementMode = PlacementMode.none,
    ) -> list[str]:
        """Validate all, then publish all with one flush; returns the request_ids in order.

        Items are `Request`s or bare bodies, all on `lane` (default interactive). If any
        item is invalid, a ContractError is raised (its message prefixed with `[index]`)
        and nothing is published. `placement="prefix"`: publish them in family order, a
        family to one partition (`place`); the default keeps the given order.
        """
        mode = placement_mode(placement)
        envelopes: list[RequestEnvelope] = []
        for index, item in enumerate(requests):
            req = item if isinstance(item, Request) else Request(item)
            try:
                envelopes.append(req.envelope())
            except ContractError as exc:
                raise ContractError(
                    f"[{index}] {exc.message}", code=exc.code, request_id=exc.request_id
                ) from None
        ids = [env.request_id for env in envelopes]
        if len(set(ids)) != len(ids):
            raise ContractError("request_ids must be unique within one call", param="request_id")
        self._lane_topic(lane)  # an unknown lane or model fails before anything is sent
        for index, env in enumerate(envelopes if self.routes is not None else ()):
            try:
                self.topic_for(lane, env.body.model)
            except ContractError as exc:
                raise ContractError(
                    f"[{index}] {exc.message}", code=exc.code, request_id=env.request_id
                ) from None
        placed = (
            self.place(envelopes, lane)
            if mode is PlacementMode.prefix
            else [(env, None) for env in envelopes]
        )
        self.flush([(env.request_id, self.send(env, lane, part)) for env, part in placed])
        return ids

    # ------------------------------------------------------------ results

    def get(self, request_id: str) -> ResultEnvelope | None:
        """The result if it is written, else None (never blocks)."""
        return parse_result(self.get_raw(request_id))

    def get_raw(self, request_id: str) -> bytes | None:
        """The result's JSON as stored, unparsed (see `schemas.result.read_stored`)."""
        raw = self.redis.get(self.keys.result(request_id))
        return raw.encode() if isinstance(raw, str) else raw

    def get_many(self, request_ids: Sequence[str]) -> dict[str, ResultEnvelope | None]:
        out: dict[str, ResultEnvelope | None] = {}
        for start in range(0, len(request_ids), 1000):
            chunk = list(request_ids[start : start + 1000])
            values = mget(self.redis, [self.keys.result(rid) for rid in chunk])
            for rid, raw in zip(chunk, values, strict=True):
                out[rid] = parse_result(raw)
        return out

    def _block(self, keys: Sequence[str], seconds: float) -> None:
        """Sleep until one of the wake-up lists gets a token, at most `seconds`."""
        if seconds <= 0:
            return
        if is_cluster(self.redis):
            keys = list(keys)[:1]  # one BLPOP cannot span slots: the others are polled
        try:
            self.redis.blpop(list(keys), timeout=max(seconds, 0.01))
        except redis.exceptions.ResponseError:
            time.sleep(min(seconds, 0.1))  # BLPOP refused (ACL, proxy): poll instead

    def wait(self, request_id: str, timeout: float | None = 30.0) -> ResultEnvelope | None:
        """The result, waiting up to `timeout` seconds (None: forever); None on timeout."""
        return parse_result(self.wait_raw(request_id, timeout))

    def wait_raw(self, request_id: str, timeout: float | None = 30.0) -> bytes | None:
        """`wait`, for the result's JSON as stored (`get_raw`)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        done_key = self.keys.done(request_id)
        while True:
            raw = self.get_raw(request_id)
            if raw is not None:
                return raw
            left = (
                self.poll_s if deadline is None else min(self.poll_s, deadline - time.monotonic())
            )
            if left <= 0:
                return None
            self._block([done_key], left)

    def wait_many(
        self, request_ids: Sequence[str], timeout: float | None = 30.0
    ) -> dict[str, ResultEnvelope | None]:
        """Results for all ids (None for those not written when `timeout` runs out)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        found: dict[str, ResultEnvelope | None] = dict.fromkeys(request_ids)
        missing = list(dict.fromkeys(request_ids))
        while True:
            got = self.get_many(missing)
            for rid, result in got.items():
                if result is not None:
                    found[rid] = result
            missing = [rid for rid in missing if found[rid] is None]
            if not missing:
                return found
            left = (
                self.poll_s if deadline is None else min(self.poll_s, deadline - time.monotonic())
            )
            if left <= 0:
                return found
            self._block([self.keys.done(rid) for rid in missing[:256]], left)

    def embed(
        self,
        input: str | Sequence[str] | Sequence[int] | Sequence[Sequence[int]],
        *,
        model: str | None = None,
        dimensions: int | None = None,
        timeout: float | None = 60.0,
        lane: str | None = None,
        **options: Any,
    ) -> list[list[float]]:
        """Embed `input` (a string, strings, token ids, or lists of token ids) and wait:
        one vector per input, in input order, as floats (sent as base64 on the wire, a
        quarter of the size). Needs a worker pool started with `--task embed`.

        `options`: request options, as `submit` takes them. Raises `EmbeddingFailed`
        (the result, with its error naming the field) when the request did not succeed,
        and `TimeoutError` when no result came within `timeout` seconds."""
        body: dict[str, Any] = {"input": _plain(input), "encoding_format": "base64"}
        if model is not None:
            body["model"] = model
        if dimensions is not None:
            body["dimensions"] = dimensions
        rid = self.submit(body, endpoint=EMBEDDINGS.path, lane=lane, **options)
        result = self.wait(rid, timeout=timeout)
        if result is None:
            raise TimeoutError(f"no result for {rid} within {timeout} s")
        if not result.ok or not isinstance(result.response, EmbeddingList):
            raise EmbeddingFailed(result)
        return [decode_vector(item.embedding) for item in result.response.data]

    def summarize(self, text: str, *, tokenizer: Any, **settings: Any) -> Any:
        """Summarise a long `text` map-reduce style (needs `pip install 'qbatch[docs]'`).

        `tokenizer`: the served model's tokenizer (a `tokenizer.json` path, its model
        directory, or a `producer.summarize.tokens.Tokenizer`). `settings`: `budget`
        (`producer.summarize.plan.Budget`: context, summary tokens, chunk and overlap),
        `templates`, `instructions`, `model`, `thinking`, `timeout`, `lane` and request
        options. Returns a `producer.summarize.plan.Summary` (summary, chunks, levels,
        usage, error naming the level and chunk that failed).
        """
        from producer.summarize.single import summarize_text
        from producer.summarize.tokens import load_tokenizer

        if isinstance(tokenizer, str | os.PathLike):
            tokenizer = load_tokenizer(tokenizer)
        return summarize_text(self, text, tokenizer, **settings)

    # ------------------------------------------------------------ lifecycle

    def close(self, timeout: float | None = None) -> None:
        """Flush and close the Kafka producer, close Redis. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._producer is not None:
            try:
                self._producer.flush(
                    timeout=timeout if timeout is not None else self.send_timeout_s
                )
            finally:
                self._producer.close(timeout=timeout if timeout is not None else 5)
        if self._redis is not None:
            self._redis.close()

    def __enter__(self) -> QBatchClient:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
