"""Prometheus metrics the worker exports, defined once.

Dashboards and alert rules under `deploy/` refer to these names; a test
cross-checks them against this registry, so renaming one here breaks that
test rather than a dashboard in production.
"""

from __future__ import annotations

import bisect
import functools
import itertools
from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import HistogramMetricFamily

REGISTRY = CollectorRegistry(auto_describe=True)

_LATENCY_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1,
    2.5,
    5,
    10,
    30,
    60,
    120,
    300,
    900,
)
_BATCH_SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)

REQUESTS = Counter(
    "qbatch_requests_total",
    "Requests finished, by status and error code (code is empty on success).",
    ["status", "code"],
    registry=REGISTRY,
)
RECORDS_CONSUMED = Counter(
    "qbatch_records_consumed_total",
    "Kafka records taken off the requests topic.",
    registry=REGISTRY,
)
DEAD_LETTERED = Counter(
    "qbatch_dead_lettered_total",
    "Records sent to the dead-letter topic, by error code.",
    ["code"],
    registry=REGISTRY,
)
DUPLICATES_SKIPPED = Counter(
    "qbatch_duplicates_skipped_total",
    "Redelivered requests whose result already existed, not run again.",
    registry=REGISTRY,
)
BATCH_SIZE = Histogram(
    "qbatch_batch_size",
    "Requests per dispatched micro-batch.",
    buckets=_BATCH_SIZE_BUCKETS,
    registry=REGISTRY,
)
BATCH_WAIT = Histogram(
    "qbatch_batch_wait_seconds",
    "Time from a micro-batch's first request to its dispatch, its time in Kafka included "
    "(capped at batch_max_wait_ms).",
    buckets=_LATENCY_BUCKETS,
    registry=REGISTRY,
)
QUEUE_LATENCY = Histogram(
    "qbatch_queue_latency_seconds",
    "Producer submit to worker dequeue.",
    buckets=_LATENCY_BUCKETS,
    registry=REGISTRY,
)
INFERENCE_LATENCY = Histogram(
    "qbatch_inference_latency_seconds",
    "Dispatch to the engine until the output is back.",
    buckets=_LATENCY_BUCKETS,
    registry=REGISTRY,
)


class StageHistogram:
    """`qbatch_stage_seconds{stage, lane}`, observed by the writer thread alone: plain
    counts per bucket, no lock, read when scraped. A prometheus_client Histogram takes a
    lock and ~1 us an observation; eight stages a result cost 9 us of the writer's ~170
    (the echo A/B showed it), this ~1 us."""

    name = "qbatch_stage_seconds"

    def __init__(self, buckets: tuple[float, ...], registry: CollectorRegistry) -> None:
        self._bounds = [b for b in buckets if b != float("inf")]
        self._series: dict[tuple[str, str], list[float]] = {}
        registry.register(self)

    def observe(self, stage: str, lane: str, seconds: float) -> None:
        counts = self._series.get((stage, lane))
        if counts is None:
            counts = self._series[(stage, lane)] = [0.0] * (len(self._bounds) + 2)
        counts[bisect.bisect_left(self._bounds, seconds)] += 1  # le: the first bound >= it
        counts[-1] += seconds

    def collect(self) -> Iterator[HistogramMetricFamily]:
        family = HistogramMetricFamily(
            self.name,
            "Time a request spent in each stage, per lane: queue (in Kafka), batch_wait (in "
            "the worker until dispatched), admission, render, engine_wait (in the engine's "
            "queue), prefill (to the first token), generation (to finished), write (finished "
            "to written).",
            labels=["stage", "lane"],
        )
        for (stage, lane), counts in list(self._series.items()):
            cumulative = list(itertools.accumulate(counts[:-1]))
            buckets = [(_bound(b), c) for b, c in zip(self._bounds, cumulative, strict=False)]
            buckets.append(("+Inf", cumulative[-1]))
            family.add_metric([stage, lane], buckets, sum_value=counts[-1])
        yield family

    def describe(self) -> list[Any]:
        return []


def _bound(value: float) -> str:
    return repr(float(value))


STAGE_SECONDS = StageHistogram(_LATENCY_BUCKETS, REGISTRY)
E2E_LATENCY = Histogram(
    "qbatch_end_to_end_latency_seconds",
    "Producer submit until the result is in Redis.",
    buckets=_LATENCY_BUCKETS,
    registry=REGISTRY,
)
PROMPT_TOKENS = Counter(
    "qbatch_prompt_tokens_total", "Prompt tokens of requests run.", registry=REGISTRY
)
COMPLETION_TOKENS = Counter(
    "qbatch_completion_tokens_total", "Tokens generated.", registry=REGISTRY
)
EMBEDDINGS = Counter(
    "qbatch_embeddings_total",
    "Vectors made: one per /v1/embeddings input (their tokens count as prompt tokens).",
    registry=REGISTRY,
)
TOKENS_PER_SECOND = Gauge(
    "qbatch_generation_tokens_per_second",
    "Completion tokens per second over the last metrics interval.",
    registry=REGISTRY,
)
DEAD_LETTERS_PENDING = Gauge(
    "qbatch_dead_letters_pending",
    "Dead letters queued and not yet delivered (their partitions' commits wait for them).",
    registry=REGISTRY,
)
DEAD_LETTERS_LOST = Counter(
    "qbatch_dead_letters_lost_total",
    "Dead-letter copies dropped after dlq_give_up_s of failed sends (the requests were "
    "answered; only the copies are lost).",
    registry=REGISTRY,
)
IN_FLIGHT = Gauge(
    "qbatch_in_flight_requests",
    "Records taken from Kafka whose result is not yet written.",
    registry=REGISTRY,
)
IN_FLIGHT_BYTES = Gauge(
    "qbatch_in_flight_bytes",
    "Bytes (as received) of the records in flight and of queued dead letters; fetching "
    "pauses past max_inflight_bytes.",
    registry=REGISTRY,
)
OLDEST_UNCOMMITTED = Gauge(
    "qbatch_oldest_uncommitted_seconds",
    "Age of the oldest record taken from Kafka whose offset is not committed yet, over the "
    "assigned partitions (0 when everything taken is committed): stuck commits show here, "
    "while qbatch_consumer_lag counts from the fetch position.",
    registry=REGISTRY,
)
PENDING_WRITES = Gauge(
    "qbatch_pending_result_writes",
    "Finished results waiting to be written to Redis.",
    registry=REGISTRY,
)
CONSUMER_LAG = Gauge(
    "qbatch_consumer_lag",
    "Records behind the log end, per assigned partition (topic: the lane's topic).",
    ["topic", "partition"],
    registry=REGISTRY,
)
PAUSED = Gauge(
    "qbatch_partitions_paused",
    "1 while fetching is paused for backpressure or Redis outage.",
    registry=REGISTRY,
)
KV_CACHE_USAGE = Gauge(
    "qbatch_engine_kv_cache_usage_ratio",
    "Fraction of the engine's KV cache in use.",
    registry=REGISTRY,
)
KV_CACHE_TOKENS = Gauge(
    "qbatch_engine_kv_cache_capacity_tokens",
    "Tokens the engine's KV cache holds, fixed at start-up (vLLM: blocks x block size; "
    "the echo engine: its simulated prefix cache). Each worker loads its own weights, so "
    "two workers on one GPU hold a fraction of one worker's cache each.",
    registry=REGISTRY,
)
PREFIX_CACHE_QUERIES = Counter(
    "qbatch_engine_prefix_cache_queries_tokens",
    "Prompt tokens looked up in the engine's prefix cache (requests whose engine reports "
    "cached tokens: vLLM, the echo engine's simulated cache).",
    registry=REGISTRY,
)
PREFIX_CACHE_HITS = Counter(
    "qbatch_engine_prefix_cache_hits_tokens",
    "Prompt tokens served from the engine's prefix cache (vLLM's num_cached_tokens); "
    "hit rate = rate(hits) / rate(queries).",
    registry=REGISTRY,
)
ENGINE_RUNNING = Gauge(
    "qbatch_engine_running_requests",
    "Requests the engine is generating for now.",
    registry=REGISTRY,
)
ENGINE_WAITING = Gauge(
    "qbatch_engine_waiting_requests",
    "Requests queued inside the engine.",
    registry=REGISTRY,
)
REDIS_UP = Gauge(
    "qbatch_redis_up",
    "1 when the last Redis write succeeded, 0 while it is failing.",
    registry=REGISTRY,
)
REDIS_UP.set(1)  # as SinkHealth starts (all up); else a fresh worker fires QbatchRedisDown
COMMITS = Counter("qbatch_offset_commits_total", "Offset commits made to Kafka.", registry=REGISTRY)
SINK_UP = Gauge(
    "qbatch_sink_up",
    "1 when the last write to a reply sink succeeded, 0 while it is failing.",
    ["sink"],
    registry=REGISTRY,
)
SINK_REFUSED = Counter(
    "qbatch_sink_refused_total",
    "Results a reply sink refused for good (a key of the wrong type, a script error); "
    "each was answered as failed where possible and dead-lettered.",
    ["sink"],
    registry=REGISTRY,
)
DUPLICATE_IDS = Counter(
    "qbatch_duplicate_request_ids_total",
    "Requests whose request_id already held another job's result (answered duplicate_request_id).",
    registry=REGISTRY,
)
THREAD_FAULTS = Counter(
    "qbatch_thread_faults_total",
    "Unexpected exceptions that stopped a worker thread (the worker then stops).",
    ["thread"],
    registry=REGISTRY,
)
QUARANTINED = Counter(
    "qbatch_quarantined_records_total",
    "Records not run because workers stopped twice while handling them (dead-lettered).",
    registry=REGISTRY,
)
LANE_IN_FLIGHT = Gauge(
    "qbatch_lane_in_flight_requests",
    "Records of a priority lane taken from Kafka whose result is not yet written.",
    ["lane"],
    registry=REGISTRY,
)
LANE_WAITING = Gauge(
    "qbatch_lane_waiting_records",
    "Records of a priority lane in Kafka not yet taken (lag over its assigned partitions).",
    ["lane"],
    registry=REGISTRY,
)
LANE_HELD = Gauge(
    "qbatch_lane_held",
    "1 while a lane's partitions are held back (yielding to a better lane, or at its cap).",
    ["lane"],
    registry=REGISTRY,
)
LANE_LATENCY = Histogram(
    "qbatch_lane_end_to_end_latency_seconds",
    "Producer submit until the result is written, per priority lane.",
    ["lane"],
    buckets=_LATENCY_BUCKETS,
    registry=REGISTRY,
)
TOOL_TURNS = Counter(
    "qbatch_tool_turns_total",
    "Tool-loop turns that ended in tool calls and went to the tool-calls topic.",
    registry=REGISTRY,
)

# ---------------------------------------------------------------- tool executor
# `qbatch tools serve` exports its own registry (it runs no engine and writes no results).
TOOLS_REGISTRY = CollectorRegistry(auto_describe=True)

TOOL_CALLS = Counter(
    "qbatch_tool_calls_total",
    "Tool calls handled by the executor, by tool and outcome (ok, an error kind, reused).",
    ["tool", "outcome"],
    registry=TOOLS_REGISTRY,
)
TOOL_CALL_SECONDS = Histogram(
    "qbatch_tool_call_seconds",
    "Time a tool call ran (reused records not counted).",
    ["tool"],
    buckets=_LATENCY_BUCKETS,
    registry=TOOLS_REGISTRY,
)
TOOL_CONTINUATIONS = Counter(
    "qbatch_tool_continuations_total",
    "Continuations published to the requests topic (aborted: the loop ends with an error).",
    ["kind"],
    registry=TOOLS_REGISTRY,
)
TOOL_EVENTS_BAD = Counter(
    "qbatch_tool_events_bad_total",
    "Records on the tool-calls topic that were not tool-turn events (dead-lettered).",
    registry=TOOLS_REGISTRY,
)
TOOL_TURN_LATENCY = Histogram(
    "qbatch_tool_turn_seconds",
    "From the worker publishing a turn until its continuation is published.",
    buckets=_LATENCY_BUCKETS,
    registry=TOOLS_REGISTRY,
)


@functools.lru_cache(maxsize=4096)
def labelled(metric: Any, *values: str) -> Any:
    """`metric.labels(*values)`, kept: the writer labels two metrics per result, and
    prometheus_client's `labels()` takes ~1 us each (argument checks and a lock) to find
    the same child again. Only for label values of bounded cardinality (statuses, error
    codes, lanes)."""
    return metric.labels(*values)
