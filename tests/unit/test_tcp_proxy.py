"""The chaos soak's delaying TCP proxy (tests/reliability/tcp_proxy.py), against a plain
echo server on loopback: bytes arrive intact and in order, the delay is what was set (per
direction, changed at run time), a pipeline keeps its throughput, many connections at
once, a refused target, the throttle, and a clean shutdown."""

from __future__ import annotations

import contextlib
import os
import socket
import socketserver
import threading
import time
from collections.abc import Iterator

import pytest

from tests.reliability.tcp_proxy import DelayProxy, Link, address_map, proxies_for


class _Echo(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        while data := self.request.recv(65536):
            self.request.sendall(data)


class _Server(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True


@pytest.fixture
def echo() -> Iterator[tuple[str, int]]:
    server = _Server(("127.0.0.1", 0), _Echo)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        host, port = server.server_address[:2]
        yield str(host), int(port)
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture
def proxy(echo: tuple[str, int]) -> Iterator[DelayProxy]:
    with DelayProxy(echo) as p:
        yield p


def _connect(p: DelayProxy) -> socket.socket:
    return socket.create_connection(("127.0.0.1", p.port), timeout=10)


def _recv_exactly(sock: socket.socket, n: int) -> bytes:
    out = bytearray()
    while len(out) < n:
        chunk = sock.recv(n - len(out))
        if not chunk:
            raise ConnectionError(f"closed after {len(out)} of {n} bytes")
        out += chunk
    return bytes(out)


def _round_trip(sock: socket.socket, payload: bytes = b"ping") -> float:
    t = time.monotonic()
    sock.sendall(payload)
    assert _recv_exactly(sock, len(payload)) == payload
    return time.monotonic() - t


def test_link_is_pure_arithmetic() -> None:
    assert Link(0.25).due(10.0) == 10.25
    assert Link(-1.0).due(10.0) == 10.0  # never earlier than read
    assert Link(0.0).slices(b"x" * 10**6) == [(0.0, b"x" * 10**6)]  # unthrottled: as is
    pieces = Link(0.0, rate_bps=1000).slices(b"x" * 50)  # 20 bytes = 20 ms at 1000 B/s
    assert [len(p) for _, p in pieces] == [20, 20, 10]
    assert [w for w, _ in pieces] == [0.02, 0.02, 0.01]


def test_bytes_arrive_intact_and_in_order(proxy: DelayProxy) -> None:
    payload = os.urandom(1 << 20)  # 1 MiB: many chunks each way
    with _connect(proxy) as sock:
        sender = threading.Thread(target=sock.sendall, args=(payload,))
        sender.start()
        assert _recv_exactly(sock, len(payload)) == payload
        sender.join()
    assert proxy.bytes == {"to_server": len(payload), "to_client": len(payload)}
    assert proxy.accepted == 1


def test_the_delay_is_added_each_way_and_can_change_at_run_time(proxy: DelayProxy) -> None:
    with _connect(proxy) as sock:
        base = min(_round_trip(sock) for _ in range(3))
        assert base < 0.2
        proxy.set_delay(0.2)
        slow = _round_trip(sock)
        assert 0.4 <= slow < 0.4 + 1.0  # 0.2 s to the server, 0.2 s back
        proxy.set_delay(to_server=0.3, to_client=0.0)
        one_way = _round_trip(sock)
        assert 0.3 <= one_way < 0.3 + 1.0
        proxy.set_delay(0)
        assert _round_trip(sock) < 0.2  # back to normal on the same connection


def test_a_pipeline_gains_latency_not_serialisation(proxy: DelayProxy) -> None:
    """Ten messages sent 20 ms apart through a 0.3 s-each-way link all come back ~0.6 s
    after they left: about 0.8 s for the lot, not 10 x 0.6 s."""
    proxy.set_delay(0.3)
    with _connect(proxy) as sock:
        t = time.monotonic()
        for i in range(10):
            sock.sendall(f"m{i:02d};".encode())
            time.sleep(0.02)
        got = _recv_exactly(sock, 40)
        took = time.monotonic() - t
    assert got == b"".join(f"m{i:02d};".encode() for i in range(10))
    assert 0.6 <= took < 2.5


def test_many_connections_at_once(proxy: DelayProxy) -> None:
    proxy.set_delay(0.05)
    errors: list[BaseException] = []

    def client(i: int) -> None:
        try:
            with _connect(proxy) as sock:
                for j in range(5):
                    payload = f"c{i}-{j}-".encode() * 100
                    _round_trip(sock, payload)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(50)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert errors == []
    assert proxy.accepted == 50
    deadline = time.monotonic() + 5
    while proxy.open_connections and time.monotonic() < deadline:
        time.sleep(0.02)
    assert proxy.open_connections == 0  # closed clients: both sides closed


def test_the_throttle_limits_the_rate(proxy: DelayProxy) -> None:
    proxy.set_rate(200_000)  # bytes/s each way
    payload = os.urandom(100_000)
    with _connect(proxy) as sock:
        t = time.monotonic()
        sender = threading.Thread(target=sock.sendall, args=(payload,))
        sender.start()
        assert _recv_exactly(sock, len(payload)) == payload
        took = time.monotonic() - t
        sender.join()
    assert took >= 0.4  # 100 kB at 200 kB/s, each way (the two overlap)


def test_a_refused_target_closes_the_client_at_once() -> None:
    free = socket.socket()
    free.bind(("127.0.0.1", 0))
    port = free.getsockname()[1]
    free.close()  # nothing listens there now
    with DelayProxy(("127.0.0.1", port)) as p, _connect(p) as sock:
        sock.settimeout(5)
        with contextlib.suppress(ConnectionResetError):  # closed, or reset
            assert sock.recv(1) == b""
        assert p.refused == 1


def test_close_ends_every_connection_and_the_listener(echo: tuple[str, int]) -> None:
    p = DelayProxy(echo, delay_s=0.5).start()
    socks = [_connect(p) for _ in range(5)]
    for s in socks:
        s.sendall(b"in flight")  # still queued in the proxy when it closes
    deadline = time.monotonic() + 5
    while p.open_connections < 5 and time.monotonic() < deadline:
        time.sleep(0.02)
    t = time.monotonic()
    p.close()
    assert time.monotonic() - t < 5
    assert not p._thread.is_alive()
    for s in socks:
        s.settimeout(5)
        with contextlib.suppress(ConnectionResetError):  # closed, or reset
            assert s.recv(100) == b""
        s.close()
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", p.port), timeout=2)
    p.close()  # again: nothing happens


def test_proxies_for_nodes_and_their_address_map(echo: tuple[str, int]) -> None:
    proxies = proxies_for([echo])
    try:
        [p] = proxies.values()
        assert address_map(proxies) == {f"{echo[0]}:{echo[1]}": f"127.0.0.1:{p.port}"}
        with _connect(p) as sock:
            _round_trip(sock)
    finally:
        for p in proxies.values():
            p.close()
