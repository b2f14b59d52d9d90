"""Worker settings: `QBATCH_*` environment variables, overridden by flags.

Connection settings are inherited from `schemas.settings.ConnectionSettings`
so the producer and the worker read the same names. Engine arguments are
named as vLLM names them, so a vLLM user's existing knowledge carries over.
"""

from __future__ import annotations

import os
import socket
from typing import Any, Literal

from pydantic import Field, model_validator
from pydantic_settings import SettingsConfigDict

from schemas.result_size import DEFAULT_MAX_RESULT_BYTES
from schemas.settings import ConnectionSettings
from worker.lanes import LanePolicy

EngineName = Literal["auto", "vllm", "transformers", "echo"]
EngineMode = Literal["continuous", "static"]


def _default_worker_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


class WorkerSettings(ConnectionSettings):
    model_config = SettingsConfigDict(env_prefix="QBATCH_", extra="ignore", frozen=True)

    # --- engine choice
    engine: EngineName = Field(
        "auto",
        description="vllm (GPU), transformers (CPU), echo (deterministic test engine that "
        "answers at once with the prompt), auto = vllm when it imports and a GPU is "
        "present, else transformers.",
    )
    task: Literal["generate", "embed"] = Field(
        "generate",
        description="What this pool runs, chosen at start: generate (chat and completions) "
        "or embed (/v1/embeddings: vLLM's pooling runner, last-token pooling, normalised). "
        "Route each model's requests to its pool (QBATCH_ROUTES).",
    )
    echo_embed_size: int = Field(
        64, ge=1, le=65_536, description="The echo engine's vectors, with --task embed."
    )
    engine_mode: EngineMode = Field(
        "continuous",
        description="continuous: micro-batches feed vLLM's async engine, which batches at "
        "the token level across them. static: one blocking generate per micro-batch "
        "(the baseline).",
    )
    model: str | None = Field(
        None, description="Model path or hub id. Required for vllm and transformers."
    )
    served_model_name: str | None = Field(
        None, description="Name results report; defaults to the model's basename."
    )
    model_aliases: list[str] = Field(
        default_factory=list,
        description="Other names a request's body.model may use for the served model.",
    )
    tokenizer: str | None = Field(None, description="Tokenizer path if not the model's.")

    # --- vLLM engine arguments (passed through as vLLM names them)
    tensor_parallel_size: int = Field(1, ge=1)
    pipeline_parallel_size: int = Field(1, ge=1)
    max_model_len: int | None = Field(None, ge=16)
    gpu_memory_utilization: float = Field(0.9, gt=0, le=1)
    enable_chunked_prefill: bool | None = None
    enable_prefix_caching: bool | None = None
    block_size: int | None = Field(None, ge=1)
    dtype: str = "auto"
    quantization: str | None = Field(None, description="e.g. awq, gptq, fp8")
    kv_cache_dtype: str = Field("auto", description="auto, fp8, fp8_e4m3, fp8_e5m2")
    max_num_seqs: int | None = Field(
        None, ge=1, description="Unset: the vLLM LLM class's default for the GPU."
    )
    max_num_batched_tokens: int | None = Field(None, ge=1)
    load_format: str = Field("auto", description="auto, safetensors, dummy (random weights)")
    enforce_eager: bool = False
    seed: int = 0
    trust_remote_code: bool = False
    engine_args: dict[str, Any] = Field(
        default_factory=dict,
        description="Further vLLM engine arguments as JSON, e.g. '{\"swap_space\": 8}'.",
    )

    # --- batching and flow control
    batch_max_size: int = Field(64, ge=1, description="Dispatch when this many are gathered.")
    batch_max_wait_ms: float = Field(
        50.0,
        ge=0,
        description="...or when the batch's first request has waited this long since it "
        "was produced (its Kafka timestamp; the time in Kafka counts, capped at this value).",
    )
    max_inflight: int = Field(
        2048,
        ge=1,
        description="Records taken from Kafka but not yet answered in Redis; past it the "
        "worker pauses its partitions (and keeps polling).",
    )
    max_inflight_bytes: int = Field(
        256 * 1024 * 1024,
        ge=1024 * 1024,
        description="The same bound in bytes as received (values and keys of the records "
        "in flight, and queued dead letters): past it fetching pauses too. A record costs "
        "about 3.5x its bytes in memory while in flight.",
    )
    resume_ratio: float = Field(
        0.75, gt=0, le=1, description="Resume fetching below max_inflight * resume_ratio."
    )
    bulk_max_inflight: int | None = Field(
        None,
        ge=1,
        description="At most this many records of lanes below the first in flight (default "
        "3/4 of max_inflight: interactive requests always find room).",
    )
    engine_gate: bool = Field(
        True,
        description="Keep requests of lanes below the first under the engine's capacity less "
        "a reserve (worker/engine_gate.py), so a first-lane request never waits for a bulk "
        "request to finish; off: every request goes straight into the engine.",
    )
    engine_reserve_slots: int = Field(
        8,
        ge=0,
        description="Engine slots (max_num_seqs) worse lanes leave to the first (at most a "
        "32nd of them).",
    )
    engine_reserve_fraction: float = Field(
        0.02,
        ge=0,
        lt=1,
        description="Share of the engine's KV-cache tokens worse lanes leave to the first.",
    )
    engine_reserve_hold_s: float = Field(
        300.0,
        ge=0,
        description="The reserve holds while a first-lane request came within this long; "
        "otherwise worse lanes may fill the engine.",
    )
    interactive_step_tokens: int = Field(
        0,
        ge=0,
        description="vLLM (continuous): while a first-lane request is in the engine beside "
        "others, each engine step schedules at most the running sequences' next tokens plus "
        "this many (bulk prefill waits its turn a step at a time; "
        "worker/engines/step_cap.py); 0: vLLM fills every step to max_num_batched_tokens.",
    )
    cancel_poll_s: float = Field(
        0.5,
        ge=0,
        description="How often the jobs of requests held or in the engine are checked for a "
        "cancel (their lines are then answered `cancelled`, the engine's aborted); 0: only "
        "at admission.",
    )
    bulk_min_inflight: int | None = Field(
        None,
        ge=0,
        description="Lanes below the first keep fetching up to this many in flight while a "
        "better lane has work: their guaranteed share (default 2 x batch_max_size).",
    )
    lane_yield_above: int = Field(
        0,
        ge=0,
        description="Worse lanes yield (down to their minimum) while a better lane has "
        "records waiting or more than this many in flight.",
    )
    default_max_tokens: int | None = Field(
        None, ge=1, description="max_tokens when a request gives none (else up to the context)."
    )
    drain_timeout_s: float = Field(60.0, ge=0)
    commit_interval_ms: float = Field(200.0, ge=0)
    poll_max_records: int = Field(2000, ge=1)
    write_batch_max: int = Field(512, ge=1, description="Results per Redis pipeline.")
    max_result_bytes: int = Field(
        DEFAULT_MAX_RESULT_BYTES,
        ge=64 * 1024,
        description="Largest result a request may ask for (choices x max_tokens x bytes a "
        "token, logprobs counted: schemas.result_size): a larger one is refused before it "
        "runs, and a result that still comes out larger is answered result_too_large.",
    )
    max_result_bytes_in_flight: int = Field(
        1024 * 1024 * 1024,
        ge=1024 * 1024,
        description="What the results of the requests in the engine can add up to (their "
        "estimates): past it the dispatcher waits for results to be written before it "
        "submits more (one request always runs).",
    )
    write_batch_max_bytes: int = Field(
        32 * 1024 * 1024,
        ge=1024 * 1024,
        description="...and at most this many bytes of result JSON per pipeline (one larger "
        "result goes alone).",
    )
    redis_stall_timeout_s: float = Field(
        120.0,
        gt=0,
        description="A Redis call that only times out (the server takes the connection but "
        "does not answer in 5 s) for this long is a fault of the thread making it: the "
        "worker stops (exit 70, liveness false) and the records it held get a strike. "
        "Refused connections and not-now replies (BUSY, LOADING, MISCONF) are outages, "
        "waited out for as long as they last.",
    )

    # --- Kafka consumer
    auto_offset_reset: Literal["earliest", "latest"] = "earliest"
    session_timeout_ms: int = 45_000
    max_poll_interval_ms: int = 300_000
    isolation_level: Literal["read_committed", "read_uncommitted"] = Field(
        "read_committed",
        description="read_committed: records of an aborted Kafka transaction, or of one "
        "still open, are not answered (the second once it commits). read_uncommitted only "
        "for a producer that must be answered before its transaction ends.",
    )
    metadata_max_age_ms: int = Field(
        5_000,
        ge=100,
        description="How often the consumer refreshes topic metadata: partitions added to "
        "a topic are served within about this long (kafka-python's default is 5 min).",
    )
    kafka_stall_timeout_s: float = Field(
        30.0,
        ge=0,
        description="Replace the Kafka consumer when, with partitions assigned and not "
        "paused and the brokers reachable, no fetch has succeeded for this long "
        "(kafka-python can stay stuck after a broker restart). 0 disables.",
    )

    # --- service
    worker_id: str = Field(default_factory=_default_worker_id)
    metrics_host: str = "0.0.0.0"
    metrics_port: int = Field(9400, ge=0, le=65535, description="0 disables the HTTP server.")
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    log_format: Literal["json", "console"] = "json"
    echo_delay_ms: float = Field(0.0, ge=0, description="echo engine: delay per answer.")
    echo_concurrency: int = Field(
        0,
        ge=0,
        description="echo engine: answers at a time, the rest wait in priority order "
        "(like vLLM's max_num_seqs); 0 = unlimited.",
    )
    echo_prefix_cache_tokens: int = Field(
        0,
        ge=0,
        description="echo engine: simulate a prefix cache of this many tokens (16-token "
        "blocks, 4 characters a token, LRU) over the whole conversation; report its hits as "
        "cached_tokens and in qbatch_engine_prefix_cache_* (prompt_tokens then count the "
        "conversation the same way); 0 = off.",
    )
    dead_letter: bool = Field(True, description="Send bad records to the DLQ topic.")
    dlq_max_record_bytes: int = Field(
        1_040_000,
        ge=16_384,
        description="Largest dead letter sent (value, key and headers; the DLQ topic's "
        "max.message.bytes must allow it: Kafka's default 1,048,588 does, with room for "
        "the batch's framing): a larger record goes there cut to its first bytes, marked "
        "qbatch.value.truncated with its size in qbatch.value.bytes.",
    )
    dlq_give_up_s: float = Field(
        60.0,
        gt=0,
        description="A dead letter not delivered for this long (a missing or unwritable "
        "DLQ topic) is dropped, logged and counted (qbatch_dead_letters_lost_total); until "
        "then its partition's commits wait for it.",
    )

    # --- reply sinks
    redis_sink: bool = Field(
        True,
        description="Write results to Redis (the v1 contract; also the dedupe store and "
        "job bookkeeping). Off: results go only to --results-topic.",
    )
    results_transactional: bool = Field(
        False,
        description="Publish results and commit consumer offsets in one Kafka transaction: "
        "exactly once on --results-topic for read_committed consumers.",
    )
    transactional_id: str | None = Field(
        None,
        description="Kafka transactional.id of this worker (default qbatch-{group}-"
        "{worker_id}); keep it stable across restarts so a crashed worker's open "
        "transaction is fenced at once instead of timing out.",
    )
    transaction_timeout_ms: int = Field(
        30_000, ge=1_000, description="Kafka transaction timeout (transactional mode)."
    )
    results_max_record_bytes: int = Field(
        4 * 1024 * 1024,
        ge=1024,
        description="Largest result record the results sink sends (the topic's "
        "max.message.bytes must allow it); a larger one is dead-lettered.",
    )

    tool_calls_max_record_bytes: int = Field(
        1_000_000,
        ge=1024,
        description="Largest tool-loop turn event sent to the tool-calls topic; a turn "
        "whose event is larger ends its loop with `tool_loop_aborted`.",
    )

    @model_validator(mode="after")
    def _needs_model(self) -> WorkerSettings:
        if self.engine in ("vllm", "transformers") and not self.model:
            raise ValueError(f"--model (QBATCH_MODEL) is required for engine {self.engine}")
        return self

    @model_validator(mode="after")
    def _has_a_sink(self) -> WorkerSettings:
        if not self.redis_sink and not self.results_topic:
            raise ValueError("no reply sink: keep --redis-sink or set --results-topic")
        if self.results_transactional and not self.results_topic:
            raise ValueError("--results-transactional needs --results-topic")
        if self.results_transactional and self.isolation_level != "read_committed":
            raise ValueError("--results-transactional needs --isolation-level read_committed")
        return self

    def lane_policies(self) -> list[LanePolicy]:
        """The lanes, best first, with their in-flight bounds filled in."""
        cap = self.bulk_max_inflight or max(1, self.max_inflight - self.max_inflight // 4)
        floor = self.bulk_min_inflight
        if floor is None:
            floor = 2 * self.batch_max_size
        policies = []
        for rank, spec in enumerate(self.lane_specs()):
            best = rank == 0
            policies.append(
                LanePolicy(
                    name=spec.name,
                    topic=spec.topic,
                    rank=rank,
                    max_inflight=spec.max_inflight or (self.max_inflight if best else cap),
                    min_inflight=spec.min_inflight or (0 if best else min(floor, cap)),
                )
            )
        return policies

    def transactional_id_or_default(self) -> str:
        return self.transactional_id or f"qbatch-{self.group}-{self.worker_id}"

    @property
    def resume_below(self) -> int:
        return max(1, int(self.max_inflight * self.resume_ratio))

    def served_name(self) -> str:
        if self.served_model_name:
            return self.served_model_name
        if self.model:
            return self.model.rstrip("/").rsplit("/", 1)[-1]
        return "echo"

    def served_names(self) -> frozenset[str]:
        names = {self.served_name(), *self.model_aliases}
        if self.model:
            names.add(self.model)
        return frozenset(names)
