"""Work-arounds for kafka-python 3.0.12 defects, shared by the producer and the worker.

`repair_idempotent_reset(producer)`: an idempotent (non-transactional) KafkaProducer
whose in-flight batches expire (delivery timeout during a broker outage) calls
`TransactionManager.reset_producer_id()`, which sets the producer id to -1 but leaves
the state READY. The sender only asks for a new id from state UNINITIALIZED
(`TransactionManager.init_producer_id`), and while it has no id its `run_once()`
returns before draining or expiring anything: the producer is wedged for good (every
later send waits, `flush()` times out, nothing is ever failed). The Java client goes
back to UNINITIALIZED on that reset; this patches the producer's transaction manager
to do the same, so the next sender loop sends InitProducerId and carries on.
"""

from __future__ import annotations

from typing import Any


def repair_idempotent_reset(producer: Any) -> Any:
    """Patch `producer` (a kafka-python KafkaProducer) in place; returns it."""
    tm = getattr(producer, "_transaction_manager", None)
    if tm is None or getattr(tm, "_qbatch_reset_repaired", False):
        return producer
    try:
        from kafka.producer.transaction_manager import TransactionState
    except ImportError:  # another kafka-python layout: nothing to repair
        return producer
    if tm.is_transactional() or not hasattr(tm, "_current_state"):
        return producer
    original = tm.reset_producer_id

    def reset_producer_id() -> None:
        original()
        with tm._lock:
            # kafka-python forbids this transition (is_transition_valid); Java's
            # resetIdempotentProducerId does exactly this for idempotent producers.
            if tm._current_state == TransactionState.READY:
                tm._current_state = TransactionState.UNINITIALIZED

    tm.reset_producer_id = reset_producer_id
    tm._qbatch_reset_repaired = True
    return producer
