"""HTTP endpoints for operators: `/metrics` (Prometheus), `/healthz`, `/readyz`.

Liveness means the main loop is turning (a wedged consumer thread gets the pod
restarted); readiness means the engine is loaded and Redis and Kafka answer, so a
rollout waits for a worker that can really take work. Partitions are not a condition
(in a group with more workers than partitions some workers rightly hold none); the
answer's `assigned_partitions` says how many this one holds.
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from worker.metrics import REGISTRY

LIVENESS_STALL_S = 60.0


@dataclass
class ServiceState:
    """What health checks read; written by the loops, read by the HTTP thread. The
    worker's state (`worker.service.WorkerState`) and the tool executor's."""

    engine_ready: bool = False
    assigned: int = 0
    redis_ok: bool = True
    """All reply sinks answer (the name predates the Kafka results sink)."""
    kafka_ok: bool = True
    last_loop: float = field(default_factory=time.monotonic)
    stopping: bool = False
    fault: str | None = None


def _checks(state: Any) -> tuple[bool, bool, dict[str, Any]]:
    stalled_for = time.monotonic() - state.last_loop
    # While the model loads the loop has not started; the startup probe bounds that phase.
    # A thread that stopped on a fault makes the worker dead at once (it is stopping and
    # will exit non-zero; a supervisor should not wait for the stall to notice).
    fault = getattr(state, "fault", None)
    live = fault is None and (not state.engine_ready or stalled_for < LIVENESS_STALL_S)
    kafka_ok = getattr(state, "kafka_ok", True)
    ready = live and state.engine_ready and state.redis_ok and kafka_ok and not state.stopping
    detail = {
        "fault": fault,
        "loop_stalled_s": round(stalled_for, 3),
        "engine_ready": state.engine_ready,
        "redis_ok": state.redis_ok,
        "kafka_ok": kafka_ok,
        "assigned_partitions": state.assigned,
        "stopping": state.stopping,
    }
    return live, ready, detail


def serve(
    state: Any, host: str, port: int, registry: CollectorRegistry = REGISTRY
) -> ThreadingHTTPServer:
    """Start the server on a daemon thread and return it (port 0 picks a free port)."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            if self.path.startswith("/metrics"):
                self._send(200, generate_latest(registry), CONTENT_TYPE_LATEST)
                return
            live, ready, detail = _checks(state)
            if self.path.startswith("/healthz"):
                ok = live
            elif self.path.startswith("/readyz"):
                ok = ready
            else:
                self._send(404, b"not found\n", "text/plain")
                return
            body = json.dumps({"ok": ok, **detail}).encode()
            self._send(200 if ok else 503, body, "application/json")

        def _send(self, code: int, body: bytes, content_type: str) -> None:
            self.send_response(code)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:
            return

    server = ThreadingHTTPServer((host, port), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="qbatch-http", daemon=True).start()
    return server
