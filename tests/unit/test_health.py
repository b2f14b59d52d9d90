"""Liveness and readiness as the probes see them."""

from __future__ import annotations

import time

from worker.health import LIVENESS_STALL_S, _checks
from worker.service import WorkerState


def test_a_fault_makes_the_worker_dead_at_once() -> None:
    state = WorkerState(engine_ready=True, last_loop=time.monotonic())
    live, ready, _ = _checks(state)
    assert live and ready
    state.fault = "writer: RuntimeError: boom"
    live, ready, detail = _checks(state)
    assert not live and not ready and detail["fault"] == state.fault


def test_a_stalled_loop_is_dead_and_a_loading_engine_is_alive_but_not_ready() -> None:
    state = WorkerState(engine_ready=True, last_loop=time.monotonic() - LIVENESS_STALL_S - 1)
    assert _checks(state)[:2] == (False, False)
    loading = WorkerState(engine_ready=False, last_loop=time.monotonic() - 1_000)
    assert _checks(loading)[:2] == (True, False)


def test_a_failing_sink_makes_the_worker_unready_not_dead() -> None:
    state = WorkerState(engine_ready=True, last_loop=time.monotonic(), redis_ok=False)
    assert _checks(state)[:2] == (True, False)
