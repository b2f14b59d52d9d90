"""A delaying TCP proxy the tests own: the chaos soak's "slow Redis" (issue 19.4).

`DelayProxy(("127.0.0.1", 17000)).start()` listens on 127.0.0.1 (a free port unless
given) and forwards every connection to the target. `set_delay(s)` makes each byte
arrive `s` seconds late in each direction (a round trip then costs 2 s more), from the
next byte read on, while the proxy runs; `set_rate(bytes_per_s)` throttles too. Both
model a slow link or a slow server's answers without touching the server, so only the
clients routed through the proxy feel it (in the soak: the workers and the CLI, not the
harness's observers).

Why a delay line and not a sleep before each forward: a sleep would serialise the
chunks (three 0.5 s chunks in flight would take 1.5 s); here each chunk is stamped when
read and sent when its time comes, so a pipeline of commands keeps its throughput and
only gains latency, as on a long link. Order is kept (one queue per direction), and a
queue of bounded size pushes back on the sender as TCP would.

One asyncio loop on a daemon thread serves every connection; `close()` stops accepting,
closes every connection and joins the thread. A target that refuses a connection gets
its client's connection closed at once (the client sees a reset, as with a dead node).
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from dataclasses import dataclass
from types import TracebackType
from typing import Any

CHUNK = 65_536
QUEUE_CHUNKS = 256
"""Chunks a direction may hold before it stops reading (backpressure)."""

TO_SERVER = "to_server"
TO_CLIENT = "to_client"


@dataclass
class Link:
    """One direction's settings, read for every chunk (so changes apply at once)."""

    delay_s: float = 0.0
    rate_bps: float | None = None
    """Bytes per second; None: unthrottled."""

    def due(self, now: float) -> float:
        """When a chunk read at `now` may leave."""
        return now + max(0.0, self.delay_s)

    def slices(self, data: bytes) -> list[tuple[float, bytes]]:
        """`data` as (seconds to wait before it, slice) under the throttle: slices of
        ~20 ms each, each sent once its own transmission time has passed (so the last
        byte leaves `len(data) / rate` after the first could); unthrottled: one piece."""
        if not self.rate_bps:
            return [(0.0, data)]
        size = max(1, min(CHUNK, int(self.rate_bps / 50)))
        return [
            (len(data[i : i + size]) / self.rate_bps, data[i : i + size])
            for i in range(0, len(data), size)
        ]


class DelayProxy:
    def __init__(
        self,
        target: tuple[str, int],
        *,
        listen: tuple[str, int] = ("127.0.0.1", 0),
        delay_s: float = 0.0,
        connect_timeout_s: float = 5.0,
    ) -> None:
        self.target = target
        self._listen = listen
        self._connect_timeout_s = connect_timeout_s
        self.links = {TO_SERVER: Link(delay_s), TO_CLIENT: Link(delay_s)}
        self.port = 0
        self.accepted = 0
        """Connections accepted so far."""
        self.refused = 0
        """Connections closed because the target refused them."""
        self.bytes = {TO_SERVER: 0, TO_CLIENT: 0}
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name=f"proxy->{target[1]}", daemon=True
        )
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        self._writers: set[asyncio.StreamWriter] = set()
        self._closed = False

    # ------------------------------------------------------------ control (any thread)

    def start(self) -> DelayProxy:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._serve(), self._loop).result(timeout=10)
        return self

    @property
    def address(self) -> str:
        """The proxy's "host:port"."""
        return f"{self._listen[0]}:{self.port}"

    def set_delay(
        self,
        seconds: float | None = None,
        *,
        to_server: float | None = None,
        to_client: float | None = None,
    ) -> None:
        """The delay of each direction (`seconds`: both); applies to bytes read from now on."""
        for name, value in ((TO_SERVER, to_server), (TO_CLIENT, to_client)):
            chosen = value if value is not None else seconds
            if chosen is not None:
                self.links[name].delay_s = float(chosen)

    def set_rate(self, bytes_per_s: float | None) -> None:
        """Throttle both directions to `bytes_per_s` (None: unthrottled)."""
        for link in self.links.values():
            link.rate_bps = bytes_per_s

    @property
    def open_connections(self) -> int:
        return len(self._tasks)

    def close(self) -> None:
        """Stops accepting, closes every connection, ends the loop's thread. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._thread.is_alive():
            with contextlib.suppress(Exception):
                asyncio.run_coroutine_threadsafe(self._shutdown(), self._loop).result(timeout=10)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=10)
        self._loop.close()

    def __enter__(self) -> DelayProxy:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    # ------------------------------------------------------------ the loop's side

    async def _serve(self) -> None:
        self._server = await asyncio.start_server(self._accept, *self._listen)
        self.port = self._server.sockets[0].getsockname()[1]

    async def _shutdown(self) -> None:
        if self._server is not None:
            self._server.close()
        for task in list(self._tasks):
            task.cancel()
        for writer in list(self._writers):
            writer.transport.abort()
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=5)

    async def _accept(self, c_reader: asyncio.StreamReader, c_writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        self.accepted += 1
        self._writers.add(c_writer)
        s_writer: asyncio.StreamWriter | None = None
        try:
            try:
                s_reader, server = await asyncio.wait_for(
                    asyncio.open_connection(*self.target), self._connect_timeout_s
                )
            except (OSError, TimeoutError):
                self.refused += 1
                return
            s_writer = server
            self._writers.add(server)
            up = asyncio.ensure_future(self._pipe(c_reader, server, TO_SERVER))
            down = asyncio.ensure_future(self._pipe(s_reader, c_writer, TO_CLIENT))
            try:
                # Both directions end (EOF passed on as a half-close), or either fails.
                done, _ = await asyncio.wait([up, down], return_when=asyncio.FIRST_EXCEPTION)
                for t in done:
                    t.result()
            finally:
                up.cancel()
                down.cancel()
                await asyncio.gather(up, down, return_exceptions=True)
        except (OSError, asyncio.IncompleteReadError):
            pass  # a side reset the connection: close both
        except asyncio.CancelledError:
            pass  # close(): this task is the connection's top level, nothing awaits it
        finally:
            for w in (c_writer, s_writer):
                if w is not None:
                    self._writers.discard(w)
                    w.close()  # flushes what is buffered, then closes
            self._tasks.discard(task)

    async def _pipe(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, direction: str
    ) -> None:
        """Reads chunks, stamps each with its time to leave, and a sender writes them
        in order when due; EOF is passed on (half-close) after the last chunk."""
        link = self.links[direction]
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue(QUEUE_CHUNKS)

        async def send() -> None:
            while True:
                due, data = await queue.get()
                if (wait := due - loop.time()) > 0:
                    await asyncio.sleep(wait)
                if not data:
                    if writer.can_write_eof():
                        writer.write_eof()
                    return
                for pause, piece in link.slices(data):
                    if pause:
                        await asyncio.sleep(pause)
                    # Counted before the write: the peer may read the piece before drain()
                    # returns, and a reader of the counter must never see fewer bytes.
                    self.bytes[direction] += len(piece)
                    writer.write(piece)
                    await writer.drain()

        sender = asyncio.ensure_future(send())
        try:
            while True:
                data = await reader.read(CHUNK)
                item = (link.due(loop.time()), data)
                if queue.full():  # wait for room, or for the sender to fail
                    put = asyncio.ensure_future(queue.put(item))
                    await asyncio.wait([put, sender], return_when=asyncio.FIRST_COMPLETED)
                    if not put.done():
                        put.cancel()
                else:
                    queue.put_nowait(item)
                if sender.done():  # failed (a reset), or passed the EOF on
                    sender.result()
                    return
                if not data:
                    break
            await sender
        finally:
            sender.cancel()
            await asyncio.gather(sender, return_exceptions=True)


def proxies_for(nodes: list[tuple[str, int]]) -> dict[int, DelayProxy]:
    """One started proxy per node, keyed by the node's port."""
    out: dict[int, DelayProxy] = {}
    try:
        for host, port in nodes:
            out[port] = DelayProxy((host, port)).start()
    except BaseException:
        for proxy in out.values():
            proxy.close()
        raise
    return out


def address_map(proxies: dict[int, DelayProxy]) -> dict[str, str]:
    """The `QBATCH_REDIS_ADDRESS_MAP` that sends a client through `proxies`: each node's
    address, as the cluster announces it, to its proxy's."""
    return {f"{p.target[0]}:{p.target[1]}": p.address for p in proxies.values()}


__all__ = ["DelayProxy", "Link", "address_map", "proxies_for"]
